#!/usr/bin/env python
"""How well does the planner's model (python/fused_reducer/tuning/costmodel.py) predict measured steps?

    python bench/allreduce_bw.py -b 16K -e 128M -f 2 -n 10 -w 2 --trials 3 -c 0 --impl fused \\
        --json bench/out/bw_w2.json                                   # calibration, world 2
    python bench/step_bench.py --sweep-first 0.25,1,4,16,64 --sweep-cap 1,4,25,100 --steps 10 \\
        --json bench/out/sweep_w2.json                                # measured sweep, world 2
    python bench/plan_validate.py record --out bench/out/plan         # one profile per model
    python bench/plan_validate.py compare --sweep bench/out/sweep_w2.json \\
        --profiles bench/out/plan --calibrate bench/out/bw_w2.json --json bench/out/validate.json

measure  the validation in one interleaved run (what docs/PLANNING.md reports): per model, one
         FusedReducer per (first, cap) cell of --sweep-first x --sweep-cap plus the recording
         one at --first-mb/--cap-mb, all with the same weights, stepped round by round on the
         same inputs (in a new random order every round, the same on every rank), so that
         machine drift hits every cell alike, next to the unwrapped model (its backward without
         communication); writes the cells as a step_bench-style sweep JSON (--json) and the
         recording FusedReducer's profile to DIR/profile_<model>.json (--out). Only that one
         layout's run is the profile: the cells are still predictions of layouts it did not run.
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
import random
import statistics
import sys
import time

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import models as zoo  # noqa: E402
import step_bench  # noqa: E402
from step import configs, measure  # noqa: E402

MiB = 1024 * 1024


# -- record ---------------------------------------------------------------------------------------
def record_worker(ctx, args):
    for name in args.model:
        d = zoo.MODEL_DEFAULTS[name]
        spec = zoo.ModelSpec(name, args.layers or d["layers"], args.hidden or d["hidden"],
                                    args.batch or d["batch"], args.seq or d["seq"], args.seed)
        model = configs.make_fused(spec.build(ctx.device), args.first_mb, args.cap_mb, False)
        for index in range(args.warmup + args.steps):
            measure.train_step(ctx, model, spec.input(ctx.rank, index, ctx.device), False)
        model.trace_steps = max(model.trace_steps, args.steps)
        path = model.export_profile(os.path.join(args.out, f"profile_{name}.json"))
        common.print0(ctx, f"# {name}: wrote {path}")
    return 0


# -- measure ---------------------------------------------------------------------------------------
class FirstGradientClock:
    """When the first parameter gradient of a backward is accumulated (reset `first` before)."""

    def __init__(self, params):
        self.first = None
        self.handles = [p.register_post_accumulate_grad_hook(self._hook) for p in params
                        if p.requires_grad]

    def _hook(self, _param):
        if self.first is None:
            self.first = time.perf_counter()

    def remove(self):
        for h in self.handles:
            h.remove()


def measure_worker(ctx, args):
    cells = [(f, c) for f in args.sweep_first for c in args.sweep_cap]
    meta = common.collect_meta(ctx, extra={
        "benchmark": "plan_validate measure", "steps": args.steps, "warmup": args.warmup,
        "seed": args.seed, "recorded_limits_mb": [args.first_mb, args.cap_mb],
        "step": "zero_grad + forward + loss + backward; per step the mean over ranks (and the "
                "slowest rank); every cell, the recording reducer and the unwrapped model "
                "interleaved, one step each per round, in a random order per round (the same "
                "on every rank)"})
    rows, models_info = [], []
    for name in args.model:
        d = zoo.MODEL_DEFAULTS[name]
        spec = zoo.ModelSpec(name, args.layers or d["layers"], args.hidden or d["hidden"],
                                    args.batch or d["batch"], args.seq or d["seq"], args.seed)
        info = spec.describe(spec.build("cpu"))
        models_info.append(info)
        # The recording reducer first; then the cells (a cell may repeat its layout: it is
        # still timed as its own reducer, which shows the spread of identical layouts).
        variants = [("record", configs.make_fused(spec.build(ctx.device), args.first_mb,
                                                     args.cap_mb, False))]
        variants += [(cell, configs.make_fused(spec.build(ctx.device), cell[0], cell[1],
                                                  False)) for cell in cells]
        for _, model in variants:
            model.trace_steps = max(model.trace_steps, args.steps)
        # The same model without any wrapper: its backward, first gradient -> end, is the
        # backward without communication that the profile's overlap cost is measured against.
        variants.append(("local", spec.build(ctx.device)))
        clock = FirstGradientClock(variants[-1][1].parameters())
        times = {key: [] for key, _ in variants}
        local_backward_us = []
        # A fresh order every round, the same on every rank (same seed): a rotation would keep
        # each reducer behind the same predecessor, whose leftovers (its last all-reduce,
        # caches) it would then pay every round (measured: one layout 7 % apart from itself).
        order = random.Random(args.seed)
        for index in range(args.warmup + args.steps):
            x = spec.input(ctx.rank, index, ctx.device)
            for key, model in order.sample(variants, len(variants)):
                clock.first = None
                step_ms, _ = measure.timed_step(ctx, model, x, False)
                if index >= args.warmup:
                    times[key].append(step_ms)
                    if key == "local":
                        local_backward_us.append((time.perf_counter() - clock.first) * 1e6)
        clock.remove()
        record = variants[0][1]
        path = record.export_profile(os.path.join(args.out, f"profile_{name}.json"))
        # Interleaved, the recording reducer's steps are not consecutive, so the reducer cannot
        # see the rest of its step (what it records as forward -> forward minus its own span
        # would hold the other cells' steps): measure it here, as the timed step minus the
        # reducer's forward start -> gradients written back, slowest rank.
        spans = [h["finalize_end_us"] - h["forward_us"]
                 for h in record.step_history()[-args.steps:]]
        rest = statistics.median(max(0.0, ms * 1e3 - span)
                                 for ms, span in zip(times["record"], spans))
        per_rank = [None] * ctx.world_size
        dist.all_gather_object(per_rank, (rest, statistics.median(local_backward_us), times))
        rest = max(r[0] for r in per_rank)  # the slowest rank, as the profile's times
        no_comm_us = max(r[1] for r in per_rank)
        per_rank = [r[2] for r in per_rank]
        if ctx.rank == 0:
            for key, model in variants[:-1]:
                recorded = key == "record"
                first, cap = (args.first_mb, args.cap_mb) if recorded else key
                steps = list(zip(*(r[key] for r in per_rank)))
                # A rank's step: the ranks wait for each other every step, so over the run
                # they take the same time; per step the mean over ranks (the max would add
                # the per-step skew, which the profile's per-rank medians do not have).
                mean = [statistics.fmean(step) for step in steps]
                slowest = [max(step) for step in steps]
                rows.append({"model": name, "impl": "fused", "first_bucket_mb": first,
                             "bucket_cap_mb": cap, "world_size": ctx.world_size,
                             "recorded": recorded, "steps": len(steps),
                             "median_ms": statistics.median(mean),
                             "slowest_rank_median_ms": statistics.median(slowest),
                             "step_times_ms": mean, "slowest_rank_step_times_ms": slowest,
                             "bucket_sizes": model.bucket_sizes()})
                common.print0(ctx, f"   {name:<11}{first:6g} {cap:6g}  "
                                   f"{len(model.bucket_sizes()):3d} buckets  "
                                   f"{rows[-1]['median_ms']:9.2f} ms (slowest rank "
                                   f"{rows[-1]['slowest_rank_median_ms']:.2f} ms)"
                                   + ("  <- the recorded layout (the profile)" if recorded
                                      else ""))
        if ctx.rank == 0:
            with open(path) as f:
                profile = json.load(f)
            source = "bench/plan_validate.py measure (steps interleaved with the sweep's cells)"
            profile["timing"].update({
                "step_us": 1e3 * next(r["median_ms"] for r in rows
                                      if r["model"] == name and r["recorded"]),
                "step_us_source": f"{source}: its measured step, as in the sweep's cells",
                "other_us": rest, "other_us_source": f"{source}: timed step minus forward -> "
                                                     "gradients written back",
                "backward_no_comm_us": no_comm_us,
                "backward_no_comm_us_source": f"{source}: the unwrapped model, first gradient "
                                              "-> backward() returns"})
            common.write_json(path, profile)
        common.print0(ctx, f"# {name}: wrote {path} (rest of the step {rest / 1e3:.2f} ms, "
                           f"backward without communication {no_comm_us / 1e3:.2f} ms)")
        del variants, record
    if ctx.rank == 0 and args.json:
        common.write_json(args.json, {"meta": meta, "models": models_info, "rows": rows,
                                      "grid": {"first_bucket_mb": args.sweep_first,
                                               "bucket_cap_mb": args.sweep_cap}})
        common.print0(ctx, f"# wrote {args.json}")
    return 0


# -- compare --------------------------------------------------------------------------------------
def compare(args):
    from fused_reducer.tuning.plan import Planner, build_network
    from fused_reducer.tuning.profile import load_profile

    with open(args.sweep) as f:
        sweep = json.load(f)
    world = int(sweep["meta"]["world_size"])
    network, inputs, metas = build_network([], args.calibrate)
    cells, recorded, planners = [], [], {}
    for info in sweep["models"]:
        profile_path = os.path.join(args.profiles, f"profile_{info['model']}.json")
        profile = load_profile(profile_path)
        recorded_bytes = sum(p["bytes"] for p in profile["params"])
        if recorded_bytes != info["grad_bytes"]:
            raise SystemExit(f"{profile_path}: {recorded_bytes} gradient bytes, the sweep's "
                             f"{info['model']} has {info['grad_bytes']}: not the same model")
        planner = Planner(profile, network, inputs, args.overlap, 1.0, profile_path, metas)
        planners[info["model"]] = planner
        for row in sweep["rows"]:
            if row["model"] != info["model"] or row["impl"] != "fused":
                continue
            candidate = (int(row["first_bucket_mb"] * MiB), int(row["bucket_cap_mb"] * MiB), 0)
            predicted = planner.predict(candidate, world, world)
            (recorded if row.get("recorded") else cells).append({"model": info["model"], "first_mb": row["first_bucket_mb"],
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
          f"overlap {planner.overlap} (cost "
          + ", ".join(f"{m} {p.overlap_cost:.2f}" for m, p in planners.items())
          + "), transport progress during backward ("
          + ", ".join(f"{m} {p.progress:.2f}" for m, p in planners.items()) + ")")
    print("#  model        first    cap  buckets(meas/pred)  measured ms  predicted ms  error %")
    for c in cells:
        print(f"   {c['model']:<11}{c['first_mb']:6g} {c['cap_mb']:6g}  {c['buckets_measured']:8d}/"
              f"{c['buckets_predicted']:<8d}  {c['measured_ms']:11.2f}  {c['predicted_ms']:12.2f}"
              f"  {c['error_pct']:+7.1f}")
    for c in recorded:  # not a prediction: the profile's own layout, its floor
        print(f"# {c['model']}: the recorded layout itself ({c['first_mb']:g} / {c['cap_mb']:g}): "
              f"measured {c['measured_ms']:.2f} ms, predicted {c['predicted_ms']:.2f} ms "
              f"({c['error_pct']:+.1f} %)")
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
        if "layouts" in s:
            p, m = s["predicted_best_layout"], s["measured_best_layout"]
            print(f"# {model}, per layout ({s['layouts']} layouts; a layout's time = median of "
                  f"its cells): predicted best {p['buckets']} buckets {p['cells']} measures "
                  f"{p['measured_ms']:.2f} ms, measured best {m['buckets']} buckets "
                  f"{m['cells']} {m['measured_ms']:.2f} ms: "
                  f"{s['predicted_best_layout_vs_measured_best_pct']:+.1f} %")
    for i in inputs:
        print(f"#   input {i['source']}: {i['input']}: {i['value']}")
    for model, p in planners.items():
        for i in p.inputs:
            if i["input"] in ("overlap cost", "backward without contention",
                              "transport progress during backward"):
                print(f"#   input {model}: {i['source']}: {i['input']}: {i['value']} "
                      f"({i['detail']})")
    if args.json:
        common.write_json(args.json, {"sweep": args.sweep, "calibrate": args.calibrate,
                                      "profiles": args.profiles, "world_size": world,
                                      "overlap": planner.overlap,
                                      "overlap_cost": {m: p.overlap_cost
                                                       for m, p in planners.items()},
                                      "progress": {m: p.progress for m, p in planners.items()},
                                      "cells": cells, "recorded_cells": recorded,
                                      "summary": summary, "inputs": planner.inputs})
        print(f"# wrote {args.json}")
    if args.plot:
        plot(args.plot, cells, summary, world)
        print(f"# wrote {args.plot}")
    if args.reference:
        write_reference(args, sweep, cells, recorded, planners)
    return 0


def write_reference(args, sweep, cells, recorded, planners):
    """Everything this comparison read (the profiles, the calibration files, the measured
    cells) and what it predicted, in one file: tests/test_plan.py predicts the cells again and
    fails when the model's predictions drift from these (or miss the measurements)."""
    calibration = []
    for path in args.calibrate:
        with open(path) as f:
            calibration.append(json.load(f))
    profiles = {}
    for model in planners:
        with open(os.path.join(args.profiles, f"profile_{model}.json")) as f:
            profiles[model] = json.load(f)
    reference = {
        "format": "fused_reducer.plan_reference", "sweep": args.sweep,
        "world_size": int(sweep["meta"]["world_size"]), "measured": sweep["meta"].get("date"),
        "calibration": calibration, "profiles": profiles,
        "cells": [dict({k: c[k] for k in ("model", "first_mb", "cap_mb", "measured_ms",
                                          "predicted_ms")}, recorded=c in recorded)
                  for c in cells + recorded]}
    common.ensure_parent(args.reference)
    with open(args.reference, "w") as f:  # compact: it is committed with the tests
        json.dump(reference, f, separators=(",", ":"))
        f.write("\n")
    print(f"# wrote {args.reference}")


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
            entry.update(best_layout(mine))
        out[model] = entry
    return out


