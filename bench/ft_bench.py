"""fused_reducer.torchft.DistributedDataParallel against torchft.DistributedDataParallel, on the
same torchft Manager set-up (issue 47): 2 replica groups of one CPU rank (gloo), interleaved.

    .venv/bin/python bench/ft_bench.py                       # gpt2 from config (bench/models.py)
    .venv/bin/python bench/ft_bench.py --model resnet18 --rounds 6 --steps 5

This process starts two Lighthouses in-process (one per wrapper, so that each wrapper's Managers
form their own quorums) and two replica processes (this script again, with --replica). Each
replica builds both wrappers over the same seeded model, each with its own Manager (the same
arguments: synchronous quorum, min_replica_size 1, gloo), and alternates: --steps steps with
one, then --steps with the other, --rounds times (the first round is warm-up, not counted).
Each step: optimizer.zero_grad() (the quorum), forward, backward, optimizer.step() (AdamW if
should_commit()); the step time is that whole span.

Whether the all-reduces start before backward ends: every bucket's launch (the hook handing it
to manager.allreduce) and completion are timestamped (torchft's hook patched with a timed
wrapper; fused_reducer.torchft's _managed_future likewise), as is every gradient computed
(a tensor hook per parameter). Per step: `launched_before_end`, buckets launched before the last
gradient was computed, and `overlapped`, buckets during whose reduction a further gradient was
computed (0 when the hook waits for its bucket: torchft's DDP). Both replicas report; the JSON
(bench/out/ft_bench.json or --out) has every step. The two wrappers' parameters after the same
steps are compared too (they see the same data).
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
                                               bucket_cap_mb=args.bucket_cap_mb)
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
    params = {name: list(setups[name][1].module.parameters()) for name in WRAPPERS}
    difference = max((a - b).abs().max().item()
                     for a, b in zip(params["fused_reducer"], params["torchft"]))
    with open(os.path.join(args.out, f"replica{args.replica}.json"), "w") as f:
        json.dump({"rows": rows, "wrapper_difference": difference}, f)
    setups["fused_reducer"][1].close()
    for manager, *_ in setups.values():
        manager.shutdown(wait=False)
    os._exit(0)  # torchft's threads are not joined at exit


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--rounds", type=int, default=6, help="the first is warm-up")
    parser.add_argument("--steps", type=int, default=5, help="steps per wrapper per round")
    parser.add_argument("--bucket-cap-mb", type=float, default=4.0,
                        help="bucket cap of both wrappers (the first bucket: 1 MB for both)")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "out", "ft_bench.json"))
    parser.add_argument("--replica", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--lighthouses", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.replica is not None:
        return replica_main(args)

    os.environ.setdefault("RUST_LOG", "warn")
    from torchft._torchft import LighthouseServer
    work = tempfile.mkdtemp(prefix="ft_bench_")
    servers = {name: LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=2000)
               for name in WRAPPERS}
    addresses = json.dumps({name: s.address() for name, s in servers.items()})
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 2) // 2)))
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--replica", str(r),
                               "--lighthouses", addresses, "--out", work, "--model", args.model,
                               "--rounds", str(args.rounds), "--steps", str(args.steps),
                               "--bucket-cap-mb", str(args.bucket_cap_mb)], env=env)
             for r in range(2)]
    while not all(os.path.exists(os.path.join(work, f"ready{r}")) for r in range(2)):
        if any(p.poll() is not None for p in procs):
            sys.exit("a replica failed to start")
        time.sleep(0.05)
    open(os.path.join(work, "go"), "w").close()
    codes = [p.wait(timeout=600) for p in procs]
    for server in servers.values():
        server.shutdown()
    if any(codes):
        sys.exit(f"replicas ended with {codes}")
    results = [json.load(open(os.path.join(work, f"replica{r}.json"))) for r in range(2)]
    rows = [dict(row, replica=r) for r, res in enumerate(results) for row in res["rows"]]
    summary = {}
    for name in WRAPPERS:
        mine = [row for row in rows if row["wrapper"] == name and row["round"] > 0]
        summary[name] = {
            "median_step_ms": round(1000 * statistics.median(row["seconds"] for row in mine), 2),
            "buckets": statistics.median(row["buckets"] for row in mine),
            "median_launched_before_end": statistics.median(
                row["launched_before_end"] for row in mine),
            "steps_with_overlap": sum(row["overlapped"] > 0 for row in mine),
            "steps": len(mine),
            "all_committed_by_2": all(row["commit"] and row["participants"] == 2 for row in mine),
        }
        s = summary[name]
        print(f"{name:14s} median step {s['median_step_ms']:8.2f} ms  buckets {s['buckets']}  "
              f"launched before the end of backward (median) {s['median_launched_before_end']}  "
              f"steps with backward computing while a bucket is reduced "
              f"{s['steps_with_overlap']}/{s['steps']}  every step committed by both: "
              f"{s['all_committed_by_2']}")
    difference = max(res["wrapper_difference"] for res in results)
    ratio = summary["torchft"]["median_step_ms"] / summary["fused_reducer"]["median_step_ms"]
    print(f"torchft DDP / fused_reducer step time: {ratio:.2f}x; parameters of the two wrappers "
          f"after the same steps differ by at most {difference:.3g}")
    meta = {"model": args.model, "rounds": args.rounds, "steps": args.steps,
            "bucket_cap_mb": args.bucket_cap_mb, "cpus": os.cpu_count(),
            "load_average": os.getloadavg(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "torch": torch.__version__}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "summary": summary, "ratio_torchft_over_fused": ratio,
                   "wrapper_difference": difference, "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
