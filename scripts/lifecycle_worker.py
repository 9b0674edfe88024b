"""One rank of a lifecycle stress run (scripts/lifecycle_stress.py): trains a small model with
FusedReducer, then ends the way `--ending` says. Launched by the stress script with the env://
variables set (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), or by torchrun.

    python scripts/lifecycle_worker.py --ending plain-exit --backend shm --outdir DIR

Writes DIR/rank<r>.json as it goes: {"pid", "trained", "raised": message, "raised_after_s"}; the
stress script reads it with the exit code and stderr to give the run a verdict. An injected
failure happens on the victim rank (the last one) in the backward of step VICTIM_STEP, inside a
gradient hook of the first layer (the last gradient of backward), so the other buckets of that
step are already in flight.
"""
import argparse
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import fused_reducer

STEPS = 6
VICTIM_STEP = 3
ENDINGS = {
    # name: (what the victim does in the backward of VICTIM_STEP, what every rank does at the end)
    "plain-exit": (None, "destroy"),          # destroy_process_group, exit without close()
    "no-destroy": (None, "exit"),             # neither destroy_process_group nor close()
    "close": (None, "close"),                 # model.close(), destroy_process_group, exit
    "gc": (None, "gc"),                       # del model + gc.collect(), then exit
    "raise-mid-step": ("raise", None),        # an exception in backward; the peers in backward
    "exit-in-flight": ("exit", None),         # sys.exit(0) in backward, buckets in flight
    "sigterm-mid-backward": ("sigterm", None),  # SIGTERM (default action) mid-backward
    "sigint-one-rank": ("sigint", None),      # KeyboardInterrupt on one rank in backward
    "sigint-all-ranks": ("sigint-all", None),  # Ctrl-C: KeyboardInterrupt on every rank
    "sharded-gather-in-flight": (None, "destroy"),  # ShardedOptimizer(overlap_param_gather=True)
    # The same failures with a ShardedOptimizer(overlap_param_gather=True): reduce-scatters in
    # flight in backward, all-gathers in flight from the step before.
    "sharded-raise-mid-step": ("raise", None),
    "sharded-sigterm-mid-backward": ("sigterm", None),
    "sharded-sigint-one-rank": ("sigint", None),
    # Launched by two torchrun agents as two nodes (lifecycle_stress.py): the victim's agent gets
    # SIGTERM mid-backward (a scheduler ending the job) and forwards it to its worker.
    "agent-sigterm": ("agent-sigterm", None),
}


class Record:
    def __init__(self, outdir, rank):
        self.path = os.path.join(outdir, f"rank{rank}.json")
        self.data = {"pid": os.getpid(), "rank": rank, "trained": False}
        self.write()

    def write(self, **items):
        self.data.update(items)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f)
        os.replace(tmp, self.path)


def make_model():
    torch.manual_seed(0)
    # 8 x 256 KiB of weights: several buckets with bucket_cap_mb=0.25, so that an injected
    # failure in the last layer's hook leaves earlier buckets in flight.
    return nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)])


def inject(what, victim):
    """The hook that fails the victim's backward of VICTIM_STEP (or every rank's)."""
    def hook(grad):
        if what == "raise":
            raise RuntimeError("lifecycle_worker: injected failure in backward")
        if what == "exit":
            sys.exit(0)
        if what == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)  # default action: the process dies here
            time.sleep(30)
        if what in ("sigint", "sigint-all"):
            raise KeyboardInterrupt
        if what == "agent-sigterm":
            if "TORCHELASTIC_RUN_ID" not in os.environ:  # the parent must be torchrun's agent
                raise RuntimeError("lifecycle_worker: agent-sigterm runs under torchrun only")
            os.kill(os.getppid(), signal.SIGTERM)  # torchrun's agent: it stops its workers
            time.sleep(30)
        return grad
    return hook if victim else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ending", choices=sorted(ENDINGS), required=True)
    ap.add_argument("--backend", choices=["shm", "process_group"], required=True)
    ap.add_argument("--outdir", required=True)
    ap.add_argument("--timeout-s", type=float, default=30.0)
    args = ap.parse_args()
    victim_action, end = ENDINGS[args.ending]

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    record = Record(args.outdir, rank)
    is_victim = victim_action == "sigint-all" or rank == world - 1
    # DDP first, as users switching over often do: its reducer and group live on to exit too.
    ddp = nn.parallel.DistributedDataParallel(make_model())
    ddp(torch.randn(4, 256)).sum().backward()

    model = fused_reducer.FusedReducer(make_model(), backend=args.backend, bucket_cap_mb=0.25,
                                       timeout=args.timeout_s)
    if args.ending.startswith("sharded-"):
        opt = fused_reducer.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-3,
                                             overlap_param_gather=True)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
    first_weight = model.module[0].weight
    started = None
    try:
        for step in range(STEPS):
            handle = None
            if step == VICTIM_STEP and victim_action is not None:
                hook = inject(victim_action, is_victim)
                if hook is not None:
                    handle = first_weight.register_hook(hook)
                started = time.monotonic()
            model(torch.randn(4, 256)).sum().backward()
            if handle is not None:
                handle.remove()
            opt.step()  # with overlap_param_gather the all-gathers stay in flight from here
            opt.zero_grad()
    except BaseException as e:  # noqa: BLE001 - recorded, then raised again (exit code)
        after = None if started is None else round(time.monotonic() - started, 3)
        record.write(raised=f"{type(e).__name__}: {e}"[:2000], raised_after_s=after)
        raise
    record.write(trained=True)
    print(f"rank {rank}: trained {STEPS} steps on {model.backend}", flush=True)
    if end == "close":
        model.close()
        dist.destroy_process_group()
    elif end == "destroy":
        dist.destroy_process_group()
    elif end == "gc":
        import gc
        del model, opt
        gc.collect()
        dist.destroy_process_group()
    # "exit": nothing; the interpreter's teardown ends everything


if __name__ == "__main__":
    main()
