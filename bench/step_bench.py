#!/usr/bin/env python
"""Training-step time of FusedReducer against torch DDP (and torch's FSDP2 replicate, DDP rebuilt
on FSDP2) on the same models, with the same bucket settings, measured interleaved in one run.

    python bench/step_bench.py                                  # CPU: spawns 2 gloo ranks
    python bench/step_bench.py --model large --sweep-first 1,4,16 --sweep-cap 25,100 \\
        --json bench/out/sweep.json                             # + bench/out/sweep.png heatmap
    torchrun --nproc-per-node 8 bench/step_bench.py --model large --hidden 2048

    python bench/step_bench.py --model all --json bench/out/real.json   # the issue-10 set
    python bench/step_bench.py --model resnet18 --channels-last --autotune

Models (bench/models.py; identical weights for both wrappers: same seed; same inputs per step
index):
  large       transformer-like blocks (LayerNorm, single-head causal attention qkv + proj, MLP
              4x): 12 tensors and ~12*hidden^2 parameters per block; the defaults (4 blocks,
              hidden 768, batch 2 x seq 16) give 28.4M parameters in 50 tensors (113 MB of
              fp32 gradients).
  many-small  hundreds of tiny residual Linear(hidden, hidden) layers; defaults 200 x 64, batch
              32: 400 tensors, 0.83M parameters (3.3 MB).
  resnet18, resnet50 (and -cl: channels_last)
              torchvision, num_classes=10, batch 8 / 4 of 32x32 images: 11.2M params in 62
              tensors / 23.5M in 161.
  gpt2        transformers GPT2LMHeadModel from a config: 2 layers, 128 wide, tied embeddings,
              batch 4 x seq 32: 6.9M params in 28 tensors.
  bert        transformers BertForMaskedLM, 2 layers, 128 wide: 4.4M params in 42 tensors.
  Sets: synthetic (default), real, all. The real models need `pip install '.[bench]'`.

One step = zero_grad + forward + loss + backward (no optimizer: the weights stay identical,
so the gradients of the two wrappers can be compared, and the optimizer would cost both the
same). A step's time is the slowest rank's wall time for it (device synchronised on GPU, before
and after the step only); the median and p90 are over the timed steps. "bwd host" is the host
time loss.backward() itself takes (slowest rank, median): on GPU, how long backward holds the CPU
before it can queue the optimizer and the next forward; a reducer that waits on the host for its
all-reduces shows it here even when the step time hides it.

Two DDP rows. 'ddp' is DDP with its best settings for the configuration, and every ratio is to
it: the same bucket limits as FusedReducer's, passed the way the installed torch takes them
(bucket_cap_mb_list=[first, cap], or bucket_cap_mb=cap when first == cap: an explicit cap makes
DDP's first bucket the cap too), and batched_grad_copy=True (one _foreach_copy_ + one div_ per
bucket instead of a copy per parameter), each only where inspect.signature(DDP.__init__) has it
(an older torch gets the limits through _DEFAULT_FIRST_BUCKET_BYTES / _DEFAULT_BUCKET_CAP_MB,
set just before it is built with bucket_cap_mb=None). 'ddp_default' is DDP(model), what most
code runs: 1 MiB first bucket, 25 MiB cap, a copy per parameter (--no-ddp-default drops it).
FusedReducer gets first_bucket_mb= and bucket_cap_mb=. The rows report the layouts (DDP's
rebuilt_bucket_sizes, FusedReducer.bucket_sizes()) and whether DDP best's and FusedReducer's
match.

FSDP2 row. 'fsdp2-replicate' is torch's own successor of DDP,
torch.distributed._composable.replicate_with_fsdp.replicate, applied as torchtitan applies
FSDP2: to each block of the model (transformer layer, ResNet block; bench/models.py
fsdp2_blocks), then to the root, on a 1-D mesh of all ranks, so each block's gradients are
all-reduced when its backward is done (FSDP2 has no bucket limits; its "buckets" column counts
these groups). Its gradients (DTensors, .full_tensor()) are checked against DDP's like
FusedReducer's. Where FSDP2 refuses a model (torch 2.14 rejects non-contiguous parameters:
the channels_last ResNets) the table says so with torch's error instead of a row. Its exposed
communication is not probed ('-'): its gradients accumulate into unsharded parameters that
exist only inside its hooks. --no-fsdp2 leaves it out.

Interleaving: timed steps run in rounds of --block steps per wrapper; the rounds cycle through
every order of the wrappers (DDP,fused / fused,DDP / ...; with the A/A twin or --autotune all 6
or 24 orders), so machine noise, drift and position effects (a wrapper running right after
itself finds warm caches) hit all alike.

A/A noise band: --aa ddp (the default) adds a second, identical DDP, timed in the same rounds;
its median over the first DDP's is the ratio noise alone produces on this machine, printed next
to FusedReducer/DDP together with bootstrap 90 % intervals of both ratios (resampling paired
steps). --autotune adds FusedReducer(autotune=True), tuned to its choice before the timed steps,
compared with the same DDP rows (its limits start from the configuration's). FusedReducer's own
telemetry of the timed steps (Note [Step telemetry]) is summarised under each configuration: last
gradient -> gradients written, time blocked in waits, and per bucket pack, ready->launch,
launch->complete, wait.

Collectives per step are counted independently of FusedReducer's stats, with torch.profiler on
one extra step per wrapper: on CPU the c10d dispatcher op events 'c10d::allreduce_' (every
ProcessGroup.allreduce, from DDP's reducer or from ours, goes through it) plus the
'shm:all_reduce' events of FusedReducer's shared-memory transport (which bypasses c10d; it
records one per bucket as it takes it, as gloo records 'gloo:all_reduce'); on GPU the NCCL
all-reduce kernels ('nccl...AllReduce...', which also catches a transport that calls NCCL
directly). Bytes per step come from the backends' 'gloo:all_reduce'/'nccl:all_reduce'/
'shm:all_reduce' events (shape x dtype); where there are none (FusedReducer's own NCCL transport) from
FusedReducer.stats()['allreduce_bytes'] (the row says which).

Exposed communication time = time from the moment the last gradient of the step is accumulated
(a post-accumulate-grad hook on every parameter records the time; on GPU a CUDA event) to
backward() returning (on GPU: an event after backward on the current stream). It is the part of
the reduction backward did not hide behind computation: the reducer's handling of the last
gradient (copy into its bucket, launch), waiting for all outstanding all-reduces, and copying
results back into .grad. Measured on --probe-steps extra steps, each started after a barrier
(the hooks are not installed during the timed steps). Per step the minimum over ranks is kept:
the rank whose computation ends last waits least, and that wait is the communication backward
did not hide; the other ranks' longer waits add their load imbalance. The median over the probe
steps is reported (per-rank samples are in the JSON). --baseline adds a wrapper-free model,
whose exposed time (~0) shows the floor of the method and whose step time the pure compute.

Where the code is: this file is the command line, the per-rank driver and the printed report; the
models are bench/models.py, the configurations compared bench/step/configs.py, the measurement
(one step, one configuration, the summary) bench/step/measure.py, the heatmap bench/step/plot.py.
"""
import argparse
import math
import os
import statistics
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import models as zoo  # noqa: E402  (the model zoo: bench/models.py)
from models import MODELS, MissingLibrary, ModelSpec  # noqa: E402
from step.configs import ddp_settings  # noqa: E402
from step.measure import AA_NAMES, FSDP2, FUSED_KINDS, run_config, summarise  # noqa: E402
from step.plot import heatmap  # noqa: E402

