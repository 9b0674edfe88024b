"""fused_reducer.torchft.DistributedDataParallel against torchft.DistributedDataParallel, on the
same torchft Manager set-up (issue 47): 2-3 replica groups of one CPU rank (gloo), interleaved.

    .venv/bin/python bench/ft_bench.py                       # gpt2 from config (bench/models.py)
    .venv/bin/python bench/ft_bench.py --model resnet18 --replicas 3 --rounds 4 --steps 4

Timing phase: this process starts two Lighthouses in-process (one per wrapper, so that each
wrapper's Managers form their own quorums) and --replicas replica processes (this script again,
with --replica). Each replica builds both wrappers over the same seeded model, each with its own
Manager (the same arguments: synchronous quorum, min_replica_size 1, gloo), and alternates:
--steps steps with one, then --steps with the other, --rounds times (the first round is warm-up,
not counted). Each step: optimizer.zero_grad() (the quorum), forward, backward, should_commit(),
AdamW; the step time is that whole span.

Whether the all-reduces start before backward ends, two ways:
* torch.profiler (--profile-steps per wrapper after the timed rounds, one profile per step, not
  timed): the `c10d::allreduce_` calls (the launch of each bucket's all-reduce on the training
  thread) that start before the end of the backward's last autograd function other than
  AccumulateGrad (whose evaluation holds the hooks, and torchft's wait in its hook), and the
  milliseconds of backward computation during which a `gloo:all_reduce` was running on gloo's
  thread (0 when the hook waits for its bucket); fused_reducer.torchft's layout agreement (one
  small all-reduce in the forward) counted apart;
* timed hooks: every bucket's launch and completion (torchft's hook patched with a timed wrapper;
  fused_reducer.torchft's _managed_future likewise) and every gradient computed (a tensor hook
  per parameter): `launched_before_end`, buckets launched before the last gradient was computed,
  and `overlapped`, buckets during whose reduction a further gradient was computed.
The two wrappers' parameters after the same steps are compared too (they see the same data).

Fault phase (--fault, per wrapper, fresh processes and Lighthouse with min_replicas 1): the last
replica SIGKILLs itself in --kill-phase of --kill-step ("backward": in the hook of the first
parameter's gradient, computed last, with the other buckets in flight; "after_backward"), and is
restarted --restart-delay-s after its death, as torchelastic would. Measured: the time from the
kill to the survivors' next committed step (the latest survivor's), and the heal: from the
restarted process's first quorum request to its first committed step, the bytes of the state it
received (model and optimizer; a shared storage such as tied embeddings counted once) and the
ratio, seconds per MB. A survivor that crashes is reported as such (no restart then).
JSON to bench/out/ft_bench.json (--out): every step of every replica, the summary, the faults.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)  # the package as installed

import torch  # noqa: E402

from models import ModelSpec  # noqa: E402

WRAPPERS = ("fused_reducer", "torchft")


class Timeline:
    """Timestamps of one step: bucket launches and completions, gradients computed."""

    def __init__(self):
        self.events = []

    def launch(self, fut):
        index = sum(1 for e in self.events if e[0] == "launch")
        self.events.append(("launch", time.perf_counter(), index))
        fut.add_done_callback(lambda _: self.events.append(("done", time.perf_counter(), index)))
        return fut

    def summary(self):
        launches = {i: t for k, t, i in self.events if k == "launch"}
        dones = {i: t for k, t, i in self.events if k == "done"}
        readies = [t for k, t, _ in self.events if k == "ready"]
        end = max(readies) if readies else float("nan")
        return {"buckets": len(launches),
                "launched_before_end": sum(t < end for t in launches.values()),
                "overlapped": sum(1 for i, t in launches.items()
                                  if any(t < r < dones.get(i, float("inf")) for r in readies))}


def profiled_collectives(events):
    """From one step's torch.profiler events: the all-reduces launched (``c10d::allreduce_``, the
    process group's call on the training thread) before the backward's computation ended (the
    end of its last autograd function other than AccumulateGrad, whose evaluation holds the
    hooks, torchft's wait included), and the milliseconds of backward computation during which
    an all-reduce was executing (its ``gloo:all_reduce`` span on gloo's thread, or the NCCL
    kernel's span; 0 when the hook waits for each bucket). All-reduces launched before the
    backward's first autograd function (fused_reducer.torchft's layout agreement, in the
    forward) are counted apart."""
    compute = [(e.time_range.start, e.time_range.end) for e in events
               if e.name.startswith("autograd::engine::evaluate_function:")
               and "AccumulateGrad" not in e.name]
    launches = [e.time_range.start for e in events if e.name == "c10d::allreduce_"]
    running = [(e.time_range.start, e.time_range.end) for e in events
               if e.name == "gloo:all_reduce" or "AllReduce" in e.name and "nccl" in e.name.lower()]
    start = min((a for a, _ in compute), default=float("nan"))
    end = max((b for _, b in compute), default=float("nan"))
    overlap_us = sum(max(0.0, min(b, d) - max(a, c)) for a, b in compute for c, d in running)
    in_forward = sum(t < start for t in launches)
    return {"allreduces": len(launches) - in_forward,
            "allreduces_in_forward": in_forward,
            "allreduces_before_backward_end": sum(start <= t < end for t in launches),
            "compute_overlapped_ms": overlap_us / 1000}


def replica_main(args):
    import torchft
    import torchft.ddp
    import fused_reducer.torchft as ft

    spec = ModelSpec.from_args(args.model)
    timeline = Timeline()
    original_future = ft._managed_future
    ft._managed_future = lambda *a: timeline.launch(original_future(*a))  # looked up per call
    original_hook = torchft.ddp.DistributedDataParallel._comm_hook

    def timed_hook(state, bucket):  # torchft's hook waits inside: its future is complete
        index = sum(1 for e in timeline.events if e[0] == "launch")
        timeline.events.append(("launch", time.perf_counter(), index))
        fut = original_hook(state, bucket)
        timeline.events.append(("done", time.perf_counter(), index))
        return fut

    torchft.ddp.DistributedDataParallel._comm_hook = staticmethod(timed_hook)
    lighthouses = json.loads(args.lighthouses)
    timeout = timedelta(seconds=30)
    stores, setups = [], {}
    for name in WRAPPERS:
        store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True,
                                           wait_for_workers=False)
        stores.append(store)
        manager = torchft.Manager(
            pg=torchft.ProcessGroupGloo(timeout=timeout), min_replica_size=1,
            load_state_dict=None, state_dict=None, replica_id=f"{name}_{args.replica}",
            lighthouse_addr=lighthouses[name], store_addr="127.0.0.1", store_port=store.port,
            rank=0, world_size=1, use_async_quorum=False, timeout=timeout,
            quorum_timeout=timedelta(seconds=60), init_sync=False)
        module = spec.build("cpu")
        if name == "fused_reducer":
            model = ft.DistributedDataParallel(manager, module, first_bucket_mb=1,
                                               bucket_cap_mb=args.bucket_cap_mb,
                                               replica_id=f"replica_{args.replica}")
        else:
            model = torchft.DistributedDataParallel(manager, module,
                                                    bucket_cap_mb=args.bucket_cap_mb)
        for p in module.parameters():
            p.register_hook(lambda g: timeline.events.append(("ready", time.perf_counter(),
                                                              None)))
        inner = torch.optim.AdamW(model.parameters(), lr=1e-4)
        setups[name] = (manager, model, ft.Optimizer(manager, inner), inner)

    open(os.path.join(args.out, f"ready{args.replica}"), "w").close()
    while not os.path.exists(os.path.join(args.out, "go")):
        time.sleep(0.01)
    rows, index = [], {name: 0 for name in WRAPPERS}
    for rnd in range(args.rounds):
        for name in WRAPPERS:
            manager, model, optimizer, inner = setups[name]
            for _ in range(args.steps):
                x = spec.input(args.replica, index[name], "cpu")
                timeline.events.clear()
                began = time.perf_counter()
                optimizer.zero_grad()
                model(x).float().pow(2).mean().backward()
                committed = manager.should_commit()
                if committed:
                    inner.step()
                seconds = time.perf_counter() - began
                rows.append(dict(timeline.summary(), wrapper=name, round=rnd, step=index[name],
                                 seconds=seconds, commit=committed,
                                 participants=manager.num_participants()))
                index[name] += 1
    # Then a few steps of each wrapper under torch.profiler, one profile per step (not timed).
    for name in WRAPPERS:
        manager, model, optimizer, inner = setups[name]
        for _ in range(args.profile_steps):
            x = spec.input(args.replica, index[name], "cpu")
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                optimizer.zero_grad()
                model(x).float().pow(2).mean().backward()
                committed = manager.should_commit()
                if committed:
                    inner.step()
            rows.append(dict(profiled_collectives(prof.events()), wrapper=name, profiled=True,
                             step=index[name], commit=committed,
                             participants=manager.num_participants()))
            index[name] += 1
    params = {name: list(setups[name][1].module.parameters()) for name in WRAPPERS}
    difference = max((a - b).abs().max().item()
                     for a, b in zip(params["fused_reducer"], params["torchft"]))
    with open(os.path.join(args.out, f"replica{args.replica}.json"), "w") as f:
        json.dump({"rows": rows, "wrapper_difference": difference}, f)
    setups["fused_reducer"][1].close()
    for manager, *_ in setups.values():
        manager.shutdown(wait=False)
    os._exit(0)  # torchft's threads are not joined at exit


def state_bytes(state, seen=None):
    """Bytes of the tensors in a (nested) state dict: what a healing replica receives (a
    storage shared by several entries, such as tied embeddings, counted once)."""
    seen = set() if seen is None else seen
    if isinstance(state, torch.Tensor):
        storage = state.untyped_storage()
        if storage.data_ptr() in seen:
            return 0
        seen.add(storage.data_ptr())
        return storage.nbytes()
    if isinstance(state, dict):
        return sum(state_bytes(v, seen) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(v, seen) for v in state)
    return 0


def fault_replica_main(args):
    """One replica of the fault phase, one wrapper: trains; the victim SIGKILLs itself at
    --kill-step in --kill-phase; a restarted victim heals from a live peer. Writes a JSON line
    per step (its time after should_commit), the kill, and the heal (its start: the first
    quorum of the restarted process; the bytes of the state it received) to <out>/fault<R>.log."""
    import signal
    import torchft
    import fused_reducer.torchft as ft

    spec = ModelSpec.from_args(args.model)
    log_path = os.path.join(args.out, f"fault{args.replica}.log")

    def write(record):
        with open(log_path, "a") as f:
            f.write(json.dumps(dict(record, replica=args.replica, time=time.time())) + "\n")

    timeout = timedelta(seconds=10)
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = torchft.Manager(
        pg=torchft.ProcessGroupGloo(timeout=timeout), min_replica_size=1,
        load_state_dict=None, state_dict=None, replica_id=f"{args.wrapper}_{args.replica}",
        lighthouse_addr=args.lighthouses, store_addr="127.0.0.1", store_port=store.port,
        rank=0, world_size=1, use_async_quorum=False, timeout=timeout,
        quorum_timeout=timedelta(seconds=30), init_sync=False)
    module = spec.build("cpu")
    if args.wrapper == "fused_reducer":
        model = ft.DistributedDataParallel(manager, module, first_bucket_mb=1,
                                           bucket_cap_mb=args.bucket_cap_mb,
                                           replica_id=f"replica_{args.replica}")
        inner = torch.optim.AdamW(model.parameters(), lr=1e-4)
        load, save = ft.state_dict_fns(model, inner)
    else:
        model = torchft.DistributedDataParallel(manager, module, bucket_cap_mb=args.bucket_cap_mb)
        inner = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def load(state):
            module.load_state_dict(state["model"])
            inner.load_state_dict(state["optimizer"])

        def save():
            return {"model": module.state_dict(), "optimizer": inner.state_dict()}

    def counted_load(state):
        write({"loaded": True, "state_bytes": state_bytes(state)})
        load(state)

    manager.register_state_dict_fn("bench", counted_load, save)
    optimizer = ft.Optimizer(manager, inner)
    if not args.restarted:
        open(os.path.join(args.out, f"ready{args.replica}"), "w").close()
        while not os.path.exists(os.path.join(args.out, "go")):
            time.sleep(0.01)
    else:
        write({"heal_start": True})
    victim = args.replica == args.replicas - 1 and not args.restarted
    last_gradient = list(module.parameters())[0]  # registered first: its gradient comes last
    together = 0
    deadline = time.monotonic() + args.max_s
    while time.monotonic() < deadline:
        optimizer.zero_grad()
        step = manager.current_step()
        hooks = []
        if victim and step == args.kill_step:
            def die(*_):
                write({"killed": step, "phase": args.kill_phase})
                os.kill(os.getpid(), signal.SIGKILL)
            if args.kill_phase == "backward":  # the earlier buckets are in flight by then
                hooks.append(last_gradient.register_hook(die))
        model(spec.input(args.replica, step, "cpu")).float().pow(2).mean().backward()
        if victim and step == args.kill_step and args.kill_phase == "after_backward":
            die()
        committed = manager.should_commit()
        if committed:
            inner.step()
        participants = manager.num_participants()
        write({"step": step, "commit": committed, "participants": participants})
        for hook in hooks:
            hook.remove()
        if committed and participants == args.replicas and step > args.kill_step:
            together += 1
        if together >= args.after_join:
            break
    if args.wrapper == "fused_reducer":
        model.close()
    manager.shutdown(wait=False)
    os._exit(0 if together >= args.after_join else 3)


def wait_ready(procs, work, names):
    while not all(os.path.exists(os.path.join(work, f"ready{r}")) for r in names):
        if any(p.poll() is not None for p in procs.values()):
            sys.exit("a replica failed to start")
        time.sleep(0.05)
    open(os.path.join(work, "go"), "w").close()


def read_log(path):
    try:
        return [json.loads(line) for line in open(path)]
    except FileNotFoundError:
        return []


def fault_phase(args, wrapper, env):
    """Kill the last replica of --replicas in --kill-phase of --kill-step, restart it
    --restart-delay-s after its death; returns what the survivors and the restart did."""
    from torchft._torchft import LighthouseServer
    work = tempfile.mkdtemp(prefix=f"ft_fault_{wrapper}_")
    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=2000)
    victim = args.replicas - 1

    def start(replica, restarted=False):
        command = [sys.executable, os.path.abspath(__file__), "--fault-replica", "--replica",
                   str(replica), "--wrapper", wrapper, "--lighthouses", server.address(),
                   "--out", work, "--model", args.model, "--replicas", str(args.replicas),
                   "--kill-step", str(args.kill_step), "--kill-phase", args.kill_phase,
                   "--after-join", str(args.after_join), "--bucket-cap-mb",
                   str(args.bucket_cap_mb)] + (["--restarted"] if restarted else [])
        return subprocess.Popen(command, env=env)

    procs = {r: start(r) for r in range(args.replicas)}
    wait_ready(procs, work, range(args.replicas))
    result = {"wrapper": wrapper, "kill_phase": args.kill_phase, "kill_step": args.kill_step}
    died = procs[victim].wait(timeout=300)
    time.sleep(args.restart_delay_s)
    survivors_alive = all(procs[r].poll() is None for r in range(victim))
    if survivors_alive:
        procs[victim] = start(victim, restarted=True)
    deadline = time.monotonic() + 180
    while any(p.poll() is None for p in procs.values()) and time.monotonic() < deadline:
        if any(procs[r].poll() not in (None, 0) for r in range(victim)):
            break  # a survivor crashed: the restart has no live peer to heal from
        time.sleep(0.1)
    codes = {}
    for r, proc in procs.items():
        if proc.poll() is None:
            proc.kill()  # only the processes this phase started
            proc.wait()
            codes[r] = "killed by the bench"
        else:
            codes[r] = proc.returncode
    server.shutdown()
    logs = {r: read_log(os.path.join(work, f"fault{r}.log")) for r in range(args.replicas)}
    kill = next((rec for rec in logs[victim] if "killed" in rec), None)
    result.update(victim_exit=died, exit_codes=codes,
                  survivors_crashed=not survivors_alive or any(codes[r] != 0
                                                               for r in range(victim)))
    if kill is None or result["survivors_crashed"]:
        return result
    firsts = [next((rec for rec in logs[r] if rec.get("commit") and rec["time"] > kill["time"]),
                   None) for r in range(victim)]
    if None in firsts:
        return result  # incomplete: printed as such
    result["kill_to_next_commit_s"] = max(rec["time"] - kill["time"] for rec in firsts)
    # Alone (the survivors only) or already with the restarted replica.
    result["next_commit_participants"] = max(rec["participants"] for rec in firsts)
    after_kill = [rec for rec in logs[victim] if rec["time"] > kill["time"]]
    heal_start = next(rec["time"] for rec in after_kill if "heal_start" in rec)
    loaded = next((rec for rec in after_kill if "loaded" in rec), None)
    joined = next((rec for rec in after_kill if rec.get("commit")), None)
    if loaded and joined:
        megabytes = loaded["state_bytes"] / 1e6
        result.update(state_mb=megabytes, heal_s=joined["time"] - heal_start,
                      heal_to_state_loaded_s=loaded["time"] - heal_start,
                      heal_s_per_mb=(joined["time"] - heal_start) / megabytes,
                      joined_at_step=joined["step"])
    return result


def timing_phase(args, env):
    from torchft._torchft import LighthouseServer
    work = tempfile.mkdtemp(prefix="ft_bench_")
    servers = {name: LighthouseServer(bind="[::]:0", min_replicas=args.replicas,
                                      join_timeout_ms=2000)
               for name in WRAPPERS}
    addresses = json.dumps({name: s.address() for name, s in servers.items()})
    procs = {r: subprocess.Popen([sys.executable, os.path.abspath(__file__), "--replica", str(r),
                                  "--lighthouses", addresses, "--out", work, "--model",
                                  args.model, "--rounds", str(args.rounds), "--steps",
                                  str(args.steps), "--profile-steps", str(args.profile_steps),
                                  "--bucket-cap-mb", str(args.bucket_cap_mb)], env=env)
             for r in range(args.replicas)}
    wait_ready(procs, work, range(args.replicas))
    codes = [p.wait(timeout=600) for p in procs.values()]
    for server in servers.values():
        server.shutdown()
    if any(codes):
        sys.exit(f"replicas ended with {codes}")
    results = [json.load(open(os.path.join(work, f"replica{r}.json")))
               for r in range(args.replicas)]
    rows = [dict(row, replica=r) for r, res in enumerate(results) for row in res["rows"]]
    summary = {}
    for name in WRAPPERS:
        mine = [row for row in rows if row["wrapper"] == name and not row.get("profiled")
                and row["round"] > 0]
        profiled = [row for row in rows if row["wrapper"] == name and row.get("profiled")]
        summary[name] = {
            "median_step_ms": round(1000 * statistics.median(row["seconds"] for row in mine), 2),
            "buckets": statistics.median(row["buckets"] for row in mine),
            "median_launched_before_end": statistics.median(
                row["launched_before_end"] for row in mine),
            "steps_with_overlap": sum(row["overlapped"] > 0 for row in mine),
            "steps": len(mine),
            "all_committed_by_all": all(row["commit"] and row["participants"] == args.replicas
                                        for row in mine + profiled),
            "profiled_steps": len(profiled),
            "profiler_allreduces_median": statistics.median(
                row["allreduces"] for row in profiled),
            "profiler_allreduces_in_forward_median": statistics.median(
                row["allreduces_in_forward"] for row in profiled),
            "profiler_allreduces_before_backward_end_median": statistics.median(
                row["allreduces_before_backward_end"] for row in profiled),
            "profiler_compute_overlapped_ms_median": round(statistics.median(
                row["compute_overlapped_ms"] for row in profiled), 2),
        }
        s = summary[name]
        print(f"{name:14s} median step {s['median_step_ms']:8.2f} ms  buckets {s['buckets']}  "
              f"launched before the last gradient (hooks, median) "
              f"{s['median_launched_before_end']}  steps with backward computing while a "
              f"bucket is reduced {s['steps_with_overlap']}/{s['steps']}  profiler: all-reduces "
              f"{s['profiler_allreduces_median']} (and "
              f"{s['profiler_allreduces_in_forward_median']} in the forward), started before "
              f"the backward's end "
              f"{s['profiler_allreduces_before_backward_end_median']}, backward computation "
              f"overlapped by an all-reduce {s['profiler_compute_overlapped_ms_median']} ms "
              f"(medians of {s['profiled_steps']})  every step committed by all: "
              f"{s['all_committed_by_all']}")
    difference = max(res["wrapper_difference"] for res in results)
    ratio = summary["torchft"]["median_step_ms"] / summary["fused_reducer"]["median_step_ms"]
    print(f"torchft DDP / fused_reducer step time: {ratio:.2f}x; parameters of the two wrappers "
          f"after the same steps differ by at most {difference:.3g}")
    return {"summary": summary, "ratio_torchft_over_fused": ratio,
            "wrapper_difference": difference, "rows": rows}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6, help="the first is warm-up")
    parser.add_argument("--steps", type=int, default=5, help="steps per wrapper per round")
    parser.add_argument("--profile-steps", type=int, default=3,
                        help="steps per wrapper under torch.profiler, after the timed rounds")
    parser.add_argument("--bucket-cap-mb", type=float, default=4.0,
                        help="bucket cap of both wrappers (the first bucket: 1 MB for both)")
    parser.add_argument("--fault", choices=("none",) + WRAPPERS + ("both",), default="both",
                        help="the kill and heal phase: for which wrappers")
    parser.add_argument("--kill-step", type=int, default=3)
    parser.add_argument("--kill-phase", choices=("backward", "after_backward"),
                        default="backward",
                        help="backward: in the gradient of the first parameter (computed last: "
                             "the other buckets are in flight)")
    parser.add_argument("--restart-delay-s", type=float, default=1.0)
    parser.add_argument("--after-join", type=int, default=3,
                        help="steps committed by all after the kill before the fault phase ends")
    parser.add_argument("--max-s", type=float, default=150, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "out", "ft_bench.json"))
    parser.add_argument("--replica", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--lighthouses", help=argparse.SUPPRESS)
    parser.add_argument("--fault-replica", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--wrapper", help=argparse.SUPPRESS)
    parser.add_argument("--restarted", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.fault_replica:
        return fault_replica_main(args)
    if args.replica is not None:
        return replica_main(args)

    os.environ.setdefault("RUST_LOG", "warn")
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 2) // args.replicas)))
    began = time.time()
    result = timing_phase(args, env) if args.rounds > 0 else {}
    faults = []
    for wrapper in {"none": (), "both": WRAPPERS}.get(args.fault, (args.fault,)):
        fault = fault_phase(args, wrapper, env)
        faults.append(fault)
        if fault["survivors_crashed"]:
            print(f"{wrapper:14s} killed in {args.kill_phase} of step {args.kill_step}: a "
                  f"survivor crashed (exit codes {fault['exit_codes']})")
        elif "heal_s" in fault:
            print(f"{wrapper:14s} killed in {args.kill_phase} of step {args.kill_step}: kill to "
                  f"the survivors' next commit {fault['kill_to_next_commit_s']:.2f} s (by "
                  f"{fault['next_commit_participants']} replicas); heal "
                  f"{fault['heal_s']:.2f} s from the restart's first quorum to its first commit "
                  f"(state loaded after {fault['heal_to_state_loaded_s']:.2f} s) for "
                  f"{fault['state_mb']:.1f} MB: {fault['heal_s_per_mb']:.3f} s/MB; joined at "
                  f"step {fault['joined_at_step']}")
        else:
            print(f"{wrapper:14s} fault phase incomplete: {fault}")
    meta = {"model": args.model, "replicas": args.replicas, "rounds": args.rounds,
            "steps": args.steps, "profile_steps": args.profile_steps,
            "bucket_cap_mb": args.bucket_cap_mb, "kill_step": args.kill_step,
            "kill_phase": args.kill_phase, "restart_delay_s": args.restart_delay_s,
            "cpus": os.cpu_count(), "load_average": os.getloadavg(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(began)),
            "wall_s": round(time.time() - began, 1), "torch": torch.__version__}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(result, meta=meta, faults=faults), f, indent=1)
    print(f"wrote {args.out} ({meta['wall_s']} s)")


if __name__ == "__main__":
    main()
