"""Lifecycle stress harness (issue 29): run FusedReducer's process endings many times and give each
run a verdict. See docs/TESTING.md ("Process life") and Note [Process life] in ext/transport.h.

    .venv/bin/python scripts/lifecycle_stress.py --rounds 20                  # every ending, both
    .venv/bin/python scripts/lifecycle_stress.py --rounds 5 --load 2 --endings two-nodes
    .venv/bin/python scripts/lifecycle_stress.py --budget-s 170               # CI's bounded subset

A run is WORLD ranks of scripts/lifecycle_worker.py (launched here with env:// variables, or by
two torchrun agents as two nodes for the ending "two-nodes"). It is bad when any of these holds:
  - a rank's exit code is not the expected one (0 for a normal ending; for an injected failure the
    victim's own outcome, and 1 for every peer);
  - a rank aborted or crashed: a signal other than the injected one, or "terminate called",
    "Fatal Python error", "Segmentation fault" in its output;
  - a rank or agent still runs after --run-timeout-s (a hang; it is killed);
  - a shared-memory segment of the run is left in /dev/shm;
  - after an injected failure a peer did not raise, did not name the failed rank, or raised later
    than the FusedReducer timeout (+ 15 s).
Prints one line per run and a summary (runs, bad runs, seconds); exits 1 if any run was bad.
`--load K` runs K busy loops beside the runs (a loaded node). `--keep DIR` keeps each run's logs.
"""
import argparse
import glob
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "lifecycle_worker.py")
sys.path.insert(0, HERE)
from lifecycle_worker import ENDINGS  # noqa: E402
from fused_reducer.testing.launch import reserved_port, wait_all  # noqa: E402

TWO_NODE_ENDINGS = {"two-nodes": "plain-exit", "two-nodes-agent-sigterm": "agent-sigterm"}
ALL_ENDINGS = sorted(e for e in ENDINGS if e != "agent-sigterm") + sorted(TWO_NODE_ENDINGS)
BACKENDS = ("shm", "process_group")
CRASH_MARKERS = ("terminate called", "Fatal Python error", "Segmentation fault",
                 "AddressSanitizer", "ThreadSanitizer", "double free", "corrupted")
# The victim's exit code per injected action (sigint: Python re-raises SIGINT at exit).
VICTIM_CODES = {"raise": {1}, "exit": {0}, "sigterm": {-signal.SIGTERM},
                "sigint": {-signal.SIGINT, 130, 1}, "sigint-all": {-signal.SIGINT, 130, 1},
                # An agent's exit code: torchrun ends with an error once SIGTERMed, or once its
                # worker failed (the peer's agent).
                "agent-sigterm": None}
PEER_SLACK_S = 15.0
# Launcher variables of an outer torchrun must not reach the ranks we launch.
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                      "ROLE_RANK", "ROLE_NAME", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE",
                      "MASTER_ADDR", "MASTER_PORT")


def base_env():
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("TORCHELASTIC_") and k not in LAUNCHER_VARIABLES}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONFAULTHANDLER"] = "1"  # a crash prints every thread's Python stack
    return env


def pid_namespace():
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def segments_of(pids):
    """Segments in /dev/shm created by any of `pids` (fused_reducer_<ns>_<pid>_<hex>)."""
    ns = pid_namespace()
    found = []
    for pid in pids:
        found += [os.path.basename(p) for p in glob.glob(f"/dev/shm/fused_reducer_{ns}_{pid}_*")]
    return found


def read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def launch_ranks(ending, backend, world, outdir, timeout_s, run_timeout_s):
    procs = []
    with reserved_port() as port:  # rank 0 binds it (env://); reserved until the run ends
        for rank in range(world):
            env = base_env()
            env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                       LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            log = open(os.path.join(outdir, f"rank{rank}.log"), "w")
            cmd = [sys.executable, WORKER, "--ending", ending, "--backend", backend,
                   "--outdir", outdir, "--timeout-s", str(timeout_s)]
            procs.append((f"rank {rank}", subprocess.Popen(cmd, env=env, stdout=log, stderr=log,
                                                           start_new_session=True)))
        hung = wait_all(procs, time.monotonic() + run_timeout_s)
    return {name: proc.returncode for name, proc in procs}, hung


def launch_two_nodes(ending, backend, outdir, timeout_s, run_timeout_s):
    """Two torchrun agents on loopback as two nodes, one rank each, c10d rendezvous, running the
    worker's ending TWO_NODE_ENDINGS[ending]."""
    procs = []
    with reserved_port() as port:  # the first agent hosts the rendezvous store on it
        for node in range(2):
            log = open(os.path.join(outdir, f"agent{node}.log"), "w")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                   "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                   "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"life{port}",
                   "--monitor-interval", "0.5", WORKER, "--ending", TWO_NODE_ENDINGS[ending],
                   "--backend", backend, "--outdir", outdir, "--timeout-s", str(timeout_s)]
            procs.append((f"agent {node}", subprocess.Popen(cmd, env=base_env(), stdout=log,
                                                            stderr=log, start_new_session=True)))
        hung = wait_all(procs, time.monotonic() + run_timeout_s)
    return {name: proc.returncode for name, proc in procs}, hung