MiB = 1024 * 1024


# -- output -------------------------------------------------------------------------------------
TABLE_HEAD = (
    "#  first     cap  impl              median      p90  bwd host  colls    MB/step  exposed   ratio  buckets\n"
    "#  (MiB)   (MiB)                      (ms)     (ms)      (ms)  /step    (1e6 B)     (ms)  /DDP best")


def format_row(row):
    mb = "-" if row["bytes_per_step"] is None else f"{row['bytes_per_step'] / 1e6:.2f}"
    buckets = len(row.get("bucket_sizes") or []) or "-"
    exposed = "-" if row["exposed_comm_ms"] is None else f"{row['exposed_comm_ms']:.2f}"
    return (f"  {row['first_bucket_mb']:6g}  {row['bucket_cap_mb']:6g}  {row['impl']:<15}"
            f"{row['median_ms']:9.2f}{row['p90_ms']:9.2f}{row['backward_host_ms']:10.2f}"
            f"  {row['collectives_per_step']:5d}"
            f"  {mb:>9}  {exposed:>7}  {row['ratio_to_ddp']:6.3f}  {buckets:>7}")




# -- main ---------------------------------------------------------------------------------------
def worker(ctx, args):
    firsts = args.sweep_first or [args.first_bucket_mb]
    caps = args.sweep_cap or [args.bucket_cap_mb]
    configs = [(f, c) for f in firsts for c in caps]
    specs = []
    for name in args.model:
        specs.append(ModelSpec.from_args(name, args.layers, args.hidden, args.batch, args.seq,
                                         args.seed))
    meta = common.collect_meta(ctx, extra={
        "benchmark": "step_bench", "steps": args.steps, "warmup": args.warmup,
        "probe_steps": args.probe_steps, "block": args.block, "seed": args.seed,
        "gradient_as_bucket_view": args.grad_as_bucket_view, "aa": args.aa,
        "autotune": args.autotune, "fsdp2": not args.no_fsdp2,
        "reduce_dtype": str(args.reduce_dtype) if args.reduce_dtype is not None else None,
        "step": "zero_grad + forward + loss + backward; slowest rank per step",
        "backward_host": ("host time inside loss.backward() (no device sync in it); slowest rank "
                          "per step, median"),
        "exposed_comm": ("last post-accumulate-grad hook -> backward() returns; min over ranks per "
                         "probe step, median over probe steps")})
    p = lambda *a: common.print0(ctx, *a)  # noqa: E731
    progress = common.Progress(ctx, enabled=not args.quiet)
    p(f"# step_bench: DDP vs FusedReducer, {ctx.world_size} ranks {ctx.backend} on {ctx.device.type}, "
      f"torch {meta['torch_version']}, {meta['hostname']} ({meta['usable_cpus']} usable cores, "
      f"{meta['threads_per_rank']} threads/rank), {meta['date']}")
    p(f"# {args.steps} timed steps per wrapper after {args.warmup} warm-up, interleaved in blocks of "
      f"{args.block} (the rounds cycle through every order of the wrappers); {args.probe_steps} probe steps for exposed comm; "
      f"seed {args.seed}" + (f"; A/A pair: {AA_NAMES[args.aa]} vs {args.aa}" if args.aa != "none" else ""))
    p("# DDP rows: 'ddp' = DDP's best settings for each configuration's limits ("
      + ddp_settings(firsts[0], caps[0])["ddp"] + " for the first"
      + ("" if args.no_ddp_default else "); 'ddp_default' = DDP(model), DDP's own limits (1 MiB "
                                        "first bucket, 25 MiB cap)") + "; ratios are to 'ddp'")

    rows, models_info, refusals = [], [], []
    total = len(specs) * len(configs)
    n = 0
    for spec in specs:
        info = spec.describe(spec.build("cpu"))
        models_info.append(info)
        p(f"#\n# model {spec.name}: {info['shape']}: {info['params'] / 1e6:.3g}M params in "
          f"{info['tensors']} tensors, {info['grad_bytes'] / 1e6:.1f} MB of fp32 gradients")
        p(TABLE_HEAD)
        for first_mb, cap_mb in configs:
            n += 1
            label = f"[{n}/{total}] {spec.name} first {first_mb:g} MiB cap {cap_mb:g} MiB"
            progress(f"{label}: start", force=True)
            mine = run_config(ctx, args, spec, first_mb, cap_mb, progress, label)
            per_rank = [None] * ctx.world_size
            dist.all_gather_object(per_rank, mine)
            if ctx.rank == 0:
                config_rows = summarise(per_rank, info, first_mb, cap_mb, ctx.world_size)
                built = ddp_settings(first_mb, cap_mb)
                for row in config_rows:
                    if row["impl"] == "ddp_default":
                        row["constructed_as"] = built["ddp_default"]
                    elif row["impl"] in ("ddp", "ddp_aa"):
                        row["constructed_as"] = built["ddp"]
                    elif row["impl"] == "ddp_hook":
                        row["constructed_as"] = built["ddp"] + " + compress hook"
                rows.extend(config_rows)
                for row in config_rows:
                    p(format_row(row))
                fused = next(r for r in config_rows if r["impl"] == "fused")
                rel = fused["grad_max_abs_diff"] / max(fused["grad_max_abs"], 1e-30)
                # half-precision all-reduces: DDP + compress hook and FusedReducer round alike
                # at 2 ranks; other world sizes divide before/after the cast (bf16 rounding)
                twin, limit = ("DDP+hook", 1e-2) if args.reduce_dtype is not None else ("DDP", 1e-4)
                p(f"#   grads {twin} vs FusedReducer: max abs diff {fused['grad_max_abs_diff']:.2e} "
                  f"(relative {rel:.1e}{', MISMATCH' if rel > limit else ''}); layouts "
                  + ("match" if fused["layout_match"] else
                     f"DIFFER: DDP {next(r for r in config_rows if r['impl'] == 'ddp')['bucket_sizes']} "
                     f"vs fused {fused['bucket_sizes']}"))
                fsdp2 = next((r for r in config_rows if r["impl"] == FSDP2), None)
                if fsdp2 is not None:
                    frel = fsdp2["grad_max_abs_diff"] / max(fsdp2["grad_max_abs"], 1e-30)
                    p(f"#   grads {twin} vs {FSDP2}: max abs diff {fsdp2['grad_max_abs_diff']:.2e} "
                      f"(relative {frel:.1e}{', MISMATCH' if frel > limit else ''})")
                for impl, error in per_rank[0]["refused"].items():
                    p(f"  {first_mb:6g}  {cap_mb:6g}  {impl:<15} refused by torch: {error}")
                    refusals.append({"model": spec.name, "first_bucket_mb": first_mb,
                                     "bucket_cap_mb": cap_mb, "impl": impl, "error": error})
                for line in describe_config(config_rows):
                    p(line)

    if ctx.rank == 0:
        p("#")
        for info in models_info:
            for first_mb, cap_mb in configs:
                fr = [r for r in rows if r["model"] == info["model"] and r["impl"] == "fused"
                      and r["first_bucket_mb"] == first_mb and r["bucket_cap_mb"] == cap_mb]
                if fr:
                    f = fr[0]
                    aa = (f" (A/A {f['aa']} {f['aa_ratio']:.3f})" if "aa_ratio" in f else "")
                    default = (f"; FusedReducer/DDP default {f['ratio_to_ddp_default']:.3f}"
                               if "ratio_to_ddp_default" in f else "")
                    p(f"# ratio FusedReducer/DDP median step, {info['model']} (first {first_mb:g}, "
                      f"cap {cap_mb:g} MiB; DDP best): {f['ratio_to_ddp']:.3f}{aa}{default}")
                    if "ratio_to_ddp_hook" in f:
                        lo, hi = f["ratio_to_ddp_hook_ci90"]
                        p(f"# ratio FusedReducer({args.reduce_dtype})/DDP+compress hook median step, "
                          f"{info['model']}: {f['ratio_to_ddp_hook']:.3f} (90% interval "
                          f"{lo:.3f}-{hi:.3f}); all-reduce bytes per step: FusedReducer "
                          f"{fused_mb(f)} MB, DDP fp32 {fused_mb(ddp_row(rows, f))} MB")
                f2 = [r for r in rows if r["model"] == info["model"] and r["impl"] == FSDP2
                      and r["first_bucket_mb"] == first_mb and r["bucket_cap_mb"] == cap_mb]
                if f2:
                    p(f"# ratio {FSDP2}/DDP median step, {info['model']} (DDP best): "
                      f"{f2[0]['ratio_to_ddp']:.3f}; FusedReducer/{FSDP2} "
                      f"{fr[0]['median_ms'] / f2[0]['median_ms']:.3f}")
                for r in refusals:
                    if (r["model"], r["first_bucket_mb"], r["bucket_cap_mb"]) == (
                            info["model"], first_mb, cap_mb):
                        p(f"# {r['impl']} refused {info['model']}: {r['error']}")
                tr = [r for r in rows if r["model"] == info["model"] and r["impl"] == "tuned"
                      and r["first_bucket_mb"] == first_mb and r["bucket_cap_mb"] == cap_mb]
                if tr:
                    default = (f"; tuned/DDP default {tr[0]['ratio_to_ddp_default']:.3f}"
                               if "ratio_to_ddp_default" in tr[0] else "")
                    p(f"# ratio tuned FusedReducer/DDP median step, {info['model']} (DDP best, "
                      f"first {first_mb:g}, cap {cap_mb:g} MiB): {tr[0]['ratio_to_ddp']:.3f}"
                      f"{default}")
        fused_rows = [r for r in rows if r["impl"] == "fused"]
        if len(fused_rows) > 1:
            gm = _geomean(fused_rows, "ratio_to_ddp")
            default = (f"; over DDP default {_geomean(fused_rows, 'ratio_to_ddp_default'):.3f}"
                       if all("ratio_to_ddp_default" in r for r in fused_rows) else "")
            p(f"# geometric mean of FusedReducer/DDP over {len(fused_rows)} configurations: "
              f"{gm:.3f} (DDP best){default}")
        settings = {k: (str(v) if isinstance(v, torch.dtype) else v)
                    for k, v in vars(args).items() if k != "corrupt"}
        if args.json:
            common.write_json(args.json, {"meta": meta, "settings": settings, "models": models_info,
                                          "grid": {"first_bucket_mb": firsts, "bucket_cap_mb": caps},
                                          "rows": rows, "refused": refusals})
            p(f"# wrote {args.json}")
        plot_path = args.plot
        if plot_path is None and args.json and (args.sweep_first or args.sweep_cap):
            plot_path = os.path.splitext(args.json)[0] + ".png"
        if plot_path:
            heatmap(plot_path, rows, meta, firsts, caps, [s.name for s in specs])
            p(f"# wrote {plot_path}")
    return 0


