"""Replica groups of two ranks launched as docs/FAULT_TOLERANCE.md says: a Lighthouse per job, a
torchrun per replica group (--max-restarts 1); rank 1 of group 1 SIGKILLs itself in the forward
of its third step, torchrun restarts group 1 as a whole, it heals rank by rank and rejoins.

    .venv/bin/python scripts/ft_groups_torchrun.py            # about 40 s on 2 cores
    .venv/bin/python scripts/ft_groups_torchrun.py --runs 3

A run passes if both torchruns exit 0, group 1 ran two attempts (its first one killed), every
rank's final parameters equal the float64 replay of the committed steps
(tests/ft_common.replay: every rank of every participating group, each step) within 1e-5, and
the four ranks end identical. Not in the test suite (torchrun's agents take seconds to start);
exits 1 if a run fails. The worker is this script under torchrun (--worker): the model, data
and optimizer of tests/ft_worker.py.
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))  # ft_worker, ft_common; the package as installed

import torch  # noqa: E402

import ft_common  # noqa: E402
import ft_worker  # noqa: E402

GROUPS, RANKS = 2, 2
KILLED_GROUP, KILLED_RANK, KILL_AT_STEP_OF_ATTEMPT = 1, 1, 2


def worker(args):
    """One rank under torchrun: the launch of docs/FAULT_TOLERANCE.md."""
    from datetime import timedelta

    import torch.distributed as dist
    import torchft
    import fused_reducer.torchft as ft

    group = int(os.environ["REPLICA_GROUP_ID"])
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    timeout = timedelta(seconds=10)
    ft.forget_dead_attempt_keys()  # a restarted attempt must not meet the dead one's keys
    dist.init_process_group("gloo", timeout=timeout)
    rank = dist.get_rank()
    manager = torchft.Manager(
        pg=torchft.ProcessGroupGloo(timeout=timeout), min_replica_size=1,
        use_async_quorum=False, load_state_dict=None, state_dict=None,
        replica_id=f"train_{group}", rank=rank, world_size=dist.get_world_size(),
        timeout=timeout, init_sync=False)
    model = ft.DistributedDataParallel(manager, ft_worker.make_model(), first_bucket_mb=0.004,
                                       bucket_cap_mb=0.04)
    inner = torch.optim.SGD(model.parameters(), lr=ft_worker.LR, momentum=ft_worker.MOMENTUM)
    optimizer = ft.Optimizer(manager, inner)
    manager.register_state_dict_fn("fused_reducer", *ft.state_dict_fns(model, inner))
    member = ft_worker.member_name(group, rank)
    log_path = os.path.join(args.out, f"{member}.log")
    base = {"replica": group, "rank": rank, "group_size": dist.get_world_size(),
            "attempt": attempt, "pid": os.getpid()}
    if attempt == 0:
        # Start together: a group whose first quorum came before the other's Manager was up
        # would train alone from the same step 0, and torchft would never heal either.
        open(os.path.join(args.out, f"ready_{member}"), "w").close()
        deadline = time.monotonic() + 60
        while len([f for f in os.listdir(args.out) if f.startswith("ready_")]) < GROUPS * RANKS:
            if time.monotonic() > deadline:
                raise SystemExit(f"{member}: the other ranks did not get ready within 60 s")
            time.sleep(0.02)
    steps_here = 0
    while manager.current_step() < args.steps:
        optimizer.zero_grad()  # the quorum; a healing group loads the live state here
        step = manager.current_step()
        if (group, rank, attempt, steps_here) == (KILLED_GROUP, KILLED_RANK, 0,
                                                  KILL_AT_STEP_OF_ATTEMPT):
            with open(log_path, "a") as f:
                f.write(json.dumps(dict(base, killed=step, contributed=False)) + "\n")
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = ft_worker.batch(step, group, rank=rank)
        ft_worker.loss_fn(model(x), y).backward()
        committed = manager.should_commit()
        if committed:
            inner.step()
        with open(log_path, "a") as f:
            f.write(json.dumps(dict(base, step=step, commit=committed,
                                    participants=manager.num_participants(),
                                    time=time.time())) + "\n")
        steps_here += 1
        time.sleep(0.05)
    torch.save({n: p.detach().clone() for n, p in model.module.named_parameters()},
               os.path.join(args.out, f"{member}.pt"))
    model.close()
    manager.shutdown(wait=False)
    os._exit(0)  # torchft's threads are not joined at exit


def run_once(args):
    from torchft._torchft import LighthouseServer

    out = tempfile.mkdtemp(prefix="ft_groups_torchrun_")
    # A join timeout longer than a failed step (up to the Managers' 10 s timeout): a restarted
    # group waits for the live group's next quorum request instead of forming a quorum of its
    # own (with min_replicas 1 it can: it then trains alone from step 0 until the quorums merge).
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=20000)
    env = dict(os.environ, TORCHFT_LIGHTHOUSE=lighthouse.address(), RUST_LOG="warn")
    torchruns = []
    for group in range(GROUPS):
        port = 29600 + 10 * group + args.port_offset
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
               "--nproc-per-node", str(RANKS), "--master-port", str(port), "--max-restarts", "1",
               os.path.abspath(__file__), "--worker", "--out", out, "--steps", str(args.steps)]
        log = open(os.path.join(out, f"torchrun{group}.out"), "wb")
        torchruns.append(subprocess.Popen(cmd, env=dict(env, REPLICA_GROUP_ID=str(group)),
                                          stdout=log, stderr=subprocess.STDOUT))
    codes = []
    for proc in torchruns:
        try:
            codes.append(proc.wait(timeout=args.timeout_s))
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)  # only the torchruns this script started, by pid
            proc.wait()
            codes.append("hung")
    lighthouse.shutdown()
    problems = []
    if codes != [0, 0]:
        problems.append(f"torchrun exit codes {codes} (output in {out})")
    keys = [(g, r) for g in range(GROUPS) for r in range(RANKS)]
    recs = {key: ft_common.records_or_none(out, key) for key in keys}
    attempts = {rec["attempt"] for rec in recs[(KILLED_GROUP, KILLED_RANK)]}
    if 1 not in attempts:
        problems.append(f"group {KILLED_GROUP} did not train in a restarted attempt: {attempts}")
    error = None
    if not problems:
        all_records = [json.loads(line) for key in keys
                       for line in open(os.path.join(out, f"{ft_common.name(key)}.log"))]
        reference, steps, _ = ft_common.replay(all_records)
        finals = {key: ft_common.final_parameters(out, key) for key in keys}
        error = max(ft_common.max_error(final, reference) for final in finals.values())
        first = {n: t.double() for n, t in finals[keys[0]].items()}
        spread = max(ft_common.max_error(final, first) for final in finals.values())
        if error >= ft_common.TOLERANCE or spread != 0.0:
            problems.append(f"final parameters {error:.3g} from the float64 replay, "
                            f"{spread:.3g} apart")
    restarted = [rec for rec in recs[(KILLED_GROUP, 0)] if rec.get("attempt") == 1]
    return {"out": out, "codes": codes, "problems": problems, "error": error,
            "restarted_from_step": restarted[0]["step"] if restarted else None}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--timeout-s", type=float, default=180)
    parser.add_argument("--port-offset", type=int, default=0, help="torchrun master ports")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    failed = 0
    for index in range(args.runs):
        began = time.monotonic()
        result = run_once(args)
        failed += bool(result["problems"])
        verdict = "FAILED: " + "; ".join(result["problems"]) if result["problems"] else "ok"
        error = "n/a" if result["error"] is None else f"{result['error']:.3g}"
        print(f"run {index}: {verdict}; group {KILLED_GROUP} restarted and healed to step "
              f"{result['restarted_from_step']}; final parameters {error} from the float64 "
              f"replay; {time.monotonic() - began:.1f} s", flush=True)
    print(f"{args.runs} runs, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
