#!/usr/bin/env python
"""FusedReducer's autotuner against an exhaustive sweep of the same candidates.

    python bench/autotune_bench.py                                  # CPU: spawns 2 gloo ranks
    python bench/autotune_bench.py --json bench/out/autotune.json --trace-png docs/img/trace.png
    torchrun --nproc-per-node 8 bench/autotune_bench.py --model large --hidden 2048

Phases, all on the same model (step_bench's models; same weights and inputs everywhere; one step
= zero_grad + forward + loss + backward, no optimizer):

  sweep    one FusedReducer; for every configuration the tuner considers (autotune.candidate_grid,
           one per distinct bucket layout, exactly the set the tuner ranks) set the limits, run
           one discarded warm-up step (it holds the rebuild) and --sweep-steps timed steps. The
           sweep's best = lowest median.
  tune     a fresh FusedReducer(..., autotune=True), trained until autotune_report()['done'];
           steps used = report['steps_used'] (warm-ups and trial steps, from the plan to the
           choice; the reducer's first --warmup steps run before tuning can start and are not
           counted, the sweep's own warm-up is not counted either).
  final    fresh FusedReducers, one per distinct configuration among default (first 1 MiB,
           cap 25 MiB, no last bucket), the sweep's best and the tuner's choice (a configuration
           named twice is one model, so their ratio is 1), plus a second instance of the
           default (the A/A pair: the noise floor of the comparison); --final-steps steps each,
           interleaved (one step each, order reversed every round) so that drift and noise hit
           all alike. Their medians give the targets:
             tuned / sweep best <= 1.05,  tuned / default <= 1.03,
             tune steps <= sweep steps / 3.

A step's time is the slowest rank's (max over ranks, one all-reduce per configuration).
Prints a table, writes --json, and with --trace-png renders the tuned model's Chrome trace (its
last --trace-steps steps, FusedReducer.export_trace) as a timeline picture; --render-trace
TRACE.json --trace-png OUT.png renders an existing trace without running anything.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import models as zoo  # noqa: E402
import step_bench  # noqa: E402
from step import measure  # noqa: E402
from report import render_trace  # noqa: E402

MiB = 1024 * 1024
DEFAULT = (1 * MiB, 25 * MiB, 0)


def short(candidate):
    f, c, l = candidate
    return (f"first {common.format_size(f)}, cap {common.format_size(c)}, last "
            f"{common.format_size(l) if l else 'off'}")


def fmt(candidate):
    f, c, l = candidate
    return f"first {common.format_size(f):>5} cap {common.format_size(c):>5} last {common.format_size(l) if l else '-':>5}"


def timed(ctx, model, x):
    """Step ms (measure.timed_step also returns backward's host ms, not used here)."""
    step_ms, _backward_ms = measure.timed_step(ctx, model, x, False)
    return step_ms


def slowest(ctx, values):
    """Per-step max over ranks (on the rank's own GPU for an NCCL group)."""
    t = torch.tensor(values, dtype=torch.float64,
                     device=ctx.device if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def make(spec, ctx, candidate=DEFAULT, **kwargs):
    from fused_reducer import FusedReducer
    model = FusedReducer(spec.build(ctx.device), first_bucket_mb=candidate[0] / MiB,
                         bucket_cap_mb=candidate[1] / MiB, **kwargs)
    model.last_bucket_bytes = candidate[2]
    return model


def set_limits(model, candidate):
    model.first_bucket_bytes, model.bucket_cap_bytes, model.last_bucket_bytes = candidate


def sweep_candidates(model):
    """The configurations the tuner ranks: its grid, one per distinct layout (rank 0's order)."""
    from fused_reducer.tuning.autotune import ParamInfo, candidate_grid
    info = ParamInfo([p for p in model.module.parameters() if p.requires_grad])
    incumbent = (model.first_bucket_bytes, model.bucket_cap_bytes, model.last_bucket_bytes)
    box = [list(model.attachment.reducer.last_ready_order())]
    dist.broadcast_object_list(box, src=0, device=model.attachment.control_device)
    layouts = {}
    grid = candidate_grid(info.group_bytes, incumbent)
    for candidate in grid:
        key = info.layout(box[0], candidate)
        if key not in layouts or candidate == incumbent:
            layouts[key] = candidate
    return list(layouts.values()), len(grid)


def worker(ctx, args):
    d = zoo.MODEL_DEFAULTS[args.model]
    spec = zoo.ModelSpec(args.model, args.layers or d["layers"], args.hidden or d["hidden"],
                                args.batch or d["batch"], args.seq or d["seq"], args.seed)
    info = spec.describe(spec.build("cpu"))
    meta = common.collect_meta(ctx, extra={"benchmark": "autotune_bench"})
    p = lambda *a: common.print0(ctx, *a)  # noqa: E731
    progress = common.Progress(ctx, enabled=not args.quiet)
    p(f"# autotune_bench: {ctx.world_size} ranks {ctx.backend} on {ctx.device.type}, torch "
      f"{meta['torch_version']}, {meta['hostname']} ({meta['usable_cpus']} usable cores, "
      f"{meta['threads_per_rank']} threads/rank), {meta['date']}")
    p(f"# model {spec.name}: {info['shape']}: {info['params'] / 1e6:.3g}M params in "
      f"{info['tensors']} tensors, {info['grad_bytes'] / 1e6:.1f} MB of fp32 gradients")
    index = 0

    def next_input():
        nonlocal index
        index += 1
        return spec.input(ctx.rank, index, ctx.device)

    t_start = time.monotonic()
    # -- sweep ---------------------------------------------------------------------------------
    start = args.start
    model = make(spec, ctx, start)
    for _ in range(args.warmup):
        timed(ctx, model, next_input())
    candidates, grid_size = sweep_candidates(model)
    p(f"# sweep: {len(candidates)} distinct layouts of {grid_size} grid points, 1 warm-up + "
      f"{args.sweep_steps} timed steps each")
    sweep = []
    for n, candidate in enumerate(candidates):
        set_limits(model, candidate)
        timed(ctx, model, next_input())  # rebuild + warm-up
        times = slowest(ctx, [timed(ctx, model, next_input()) for _ in range(args.sweep_steps)])
        sweep.append({"candidate": list(candidate), "median_ms": statistics.median(times),
                      "times_ms": times, "buckets": len(model.bucket_sizes())})
        progress(f"sweep {n + 1}/{len(candidates)}: {fmt(candidate)}: {statistics.median(times):.1f} ms")
    sweep_steps = len(candidates) * (1 + args.sweep_steps)
    best = min(sweep, key=lambda r: r["median_ms"])
    sweep_best = tuple(best["candidate"])
    del model
    t_sweep = time.monotonic() - t_start

    # -- tune ----------------------------------------------------------------------------------
    t0 = time.monotonic()
    tuned_model = make(spec, ctx, start, autotune=True)
    total_steps = 0
    while not tuned_model.autotune_report()["done"]:
        timed(ctx, tuned_model, next_input())
        total_steps += 1
        if total_steps > 10 * sweep_steps:
            raise SystemExit("the tuner did not finish")
    report = tuned_model.autotune_report()
    choice = report["choice"]
    tuned = (choice["first_bucket_bytes"], choice["bucket_cap_bytes"], choice["last_bucket_bytes"])
    t_tune = time.monotonic() - t0
    progress(f"tuner: {fmt(tuned)} after {report['steps_used']} steps", force=True)

    # -- final, interleaved --------------------------------------------------------------------
    # One fresh FusedReducer per distinct configuration (a configuration named twice is one
    # model), plus a second instance of the default: the A/A pair shows the noise floor.
    del tuned_model
    configs = {"default": start, "sweep_best": sweep_best, "tuned": tuned}
    instances = {}
    for candidate in configs.values():
        if candidate not in instances:
            instances[candidate] = make(spec, ctx, candidate)
    models = {fmt(c): m for c, m in instances.items()}
    models["default, 2nd instance"] = make(spec, ctx, start)
    for _ in range(args.warmup):
        x = next_input()
        for m in models.values():
            timed(ctx, m, x)
    final = {name: [] for name in models}
    names = list(models)
    for r in range(args.final_steps):
        x = next_input()
        for name in (names if r % 2 == 0 else names[::-1]):
            final[name].append(timed(ctx, models[name], x))
        progress(f"final {r + 1}/{args.final_steps}")
    final = {name: slowest(ctx, v) for name, v in final.items()}
    med = {name: statistics.median(final[fmt(c)]) for name, c in configs.items()}
    med["default, 2nd instance"] = statistics.median(final["default, 2nd instance"])
    trace_path = None
    if args.trace_png or args.trace_json:
        trace_path = args.trace_json or os.path.join(os.path.dirname(args.trace_png) or ".",
                                                     "autotune_trace.json")
        if ctx.rank == 0:
            instances[tuned].export_trace(trace_path, steps=args.trace_steps)
    elapsed = time.monotonic() - t_start

    if ctx.rank == 0:
        p("#\n# sweep (median of the slowest rank's step times, ms):")
        for row in sorted(sweep, key=lambda r: r["median_ms"]):
            p(f"  {fmt(tuple(row['candidate']))}  buckets {row['buckets']:3d}  {row['median_ms']:9.2f}")
        p("#\n# tuner trials (median ms over their timed steps; predicted by the cost model):")
        for t in report["trials"]:
            c = (t["first_bucket_bytes"], t["bucket_cap_bytes"], t["last_bucket_bytes"])
            p(f"  {fmt(c)}  buckets {t['buckets']:3d}  {t['step_ms']:9.2f}  predicted "
              f"{t['predicted_ms']:9.2f}  samples {len(t['samples_ms'])}"
              + ("  (incumbent)" if t["incumbent"] else ""))
        p(f"#\n# final, interleaved, {args.final_steps} steps per model (median ms; one model "
          f"per distinct configuration):")
        for name, c in configs.items():
            p(f"  {name:<10} {fmt(c)}  {med[name]:9.2f}")
        p(f"  default, 2nd instance (noise floor)            {med['default, 2nd instance']:9.2f}")
        targets = {
            "tuned_over_sweep_best": med["tuned"] / med["sweep_best"],
            "tuned_over_default": med["tuned"] / med["default"],
            "tune_steps_over_sweep_steps": report["steps_used"] / sweep_steps,
        }
        aa = med["default, 2nd instance"] / med["default"]
        ok = {"tuned_over_sweep_best": targets["tuned_over_sweep_best"] <= 1.05,
              "tuned_over_default": targets["tuned_over_default"] <= 1.03,
              "tune_steps_over_sweep_steps": targets["tune_steps_over_sweep_steps"] <= 1 / 3}
        p("#")
        p(f"# tuned / sweep best = {targets['tuned_over_sweep_best']:.3f} (target <= 1.05: "
          f"{'met' if ok['tuned_over_sweep_best'] else 'MISSED'})")
        p(f"# tuned / default    = {targets['tuned_over_default']:.3f} (target <= 1.03: "
          f"{'met' if ok['tuned_over_default'] else 'MISSED'})")
        p(f"# tuner steps {report['steps_used']} vs sweep steps {sweep_steps}: "
          f"{targets['tune_steps_over_sweep_steps']:.3f} (target <= 0.333: "
          f"{'met' if ok['tune_steps_over_sweep_steps'] else 'MISSED'})")
        p(f"# noise floor: default 2nd instance / default = {aa:.3f}")
        p(f"# wall time: sweep {t_sweep:.0f} s, tune {t_tune:.0f} s, total {elapsed:.0f} s")
        if args.json:
            common.write_json(args.json, {
                "meta": meta, "settings": vars(args), "model": info,
                "sweep": sweep, "sweep_steps": sweep_steps, "grid_points": grid_size,
                "sweep_best": list(sweep_best), "report": report, "final_ms": final,
                "final_median_ms": med, "configs": {k: list(v) for k, v in configs.items()},
                "targets": targets, "met": ok, "aa_ratio": aa,
                "wall_s": {"sweep": t_sweep, "tune": t_tune, "total": elapsed}})
            p(f"# wrote {args.json}")
        if args.trace_png:
            render_trace(trace_path, args.trace_png,
                         title=f"{spec.name} model, tuned ({short(tuned)}) - {common.meta_label(meta)}")
            p(f"# wrote {trace_path} and {args.trace_png}")
    return 0


# -- trace picture --------------------------------------------------------------------------------
def _config(text):
    parts = [common.parse_size(v) for v in str(text).split(",")]
    if len(parts) != 3 or parts[0] <= 0 or parts[1] <= 0:
        raise argparse.ArgumentTypeError(f"need FIRST,CAP,LAST sizes (LAST 0 = off), got {text!r}")
    return tuple(parts)


def build_parser():
    parser = argparse.ArgumentParser(prog="autotune_bench.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    m = parser.add_argument_group("model (bench/step_bench.py's models)")
    m.add_argument("--model", choices=zoo.MODELS, default="large")
    m.add_argument("--layers", type=step_bench._positive_int, default=None)
    m.add_argument("--hidden", type=step_bench._positive_int, default=None)
    m.add_argument("--batch", type=step_bench._positive_int, default=None)
    m.add_argument("--seq", type=step_bench._positive_int, default=None)
    m.add_argument("--seed", type=int, default=0)
    r = parser.add_argument_group("measurement")
    r.add_argument("--start", type=_config, default=DEFAULT, metavar="FIRST,CAP,LAST",
                   help="configuration the tuner starts from and the 'default' row, e.g. "
                        "64K,64K,0 (default 1M,25M,0: FusedReducer's defaults)")
    r.add_argument("--warmup", type=step_bench._positive_int, default=2,
                   help="untimed steps of each fresh reducer (default 2)")
    r.add_argument("--sweep-steps", type=step_bench._positive_int, default=3,
                   help="timed steps per sweep configuration, after one warm-up (default 3)")
    r.add_argument("--final-steps", type=step_bench._positive_int, default=15,
                   help="interleaved steps per configuration in the final comparison (default 15)")
    o = parser.add_argument_group("output")
    o.add_argument("--json", metavar="FILE")
    o.add_argument("--trace-png", metavar="FILE.png",
                   help="render the tuned model's trace (last --trace-steps steps) to FILE.png")
    o.add_argument("--trace-json", metavar="FILE.json",
                   help="where to write that trace (default: autotune_trace.json next to the PNG)")
    o.add_argument("--trace-steps", type=step_bench._positive_int, default=1,
                   help="steps in the exported trace and picture (default 1)")
    o.add_argument("--render-trace", metavar="TRACE.json",
                   help="only render TRACE.json to --trace-png, run nothing")
    o.add_argument("--quiet", action="store_true")
    common.add_launch_args(parser)
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.render_trace:
        if not args.trace_png:
            parser.error("--render-trace needs --trace-png")
        render_trace(args.render_trace, args.trace_png)
        return 0
    return common.launch(worker, args)


if __name__ == "__main__":
    sys.exit(main())
