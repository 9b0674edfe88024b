"""torchrun restarts, DDP next to FusedReducer (issue 29 item 4): how often does a restarted job
resume, under which launcher set-up, and when it does not, whose failure is it?

    .venv/bin/python scripts/restart_study.py --runs 5                 # every set-up, both wrappers
    .venv/bin/python scripts/restart_study.py --runs 3 --setups two-nodes --wrappers fused

One run is tests/torchrun_restart_worker.py (2 CPU ranks, gloo): attempt 0 trains, rank 0
checkpoints, rank 1 SIGKILLs itself mid-step; torchrun restarts the workers (--max-restarts 1)
and attempt 1 resumes from the checkpoint to the end. Set-ups:
  standalone        torchrun --standalone --nproc-per-node 2 (one agent)
  two-nodes         two torchrun agents on loopback as two nodes (--nnodes 2, c10d rendezvous)
each run as a user has it ("plain": the restarted workers meet torchrun's store with the dead
attempt's keys in it) and, on one node, with
fused_reducer.transports.elastic.forget_dead_attempt_keys() before init_process_group ("scrubbed", the test suite's set-up; pytorch/pytorch#135712).

Each run gets one verdict:
  resumed           every launcher exited 0, both ranks of attempt 1 trained to the end
  upstream          a restart failed inside torch (init_process_group, gloo's connectFullMesh,
                    the rendezvous) before or outside FusedReducer; the failing line is shown
  fused_reducer     a restart failed with an error raised by FusedReducer's code
  hang / other      no launcher exit within --run-timeout-s / anything else (logs kept)
Prints a line per run and a table per (set-up, scrub, wrapper); exits 1 if any FusedReducer run
failed where the same set-up's DDP runs all resumed, or with a 'fused_reducer' verdict.
"""
import argparse
import collections
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from fused_reducer.testing.launch import reserved_port, wait_all

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "torchrun_restart_worker.py")
SETUPS = ("standalone", "two-nodes")
WRAPPERS = ("ddp", "fused")
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                      "ROLE_RANK", "ROLE_NAME", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE",
                      "MASTER_ADDR", "MASTER_PORT")
# Where a failing run's traceback ends decides whose failure it is.
UPSTREAM_MARKERS = ("connectFullMesh", "init_process_group", "rendezvous", "RendezvousError",
                    "ProcessGroupGloo", "TCPStore")


