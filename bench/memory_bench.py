#!/usr/bin/env python
"""Resident memory that wrapping and training add: FusedReducer against DDP (and torch's FSDP2
replicate), per rank, CPU.

    python bench/memory_bench.py                          # every wrapper, gv off and on (~4 min)
    python bench/memory_bench.py --impl fused-shm,ddp --gv off --json bench/out/memory.json
    python bench/memory_bench.py --impl ddp-best,fused-sharded --gv off --optimizer adamw
    python bench/memory_bench.py --impl ddp-best,fused-shm,fused-sharded,fsdp2-replicate \
        --gv off --optimizer adamw --changes 0 --layers 24 --hidden 2048

Every (wrapper, gradient_as_bucket_view) pair runs in a fresh pair of gloo ranks (spawned, 2 by
default), so nothing one wrapper leaves in the allocator is charged to another. Per rank:

1. Every library either wrapper needs is loaded first, so neither is charged for it: torch,
   torch.distributed (gloo), torch.optim, fused_reducer and its _C; a tiny model is wrapped in
   DDP (default and with its best settings), in FusedReducer on shared memory and on the process
   group, and trained one step each (gloo's buffers, the shared-memory segment code, autograd's
   threads); then all of it is closed, deleted, garbage-collected and malloc_trim(0)med.
2. baseline: /proc/self/status (VmRSS, RssAnon, RssShmem) and /proc/self/smaps_rollup (Pss).
3. The model (--layers x Linear(--hidden, --hidden) + ReLU, ~100 MB of fp32 parameters by
   default), its input and the optimizer (--optimizer: SGD by default, no state; AdamW: two
   state tensors per parameter) are built: "model" point.
4. It is wrapped and trained --steps steps (zero_grad, forward, loss, backward, optimizer step; with
   gradient_as_bucket_view zero_grad(set_to_none=False), as DDP's documentation advises);
   "steady" is read after the last step (gradients alive, as during training). "added" =
   steady - model: what wrapping and training add, for DDP its buckets and gradients, for
   FusedReducer the same plus its transport (the shared-memory segment is RssShmem: mapped by
   every rank, counted in every rank's RSS, one copy in RAM; Pss shares it out).
   The peak ("train peak") is VmHWM over the training steps (reset through
   /proc/self/clear_refs after wrapping) minus "model".
5. FusedReducer only: as many more steps as the changes will take ("before": glibc's cache back
   at its level of a long run after the trim of step 4), then --changes limit changes (bucket_cap_bytes / first_bucket_bytes set, then
   --rebuild-steps steps each, so each one rebuilds the buckets at the next forward), then two
   steps with the last limits ("after"). "retained raw" = after - before, both as is;
   "retained trimmed" = after - steady, both trimmed; "rebuild peak" = VmHWM over the changes
   minus before: the transient cost of a rebuild (with gradient_as_bucket_view the gradients
   move from the old buckets into the new, so both layouts exist for a moment).

fsdp2-replicate is torch's replicate_with_fsdp.replicate applied to each Linear, then to the
root (as torchtitan applies FSDP2: one group per layer), its optimizer built over its DTensor
parameters after wrapping (the module's own parameters are replaced, and freed). FSDP2 has no
gradient_as_bucket_view: it runs with --gv off only.

The parameters after training are compared across the scenarios (each in its own ranks, same
weights, inputs and optimizer): per tensor the float64 sum and sum of squares of rank 0's
(FSDP2's whole: DTensor.full_tensor()), against the first scenario's; the largest relative
difference is printed per row ("params"), and a row above 1e-6 says MISMATCH.

glibc keeps freed memory in its arenas (and after a large block is freed, raises its mmap
threshold, so later blocks of that size come from the heap): the same bytes can read as resident
or not depending on what was freed before. Every point is therefore read twice: as is ("raw")
and right after malloc_trim(0) ("trimmed"), which returns free arena memory to the system; both
wrappers get the same treatment. "trimmed" is the memory actually in use; "raw" is what a user
sees without trimming.
"""
import argparse
import ctypes
import gc
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

