"""Fault-tolerant data parallelism on CPU: two torchft replica groups training through
fused_reducer.torchft; replica 1 is SIGKILLed in the backward of a step (buckets in flight),
restarted, heals from replica 0's live state and rejoins; both end with identical parameters.

    python examples/train_ft.py                    # about 30 s on 2 cores
    python examples/train_ft.py --steps 40 --kill-step 10

This process starts a Lighthouse (torchft's quorum server) in-process and runs the replicas as
subprocesses (this script again, with --replica), restarting replica 1 once it died, as
torchelastic restarts a dead worker. Each replica is one process (a replica group of one rank,
gloo on 127.0.0.1); the Managers form a quorum at every step, a step that fails on one replica is
skipped on all (should_commit() is False), and the restarted replica receives the model, the
optimizer and the reducer's layout from replica 0 before its first step. Replica 0's Manager
logs the failed all-reduce of the step replica 1 died in (a gloo "Connection reset by peer"
traceback): that step is skipped, replica 0 goes on in the same process. Needs torchft
(pip install ".[ft]").
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

import torch
from torch import nn

WIDTH = 256


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(),
                         nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 4))


def batch(step, replica):
    """Replica `replica`'s batch of `step` (each replica its own data, as a sampler gives)."""
    g = torch.Generator().manual_seed(1000 * step + replica)
    return torch.randn(64, 32, generator=g), torch.randn(64, 4, generator=g)


def replica_main(args):
    """One replica group: train until --steps, then 3 more steps committed by both replicas (so
    that both end after the same step), logging each step."""
    import torchft
    import fused_reducer.torchft as ft

    timeout = timedelta(seconds=10)
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = torchft.Manager(
        pg=torchft.ProcessGroupGloo(timeout=timeout), min_replica_size=1,
        load_state_dict=None, state_dict=None, replica_id=f"replica_{args.replica}",
        lighthouse_addr=args.lighthouse, store_addr="127.0.0.1", store_port=store.port,
        rank=0, world_size=1, use_async_quorum=False, timeout=timeout,
        quorum_timeout=timedelta(seconds=30), init_sync=False)
    model = ft.DistributedDataParallel(manager, make_model(), first_bucket_mb=0.1,
                                       bucket_cap_mb=0.25)
    inner = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    optimizer = ft.Optimizer(manager, inner)
    manager.register_state_dict_fn("fused_reducer", *ft.state_dict_fns(model, inner))

    def die(grad):  # in the backward, once the last layers' buckets went out
        print(f"replica {args.replica}: SIGKILL in the backward of step {step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    log = open(os.path.join(args.out, f"replica{args.replica}.log"), "a")
    open(os.path.join(args.out, f"ready{args.replica}"), "w").close()
    while not os.path.exists(os.path.join(args.out, "go")):
        time.sleep(0.01)
    together, first = 0, True
    while True:
        optimizer.zero_grad()  # the quorum; a restarted replica heals here
        step = manager.current_step()
        if first and step > 0:
            print(f"replica {args.replica} (restarted): healed to step {step}", flush=True)
        first = False
        hook = model.module[0].weight.register_hook(die) if step == args.kill_step else None
        x, y = batch(step, args.replica)
        nn.functional.mse_loss(model(x), y).backward()
        participants = manager.num_participants()
        # What optimizer.step() does, spelled out to log it: step only if every replica's
        # all-reduces of this step succeeded.
        committed = manager.should_commit()
        if committed:
            inner.step()
        if hook:
            hook.remove()
        log.write(json.dumps({"pid": os.getpid(), "step": step, "commit": committed,
                              "participants": participants}) + "\n")
        log.flush()
        together = together + 1 if committed and participants == 2 else 0
        if manager.current_step() >= args.steps and together >= 3:
            break
        time.sleep(0.05)  # a slower step, so that the survivor trains alone a while
    torch.save(model.module.state_dict(), os.path.join(args.out, f"replica{args.replica}.pt"))
    model.close()
    manager.shutdown(wait=False)
    os._exit(0)  # torchft's threads are not joined at exit


def spans(records):
    """'0-3 x2, 4 failed, 5-9 x1' from a replica's step records."""
    out = []
    for rec in records:
        label = f"x{rec['participants']}" if rec["commit"] else "failed"
        if out and out[-1][2] == label and out[-1][1] == rec["step"] - 1 and rec["commit"]:
            out[-1][1] = rec["step"]
        else:
            out.append([rec["step"], rec["step"], label])
    return ", ".join(f"{a}{'' if a == b else f'-{b}'} {label}" for a, b, label in out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--kill-step", type=int, default=8)
    parser.add_argument("--restart-delay-s", type=float, default=3.0,
                        help="restart replica 1 this long after its death (replica 0 trains "
                             "alone meanwhile)")
    parser.add_argument("--replica", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--lighthouse", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.replica is not None:
        return replica_main(args)

    os.environ.setdefault("RUST_LOG", "warn")  # torchft's quorum chatter
    from torchft._torchft import LighthouseServer
    began = time.monotonic()
    out = tempfile.mkdtemp(prefix="train_ft_")
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=2000)

    def launch(replica, kill_step=-1):
        return subprocess.Popen([sys.executable, os.path.abspath(__file__), "--replica",
                                 str(replica), "--lighthouse", lighthouse.address(), "--out", out,
                                 "--steps", str(args.steps), "--kill-step", str(kill_step)])

    procs = {0: launch(0), 1: launch(1, args.kill_step)}
    # Start together, so that the first quorum has both.
    while not all(os.path.exists(os.path.join(out, f"ready{r}")) for r in procs):
        if any(p.poll() is not None for p in procs.values()):
            sys.exit("a replica failed to start")
        time.sleep(0.05)
    open(os.path.join(out, "go"), "w").close()
    code = procs[1].wait(timeout=120)
    print(f"replica 1 (pid {procs[1].pid}) ended with {code}; restarting it in "
          f"{args.restart_delay_s} s", flush=True)
    first_pid = procs[1].pid
    time.sleep(args.restart_delay_s)
    procs[1] = launch(1)
    codes = {r: p.wait(timeout=120) for r, p in procs.items()}
    lighthouse.shutdown()

    for r in procs:
        recs = [json.loads(line) for line in open(os.path.join(out, f"replica{r}.log"))]
        lives = [[rec for rec in recs if rec["pid"] == pid]
                 for pid in dict.fromkeys(rec["pid"] for rec in recs)]
        for life, pid_recs in enumerate(lives):
            what = "restarted" if life else ("survivor" if r == 0 else f"killed, pid {first_pid}")
            print(f"replica {r} ({what}): {sum(rec['commit'] for rec in pid_recs)} steps "
                  f"committed: {spans(pid_recs)}")
    finals = [torch.load(os.path.join(out, f"replica{r}.pt")) for r in procs]
    identical = all(torch.equal(finals[0][k], finals[1][k]) for k in finals[0])
    print(f"exit codes {codes}; both replicas end with identical parameters: {identical} "
          f"({time.monotonic() - began:.1f} s)")
    sys.exit(0 if identical and all(c == 0 for c in codes.values()) else 1)


if __name__ == "__main__":
    main()
