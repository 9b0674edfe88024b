#!/usr/bin/env python
"""All-reduce bandwidth of FusedReducer's transport next to torch.distributed and raw NCCL,
measured the way nccl-tests' all_reduce_perf measures it.

    python bench/allreduce_bw.py -b 8 -e 64M -f 2              # CPU: spawns 2 gloo ranks
    torchrun --nproc-per-node 8 bench/allreduce_bw.py -b 8 -e 1G -f 2   # GPU node: NCCL

Method (as all_reduce_perf):
  * for each size from -b to -e (times -f, or plus -i when -f is 1), for each implementation,
    out-of-place then in-place: -w warm-up operations, then -n timed operations back to back;
    time = wall time of the -n operations / n, averaged over ranks (with --trials T > 1: T
    such loops, implementations alternating, and the median loop is reported);
  * algbw = bytes / time (GB = 1e9 bytes); busbw = algbw * 2(n-1)/n for n ranks;
  * -c 1: after timing, each case runs once more on crafted inputs whose sum over ranks is
    exactly representable in the dtype (rank r, element i holds a small integer derived from i
    and r); #wrong = elements that differ from the exact sum, summed over ranks;
  * '# Avg bus bandwidth' = mean of every busbw cell (out-of-place and in-place) of an impl.

Implementations (--impl):
  fused   FusedReducer's own transport (fused_reducer.make_transport: NCCL on GPU builds; on CPU
          shared memory when every rank is on one host, else the c10d process group;
          --transport picks one) on a flat buffer, the path a gradient bucket takes.
  torch   torch.distributed.all_reduce.
  cupy    raw NCCL through cupy.cuda.nccl (GPU runs with cupy installed; else listed as skipped).
  --launch queued (default, as all_reduce_perf enqueues its -n operations on a stream and
  synchronises once): the -n operations are started back to back and then waited for, so a
  CPU process group works through a queue of them, as it does a step's buckets; --launch
  waited: each operation is waited for before the next starts (adds the wake-up latency of
  every operation). On GPU the device is synchronised once after the timed loop. Queued
  out-of-place operations on a CPU process group copy into the buffer the previous operation
  may still be reducing: their times are right, their values are not (-c checks one operation
  alone). NCCL is natively
  out-of-place (cupy); torch and fused reduce in place, so their out-of-place case copies the
  input into the output buffer and reduces that, and the copy is part of the timed operation.

Exit status: 0 when every checked case had #wrong == 0, 1 otherwise, 2 when no requested
implementation can run here.
"""
import argparse
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

IMPLS = ("fused", "torch", "cupy")

# nccl-tests names first, torch names accepted too.
DTYPES = {
    "int8": torch.int8, "char": torch.int8, "uint8": torch.uint8,
    "int32": torch.int32, "int": torch.int32, "int64": torch.int64,
    "half": torch.float16, "float16": torch.float16,
    "float": torch.float32, "float32": torch.float32,
    "double": torch.float64, "float64": torch.float64,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}
TYPE_NAME = {torch.int8: "int8", torch.uint8: "uint8", torch.int32: "int32", torch.int64: "int64",
             torch.float16: "half", torch.float32: "float", torch.float64: "double",
             torch.bfloat16: "bfloat16"}
# Largest M such that every integer in [0, M] is exact in the dtype.
EXACT_LIMIT = {torch.int8: 127, torch.uint8: 255, torch.int32: 2 ** 31 - 1,
               torch.int64: 2 ** 63 - 1, torch.float16: 2 ** 11, torch.bfloat16: 2 ** 8,
               torch.float32: 2 ** 24, torch.float64: 2 ** 53}
PATTERN_PERIOD = 1_000_003  # prime: crafted values repeat with this period (keeps set-up cheap)
CORRUPT_FLAG = "--corrupt"


def bus_factor(world):
    return 2.0 * (world - 1) / world


