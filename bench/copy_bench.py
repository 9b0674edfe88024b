"""Bucket copy bandwidth on one GPU: FusedReducer's fused multi-tensor copy (one launch per bucket)
against a per-tensor torch.Tensor.copy_ loop (DDP's way: one launch per parameter) and against one
large device-to-device copy of the same bytes (the ceiling).

    python bench/copy_bench.py [--tensors 64] [--sizes 1M,16M,64M,256M] [--iters 50] [--json F]
    python bench/copy_bench.py --dtype float32 --to-dtype bfloat16   # the reduce_dtype cast-copy

With --to-dtype the bucket has another dtype than the gradients (reduce_dtype): the fused copy
casts and scales in one pass; the D2D ceiling is then a byte copy moving the same total bytes.
--unpack copies the other way, bucket -> gradients, as at the end of backward (with
--to-dtype bfloat16 the widening bf16 -> fp32 unpack).

The bucket is laid out as the reducer lays it out (Note [Slot layout] in ext/reducer.cpp): every
gradient's slot starts at a multiple of 16 bytes of the flat buffer, padding between slots, so the
fused copy takes its 16-byte vector path for every slot (a plain split of the flat buffer would put
most slots off alignment and measure the scalar path instead).

Bandwidth counts bytes read + bytes written, timed with CUDA events over --iters back-to-back
copies after --warmup; the median of 5 repeats is reported. Needs a GPU and a CUDA build.
"""
import argparse
import json
import os
import statistics
import sys

import torch

import fused_reducer
from fused_reducer import _C

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import parse_size  # noqa: E402  (K/M/G: powers of 1024, as the other benchmarks)


SLOT_ALIGN_BYTES = 16  # kSlotAlignBytes in ext/reducer.cpp, Note [Slot layout]


def slot_layout(numels, dtype, device="cuda"):
    """A bucket's flat buffer and one slot view per gradient, as the reducer lays them out: each
    slot starts at a multiple of 16 bytes (padding zeros between slots)."""
    align = max(1, SLOT_ALIGN_BYTES // torch.empty((), dtype=dtype).element_size())
    offsets, total = [], 0
    for n in numels:
        offsets.append(total)
        total += -(-n // align) * align
    flat = torch.zeros(total, device=device, dtype=dtype)
    return flat, [flat.narrow(0, offset, n) for offset, n in zip(offsets, numels)]


def time_ms(fn, iters, warmup):
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / iters)
    return statistics.median(samples)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1M,16M,64M,256M", help="bucket sizes in bytes (K/M/G suffixes)")
    ap.add_argument("--tensors", type=int, default=64, help="gradients per bucket (sizes vary +-50%%)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16", "float64"])
    ap.add_argument("--to-dtype", default=None, choices=["float32", "float16", "bfloat16", "float64"],
                    help="bucket dtype (default: --dtype): a cast-copy, as with reduce_dtype")
    ap.add_argument("--unpack", action="store_true",
                    help="copy bucket -> gradients (the unpack at the end of backward)")
    ap.add_argument("--iters", type=int, default=50, help="timed copies per sample")
    ap.add_argument("--warmup", type=int, default=5, help="untimed copies first")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    if not torch.cuda.is_available() or not fused_reducer.build_info()["cuda"]:
        raise SystemExit("copy_bench needs a CUDA GPU and a CUDA build of fused_reducer")
    dtype = getattr(torch, args.dtype)
    to_dtype = getattr(torch, args.to_dtype or args.dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    to_itemsize = torch.empty((), dtype=to_dtype).element_size()
    g = torch.Generator().manual_seed(0)
    rows = []
    direction = "unpack" if args.unpack else "pack"
    print(f"# {torch.cuda.get_device_name()}  gradients {args.dtype}, bucket {to_dtype}, {direction}  "
          f"{args.tensors} tensors per bucket, 16-byte slots")
    print(f"# {'bucket':>10} {'fused GB/s':>11} {'copy_ GB/s':>11} {'D2D GB/s':>10} {'fused/D2D':>10}")
    for total in [parse_size(s) for s in args.sizes.split(",")]:
        weights = torch.rand(args.tensors, generator=g) + 0.5
        numels = (weights / weights.sum() * total / itemsize).long().clamp(min=1).tolist()
        grads = [torch.randn(n, device="cuda").to(dtype) for n in numels]
        flat, slots = slot_layout(numels, to_dtype)
        if args.unpack:
            for slot in slots:
                slot.normal_()
        srcs, dsts = (slots, grads) if args.unpack else (grads, slots)
        moved = sum(numels) * (itemsize + to_itemsize)  # read + write
        big_src = torch.empty(moved // 2, device="cuda", dtype=torch.uint8)  # the same bytes moved
        big_dst = torch.empty_like(big_src)

        def fused():
            _C.scaled_copy(srcs, dsts, 0.5)

        def per_tensor():
            for s, d in zip(srcs, dsts):
                d.copy_(s)

        def d2d():
            big_dst.copy_(big_src)

        times = {name: time_ms(fn, args.iters, args.warmup)
                 for name, fn in [("fused", fused), ("copy_", per_tensor), ("d2d", d2d)]}
        gbps = {k: moved / (v * 1e-3) / 1e9 for k, v in times.items()}
        rows.append({"bytes": sum(numels) * itemsize, "tensors": args.tensors, "dtype": args.dtype,
                     "to_dtype": str(to_dtype).replace("torch.", ""), "direction": direction,
                     "slot_align_bytes": SLOT_ALIGN_BYTES,
                     **{f"{k}_GBps": v for k, v in gbps.items()},
                     "fused_over_d2d": gbps["fused"] / gbps["d2d"]})
        print(f"  {rows[-1]['bytes']:>10} {gbps['fused']:>11.1f} {gbps['copy_']:>11.1f} "
              f"{gbps['d2d']:>10.1f} {gbps['fused'] / gbps['d2d']:>10.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__},
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
