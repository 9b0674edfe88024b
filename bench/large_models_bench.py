"""Step time of FusedReducer against DDP as the data-parallel dimension of tensor- and
pipeline-parallel training (issue 40, point 5), in the same set-up, with the same bucket limits:

    tp   TP=2 x DP=2: a stack of blocks (LayerNorm, ColwiseParallel up, RowwiseParallel down)
         split over mesh["tp"]. ours: FusedReducer(model, device_mesh=mesh["dp"]);
         ddp: torch's _pre_dp_module_transform(model), then DDP(model, process_group=dp group).
    pp   PP=2 x DP=2: each stage a stack of Linear + ReLU layers under Schedule1F1B
         (--microbatches). ours: FusedReducer stages driven by fused_reducer.pipelining.PipelineStage;
         ddp: DDP stages driven by torch's PipelineStage.

Both ways run interleaved, one step each per round (the order alternates), SGD on the same data.
A step is timed from a barrier to the end of the optimizer step; the medians of the timed rounds
and the median of the per-round ratio ours / ddp are printed. All-reduces per step are counted by
torch.profiler (one untimed step per way), not by FusedReducer's stats: 'c10d::allreduce_' (any
c10d process group: DDP's, TP's, FusedReducer's process_group transport) and 'shm:all_reduce'
(FusedReducer's shared-memory transport); TP's own all-reduces are counted once on the bare TP
model and subtracted (the 'dp' column). At the end the two ways' parameters are compared.

    python bench/large_models_bench.py --nranks 4                      # both layouts, 4 gloo ranks
    python bench/large_models_bench.py --nranks 4 --layouts tp --steps 40 --json out.json
    torchrun --nproc-per-node 4 bench/large_models_bench.py            # NCCL on 4 GPUs
"""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fused_reducer  # noqa: E402
from fused_reducer.testing.collectives import count_allreduces  # noqa: E402
from common import add_launch_args, collect_meta, ddp_best_kwargs, launch, print0, write_json  # noqa: E402

LAYOUTS = ("tp", "pp")
WAYS = ("ours", "ddp")
LR = 1e-3


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


# -- TP x DP ---------------------------------------------------------------------------------------
def _tp_model(mesh, args, device):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    torch.manual_seed(0)
    model = nn.Sequential(*(Block(args.dim) for _ in range(args.layers))).to(device)
    plan = {}
    for i in range(args.layers):
        plan.update({f"{i}.up": ColwiseParallel(), f"{i}.down": RowwiseParallel()})
    parallelize_module(model, mesh["tp"], plan)
    return model


def build_tp(way, mesh, args, device):
    """(step(x, y), parameters to compare: local tensors)"""
    from torch.distributed.tensor.parallel.ddp import _pre_dp_module_transform
    module = _tp_model(mesh, args, device)
    if way == "ours":
        model = fused_reducer.FusedReducer(module, device_mesh=mesh["dp"], first_bucket_mb=args.first_mb,
                                           bucket_cap_mb=args.cap_mb, backend=args.transport)
        params = list(model.parameters())
    elif way == "ddp":
        _pre_dp_module_transform(module)
        kwargs, why = ddp_best_kwargs(args.first_mb, args.cap_mb)
        if why:
            raise SystemExit(f"large_models_bench: {why}; use --first-mb equal to --cap-mb")
        model = DDP(module, process_group=mesh["dp"].get_group(), **kwargs)
        # The transform's local Parameters: after a forward the module holds DTensors as plain
        # attributes, so keep them from here.
        params = list(model.parameters())
    else:  # "tp": no data parallelism, for counting TP's own collectives
        model, params = module, list(module.parameters())
    opt = torch.optim.SGD(params, lr=LR)

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        (model(x) - y).pow(2).mean().backward()
        opt.step()
    local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
    return step, local, model


# -- PP x DP ---------------------------------------------------------------------------------------
def build_pp(way, mesh, args, device):
    from torch.distributed.pipelining import PipelineStage as TorchStage, Schedule1F1B
    from fused_reducer.pipelining import PipelineStage
    pp = mesh["pp"].get_local_rank()
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(args.dim, args.dim), nn.ReLU()) for _ in range(2 * args.layers)]
    module = nn.Sequential(*layers[pp * args.layers:(pp + 1) * args.layers]).to(device)
    if way == "ours":
        model = fused_reducer.FusedReducer(module, device_mesh=mesh["dp"], first_bucket_mb=args.first_mb,
                                           bucket_cap_mb=args.cap_mb, backend=args.transport)
        stage_class = PipelineStage
    else:
        kwargs, why = ddp_best_kwargs(args.first_mb, args.cap_mb)
        if why:
            raise SystemExit(f"large_models_bench: {why}; use --first-mb equal to --cap-mb")
        model = DDP(module, process_group=mesh["dp"].get_group(), **kwargs)
        stage_class = TorchStage
    stage = stage_class(model, pp, 2, device, group=mesh["pp"].get_group())
    schedule = Schedule1F1B(stage, n_microbatches=args.microbatches,
                            loss_fn=lambda out, y: (out - y).pow(2).mean())
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        schedule.step(x) if pp == 0 else schedule.step(target=y)
        opt.step()
    return step, list(module.parameters()), model