def by_layout(cells):
    """Cells grouped by (model, bucket sizes): cells that share a layout are repeated
    measurements of it."""
    groups = {}
    for c in cells:
        groups.setdefault((c["model"], tuple(c["bucket_sizes"])), []).append(c)
    return list(groups.values())


def best_layout(cells):
    """The same comparison per layout (one model's cells): a layout's measured time is the
    median of its cells; the predicted best layout (its cells all predict the same) against the
    best of those medians."""
    layouts = [{"cells": [[c["first_mb"], c["cap_mb"]] for c in g],
                "buckets": len(g[0]["bucket_sizes"]),
                "predicted_ms": statistics.median(c["predicted_ms"] for c in g),
                "measured_ms": statistics.median(c["measured_ms"] for c in g)} for g in
               by_layout(cells)]
    predicted = min(layouts, key=lambda lay: lay["predicted_ms"])
    measured = min(layouts, key=lambda lay: lay["measured_ms"])
    return {"layouts": len(layouts), "predicted_best_layout": predicted,
            "measured_best_layout": measured,
            "predicted_best_layout_vs_measured_best_pct":
                100 * (predicted["measured_ms"] / measured["measured_ms"] - 1)}


def same_layout_spread(cells):
    """Median |measured - median of the cells with the same layout| / that median, over cells
    whose layout (bucket sizes) another cell shares: the error a perfect model would show on
    these measurements (noise and drift), None when no two cells share a layout."""
    deviations = []
    for group in by_layout(cells):
        times = [c["measured_ms"] for c in group]
        if len(times) > 1:
            middle = statistics.median(times)
            deviations += [100 * abs(t - middle) / middle for t in times]
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
        ax.set_title(f"{model}, world {world}: median |err| {s['median_abs_error_pct']:.1f} %; "
                     f"predicted best layout {s['predicted_best_layout_vs_measured_best_pct']:+.1f}"
                     f" % of best (cell {s['predicted_best_vs_measured_best_pct']:+.1f} %)",
                     fontsize=9)
        ax.set_xlabel("measured median step (ms)")
        ax.set_ylabel("predicted step (ms)")
        ax.legend(fontsize=8)
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    common.ensure_parent(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _overlap(text):
    from fused_reducer.tuning.plan import _overlap as parse
    return parse(text)


def build_parser():
    parser = argparse.ArgumentParser(prog="plan_validate.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    mea = sub.add_parser("measure", help="profiles and the measured sweep in one interleaved run")
    mea.add_argument("--out", required=True, help="directory for profile_<model>.json")
    mea.add_argument("--json", required=True, help="the measured cells (step_bench sweep format)")
    mea.add_argument("--sweep-first", type=common.parse_float_list, required=True,
                     metavar="MiB,...", help="first bucket sizes of the cells")
    mea.add_argument("--sweep-cap", type=common.parse_float_list, required=True,
                     metavar="MiB,...", help="bucket caps of the cells")
    rec = sub.add_parser("record", help="record one profile per model")
    rec.add_argument("--out", required=True, help="directory for profile_<model>.json")
    cmp_ = sub.add_parser("compare", help="predicted vs measured per sweep cell")
    cmp_.add_argument("--sweep", required=True, help="bench/step_bench.py --json output")
    cmp_.add_argument("--profiles", required=True, help="directory written by record")
    cmp_.add_argument("--calibrate", action="append", required=True,
                      help="bench/allreduce_bw.py --json output (repeat per world size)")
    cmp_.add_argument("--overlap", type=_overlap, default="auto",
                      help="as fused_reducer.plan's --overlap (default auto: measured when the "
                           "profiles have a backward without communication)")
    cmp_.add_argument("--json", help="write cells and summary")
    cmp_.add_argument("--plot", help="predicted vs measured scatter PNG")
    cmp_.add_argument("--reference", help="write the inputs, measurements and predictions as a "
                      "reference file for tests/test_plan.py's drift test")
    for sp, steps in ((mea, 16), (rec, 10)):
        sp.add_argument("--model", type=step_bench._models, default=["large", "many-small"],
                        help="comma list of step_bench models or sets (synthetic, real, "
                             "holdout; default: the synthetic two)")
        sp.add_argument("--first-mb", type=float, default=1.0,
                        help="first bucket of the recorded run, MiB (default 1, DDP's)")
        sp.add_argument("--cap-mb", type=float, default=25.0,
                        help="bucket cap of the recorded run, MiB (default 25, DDP's)")
        sp.add_argument("--warmup", type=int, default=3, help="steps before the timed ones")
        sp.add_argument("--steps", type=int, default=steps,
                        help=f"timed/recorded steps (medians; default {steps})")
        sp.add_argument("--seed", type=int, default=0, help="as step_bench's --seed (default 0)")
        for flag in ("--layers", "--hidden", "--batch", "--seq"):
            sp.add_argument(flag, type=int, default=None, help="as step_bench's (default its)")
        common.add_launch_args(sp)
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.command in ("record", "measure"):
        os.makedirs(args.out, exist_ok=True)
        return common.launch(record_worker if args.command == "record" else measure_worker, args)
    from fused_reducer.tuning.plan import PlanInputError
    from fused_reducer.tuning.profile import ProfileError
    try:
        return compare(args)
    except (PlanInputError, ProfileError) as e:
        print(f"plan_validate: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
