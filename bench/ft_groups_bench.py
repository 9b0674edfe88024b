"""Replica groups of several ranks under torchft (issue 47, part 2): the two ways
fused_reducer.torchft reduces a bucket, interleaved in one run on CPU gloo.

    .venv/bin/python bench/ft_groups_bench.py                 # 2 groups x 2 ranks
    .venv/bin/python bench/ft_groups_bench.py --layers 8 --rounds 7 --steps 5

  reduce_scatter: reduce-scatter inside the group, the Manager's all-reduce of this rank's 1/N
                  shard across groups, all-gather inside the group;
  all_reduce:     all-reduce inside the group, the Manager's all-reduce of the whole bucket.

This process starts a Lighthouse in-process and one process per rank (this script again, with
--group and --rank). The ranks of a group share their own gloo process group (rank 0 holds the
group's TCPStore, as torchrun's would); every rank has its own Manager (synchronous quorum,
rank = group rank, world_size = group size) and two models built alike (an MLP of --layers
Linear(--hidden, --hidden), bucket cap 4 MB, first bucket 1 MB), one per method, over the same
Manager. They alternate --steps steps of one, then of the other, --rounds times (the first round
is warm-up, not counted). Step: optimizer.zero_grad() (the quorum), forward, backward,
optimizer.step() if should_commit(); the step time is that span, and the backward time from the
end of forward to the end of backward (where the reducer has waited for every bucket). Prints
the medians over every rank and step; JSON with every step to bench/out/ft_groups_bench.json.
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

import torch  # noqa: E402
from torch import nn  # noqa: E402

METHODS = ("reduce_scatter", "all_reduce")


def build_model(layers, hidden):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh())
                           for _ in range(layers)])


def group_store(work, group, rank):
    """The group's TCPStore: rank 0 holds it and writes its port for the others."""
    path = os.path.join(work, f"group{group}.store")
    if rank == 0:
        store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True,
                                           wait_for_workers=False)
        with open(path + ".tmp", "w") as f:
            f.write(str(store.port))
        os.replace(path + ".tmp", path)
        return store
    while not os.path.exists(path):
        time.sleep(0.02)
    return torch.distributed.TCPStore("127.0.0.1", int(open(path).read()), is_master=False,
                                      wait_for_workers=False)


