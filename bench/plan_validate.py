#!/usr/bin/env python
"""How well does the planner's model (python/fused_reducer/costmodel.py) predict measured steps?

    python bench/allreduce_bw.py -b 16K -e 128M -f 2 -n 10 -w 2 --trials 3 -c 0 --impl fused \\
        --json bench/out/bw_w2.json                                   # calibration, world 2
    python bench/step_bench.py --sweep-first 0.25,1,4,16,64 --sweep-cap 1,4,25,100 --steps 10 \\
        --json bench/out/sweep_w2.json                                # measured sweep, world 2
    python bench/plan_validate.py record --out bench/out/plan         # one profile per model
    python bench/plan_validate.py compare --sweep bench/out/sweep_w2.json \\
        --profiles bench/out/plan --calibrate bench/out/bw_w2.json --json bench/out/validate.json

record   runs step_bench's models and step (zero_grad + forward + loss + backward) under a
         FusedReducer with the given limits (default DDP's 1 MiB / 25 MiB) for --warmup + --steps
         steps and writes model.export_profile() to DIR/profile_<model>.json. Only the
         profile's layout is run: every other cell of the sweep is a prediction.
compare  predicts every (first, cap) cell of a step_bench sweep (its 'fused' rows) from the
         profile and the calibration, at the sweep's world size, with fused_reducer.plan's
         Planner (the one model), and prints predicted vs measured per cell, the median
         absolute error, and how far the predicted best cell's measured time is from the
         measured best.
"""
import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import step_bench  # noqa: E402

MiB = 1024 * 1024


# -- record ---------------------------------------------------------------------------------------
def record_worker(ctx, args):
    for name in args.model:
        d = step_bench.MODEL_DEFAULTS[name]
        spec = step_bench.ModelSpec(name, args.layers or d["layers"], args.hidden or d["hidden"],
                                    args.batch or d["batch"], args.seq or d["seq"], args.seed)
        model = step_bench.make_fused(spec.build(ctx.device), args.first_mb, args.cap_mb, False)
        for index in range(args.warmup + args.steps):
            step_bench.train_step(ctx, model, spec.input(ctx.rank, index, ctx.device), False)
        model.trace_steps = max(model.trace_steps, args.steps)
        path = model.export_profile(os.path.join(args.out, f"profile_{name}.json"))
        common.print0(ctx, f"# {name}: wrote {path}")
    return 0


# -- compare --------------------------------------------------------------------------------------
def compare(args):
    from fused_reducer.plan import Planner, build_network
    from fused_reducer.profile import load_profile

    with open(args.sweep) as f:
        sweep = json.load(f)
    world = int(sweep["meta"]["world_size"])
    network, inputs, metas = build_network([], args.calibrate)
    cells = []
    for info in sweep["models"]:
        profile_path = os.path.join(args.profiles, f"profile_{info['model']}.json")
        profile = load_profile(profile_path)
        recorded_bytes = sum(p["bytes"] for p in profile["params"])
        if recorded_bytes != info["grad_bytes"]:
            raise SystemExit(f"{profile_path}: {recorded_bytes} gradient bytes, the sweep's "
                             f"{info['model']} has {info['grad_bytes']}: not the same model")
        planner = Planner(profile, network, inputs, args.overlap, 1.0, profile_path, metas)
        for row in sweep["rows"]:
            if row["model"] != info["model"] or row["impl"] != "fused":
                continue
            candidate = (int(row["first_bucket_mb"] * MiB), int(row["bucket_cap_mb"] * MiB), 0)
            predicted = planner.predict(candidate, world, world)
            cells.append({"model": info["model"], "first_mb": row["first_bucket_mb"],
                          "cap_mb": row["bucket_cap_mb"],
                          "bucket_sizes": list(row.get("bucket_sizes") or []),
                          "buckets_measured": len(row.get("bucket_sizes") or []),
                          "buckets_predicted":
                          predicted.buckets, "measured_ms": row["median_ms"],
                          "predicted_ms": predicted.step_us / 1e3,
                          "error_pct": 100 * (predicted.step_us / 1e3 - row["median_ms"])
                          / row["median_ms"]})
    summary = summarise(cells)
    print(f"# plan_validate: {args.sweep} (world {world}, {sweep['meta'].get('hostname')}, "
          f"{sweep['meta'].get('date')}), calibration {', '.join(args.calibrate)}, "
          f"overlap {planner.overlap}")
    print("#  model        first    cap  buckets(meas/pred)  measured ms  predicted ms  error %")
    for c in cells:
        print(f"   {c['model']:<11}{c['first_mb']:6g} {c['cap_mb']:6g}  {c['buckets_measured']:8d}/"
              f"{c['buckets_predicted']:<8d}  {c['measured_ms']:11.2f}  {c['predicted_ms']:12.2f}"
              f"  {c['error_pct']:+7.1f}")
    for model, s in summary.items():
        line = f"# {model}: median |error| {s['median_abs_error_pct']:.1f} % over {s['cells']} cells"
        if s["same_layout_spread_pct"] is not None:
            line += (f" (cells sharing a layout differ by {s['same_layout_spread_pct']:.1f} % "
                     f"from their median: the floor for any model)")
        if "predicted_best" in s:
            line += (f"; predicted best {s['predicted_best']} measures "
                     f"{s['predicted_best_measured_ms']:.2f} ms, measured best "
                     f"{s['measured_best']} {s['measured_best_ms']:.2f} ms: "
                     f"{s['predicted_best_vs_measured_best_pct']:+.1f} %")
        print(line)
    for i in inputs:
        print(f"#   input {i['source']}: {i['input']}: {i['value']}")
    if args.json:
        common.write_json(args.json, {"sweep": args.sweep, "calibrate": args.calibrate,
                                      "profiles": args.profiles, "world_size": world,
                                      "overlap": planner.overlap, "cells": cells,
                                      "summary": summary, "inputs": planner.inputs})
        print(f"# wrote {args.json}")
    if args.plot:
        plot(args.plot, cells, summary, world)
        print(f"# wrote {args.plot}")
    return 0