def _geomean(rows, key):
    return statistics.geometric_mean(r[key] for r in rows)


def fused_mb(row):
    return "-" if row["bytes_per_step"] is None else f"{row['bytes_per_step'] / 1e6:.2f}"


def ddp_row(rows, like):
    return next(r for r in rows if r["impl"] == "ddp" and r["model"] == like["model"]
                and r["first_bucket_mb"] == like["first_bucket_mb"]
                and r["bucket_cap_mb"] == like["bucket_cap_mb"])


def describe_config(config_rows):
    """Comment lines under a configuration's rows: the A/A band and the ratio's interval,
    FusedReducer's own telemetry (exposed, blocked waits, per bucket) and the tuner's choice."""
    by = {r["impl"]: r for r in config_rows}
    fused = by["fused"]
    lines = []
    lo, hi = fused["ratio_ci90"]
    line = (f"#   FusedReducer/DDP best {fused['ratio_to_ddp']:.3f} (bootstrap 90% interval "
            f"{lo:.3f}-{hi:.3f})")
    if "aa_ratio" in fused:
        alo, ahi = fused["aa_ci90"]
        line += (f"; A/A {fused['aa']} {fused['aa_ratio']:.3f} (interval {alo:.3f}-{ahi:.3f}): "
                 f"noise band +-{abs(fused['aa_ratio'] - 1):.3f}")
    lines.append(line)
    if "ddp_default" in by:
        dlo, dhi = fused["ratio_to_ddp_default_ci90"]
        lines.append(f"#   FusedReducer/DDP default {fused['ratio_to_ddp_default']:.3f} (interval "
                     f"{dlo:.3f}-{dhi:.3f}); DDP best/DDP default "
                     f"{by['ddp']['ratio_to_ddp_default']:.3f}")
    lines.append("#   built as: " + "; ".join(f"{r['impl']} = {r['constructed_as']}"
                                           for r in config_rows if "constructed_as" in r))
    lines.append("#   transports: " + ", ".join(
        f"{name} {by[name]['stats']['transport']}" for name in FUSED_KINDS
        if "stats" in by.get(name, {})))
    if "fused_pg" in by:
        lines.append(f"#   fused_pg/DDP {by['fused_pg']['ratio_to_ddp']:.3f} (the reducer alone: "
                     "FusedReducer on DDP's process group)")
    for name in FUSED_KINDS:
        tel = by.get(name, {}).get("telemetry")
        if not tel:
            continue
        lines.append(
            f"#   {name} telemetry (median of timed steps): last gradient -> grads written "
            f"{tel['exposed_ms']:.2f} ms, blocked in waits {tel['wait_ms']:.2f} ms, end-of-backward "
            f"callback {tel['finalize_ms']:.2f} ms; overlap per rank "
            + "/".join(f"{o:.2f}" for o in tel["overlap_per_rank"]))
        for i, b in enumerate(tel["buckets"]):
            per = lambda key: "/".join(f"{v / 1e3:.2f}" for v in b[key])  # noqa: E731
            lines.append(f"#     bucket {i}: {b['bytes'] / 1e6:7.2f} MB {b['params']:4d} params: pack "
                         f"{per('pack_us')} ms, ready->launch {per('launch_lag_us')} ms, "
                         f"launch->complete {per('comm_us')} ms, wait {per('wait_us')} ms (per rank)")
    tuned = by.get("tuned")
    if tuned:
        f, c, last = tuned["autotune"]["limits"]
        lines.append(f"#   tuned: first {common.format_size(f)} cap {common.format_size(c)} last "
                     f"{common.format_size(last) if last else 'off'} after "
                     f"{tuned['autotune']['tune_steps']} tuning steps; tuned/DDP "
                     f"{tuned['ratio_to_ddp']:.3f}")
    return lines