def bandwidths(nbytes, time_us, world):
    """(algbw, busbw) in GB/s (1e9 bytes/s) for an all-reduce of nbytes taking time_us."""
    if time_us <= 0:
        return 0.0, 0.0
    algbw = nbytes / (time_us * 1e-6) / 1e9
    return algbw, algbw * bus_factor(world)


def sizes_from(args):
    sizes, size = [], args.minbytes
    if args.maxbytes < args.minbytes:
        raise SystemExit(f"-e ({args.maxbytes}) is smaller than -b ({args.minbytes})")
    if args.stepfactor <= 1 and args.stepbytes <= 0:
        raise SystemExit("-f must be > 1, or -f 1 with -i > 0")
    while size <= args.maxbytes:
        sizes.append(size)
        size = size * args.stepfactor if args.stepfactor > 1 else size + args.stepbytes
        size = int(size)
    return sizes


# -- crafted data -------------------------------------------------------------------------------
def _pattern(rank, period, modulus):
    i = torch.arange(period, dtype=torch.int64)
    return (i * 2654435761 + rank * 40503 + 17) % modulus


def modulus_for(dtype, world):
    """Values lie in [0, modulus): the sum over `world` ranks (and every partial sum) is exact."""
    return max(2, min(EXACT_LIMIT[dtype] // world, 1 << 20))


class CraftedData:
    """Rank r's input and the exact expected sum, for one dtype and world size."""

    def __init__(self, dtype, rank, world, device, period=PATTERN_PERIOD):
        self.dtype, self.device = dtype, device
        self.modulus = modulus_for(dtype, world)
        self.exact = self.modulus * world <= EXACT_LIMIT[dtype]
        self.period = period
        self.mine = _pattern(rank, self.period, self.modulus).to(dtype).to(device)
        total = sum(_pattern(r, self.period, self.modulus) for r in range(world))
        self.expected_period = total.to(dtype).to(device)

    def _tiled(self, base, count):
        reps = -(-count // self.period)
        return base.repeat(reps)[:count] if reps > 1 else base[:count]

    def fill_input(self, buf):
        buf.copy_(self._tiled(self.mine, buf.numel()))

    def count_wrong(self, result):
        return int((result != self._tiled(self.expected_period, result.numel())).sum().item())


def fill_sentinel(buf):
    """Output buffer before an out-of-place check: a value the sum never takes."""
    buf.fill_(-1 if buf.dtype != torch.uint8 else 255)


# -- implementations ----------------------------------------------------------------------------
class Impl:
    name = "?"

    def describe(self):
        return self.name

    def start(self, send, recv, inplace):
        """Starts one operation; returns a callable that waits for it."""
        raise NotImplementedError

    def run(self, send, recv, inplace):
        self.start(send, recv, inplace)()


class FusedImpl(Impl):
    """FusedReducer's transport on its own flat buffer (the bucket path)."""
    name = "fused"

    def __init__(self, ctx, timeout, transport="auto"):
        import fused_reducer
        self.timeout = timeout
        group = dist.group.WORLD
        # As a FusedReducer would: NCCL for CUDA tensors in a CUDA build; CPU ranks of one host
        # shared memory; else the process group (--transport overrides).
        self.transport = fused_reducer.make_transport(group, ctx.device, transport,
                                                      timeout_s=timeout)

    def describe(self):
        return f"fused [{self.transport.name}]"

    def start(self, send, recv, inplace):
        if not inplace:
            recv.copy_(send)
        pending = self.transport.allreduce_sum(recv)
        return lambda: pending.wait(self.timeout)


class TorchImpl(Impl):
    name = "torch"

    def __init__(self, ctx):
        self.backend = ctx.backend

    def describe(self):
        return f"torch [dist.all_reduce, {self.backend}]"

    def start(self, send, recv, inplace):
        if not inplace:
            recv.copy_(send)
        return dist.all_reduce(recv, async_op=True).wait


class CupyImpl(Impl):
    """Raw NCCL via cupy.cuda.nccl on torch's current stream; natively out-of-place."""
    name = "cupy"

    def __init__(self, ctx):
        import cupy
        from cupy.cuda import nccl
        self.nccl = nccl
        cupy.cuda.Device(ctx.device.index).use()
        box = [nccl.get_unique_id() if ctx.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        self.comm = nccl.NcclCommunicator(ctx.world_size, box[0], ctx.rank)
        self.types = {}
        for dtype, attr in ((torch.int8, "NCCL_INT8"), (torch.uint8, "NCCL_UINT8"),
                            (torch.int32, "NCCL_INT32"), (torch.int64, "NCCL_INT64"),
                            (torch.float16, "NCCL_FLOAT16"), (torch.float32, "NCCL_FLOAT32"),
                            (torch.float64, "NCCL_FLOAT64"), (torch.bfloat16, "NCCL_BFLOAT16")):
            if hasattr(nccl, attr):
                self.types[dtype] = getattr(nccl, attr)
        self.version = nccl.get_version()

    def describe(self):
        return f"cupy [raw NCCL {self.version}]"

    def supports(self, dtype):
        return dtype in self.types

    def start(self, send, recv, inplace):
        stream = torch.cuda.current_stream(recv.device).cuda_stream
        src = recv if inplace else send
        self.comm.allReduce(src.data_ptr(), recv.data_ptr(), recv.numel(), self.types[recv.dtype],
                            self.nccl.NCCL_SUM, stream)
        return lambda: None  # ordered on the stream; the device sync after the loop waits


def make_impls(ctx, args):
    """(list of Impl, {name: reason skipped}); creation is collective, same order on all ranks."""
    impls, skipped = [], {}
    for name in args.impl:
        if name == "fused":
            impls.append(FusedImpl(ctx, args.timeout, args.transport))
        elif name == "torch":
            impls.append(TorchImpl(ctx))
        elif name == "cupy":
            if not ctx.is_cuda:
                skipped["cupy"] = "needs a CUDA device and the nccl backend (this run: " \
                                  f"{ctx.backend} on {ctx.device.type})"
                continue
            try:
                import cupy  # noqa: F401
                from cupy.cuda import nccl  # noqa: F401
                ok = 1
            except Exception as e:  # noqa: BLE001
                ok, reason = 0, f"cupy not importable ({type(e).__name__}: {e})"
            flag = torch.tensor([ok], device=ctx.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            if not flag.item():
                skipped["cupy"] = reason if not ok else "cupy not importable on some rank"
                continue
            impl = CupyImpl(ctx)
            if not impl.supports(args.dtype):
                skipped["cupy"] = f"cupy.cuda.nccl has no type for {args.dtype}"
                continue
            impls.append(impl)
    return impls, skipped


# -- measurement --------------------------------------------------------------------------------
def _mean_over_ranks(ctx, value):
    t = torch.tensor([value], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t)
    return t.item() / ctx.world_size


def _sum_over_ranks(ctx, value):
    t = torch.tensor([value], dtype=torch.int64, device=ctx.device)
    dist.all_reduce(t)
    return int(t.item())


def time_case(ctx, impl, send, recv, inplace, warmup, iters, queued=True):
    """Mean time per operation in microseconds (per-rank wall time / iters, averaged over ranks).
    queued: start all `iters` operations, then wait for them; else wait for each in turn."""
    for _ in range(warmup):
        impl.run(send, recv, inplace)
    ctx.sync()
    dist.barrier()
    start = time.perf_counter()
    if queued:
        for wait in [impl.start(send, recv, inplace) for _ in range(iters)]:
            wait()
    else:
        for _ in range(iters):
            impl.run(send, recv, inplace)
    ctx.sync()
    elapsed = time.perf_counter() - start
    return _mean_over_ranks(ctx, elapsed / iters * 1e6)


def check_case(ctx, impl, data, send, recv, inplace, corrupt):
    """#wrong elements, summed over ranks, of one operation on crafted inputs."""
    data.fill_input(send)
    if inplace:
        data.fill_input(recv)
    else:
        fill_sentinel(recv)
    ctx.sync()
    impl.run(send, recv, inplace)
    ctx.sync()
    if corrupt and ctx.rank == ctx.world_size - 1:
        flat = recv.view(-1)
        flat[flat.numel() // 2] += 1  # what a broken transport would leave behind
    return _sum_over_ranks(ctx, data.count_wrong(recv))


# -- output -------------------------------------------------------------------------------------
HEADER = (
    "#                                                                      out-of-place"
    "                       in-place          \n"
    "#  impl        size         count      type   redop    root     time   algbw   busbw #wrong"
    "     time   algbw   busbw #wrong\n"
    "#               (B)    (elements)                               (us)  (GB/s)  (GB/s)      "
    "      (us)  (GB/s)  (GB/s)       "
)


def _fmt_time(us):
    return f"{us:8.2f}" if us < 1e5 else f"{us:8.0f}"


def _fmt_cell(row):
    wrong = "N/A" if row["wrong"] is None else str(row["wrong"])
    return f" {_fmt_time(row['time_us'])} {row['algbw_GBps']:7.2f} {row['busbw_GBps']:7.2f} {wrong:>6}"


def format_line(impl, nbytes, count, type_name, oop, ip):
    return (f"  {impl:<6}{nbytes:>12} {count:>13} {type_name:>9}     sum      -1"
            f"{_fmt_cell(oop)}{_fmt_cell(ip)}")


def summary_lines(rows, impl_names):
    lines = []
    for name in impl_names:
        cells = [r["busbw_GBps"] for r in rows if r["impl"] == name]
        if cells:
            lines.append(f"# Avg bus bandwidth    : {sum(cells) / len(cells):.4f}  ({name})")
    # The target: fused vs torch at >= 1 MB, same run. The busbw ratio equals the algbw
    # ratio (same factor), which stays defined with one rank, where busbw is 0.
    if "fused" in impl_names and "torch" in impl_names:
        ratios = []
        for r in rows:
            if r["impl"] == "fused" and r["bytes"] >= 1_000_000:
                twin = [t for t in rows if t["impl"] == "torch" and t["bytes"] == r["bytes"]
                        and t["inplace"] == r["inplace"]]
                if twin and twin[0]["algbw_GBps"] > 0:
                    ratios.append(r["algbw_GBps"] / twin[0]["algbw_GBps"])
        if ratios:
            lines.append(f"# fused/torch busbw at >= 1 MB: min {min(ratios):.3f}, "
                         f"mean {sum(ratios) / len(ratios):.3f} ({len(ratios)} cells)")
    return lines


def plot(path, rows, meta, impl_names, dtype_name):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    fig, ax = plt.subplots(figsize=(9, 5.5))
    colors = {"fused": "tab:blue", "torch": "tab:orange", "cupy": "tab:green"}
    for name in impl_names:
        for inplace, style in ((False, "-"), (True, "--")):
            pts = sorted((r["bytes"], r["busbw_GBps"]) for r in rows
                         if r["impl"] == name and r["inplace"] == inplace)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", markersize=3,
                        color=colors.get(name), label=f"{name} ({'in-place' if inplace else 'out-of-place'})")
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: common.format_size(int(x)) if x >= 1 else ""))
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s, 1e9 B/s)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    ax.set_title(f"all_reduce busbw, {dtype_name} sum, {meta['world_size']} ranks\n"
                 f"{common.meta_label(meta)}", fontsize=9)
    fig.tight_layout()
    common.ensure_parent(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- main ---------------------------------------------------------------------------------------
def worker(ctx, args):
    dtype = args.dtype
    type_name = TYPE_NAME[dtype]
    elem = torch.empty((), dtype=dtype).element_size()
    sizes = sizes_from(args)
    impls, skipped = make_impls(ctx, args)
    impl_names = [i.name for i in impls]
    if not impls:
        common.print0(ctx, "# no implementation left to run: "
                      + "; ".join(f"{k} skipped ({v})" for k, v in skipped.items()))
        return 2
    meta = common.collect_meta(ctx, extra={
        "benchmark": "allreduce_bw", "dtype": type_name, "op": "sum", "iters": args.iters,
        "warmup_iters": args.warmup_iters, "trials": args.trials, "check": bool(args.check),
        "impls": {i.name: i.describe() for i in impls}, "skipped": skipped,
        "launch": args.launch,
        "time": (f"wall time of iters back-to-back operations ({args.launch}) / iters, mean "
                 "over ranks; median over trials"),
        "busbw_factor": bus_factor(ctx.world_size)})
    corrupt = set(args.corrupt or [])

    p = lambda *a: common.print0(ctx, *a)  # noqa: E731
    p("# FusedReducer allreduce_bw (nccl-tests all_reduce_perf methodology)")
    p(f"# nRanks {ctx.world_size} backend {ctx.backend} device {ctx.device.type} "
      f"minBytes {args.minbytes} maxBytes {args.maxbytes} step: "
      + (f"{args.stepfactor:g}(factor)" if args.stepfactor > 1 else f"{args.stepbytes}(bytes)")
      + f" warmup iters: {args.warmup_iters} iters: {args.iters} trials: {args.trials}"
      f" launch: {args.launch} validation: {args.check}")
    p(f"# torch {meta['torch_version']} on {meta['hostname']} ({meta['usable_cpus']} usable cores, "
      f"{meta['threads_per_rank']} threads/rank), {meta['date']}")
    p("# impls: " + ", ".join(i.describe() for i in impls)
      + ("; skipped: " + "; ".join(f"{k} ({v})" for k, v in skipped.items()) if skipped else ""))
    if args.check:
        data = CraftedData(dtype, ctx.rank, ctx.world_size, ctx.device)
        if not data.exact:
            p(f"# warning: {ctx.world_size} ranks exceed the exactly-summable range of {type_name}; "
              "the check compares against rounded sums")
    p("#\n# Using devices")
    for r in meta["ranks"]:
        p(f"#  Rank {r['rank']:>3} Pid {r['pid']:>7} on {r['hostname']:>12} device {r['device']}"
          + (f" [{r['gpu']}]" if r["gpu"] else ""))
    p("#")
    p(HEADER)

    rows, progress = [], common.Progress(ctx, enabled=not args.quiet, every=5.0)
    for nbytes in sizes:
        count = nbytes // elem
        if count == 0:
            continue
        nbytes = count * elem
        send = torch.empty(count, dtype=dtype, device=ctx.device)
        recv = torch.empty(count, dtype=dtype, device=ctx.device)
        if args.check:
            data.fill_input(send)
        else:
            send.fill_(1)
        # Timing: --trials rounds, the impl order reversed every round; median per case.
        times = {(impl.name, inplace): [] for impl in impls for inplace in (False, True)}
        for trial in range(args.trials):
            for impl in (impls if trial % 2 == 0 else list(reversed(impls))):
                for inplace in (False, True):
                    progress(f"{impl.name} {common.format_size(nbytes)} "
                             f"{'in' if inplace else 'out-of'}-place, trial {trial + 1}/{args.trials}")
                    if inplace:
                        recv.copy_(send)
                    times[(impl.name, inplace)].append(
                        time_case(ctx, impl, send, recv, inplace, args.warmup_iters, args.iters,
                                  args.launch == "queued"))
        for impl in impls:
            cells = {}
            for inplace in (False, True):
                us = statistics.median(times[(impl.name, inplace)])
                wrong = (check_case(ctx, impl, data, send, recv, inplace, impl.name in corrupt)
                         if args.check else None)
                algbw, busbw = bandwidths(nbytes, us, ctx.world_size)
                row = {"impl": impl.name, "bytes": nbytes, "dtype": type_name, "inplace": inplace,
                       "time_us": us, "algbw_GBps": algbw, "busbw_GBps": busbw, "wrong": wrong}
                rows.append(row)
                cells[inplace] = row
            p(format_line(impl.name, nbytes, count, type_name, cells[False], cells[True]))
        del send, recv

    wrong_total = sum(r["wrong"] or 0 for r in rows)
    p(f"# Out of bounds values : {wrong_total} {'OK' if wrong_total == 0 else 'FAILED'}")
    for line in summary_lines(rows, impl_names):
        p(line)
    p("#")
    if ctx.rank == 0:
        if args.json:
            common.write_json(args.json, {"meta": meta, "rows": rows})
            p(f"# wrote {args.json}")
        if args.plot:
            plot(args.plot, rows, meta, impl_names, type_name)
            p(f"# wrote {args.plot}")
    return 1 if wrong_total else 0


def _dtype(text):
    try:
        return DTYPES[text.lower()]
    except KeyError:
        raise argparse.ArgumentTypeError(
            f"unknown dtype {text!r}; one of {', '.join(sorted(DTYPES))}") from None


def _impls(text):
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in IMPLS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"--impl takes a comma list of {', '.join(IMPLS)}; got {text!r}")
    return list(dict.fromkeys(names))


def build_parser():
    parser = argparse.ArgumentParser(
        prog="allreduce_bw.py", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-b", "--minbytes", type=common.parse_size, default=common.parse_size("8"),
                        help="smallest message in bytes, K/M/G suffixes = powers of 1024 (default 8)")
    parser.add_argument("-e", "--maxbytes", type=common.parse_size, default=common.parse_size("64M"),
                        help="largest message in bytes (default 64M)")
    parser.add_argument("-f", "--stepfactor", type=float, default=2,
                        help="multiply the size by this between cases (default 2)")
    parser.add_argument("-i", "--stepbytes", type=common.parse_size, default=common.parse_size("1M"),
                        help="add this many bytes between cases when -f is 1 (default 1M)")
    parser.add_argument("-n", "--iters", type=int, default=20,
                        help="timed operations per case (default 20)")
    parser.add_argument("-w", "--warmup-iters", type=int, default=5,
                        help="untimed operations before each timed loop (default 5)")
    parser.add_argument("--trials", type=int, default=1,
                        help="repeat each timed loop this many times, alternating implementations, "
                             "and report the median loop (default 1, as all_reduce_perf; use 3-5 "
                             "on a shared machine)")
    parser.add_argument("--launch", choices=("queued", "waited"), default="queued",
                        help="queued: start the -n operations back to back, then wait for "
                             "them (all_reduce_perf; how a step's buckets queue); waited: wait "
                             "for each before starting the next (default queued)")
    parser.add_argument("-d", "--dtype", type=_dtype, default=torch.float32,
                        help="element type: float, half, bfloat16, double, int8, uint8, int32, "
                             "int64 (default float)")
    parser.add_argument("-c", "--check", type=int, choices=(0, 1), default=1,
                        help="1: verify every case on crafted inputs and report #wrong; 0: skip "
                             "(#wrong N/A) (default 1)")
    parser.add_argument("--impl", type=_impls, default=list(IMPLS),
                        help="comma list of implementations, measured side by side: "
                             "fused,torch,cupy (default all; cupy is skipped without CUDA+cupy)")
    parser.add_argument("--transport", choices=("auto", "shm", "process_group", "nccl"),
                        default="auto",
                        help="the transport of impl fused (default auto, as FusedReducer: NCCL "
                             "for CUDA, shared memory for CPU ranks of one host, else the "
                             "process group)")
    parser.add_argument("--json", metavar="FILE",
                        help="write {meta, rows:[{impl, bytes, dtype, inplace, time_us, "
                             "algbw_GBps, busbw_GBps, wrong}]} to FILE")
    parser.add_argument("--plot", metavar="FILE.png",
                        help="write busbw against size per implementation (log size axis)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    # Testing only: corrupt one result element on the last rank for these impls, after the
    # collective and before the check, to show that the check catches a wrong result.
    parser.add_argument(CORRUPT_FLAG, type=_impls, default=None, help=argparse.SUPPRESS)
    common.add_launch_args(parser)
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.iters < 1 or args.warmup_iters < 0 or args.trials < 1:
        raise SystemExit("-n and --trials must be >= 1, -w >= 0")
    return common.launch(worker, args)


if __name__ == "__main__":
    sys.exit(main())