MiB = 1 << 20
IMPLS = ("ddp", "ddp-best", "fused-shm", "fused-pg", "fused-sharded", "fsdp2-replicate")
DEFAULT_IMPLS = IMPLS[:4]
IMPL_NAMES = {"ddp": "DDP default", "ddp-best": "DDP best", "fused-shm": "FusedReducer shm",
              "fused-pg": "FusedReducer process_group",
              "fused-sharded": "FusedReducer shm + ShardedOptimizer",
              "fsdp2-replicate": "FSDP2 replicate"}
NO_GV = {"fused-sharded": "gradient_as_bucket_view is not supported with a ShardedOptimizer yet",
         "fsdp2-replicate": "FSDP2 has no gradient_as_bucket_view"}
PARAM_TOLERANCE = 1e-6  # relative, of the parameters' fingerprints (sum, sum of squares)
OPTIMIZERS = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}
# The limit changes of the rebuild scenario, cycled: (property, MiB).
CHANGES = (("bucket_cap_bytes", 10), ("first_bucket_bytes", 16), ("bucket_cap_bytes", 50),
           ("first_bucket_bytes", 1), ("bucket_cap_bytes", 25))


# -- reading memory -------------------------------------------------------------------------------
def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


_LIBC = _libc()


def malloc_trim():
    """Return glibc's free arena memory to the system (no-op without glibc)."""
    if _LIBC is not None and hasattr(_LIBC, "malloc_trim"):
        _LIBC.malloc_trim(0)