def rank_main(args):
    import torchft
    import fused_reducer.torchft as ft

    torch.set_num_threads(1)  # 4 processes on the machine's cores
    timeout = timedelta(seconds=60)
    store = group_store(args.out, args.group, args.rank)
    torch.distributed.init_process_group(
        "gloo", store=torch.distributed.PrefixStore("group", store), rank=args.rank,
        world_size=args.group_size, timeout=timeout)
    manager = torchft.Manager(
        pg=torchft.ProcessGroupGloo(timeout=timeout), min_replica_size=1,
        load_state_dict=None, state_dict=None, replica_id=f"group_{args.group}",
        lighthouse_addr=args.lighthouse, store_addr="127.0.0.1", store_port=store.port,
        rank=args.rank, world_size=args.group_size, use_async_quorum=False, timeout=timeout,
        quorum_timeout=timedelta(seconds=60), init_sync=False)
    setups = {}
    for method in METHODS:
        model = ft.DistributedDataParallel(manager, build_model(args.layers, args.hidden),
                                           first_bucket_mb=1, bucket_cap_mb=4,
                                           group_reduction=method)
        inner = torch.optim.SGD(model.parameters(), lr=1e-3)
        setups[method] = (model, ft.Optimizer(manager, inner), inner)

    open(os.path.join(args.out, f"ready_{args.group}_{args.rank}"), "w").close()
    while not os.path.exists(os.path.join(args.out, "go")):
        time.sleep(0.01)
    rows, index = [], {method: 0 for method in METHODS}
    for rnd in range(args.rounds):
        for method in METHODS:
            model, optimizer, inner = setups[method]
            for _ in range(args.steps):
                g = torch.Generator().manual_seed(index[method] * 100 + args.group * 10 + args.rank)
                x = torch.randn(args.batch, args.hidden, generator=g)
                began = time.perf_counter()
                optimizer.zero_grad()
                loss = model(x).pow(2).mean()
                forward_end = time.perf_counter()
                loss.backward()
                backward_end = time.perf_counter()
                committed = manager.should_commit()
                if committed:
                    inner.step()
                rows.append({"method": method, "round": rnd, "step": index[method],
                             "seconds": time.perf_counter() - began,
                             "backward_seconds": backward_end - forward_end,
                             "commit": committed, "participants": manager.num_participants(),
                             "buckets": len(model.bucket_parameter_names())})
                index[method] += 1
    params = [list(setups[m][0].module.parameters()) for m in METHODS]
    difference = max((a - b).abs().max().item() for a, b in zip(*params))
    with open(os.path.join(args.out, f"rank_{args.group}_{args.rank}.json"), "w") as f:
        json.dump({"rows": rows, "method_difference": difference}, f)
    for model, *_ in setups.values():
        model.close()
    manager.shutdown(wait=False)
    os._exit(0)  # torchft's threads are not joined at exit


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=2)
    parser.add_argument("--layers", type=int, default=6, help="Linear(hidden, hidden) layers")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=6, help="the first is warm-up")
    parser.add_argument("--steps", type=int, default=5, help="steps per method per round")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "out",
                                                      "ft_groups_bench.json"))
    parser.add_argument("--group", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--lighthouse", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.group is not None:
        return rank_main(args)

    os.environ.setdefault("RUST_LOG", "warn")
    from torchft._torchft import LighthouseServer
    work = tempfile.mkdtemp(prefix="ft_groups_bench_")
    server = LighthouseServer(bind="[::]:0", min_replicas=args.groups, join_timeout_ms=2000)
    members = [(g, r) for g in range(args.groups) for r in range(args.group_size)]
    common = ["--out", work, "--lighthouse", server.address(), "--group-size",
              str(args.group_size), "--layers", str(args.layers), "--hidden", str(args.hidden),
              "--batch", str(args.batch), "--rounds", str(args.rounds), "--steps",
              str(args.steps)]
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--group", str(g),
                               "--rank", str(r)] + common) for g, r in members]
    while not all(os.path.exists(os.path.join(work, f"ready_{g}_{r}")) for g, r in members):
        if any(p.poll() is not None for p in procs):
            sys.exit("a rank failed to start")
        time.sleep(0.05)
    open(os.path.join(work, "go"), "w").close()
    codes = [p.wait(timeout=900) for p in procs]
    server.shutdown()
    if any(codes):
        sys.exit(f"ranks ended with {codes}")
    results = {m: json.load(open(os.path.join(work, f"rank_{m[0]}_{m[1]}.json")))
               for m in members}
    rows = [dict(row, group=g, rank=r) for (g, r), res in results.items() for row in res["rows"]]
    grad_mb = sum(p.numel() for p in build_model(args.layers, args.hidden).parameters()) * 4e-6
    summary = {"gradient_mb": round(grad_mb, 2), "groups": args.groups,
               "group_size": args.group_size,
               "method_difference": max(res["method_difference"] for res in results.values())}
    print(f"{args.groups} groups x {args.group_size} ranks, {grad_mb:.1f} MB of gradients, "
          f"{args.rounds - 1} rounds x {args.steps} steps per method counted")
    for method in METHODS:
        mine = [row for row in rows if row["method"] == method and row["round"] > 0]
        summary[method] = {
            "median_step_ms": round(1000 * statistics.median(r["seconds"] for r in mine), 2),
            "median_backward_ms": round(
                1000 * statistics.median(r["backward_seconds"] for r in mine), 2),
            "buckets": statistics.median(r["buckets"] for r in mine),
            "steps": len(mine),
            "all_committed_by_all": all(r["commit"] and r["participants"] == args.groups
                                        for r in mine),
        }
        s = summary[method]
        print(f"{method:15s} median step {s['median_step_ms']:8.2f} ms  backward (with the "
              f"wait for the buckets) {s['median_backward_ms']:8.2f} ms  buckets {s['buckets']}  "
              f"every step committed by every group: {s['all_committed_by_all']}")
    print(f"largest parameter difference between the two methods' models: "
          f"{summary['method_difference']:.3g}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"summary": summary, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