def run_layout(layout, ctx, args):
    from torch.distributed.device_mesh import init_device_mesh
    if ctx.world_size != 4:
        raise SystemExit(f"large_models_bench: needs 4 ranks (2 x 2 mesh), got {ctx.world_size}")
    names = ("dp", "tp") if layout == "tp" else ("pp", "dp")
    mesh = init_device_mesh(ctx.device.type, (2, 2), mesh_dim_names=names)
    build = build_tp if layout == "tp" else build_pp
    built = {way: build(way, mesh, args, ctx.device) for way in WAYS}
    dp = mesh["dp"].get_local_rank()

    def batch(step):
        g = torch.Generator().manual_seed(1000 * step + dp)  # this DP rank's rows
        rows = args.batch
        return (torch.randn(rows, args.dim, generator=g).to(ctx.device),
                torch.randn(rows, args.dim, generator=g).to(ctx.device))

    times = {way: [] for way in WAYS}
    ratios = []
    for step in range(args.warmup + args.steps):
        x, y = batch(step)
        order = WAYS if step % 2 == 0 else WAYS[::-1]
        took = {}
        for way in order:
            ctx.sync()
            dist.barrier()
            start = time.perf_counter()
            built[way][0](x, y)
            ctx.sync()
            took[way] = time.perf_counter() - start
        if step >= args.warmup:
            for way in WAYS:
                times[way].append(took[way])
            ratios.append(took["ours"] / took["ddp"])
    # The two ways trained on the same data from the same start: compare, then count.
    diff = max(float((a.detach().double() - b.detach().double()).abs().max())
               for a, b in zip(built["ours"][1], built["ddp"][1]))
    counts = {way: count_allreduces(lambda: built[way][0](*batch(0))) for way in WAYS}
    tp_own = 0
    if layout == "tp":
        bare = build_tp("tp", mesh, args, ctx.device)[0]
        tp_own = count_allreduces(lambda: bare(*batch(0)))
    buckets = len(built["ours"][2].bucket_sizes())
    transport = built["ours"][2].backend
    built["ours"][2].close()
    gathered = [None] * ctx.world_size
    dist.all_gather_object(gathered, (counts, times))
    rows = []
    for way in WAYS:
        slowest = [max(g[1][way][i] for g in gathered) for i in range(args.steps)]
        rows.append({"layout": layout, "way": way, "step_ms": statistics.median(slowest) * 1e3,
                     "iqr_ms": _iqr(slowest) * 1e3,
                     "allreduces_per_step": [g[0][way] for g in gathered],
                     "dp_allreduces_per_step": [g[0][way] - tp_own for g in gathered]})
    ratio = statistics.median(ratios)
    what = (f"TP=2 x DP=2, {args.layers} blocks of dim {args.dim}" if layout == "tp" else
            f"PP=2 x DP=2, {args.layers} Linear({args.dim}) per stage, Schedule1F1B, "
            f"{args.microbatches} microbatches")
    print0(ctx, f"{what}; {args.batch} rows per DP rank; buckets first {args.first_mb} MiB, cap "
                f"{args.cap_mb} MiB (ours: {buckets} buckets on rank 0, {transport} transport); "
                f"{args.steps} timed rounds after {args.warmup}; max |ours - ddp| parameter "
                f"{diff:.2e}")
    for r in rows:
        print0(ctx, f"  {layout} {r['way']:4s}  step {r['step_ms']:8.2f} ms (IQR {r['iqr_ms']:.2f})  "
                    f"all-reduces per step and rank {r['allreduces_per_step']}"
                    + (f" (DP: {r['dp_allreduces_per_step']}, TP's own: {tp_own})" if tp_own else ""))
    print0(ctx, f"  {layout} ours / ddp: median of the per-round ratios {ratio:.3f}")
    for r in rows:
        r.update(ratio=ratio, max_param_diff=diff, buckets=buckets, transport=transport)
    return rows


def _iqr(values):
    if len(values) < 2:
        return 0.0
    q = statistics.quantiles(values, n=4)
    return q[2] - q[0]


def worker(ctx, args):
    layouts = args.layouts.split(",")
    if not layouts or set(layouts) - set(LAYOUTS):
        raise SystemExit(f"large_models_bench: --layouts takes {', '.join(LAYOUTS)}, got {args.layouts}")
    rows = []
    for layout in layouts:
        rows += run_layout(layout, ctx, args)
    meta = collect_meta(ctx)
    if args.json and ctx.rank == 0:
        write_json(args.json, {"meta": meta, "rows": rows})
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", default="tp,pp", help="comma-separated, of tp, pp (default both)")
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4, help="blocks (tp) or layers per stage (pp)")
    parser.add_argument("--batch", type=int, default=32, help="rows per DP rank and step")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20, help="timed rounds")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--first-mb", type=float, default=1.0)
    parser.add_argument("--cap-mb", type=float, default=25.0)
    parser.add_argument("--transport", choices=("auto", "shm", "process_group"), default="auto",
                        help="FusedReducer's transport (default auto: shared memory on one host)")
    parser.add_argument("--json", metavar="FILE", help="also write the rows and the machine as JSON")
    add_launch_args(parser)
    args = parser.parse_args(argv)
    return launch(worker, args)


if __name__ == "__main__":
    sys.exit(main())