def summarise(cells):
    out = {}
    for model in list(dict.fromkeys(c["model"] for c in cells)) + ["all"]:
        mine = [c for c in cells if model == "all" or c["model"] == model]
        if not mine:
            continue
        entry = {"cells": len(mine),
                 "median_abs_error_pct": statistics.median(abs(c["error_pct"]) for c in mine),
                 "same_layout_spread_pct": same_layout_spread(mine)}
        if model != "all":
            best_pred = min(mine, key=lambda c: c["predicted_ms"])
            best_meas = min(mine, key=lambda c: c["measured_ms"])
            entry.update({
                "predicted_best": [best_pred["first_mb"], best_pred["cap_mb"]],
                "predicted_best_measured_ms": best_pred["measured_ms"],
                "measured_best": [best_meas["first_mb"], best_meas["cap_mb"]],
                "measured_best_ms": best_meas["measured_ms"],
                "predicted_best_vs_measured_best_pct":
                    100 * (best_pred["measured_ms"] / best_meas["measured_ms"] - 1)})
        out[model] = entry
    return out


def same_layout_spread(cells):
    """Median |measured - median of the cells with the same layout| / that median, over cells
    whose layout (bucket sizes) another cell shares: the error a perfect model would show on
    these measurements (noise and drift), None when no two cells share a layout."""
    groups = {}
    for c in cells:
        groups.setdefault((c["model"], tuple(c["bucket_sizes"])), []).append(c["measured_ms"])
    deviations = [100 * abs(t - statistics.median(ts)) / statistics.median(ts)
                  for ts in groups.values() if len(ts) > 1 for t in ts]
    return statistics.median(deviations) if deviations else None


def plot(path, cells, summary, world):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(c["model"] for c in cells))
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 5), squeeze=False)
    for ax, model in zip(axes[0], models):
        mine = [c for c in cells if c["model"] == model]
        xs = [c["measured_ms"] for c in mine]
        ys = [c["predicted_ms"] for c in mine]
        lo, hi = min(xs + ys) * 0.9, max(xs + ys) * 1.1
        ax.plot([lo, hi], [lo, hi], "k--", lw=1, label="predicted = measured")
        ax.fill_between([lo, hi], [lo * 0.9, hi * 0.9], [lo * 1.1, hi * 1.1], color="0.9",
                        label="+-10 %")
        ax.scatter(xs, ys, zorder=3)
        for c in mine:
            ax.annotate(f"{c['first_mb']:g},{c['cap_mb']:g}", (c["measured_ms"], c["predicted_ms"]),
                        fontsize=7, xytext=(3, 3), textcoords="offset points")
        s = summary[model]
        ax.set_title(f"{model}, world {world}: median |err| {s['median_abs_error_pct']:.1f} %, "
                     f"pred. best {s['predicted_best_vs_measured_best_pct']:+.1f} % of best",
                     fontsize=9)
        ax.set_xlabel("measured median step (ms)")
        ax.set_ylabel("predicted step (ms)")
        ax.legend(fontsize=8)
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    common.ensure_parent(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build_parser():
    parser = argparse.ArgumentParser(prog="plan_validate.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="record one profile per model")
    rec.add_argument("--out", required=True, help="directory for profile_<model>.json")
    rec.add_argument("--model", type=step_bench._models, default=list(step_bench.MODELS),
                     help="comma list of step_bench models (default both)")
    rec.add_argument("--first-mb", type=float, default=1.0,
                     help="first bucket of the recorded run, MiB (default 1, DDP's)")
    rec.add_argument("--cap-mb", type=float, default=25.0,
                     help="bucket cap of the recorded run, MiB (default 25, DDP's)")
    rec.add_argument("--warmup", type=int, default=3, help="steps before the recorded ones")
    rec.add_argument("--steps", type=int, default=10, help="recorded steps (medians)")
    rec.add_argument("--seed", type=int, default=0, help="as step_bench's --seed (default 0)")
    for flag in ("--layers", "--hidden", "--batch", "--seq"):
        rec.add_argument(flag, type=int, default=None, help="as step_bench's (default its)")
    common.add_launch_args(rec)
    cmp_ = sub.add_parser("compare", help="predicted vs measured per sweep cell")
    cmp_.add_argument("--sweep", required=True, help="bench/step_bench.py --json output")
    cmp_.add_argument("--profiles", required=True, help="directory written by record")
    cmp_.add_argument("--calibrate", action="append", required=True,
                      help="bench/allreduce_bw.py --json output (repeat per world size)")
    cmp_.add_argument("--overlap", choices=("auto", "free", "contended"), default="auto",
                      help="as fused_reducer.plan's --overlap (default auto)")
    cmp_.add_argument("--json", help="write cells and summary")
    cmp_.add_argument("--plot", help="predicted vs measured scatter PNG")
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.command == "record":
        os.makedirs(args.out, exist_ok=True)
        return common.launch(record_worker, args)
    from fused_reducer.plan import PlanInputError
    from fused_reducer.profile import ProfileError
    try:
        return compare(args)
    except (PlanInputError, ProfileError) as e:
        print(f"plan_validate: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