def environment(scrub):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("TORCHELASTIC_") and k not in LAUNCHER_VARIABLES}
    import fused_reducer
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(fused_reducer.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([package_root, os.path.dirname(WORKER)]
                                        + [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                           if p])
    env["OMP_NUM_THREADS"] = "1"
    env["RESTART_WORKER_KEEP_TORCH_KEYS"] = "0" if scrub else "1"
    return env


def commands(setup, wrapper, outdir, port):
    """The launcher commands of one run; `port` (two-nodes: the rendezvous endpoint, hosted by the
    first agent) is held reserved by the caller until the run ends."""
    common = ["--max-restarts", "1", "--monitor-interval", "0.5", WORKER, outdir, wrapper]
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    if setup == "standalone":
        return [torchrun + ["--standalone", "--nproc-per-node", "2"] + common]
    return [torchrun + ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                        "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"restart{port}"]
            + common for _ in range(2)]


def end_stray_workers(outdir):
    """Workers run in sessions of their own: end any still running, by the pids they wrote."""
    for path in glob.glob(os.path.join(outdir, "pid_*")):
        try:
            pid = int(open(path).read())
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace")
        except (OSError, ValueError):
            continue
        if WORKER in cmdline and outdir in cmdline:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def run_once(setup, wrapper, scrub, outdir, run_timeout_s):
    """(verdict, detail, seconds)."""
    started = time.monotonic()
    procs = []
    with reserved_port() as port:
        for i, cmd in enumerate(commands(setup, wrapper, outdir, port)):
            log = open(os.path.join(outdir, f"agent{i}.log"), "w")
            procs.append((f"agent {i}", subprocess.Popen(
                cmd, env=environment(scrub), cwd=outdir, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)))
        hung = bool(wait_all(procs, started + run_timeout_s))
    procs = [proc for _, proc in procs]
    end_stray_workers(outdir)
    elapsed = time.monotonic() - started
    output = "".join(open(p, errors="replace").read()
                     for p in sorted(glob.glob(os.path.join(outdir, "agent*.log"))))
    reports = {}
    for path in glob.glob(os.path.join(outdir, "attempt*_rank*.json")):
        with open(path) as f:
            reports[os.path.basename(path)] = json.load(f)
    resumed = all(reports.get(f"attempt1_rank{r}.json", {}).get("final") for r in range(2))
    if hung:
        return "hang", "no launcher exit within the run timeout", elapsed
    if all(p.returncode == 0 for p in procs) and resumed:
        return "resumed", "", elapsed
    return classify(outdir, output) + (elapsed,)


def _package_dir():
    import fused_reducer
    return os.path.dirname(os.path.realpath(fused_reducer.__file__)) + os.sep


def classify(outdir, output):
    """(verdict, what decided it) for a failed run, from what the restarted workers wrote (their
    tracebacks, or their stacks when the worker's watchdog ended a hang), else the agents' log."""
    evidence = []
    # A worker names its files by the attempt its ranks agreed on; one that hung before they
    # agreed (inside init_process_group: only a restarted attempt does) by its pid.
    for kind, pattern in (("error", "error_attempt[1-9]*_rank*.txt"),
                          ("hang", "hang_attempt[1-9]*_rank*.txt"), ("hang", "hang_pid*.txt")):
        for path in sorted(glob.glob(os.path.join(outdir, pattern))):
            text = open(path, errors="replace").read().strip()
            if text:
                evidence.append((kind, os.path.basename(path), text))
    package = _package_dir()
    ours = lambda path: os.path.realpath(path).startswith(package)  # noqa: E731
    for kind, name, text in evidence:
        frames = re.findall(r'File "([^"]+)", line \d+,? in (\S+)', text)
        last_line = text.splitlines()[-1].strip()
        if "pytorch/pytorch#135712" in text:  # FusedReducer naming torch's failure
            continue
        # A traceback: raised through FusedReducer's code; a hang (faulthandler lists the
        # innermost frame first): stuck in it.
        if (kind == "error" and any(ours(path) for path, _ in frames)) or \
                (kind == "hang" and frames and ours(frames[0][0])):
            return "fused_reducer", f"{name}: {last_line}"[:200]
    for kind, name, text in evidence:
        frames = re.findall(r'File "([^"]+)", line \d+,? in (\S+)', text)
        torch_frames = [(os.path.basename(p), f) for p, f in frames if "/torch/" in p]
        if "pytorch/pytorch#135712" in text:
            return "upstream", f"{name}: named by FusedReducer: {last_line[:120]}"[:200]
        if torch_frames:
            if kind == "hang":  # faulthandler: innermost frame first
                where = "hung in {1} ({0})".format(*torch_frames[0])
            else:
                where = text.splitlines()[-1].strip()
            return "upstream", f"{name}: {where}"[:200]
    for marker in UPSTREAM_MARKERS:
        for line in output.splitlines():
            if marker in line and re.search(r"(Error|error|failed)", line):
                return "upstream", line.strip()[:200]
    errors = [l.strip() for l in output.splitlines() if re.search(r"(Error|Exception|failed)", l)]
    return "other", (errors[-1] if errors else "no error line")[:200]


def reclassify(keep):
    """The verdicts of runs kept by --keep, again (a resumed run stays resumed)."""
    counts = collections.defaultdict(collections.Counter)
    for run in sorted(os.listdir(keep)):
        outdir = os.path.join(keep, run)
        setup, store, wrapper, _ = run.split("_")
        reports = [os.path.join(outdir, f"attempt1_rank{r}.json") for r in range(2)]
        if all(os.path.exists(p) and json.load(open(p)).get("final") for p in reports):
            verdict, detail = "resumed", ""
        else:
            output = "".join(open(p, errors="replace").read()
                             for p in sorted(glob.glob(os.path.join(outdir, "agent*.log"))))
            verdict, detail = classify(outdir, output)
        counts[setup, store, wrapper][verdict] += 1
        print(f"{run:32s} {verdict:14s} {detail}")
    for (setup, store, wrapper), c in counts.items():
        others = ", ".join(f"{v} {n}" for v, n in sorted(c.items()) if v != "resumed")
        print(f"  {setup:12s} {store:9s} {wrapper:8s} {c['resumed']:>3d} of {sum(c.values()):<3d} "
              f"{others}")
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5, help="runs per (set-up, scrub, wrapper)")
    ap.add_argument("--setups", default=",".join(SETUPS))
    ap.add_argument("--wrappers", default=",".join(WRAPPERS))
    ap.add_argument("--scrub", default="plain,scrubbed", help="plain, scrubbed or both")
    ap.add_argument("--run-timeout-s", type=float, default=150.0)
    ap.add_argument("--keep", default=None, help="keep each run's logs under this directory")
    ap.add_argument("--json", default=None, help="write every run's verdict here")
    ap.add_argument("--reclassify", default=None, metavar="KEEP_DIR",
                    help="give the runs kept under KEEP_DIR (--keep) their verdicts again")
    args = ap.parse_args()
    if args.reclassify:
        return reclassify(args.reclassify)
    # forget_dead_attempt_keys() works for one agent only (it raises on several nodes).
    cells = [(setup, scrub == "scrubbed", wrapper)
             for setup in args.setups.split(",") for scrub in args.scrub.split(",")
             for wrapper in args.wrappers.split(",")
             if not (setup == "two-nodes" and scrub == "scrubbed")]
    results = collections.defaultdict(list)
    rows = []
    started = time.monotonic()
    for round_ in range(args.runs):  # interleaved, so a slow phase of the machine hits all cells
        for setup, scrub, wrapper in cells:
            outdir = tempfile.mkdtemp(prefix="restart_study_")
            verdict, detail, seconds = run_once(setup, wrapper, scrub, outdir, args.run_timeout_s)
            name = f"{setup} {'scrubbed' if scrub else 'plain'} {wrapper}"
            print(f"[{time.monotonic() - started:7.1f}s] {name:28s} run {round_ + 1}: {verdict:14s}"
                  f" {seconds:5.1f}s {detail}", flush=True)
            results[setup, scrub, wrapper].append(verdict)
            rows.append(dict(setup=setup, scrubbed=scrub, wrapper=wrapper, run=round_ + 1,
                             verdict=verdict, detail=detail, seconds=round(seconds, 1)))
            if args.keep:
                shutil.copytree(outdir, os.path.join(args.keep, f"{name.replace(' ', '_')}_"
                                                                f"{round_ + 1}"))
            shutil.rmtree(outdir, ignore_errors=True)
    print(f"\n# {len(rows)} runs in {time.monotonic() - started:.0f} s")
    print(f"# {'set-up':12s} {'store':9s} {'wrapper':8s} {'resumed':>8s}  other verdicts")
    bad = False
    for (setup, scrub, wrapper), verdicts in results.items():
        counts = collections.Counter(verdicts)
        others = ", ".join(f"{v} {n}" for v, n in sorted(counts.items()) if v != "resumed")
        print(f"  {setup:12s} {'scrubbed' if scrub else 'plain':9s} {wrapper:8s} "
              f"{counts['resumed']:>3d} of {len(verdicts):<3d} {others}")
        ddp = results.get((setup, scrub, "ddp"), [])
        if wrapper == "fused" and ("fused_reducer" in counts or (
                ddp and all(v == "resumed" for v in ddp) and counts["resumed"] < len(verdicts))):
            bad = True
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