def verdict(ending, world, outdir, codes, hung, timeout_s):
    """A list of what went wrong in this run (empty: good)."""
    problems = [f"{name} hung (killed after the run timeout)" for name in hung]
    logs = {os.path.basename(p): open(p, errors="replace").read()
            for p in glob.glob(os.path.join(outdir, "*.log"))}
    for name, text in sorted(logs.items()):
        for marker in CRASH_MARKERS:
            if marker in text:
                problems.append(f"{name}: {marker!r}")
    ranks = {r: read_json(os.path.join(outdir, f"rank{r}.json")) for r in range(world)}
    problems += [f"leftover segment /dev/shm/{s}"
                 for s in segments_of([d.get("pid") for d in ranks.values() if d.get("pid")])]
    action = ENDINGS[TWO_NODE_ENDINGS.get(ending, ending)][0]
    if action is None:
        problems += [f"{name} exited {code}" for name, code in codes.items() if code != 0]
        problems += [f"rank {r} did not finish training" for r, d in ranks.items()
                     if not d.get("trained")]
        return problems
    victims = set(range(world)) if action == "sigint-all" else {world - 1}
    by_agent = ending in TWO_NODE_ENDINGS  # exit codes are the agents'; both end with an error
    if by_agent:
        problems += [f"{name} exited 0 after the injected failure" for name, code in codes.items()
                     if code == 0]
    for r in range(world):
        code = codes.get(f"rank {r}")
        if r in victims:
            if not by_agent and code not in VICTIM_CODES[action] and f"rank {r}" not in hung:
                problems.append(f"rank {r} (victim, {action}) exited {code}")
            continue
        raised = ranks[r].get("raised") or ""
        after = ranks[r].get("raised_after_s")
        if not by_agent and code != 1 and f"rank {r}" not in hung:
            problems.append(f"rank {r} (peer) exited {code}, expected 1")
        if not raised:
            problems.append(f"rank {r} (peer) did not raise")
        elif not any(re.search(rf"\brank[s]? (\S+, )*{v}\b", raised) for v in victims):
            problems.append(f"rank {r} (peer) raised without naming rank {sorted(victims)}: "
                            f"{raised[:300]!r}")
        elif after is not None and after > timeout_s + PEER_SLACK_S:
            problems.append(f"rank {r} (peer) raised only after {after} s")
    return problems


def busy_loops(count):
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=1, help="runs of each (ending, backend)")
    ap.add_argument("--endings", default=",".join(ALL_ENDINGS))
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--timeout-s", type=float, default=30.0, help="FusedReducer's timeout")
    ap.add_argument("--run-timeout-s", type=float, default=120.0)
    ap.add_argument("--load", type=int, default=0, help="busy loops beside the runs")
    ap.add_argument("--alternate-backends", action="store_true",
                    help="each ending on one backend per round, alternating (CI's subset: every "
                         "ending once, both backends in turn)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="stop starting runs after this many seconds (CI's bounded subset)")
    ap.add_argument("--keep", default=None, help="keep each run's logs under this directory")
    args = ap.parse_args()
    endings = [e for e in args.endings.split(",") if e]
    unknown = sorted(set(endings) - set(ALL_ENDINGS))
    if unknown:
        ap.error(f"unknown endings {unknown}; choose from {ALL_ENDINGS}")
    backends = [b for b in args.backends.split(",") if b]

    load = busy_loops(args.load)
    began = time.monotonic()
    runs, bad = 0, []
    try:
        plan = list(itertools.product(range(args.rounds), endings, backends))
        if args.alternate_backends:
            plan = [(r, e, backends[(r + i) % len(backends)])
                    for r in range(args.rounds) for i, e in enumerate(endings)]
        for round_, ending, backend in plan:
            if args.budget_s is not None and time.monotonic() - began > args.budget_s:
                break
            outdir = tempfile.mkdtemp(prefix="fr_life_")
            t0 = time.monotonic()
            if ending in TWO_NODE_ENDINGS:
                codes, hung = launch_two_nodes(ending, backend, outdir, args.timeout_s,
                                               args.run_timeout_s)
                world = 2
            else:
                codes, hung = launch_ranks(ending, backend, args.world, outdir, args.timeout_s,
                                           args.run_timeout_s)
                world = args.world
            problems = verdict(ending, world, outdir, codes, hung, args.timeout_s)
            runs += 1
            label = f"run {runs:4d} {ending:26s} {backend:13s} {time.monotonic() - t0:5.1f} s"
            print(f"{label} {'BAD: ' + '; '.join(problems) if problems else 'ok'} "
                  f"(exit codes {sorted(codes.values(), key=str)})", flush=True)
            if problems:
                bad.append((label, problems))
            if args.keep:
                dest = os.path.join(args.keep, f"run{runs:04d}_{ending}_{backend}")
                shutil.copytree(outdir, dest)
            shutil.rmtree(outdir, ignore_errors=True)
    finally:
        for p in load:
            p.kill()
    took = time.monotonic() - began
    print(f"lifecycle: {runs} runs, {len(bad)} bad, {took:.0f} s "
          f"(endings {','.join(endings)}; backends {','.join(backends)}; world {args.world}; "
          f"load {args.load})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