def reset_peak():
    """Reset VmHWM to the current RSS (Linux >= 4.0); False if not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _kib_fields(path, names):
    out = {}
    try:
        with open(path) as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in names:
                    out[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


def memory():
    """Bytes: rss, anon, shmem, file, hwm (peak RSS since the last reset_peak), pss."""
    st = _kib_fields("/proc/self/status", {"VmRSS", "RssAnon", "RssShmem", "RssFile", "VmHWM"})
    roll = _kib_fields("/proc/self/smaps_rollup", {"Pss"})
    return {"rss": st.get("VmRSS"), "anon": st.get("RssAnon"), "shmem": st.get("RssShmem"),
            "file": st.get("RssFile"), "hwm": st.get("VmHWM"), "pss": roll.get("Pss")}


def point():
    """{'raw': memory(), 'trimmed': memory() after gc + malloc_trim}."""
    raw = memory()
    gc.collect()
    malloc_trim()
    return {"raw": raw, "trimmed": memory()}


# -- the models and wrappers ----------------------------------------------------------------------
def build_model(layers, hidden, seed=0):
    torch.manual_seed(seed)
    mods = []
    for _ in range(layers):
        mods += [nn.Linear(hidden, hidden), nn.ReLU()]
    return nn.Sequential(*mods)


def wrap(impl, module, gv, first_mb=1.0, cap_mb=25.0):
    if impl == "fsdp2-replicate":  # each Linear, then the root (torchtitan's way)
        blocks = [m for m in module if isinstance(m, nn.Linear)]
        return common.fsdp2_wrap(module, "replicate", blocks)
    if impl == "ddp":
        return nn.parallel.DistributedDataParallel(module, gradient_as_bucket_view=gv)
    if impl == "ddp-best":
        kwargs, why_not = common.ddp_best_kwargs(first_mb, cap_mb)
        if why_not:
            raise SystemExit(f"memory_bench: ddp-best needs DDP(bucket_cap_mb_list=...): {why_not}")
        return nn.parallel.DistributedDataParallel(module, gradient_as_bucket_view=gv, **kwargs)
    from fused_reducer import FusedReducer
    backend = {"fused-shm": "shm", "fused-pg": "process_group", "fused-sharded": "shm"}[impl]
    return FusedReducer(module, gradient_as_bucket_view=gv, backend=backend,
                        first_bucket_mb=first_mb, bucket_cap_mb=cap_mb)


def make_optimizer(impl, model, params, name, lr=1e-4):
    """The optimizer `name` over `params`; for fused-sharded a ShardedOptimizer of it."""
    if impl == "fused-sharded":
        from fused_reducer import ShardedOptimizer
        return ShardedOptimizer(model, OPTIMIZERS[name], lr=lr)
    return OPTIMIZERS[name](params, lr=lr)


def step(model, opt, x, gv):
    opt.zero_grad(set_to_none=not gv)
    model(x).pow(2).mean().backward()
    opt.step()


def close(model):
    if hasattr(model, "close") and not isinstance(model, nn.parallel.DistributedDataParallel):
        model.close()


def load_libraries(gv):
    """Every library and lazily created state either wrapper needs, then released."""
    import fused_reducer  # noqa: F401
    from fused_reducer import _C  # noqa: F401
    for impl in IMPLS:
        if gv and impl == "fused-sharded":
            continue  # ShardedOptimizer does not take gradient_as_bucket_view yet
        tiny = build_model(2, 8)
        model = wrap(impl, tiny, gv)
        opt = make_optimizer(impl, model, list(model.parameters()), "adamw", lr=1e-3)
        x = torch.randn(2, 8)
        for _ in range(2):
            step(model, opt, x, gv)
        close(model)
        del model, opt, tiny, x
    gc.collect()
    malloc_trim()


# -- one scenario on one rank ---------------------------------------------------------------------
def worker(ctx, args):
    gv = args.gv_now
    load_libraries(gv)
    result = {"rank": ctx.rank, "impl": args.impl_now, "gv": gv, "peak_reset": reset_peak()}
    result["baseline"] = point()
    module = build_model(args.layers, args.hidden, args.seed)
    x = torch.randn(args.batch, args.hidden, generator=torch.Generator().manual_seed(ctx.rank))
    # FSDP2 replaces the module's parameters with DTensors: its optimizer takes those (and the
    # originals are freed); the others' optimizers take the module's own, listed before "model".
    opt_params = None if args.impl_now == "fsdp2-replicate" else list(module.parameters())
    result["model"] = point()
    model = wrap(args.impl_now, module, gv, args.first_bucket_mb, args.bucket_cap_mb)
    opt = make_optimizer(args.impl_now, model, opt_params or list(model.parameters()),
                         args.optimizer)
    result["wrapped"] = point()
    reset_peak()
    for _ in range(args.steps):
        step(model, opt, x, gv)
    result["steady"] = point()
    result["train_hwm"] = result["steady"]["raw"]["hwm"]
    result["fingerprint"] = fingerprint(model)  # after the same steps in every scenario
    if args.impl_now.startswith("fused") and args.changes:
        # As many steps as the changes will take, so that glibc's cache is back at its level of
        # a long run after the trim (autograd's temporaries of a layer's size come from it).
        for _ in range(args.changes * args.rebuild_steps + 2):
            step(model, opt, x, gv)
        result["before_rebuilds"] = memory()
        reset_peak()
        for i in range(args.changes):
            name, mb = CHANGES[i % len(CHANGES)]
            setattr(model, name, int(mb * MiB))
            for _ in range(args.rebuild_steps):
                step(model, opt, x, gv)
        result["rebuild_hwm"] = memory()["hwm"]
        for _ in range(2):
            step(model, opt, x, gv)
        result["after_rebuilds"] = point()
        result["rebuilds"] = model.stats()["rebuilds"]
    result["buckets"] = (model.bucket_sizes() if hasattr(model, "bucket_sizes") else None)
    dist.barrier()
    close(model)
    with open(os.path.join(args.out_dir, f"rank{ctx.rank}.json"), "w") as f:
        json.dump(result, f)
    return 0


def fingerprint(model):
    """Per parameter tensor [float64 sum, float64 sum of squares] of the whole tensor."""
    out = []
    with torch.no_grad():
        for p in model.parameters():
            t = common.full_tensor(p).double()
            out.append([t.sum().item(), t.square().sum().item()])
    return out


def fingerprint_difference(a, b):
    """Largest relative difference of two fingerprints (inf if their shapes differ)."""
    if len(a) != len(b):
        return float("inf")
    return max(abs(x - y) / max(abs(y), 1e-30) for pa, pb in zip(a, b) for x, y in zip(pa, pb))


# -- the table ------------------------------------------------------------------------------------
def added(r, key="trimmed", field="rss", frm="model", to="steady"):
    a, b = r[frm][key][field], r[to][key][field]
    return None if a is None or b is None else b - a


def summarise(per_rank):
    """One row per scenario: the largest value over ranks of each quantity (MiB)."""
    def worst(fn):
        vals = [fn(r) for r in per_rank]
        vals = [v for v in vals if v is not None]
        return max(vals) / MiB if vals else None
    r0 = per_rank[0]
    row = {"impl": r0["impl"], "gv": r0["gv"],
           "added_raw": worst(lambda r: added(r, "raw")),
           "added": worst(lambda r: added(r)),
           "added_anon": worst(lambda r: added(r, field="anon")),
           "added_shmem": worst(lambda r: added(r, field="shmem")),
           "added_pss": worst(lambda r: added(r, field="pss")),
           "wrap": worst(lambda r: added(r, to="wrapped")),
           "train_peak": worst(lambda r: r["train_hwm"] - r["model"]["trimmed"]["rss"]),
           "buckets": r0.get("buckets"), "fingerprint": r0["fingerprint"]}
    if "after_rebuilds" in r0:
        row.update({
            "retained_raw": worst(lambda r: r["after_rebuilds"]["raw"]["rss"]
                                  - r["before_rebuilds"]["rss"]),
            "retained": worst(lambda r: added(r, frm="steady", to="after_rebuilds")),
            "rebuild_peak": worst(lambda r: r["rebuild_hwm"] - r["before_rebuilds"]["rss"]),
            "rebuilds": r0["rebuilds"]})
    return row


def fmt(v, width=8, digits=1):
    return f"{'-':>{width}}" if v is None else f"{v:{width}.{digits}f}"


HEAD = ("# wrapper                    gv    added   added   of which  of which   train  /DDP  /DDP"
        "  retained retained rebuild\n"
        "#                                    raw trimmed    private    shared    peak  dflt  best"
        "       raw  trimmed    peak\n"
        "#                                  (MiB)   (MiB)      (MiB)     (MiB)   (MiB)            "
        "     (MiB)    (MiB)   (MiB)   params: max relative difference from the first row's")


def ratios(row, rows):
    """added (trimmed) over DDP default's and DDP best's of the same gradient_as_bucket_view."""
    out = []
    for impl in ("ddp", "ddp-best"):
        ref = next((r for r in rows if r["impl"] == impl and r["gv"] == row["gv"]), None)
        out.append(row["added"] / ref["added"] if ref and ref["added"] else None)
    return out


def format_row(row, rows):
    to_default, to_best = ratios(row, rows)
    return (f"  {IMPL_NAMES[row['impl']]:<27} {'on ' if row['gv'] else 'off'}"
            f"{fmt(row['added_raw'])}{fmt(row['added'])}{fmt(row['added_anon'], 11)}"
            f"{fmt(row['added_shmem'], 10)}{fmt(row['train_peak'])}{fmt(to_default, 6, 3)}"
            f"{fmt(to_best, 6, 3)}{fmt(row.get('retained_raw'), 10)}"
            f"{fmt(row.get('retained'), 9)}{fmt(row.get('rebuild_peak'), 8)}"
            f"   params {row['param_difference']:.1e}"
            + (" MISMATCH" if row["param_difference"] > PARAM_TOLERANCE else ""))


def run_scenario(args, impl, gv):
    with tempfile.TemporaryDirectory(prefix="memory_bench_") as out_dir:
        args.impl_now, args.gv_now, args.out_dir = impl, gv, out_dir
        code = common.launch(worker, args)
        if code != 0:
            raise SystemExit(f"memory_bench: {impl} gv={gv} failed (exit {code})")
        return [json.load(open(os.path.join(out_dir, f"rank{r}.json")))
                for r in range(args.nranks)]


def _impls(text):
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names or any(n not in IMPLS for n in names):
        raise argparse.ArgumentTypeError(f"--impl takes a comma list of {', '.join(IMPLS)}")
    return names


def build_parser():
    parser = argparse.ArgumentParser(prog="memory_bench.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--impl", type=_impls, default=list(DEFAULT_IMPLS),
                        help="comma list of wrappers: ddp (DDP(model)), ddp-best (DDP with "
                             "batched_grad_copy and the same bucket limits), fused-shm, fused-pg, "
                             "fused-sharded (fused-shm with a ShardedOptimizer of --optimizer; "
                             "gradient_as_bucket_view off only), fsdp2-replicate (torch's "
                             "replicate_with_fsdp.replicate per Linear, then the root; off only) "
                             "(default: all but fused-sharded and fsdp2-replicate)")
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="sgd",
                        help="the optimizer every wrapper trains with (default sgd: no state)")
    parser.add_argument("--gv", choices=("off", "on", "both"), default="both",
                        help="gradient_as_bucket_view for both wrappers (default both)")
    parser.add_argument("--layers", type=int, default=6, help="Linear layers (default 6)")
    parser.add_argument("--hidden", type=int, default=2048,
                        help="their width (default 2048: 6 x 2048^2 fp32 = 96 MiB of parameters)")
    parser.add_argument("--batch", type=int, default=8, help="input rows (default 8)")
    parser.add_argument("--steps", type=int, default=8,
                        help="training steps before 'steady' (default 8)")
    parser.add_argument("--changes", type=int, default=3,
                        help="limit changes of the rebuild scenario, FusedReducer only (default 3;"
                             " 0: skip it)")
    parser.add_argument("--rebuild-steps", type=int, default=2,
                        help="steps after each limit change (default 2)")
    parser.add_argument("--first-bucket-mb", type=float, default=1.0,
                        help="first bucket limit of FusedReducer and DDP best (default 1)")
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0,
                        help="cap of FusedReducer and DDP best (default 25)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights (default 0)")
    parser.add_argument("--json", metavar="FILE", help="write {meta, rows, per_rank} to FILE")
    common.add_launch_args(parser)
    return parser


def _now():
    import datetime
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def main(argv=None):
    args = build_parser().parse_args(argv)
    if common.launched_by_torchrun():
        raise SystemExit("memory_bench.py spawns a fresh pair of ranks per scenario: run it with "
                         "plain python, not torchrun")
    gvs = {"off": [False], "on": [True], "both": [False, True]}[args.gv]
    grad_mb = args.layers * (args.hidden * args.hidden + args.hidden) * 4 / MiB
    print(f"# memory_bench: {args.nranks} gloo ranks on CPU, torch {torch.__version__}, model "
          f"{args.layers} x Linear({args.hidden}, {args.hidden}): {grad_mb:.1f} MiB of fp32 "
          f"parameters (and of gradients); {args.steps} steps; buckets first "
          f"{args.first_bucket_mb:g} / cap {args.bucket_cap_mb:g} MiB (DDP default: its own, "
          f"the same values); rebuild scenario: {args.changes} limit changes, "
          f"{args.rebuild_steps} steps each", flush=True)
    print("# per rank, the larger of the ranks; 'added' = steady - model (after wrapping and "
          "training); 'trimmed' = after malloc_trim(0), both wrappers alike", flush=True)
    print(HEAD, flush=True)
    rows, per_rank_all = [], []
    for gv in gvs:
        for impl in args.impl:
            if gv and impl in NO_GV:
                print(f"# {impl}: {NO_GV[impl]}; skipped with gradient_as_bucket_view on",
                      flush=True)
                continue
            per_rank = run_scenario(args, impl, gv)
            per_rank_all.append(per_rank)
            rows.append(summarise(per_rank))
            rows[-1]["param_difference"] = fingerprint_difference(rows[-1]["fingerprint"],
                                                                  rows[0]["fingerprint"])
            print(format_row(rows[-1], rows), flush=True)
    if args.json:
        common.write_json(args.json, {"meta": {"benchmark": "memory_bench",
                                               "command": " ".join(["python"] + sys.argv),
                                               "torch_version": torch.__version__,
                                               "cpu_count": os.cpu_count(),
                                               "date": _now(), "git_commit": common._git_commit(),
                                               "world_size": args.nranks},
                                      "settings": {k: v for k, v in vars(args).items()
                                                   if not k.endswith("_now") and k != "out_dir"},
                                      "rows": rows, "per_rank": per_rank_all})
        print(f"# wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