def _models(text):
    names = zoo.expand(n.strip() for n in text.split(",") if n.strip())
    if not names or any(n not in MODELS for n in names):
        raise argparse.ArgumentTypeError(
            f"--model takes a comma list of {', '.join(MODELS)} or of the sets "
            f"{', '.join(zoo.ALIASES)}; got {text!r}")
    return names


def _reduce_dtype(text):
    dtypes = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
              "fp16": torch.float16, "float16": torch.float16}
    if text not in dtypes:
        raise argparse.ArgumentTypeError(f"--reduce-dtype {text!r}: use bf16 or fp16")
    return dtypes[text]


def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive_float(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


def build_parser():
    parser = argparse.ArgumentParser(prog="step_bench.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    m = parser.add_argument_group("model")
    m.add_argument("--model", type=_models, default=list(zoo.SYNTHETIC),
                   help="comma list of models to run: " + ", ".join(MODELS) + "; or a set: "
                        "synthetic (large, many-small; the default), real (the ResNets in both "
                        "formats, gpt2, bert), all (real + synthetic: the issue-10 set). The real "
                        "models need the bench extra (pip install '.[bench]')")
    m.add_argument("--channels-last", action="store_true",
                   help="run the ResNets in channels_last (resnet18 -> resnet18-cl, ...)")
    m.add_argument("--layers", type=_positive_int, default=None,
                   help="blocks (large), Linear layers (many-small) or transformer layers (gpt2, "
                        "bert); default 4 / 200 / 2")
    m.add_argument("--hidden", type=_positive_int, default=None,
                   help="hidden size; default 768 (large) / 64 (many-small) / 128 (gpt2, bert)")
    m.add_argument("--batch", type=_positive_int, default=None,
                   help="per-rank batch; default 2 (large) / 32 (many-small) / 8 (resnet18) / "
                        "4 (resnet50, gpt2, bert)")
    m.add_argument("--seq", type=_positive_int, default=None,
                   help="sequence length of the large model's input (default 16; the small "
                        "default keeps a CPU step communication-heavy, ~0.3 s of compute on one "
                        "core, so the reducers' differences show; raise it on GPUs); of gpt2 and "
                        "bert (default 32); the image side of the ResNets (default 32)")
    b = parser.add_argument_group("buckets (the same for DDP and FusedReducer)")
    b.add_argument("--first-bucket-mb", type=_positive_float, default=1.0,
                   help="first bucket limit in MiB (default 1, DDP's default)")
    b.add_argument("--bucket-cap-mb", type=_positive_float, default=25.0,
                   help="limit of every later bucket in MiB (default 25, DDP's default)")
    b.add_argument("--sweep-first", type=common.parse_float_list, default=None, metavar="MiB,...",
                   help="grid of first-bucket limits (replaces --first-bucket-mb), e.g. 1,4,16")
    b.add_argument("--sweep-cap", type=common.parse_float_list, default=None, metavar="MiB,...",
                   help="grid of bucket caps (replaces --bucket-cap-mb), e.g. 5,25,100; every "
                        "(first, cap) pair of the two grids is a configuration")
    b.add_argument("--reduce-dtype", type=_reduce_dtype, default=None, metavar="bf16|fp16",
                   help="FusedReducer(reduce_dtype=...) with its limits halved (the same "
                        "parameters per bucket), next to DDP + bf16/fp16_compress_hook ('ddp_hook', "
                        "same limits) and plain fp32 DDP; gradients are compared with the hook's")
    b.add_argument("--grad-as-bucket-view", action="store_true",
                   help="gradient_as_bucket_view=True for both wrappers")
    b.add_argument("--transport", choices=("auto", "shm", "process_group", "nccl"), default="auto",
                   help="FusedReducer's transport (default auto: NCCL for CUDA; for CPU ranks of "
                        "one host shared memory, else the process group DDP uses)")
    b.add_argument("--fused-pg", action="store_true",
                   help="also time FusedReducer(backend='process_group') (row fused_pg): the "
                        "same reducer on DDP's own transport")
    r = parser.add_argument_group("measurement")
    r.add_argument("--steps", type=_positive_int, default=20,
                   help="timed steps per wrapper and configuration (default 20)")
    r.add_argument("--warmup", type=_positive_int, default=3,
                   help="untimed steps per wrapper first; >= 2 so both have rebuilt their buckets "
                        "(default 3)")
    r.add_argument("--block", type=_positive_int, default=1,
                   help="consecutive steps of one wrapper before switching (default 1: alternate)")
    r.add_argument("--probe-steps", type=_positive_int, default=3,
                   help="extra steps per wrapper with the exposed-communication hooks (default 3)")
    r.add_argument("--no-ddp-default", action="store_true",
                   help="leave out the 'ddp_default' row (DDP(model), DDP's own limits), timed "
                        "next to DDP with its best settings ('ddp') by default")
    r.add_argument("--no-fsdp2", action="store_true",
                   help="leave out the 'fsdp2-replicate' row (torch's replicate_with_fsdp."
                        "replicate per block, then the root), timed next to DDP by default")
    r.add_argument("--aa", choices=("ddp", "fused", "none"), default="ddp",
                   help="A/A pair for the noise band: a second DDP (ddp, the default) or "
                        "FusedReducer (fused) interleaved with the others; its median over the "
                        "first's is the ratio noise alone gives")
    r.add_argument("--autotune", action="store_true",
                   help="also time FusedReducer(autotune=True) ('tuned', started from the same "
                        "limits and tuned to its choice before the timed steps) against the DDP")
    r.add_argument("--autotune-max-steps", type=_positive_int, default=400,
                   help="fail if the tuner has not chosen after this many steps (default 400)")
    r.add_argument("--baseline", action="store_true",
                   help="also time the bare model without any wrapper or communication ('local')")
    r.add_argument("--seed", type=int, default=0, help="seed of weights and inputs (default 0)")
    o = parser.add_argument_group("output")
    o.add_argument("--trace-dir", metavar="DIR",
                   help="rank 0 writes each FusedReducer variant's last 2 timed steps as a Chrome "
                        "trace and a timeline picture: DIR/<model>_<variant>.json/.png")
    o.add_argument("--json", metavar="FILE",
                   help="write {meta, settings, models, grid, rows} to FILE; one row per (model, "
                        "first, cap, impl) with median_ms, p90_ms, collectives_per_step, "
                        "bytes_per_step, exposed_comm_ms, ratio_to_ddp, bucket_sizes, step times")
    o.add_argument("--plot", metavar="FILE.png",
                   help="heatmap PNG of median step time (DDP, FusedReducer) and their ratio over "
                        "(first bucket, cap); default with --sweep-* and --json: the JSON path "
                        "with .png")
    o.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    common.add_launch_args(parser)
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.channels_last:
        args.model = list(dict.fromkeys(f"{n}-cl" if n in ("resnet18", "resnet50") else n
                                        for n in args.model))
    for name in args.model:
        try:
            zoo.require(name)
        except MissingLibrary as e:
            parser.error(str(e))
    if args.warmup < 2:
        parser.error("--warmup must be >= 2: DDP and FusedReducer rebuild their buckets after step 1")
    return common.launch(worker, args)


if __name__ == "__main__":
    sys.exit(main())
