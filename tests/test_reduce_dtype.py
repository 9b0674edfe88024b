"""reduce_dtype: buckets of floating-point gradients reduced in another dtype.

On 2 and 3 gloo ranks (one spawn each, many checks): equivalence with DDP + bf16_compress_hook /
fp16_compress_hook (bitwise on 2 ranks, where dividing by 2 is exact and a + b is commutative;
within the dtype's rounding on 3); all-reduce bytes per step exactly half of fp32's, counted with
torch.profiler from the c10d::allreduce_ events' shapes and dtypes (not from our stats);
property semantics (applied at the next forward, kept by a rebuild, rank 0's value wins, shown in
stats(), step_history(), the trace, bucket_sizes()); errors; no_sync; find_unused_parameters;
DDP communication hooks (they see the bucket in the reduce dtype); autotune keeps it. Accuracy:
FusedReducer(bf16) ends no farther from the fp32 run than DDP + bf16_compress_hook (+10 %), and
a bf16 model reduced in fp32 ends closer to an fp64 reference than reduced in bf16.
"""
import json
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as dh
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile

from dist_utils import ALLREDUCE_EVENTS, SHAPED_ALLREDUCE_EVENTS, per_rank, run_checks

LR = 0.05
HOOK = {torch.bfloat16: dh.bf16_compress_hook, torch.float16: dh.fp16_compress_hook}
ELEMENT = {"float": 4, "c10::BFloat16": 2, "c10::Half": 2, "double": 8, "int": 4, "long int": 8}


class Net(nn.Module):
    """Every parameter's numel is a multiple of 8, so bucket slots need no padding in any dtype
    (Note [Slot layout]) and byte counts compare exactly."""

    def __init__(self, d_in=32, hidden=64, d_out=8):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, d_out)

    def forward(self, x):
        return self.out(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


class BranchNet(Net):
    """`extra` takes part only when forward gets use_extra=True."""

    def __init__(self):
        super().__init__()
        self.extra = nn.Linear(64, 64)

    def forward(self, x, use_extra=False):
        h = torch.tanh(self.fc1(x))
        if use_extra:
            h = torch.tanh(self.extra(h))
        return self.out(torch.tanh(self.fc2(h)))


def build(cls=Net, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return cls().to(dtype)


def batch(rank, step, dtype=torch.float32, d_in=32, d_out=8):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return (torch.randn(16, d_in, generator=g).to(dtype),
            torch.randn(16, d_out, generator=g).to(dtype))


def fused(module, **kwargs):
    from fused_reducer import FusedReducer
    kwargs.setdefault("first_bucket_mb", 1)
    return FusedReducer(module, **kwargs)


def ddp_with_hook(module, dtype, **kwargs):
    m = DDP(module, **kwargs)
    if dtype is not None:
        m.register_comm_hook(dist.group.WORLD, HOOK[dtype])
    return m


def grads(model):
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def params(model):
    return [p.detach().clone() for p in model.parameters()]


def step(model, rank, i, opt=None, **fwd):
    dtype = next(model.parameters()).dtype
    x, y = batch(rank, i, dtype)
    model.zero_grad(set_to_none=True)
    ((model(x, **fwd) - y) ** 2).mean().backward()
    g = grads(model)
    if opt is not None:
        opt.step()
    return g


def allreduce_bytes(fn):
    """(collectives, bytes, dtypes) of the all-reduces `fn` runs, from the profiler,
    independently of FusedReducer.stats(): dist_utils.ALLREDUCE_EVENTS counted, and the input
    shapes and dtypes of the SHAPED_ALLREDUCE_EVENTS (the c10d op records its TensorList
    without dtypes)."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    count, gloo_count, nbytes, dtypes = 0, 0, 0, set()
    for e in prof.events():
        count += e.name in ALLREDUCE_EVENTS
        if e.name in SHAPED_ALLREDUCE_EVENTS:
            gloo_count += 1
            numel = 1
            for d in e.input_shapes[0]:
                numel *= d
            nbytes += numel * ELEMENT[e.input_dtypes[0]]
            dtypes.add(e.input_dtypes[0])
    assert count == gloo_count, (count, gloo_count)
    return count, nbytes, sorted(dtypes)


def max_abs(tensors):
    return max(t.abs().max().item() for t in tensors if t is not None)


def max_diff(a, b):
    return max((x.double() - y.double()).abs().max().item() for x, y in zip(a, b)
               if x is not None)


# -- checks (run on every rank) ------------------------------------------------------------------

def check_equivalence_with_ddp_hooks(rank, world):
    """FusedReducer(reduce_dtype=d) vs DDP + d's compress hook: grads of step 0 (same params)
    and params after 4 SGD steps. Also grads stay in the parameters' dtype."""
    out = {}
    for dtype in (torch.bfloat16, torch.float16):
        runs = {}
        for kind in ("ddp", "fr"):
            module = build()
            m = ddp_with_hook(module, dtype) if kind == "ddp" else fused(module, reduce_dtype=dtype)
            opt = torch.optim.SGD(m.parameters(), lr=LR)
            gs = [step(m, rank, i, opt) for i in range(4)]
            runs[kind] = {"grads0": gs[0], "params": params(m),
                          "grad_dtypes": {str(g.dtype) for g in gs[-1]}}
        out[str(dtype)] = {
            "grad_diff0": max_diff(runs["ddp"]["grads0"], runs["fr"]["grads0"]),
            "grad_scale": max_abs(runs["ddp"]["grads0"]),
            "param_diff": max_diff(runs["ddp"]["params"], runs["fr"]["params"]),
            "grad_dtypes": runs["fr"]["grad_dtypes"],
        }
    return out


def check_bytes_halved(rank, world):
    """Bytes all-reduced per step (profiler), after the rebuild: FusedReducer in bf16 and fp16
    vs FusedReducer in fp32 vs DDP in fp32 vs DDP + bf16 hook."""
    out = {}
    variants = {
        "fr_fp32": lambda: fused(build()),
        "fr_bf16": lambda: fused(build(), reduce_dtype=torch.bfloat16),
        "fr_fp16": lambda: fused(build(), reduce_dtype=torch.float16),
        "ddp_fp32": lambda: DDP(build()),
        "ddp_bf16_hook": lambda: ddp_with_hook(build(), torch.bfloat16),
    }
    for name, make in variants.items():
        m = make()
        for i in range(2):
            step(m, rank, i)
        count, nbytes, dtypes = allreduce_bytes(lambda: step(m, rank, 2))
        row = {"count": count, "bytes": nbytes, "dtypes": dtypes}
        if name.startswith("fr"):
            row.update(stats_bytes=m.stats()["allreduce_bytes"], sizes=m.bucket_sizes(),
                       stats_dtype=m.stats()["reduce_dtype"])
        out[name] = row
    return out


def check_limits_count_reduce_dtype_bytes(rank, world):
    """A first bucket of 12 KiB. Ready order out.bias (32 B in fp32), out.weight (2048 B),
    fc2.bias (256 B), fc2.weight (16384 B), fc1.bias (256 B), fc1.weight (8192 B): in fp32 the
    first bucket closes after fc2.weight (18720 B), fc1 goes to a second one; in bf16 the same
    gradients are 9360 B there, so the first bucket also takes fc1 (13584 B): one bucket."""
    out = {}
    for dtype in (None, torch.bfloat16):
        m = fused(build(), first_bucket_mb=12 / 1024, bucket_cap_mb=25, reduce_dtype=dtype)
        for i in range(2):
            step(m, rank, i)
        out[str(dtype)] = {"sizes": m.bucket_sizes(), "names": m.bucket_parameter_names()}
    return out


def check_property_semantics(rank, world):
    r = {}
    m = fused(build(), process_group=dist.new_group(backend="gloo"))
    opt = torch.optim.SGD(m.parameters(), lr=LR)
    for i in range(2):
        step(m, rank, i, opt)
    r["initial"] = (m.reduce_dtype, m.stats()["reduce_dtype"])
    rebuilds = m.stats()["rebuilds"]

    m.reduce_dtype = torch.bfloat16
    r["after_set_before_forward"] = (m.reduce_dtype, m.stats()["reduce_dtype"],
                                     m.stats()["rebuilds"] - rebuilds)
    r["applied"] = allreduce_bytes(lambda: step(m, rank, 2, opt))
    r["applied_stats"] = (m.stats()["reduce_dtype"], m.stats()["rebuilds"] - rebuilds,
                          m.step_history()[-1]["reduce_dtype"],
                          {str(p.grad.dtype) for p in m.parameters()})

    # A rebuild for another reason (a new first bucket) keeps the reduce dtype.
    m.first_bucket_bytes = 4096
    r["after_limit_change"] = allreduce_bytes(lambda: step(m, rank, 3, opt))
    r["after_limit_stats"] = (m.reduce_dtype, m.stats()["reduce_dtype"],
                              m.stats()["rebuilds"] - rebuilds, m.stats()["first_bucket_bytes"])

    # Ranks disagree: rank 0's value wins everywhere.
    m.reduce_dtype = torch.float16 if rank == 0 else torch.float32
    r["disagree"] = allreduce_bytes(lambda: step(m, rank, 4, opt))
    r["disagree_stats"] = (m.reduce_dtype, m.stats()["reduce_dtype"])

    # The trace shows it.
    with tempfile.TemporaryDirectory() as d:
        path = m.export_trace(os.path.join(d, "trace_{rank}.json"))
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    r["trace"] = sorted({e["args"].get("reduce_dtype") for e in events
                         if e.get("name", "").startswith("step ")}, key=str)

    # Back to the gradients' own dtype.
    m.reduce_dtype = None
    r["none"] = allreduce_bytes(lambda: step(m, rank, 5, opt))
    r["none_stats"] = (m.reduce_dtype, m.stats()["reduce_dtype"])
    r["params_synced"] = _same_on_all_ranks(params(m))
    return r


def _same_on_all_ranks(tensors):
    flat = torch.cat([t.detach().double().reshape(-1) for t in tensors])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return all(torch.equal(gathered[0], g) for g in gathered)


def _raises(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, str(e), isinstance(e, ValueError)
    return "ok", None, None


def check_errors(rank, world):
    r = {}
    r["view_at_construction"] = _raises(
        lambda: fused(build(), gradient_as_bucket_view=True, reduce_dtype=torch.bfloat16))
    m = fused(build(), gradient_as_bucket_view=True)
    r["view_setter"] = _raises(lambda: setattr(m, "reduce_dtype", torch.float16))
    r["view_setter_kept"] = m.reduce_dtype
    r["bad_setter_int"] = _raises(lambda: setattr(m, "reduce_dtype", torch.int64))
    r["bad_setter_str"] = _raises(lambda: setattr(m, "reduce_dtype", "bf16"))
    # Same dtype as the gradients: allowed with views, and exact.
    v = fused(build(), gradient_as_bucket_view=True, reduce_dtype=torch.float32)
    plain = fused(build())
    diffs = []
    for i in range(3):
        diffs.append(max_diff(step(v, rank, i), step(plain, rank, i)))
    r["view_same_dtype_diffs"] = diffs
    r["view_same_dtype_is_view"] = all(
        p.grad.data_ptr() != 0 and p.grad._base is not None for p in v.parameters())
    return r


def check_no_sync(rank, world):
    """Two micro-batches under no_sync, then a synced one: DDP + bf16 hook and
    FusedReducer(bf16) both accumulate in fp32 and cast the sum once."""
    out = {}
    for kind in ("ddp", "fr"):
        module = build()
        m = (ddp_with_hook(module, torch.bfloat16) if kind == "ddp"
             else fused(module, reduce_dtype=torch.bfloat16))
        opt = torch.optim.SGD(m.parameters(), lr=LR)
        trail = []
        for outer in range(2):
            m.zero_grad(set_to_none=True)
            with m.no_sync():
                for k in range(2):
                    x, y = batch(rank, 10 * outer + k)
                    ((m(x) - y) ** 2).mean().backward()
            x, y = batch(rank, 10 * outer + 2)
            ((m(x) - y) ** 2).mean().backward()
            trail.append(grads(m))
            opt.step()
        out[kind] = trail
    return {"diffs": [max_diff(a, b) for a, b in zip(out["ddp"], out["fr"])],
            "dtypes": sorted({str(g.dtype) for g in out["fr"][-1]})}


def check_find_unused(rank, world):
    """`extra` used on rank 1 only at step 1, nowhere at step 0 and 2: DDP(find_unused) + bf16
    hook vs FusedReducer(find_unused, bf16): same grads, same None grads."""
    out = {}
    for kind in ("ddp", "fr"):
        module = build(BranchNet)
        m = (ddp_with_hook(module, torch.bfloat16, find_unused_parameters=True) if kind == "ddp"
             else fused(module, reduce_dtype=torch.bfloat16, find_unused_parameters=True))
        opt = torch.optim.SGD(m.parameters(), lr=LR)
        trail = []
        for i in range(3):
            trail.append(step(m, rank, i, opt, use_extra=(i == 1 and rank == 1)))
        out[kind] = trail
    nones = [[g is None for g in s] for s in out["fr"]]
    return {"diffs": [max_diff(a, b) for a, b in zip(out["ddp"], out["fr"])],
            "same_nones": nones == [[g is None for g in s] for s in out["ddp"]],
            "nones": nones}


def check_comm_hook_sees_reduce_dtype(rank, world):
    seen = []

    def hook(state, bucket):
        seen.append((str(bucket.buffer().dtype),
                     tuple(sorted({str(g.dtype) for g in bucket.gradients()}))))
        return dh.allreduce_hook(state, bucket)

    hooked = fused(build(), reduce_dtype=torch.bfloat16)
    hooked.register_comm_hook(dist.group.WORLD, hook)
    plain = fused(build(), reduce_dtype=torch.bfloat16)
    diffs = [max_diff(step(hooked, rank, i), step(plain, rank, i)) for i in range(2)]
    return {"seen": sorted(set(seen)), "diffs": diffs,
            "grad_dtypes": sorted({str(p.grad.dtype) for p in hooked.parameters()})}


def check_autotune_keeps_reduce_dtype(rank, world):
    m = fused(build(), reduce_dtype=torch.bfloat16)
    m.autotune(candidates=[(1 << 20, 25 << 20, 0), (4096, 8192, 0)], round_steps=(1,),
               min_steps=1)
    steps = 0
    while not m.autotune_report()["done"]:
        step(m, rank, steps)
        steps += 1
        assert steps < 50, "autotune did not finish"
    step(m, rank, steps)
    return {"reduce_dtype": m.reduce_dtype, "stats": m.stats()["reduce_dtype"],
            "trace": {s["reduce_dtype"] for s in m.step_history()}}


def _distance(a, b):
    return sum(((x.double() - y.double()) ** 2).sum().item() for x, y in zip(a, b)) ** 0.5


def cancelling_batch(rank, world, i, dtype, d_in=32, d_out=8):
    """Rank-specific target offsets that cancel over the ranks: the local gradients are much
    larger than their mean, as with heterogeneous data; the reduction's rounding then matters."""
    x, y = batch(rank, 100 + i, dtype, d_in, d_out)
    offset = 8.0 * (rank - (world - 1) / 2)
    return x, y + offset


def train_accuracy(make, rank, world, dtype, steps, master=False):
    """SGD with momentum; `master`: fp64 master weights updated from the (low-precision)
    grads, as mixed-precision training does (there in fp32), so that the update itself adds
    little rounding; the master weights are returned."""
    m = make()
    ps = list(m.parameters())
    masters = [p.detach().double().clone() for p in ps] if master else None
    opt = torch.optim.SGD(masters if master else ps, lr=0.01, momentum=0.9)
    if master:
        for t in masters:
            t.grad = torch.zeros_like(t)
    for i in range(steps):
        x, y = cancelling_batch(rank, world, i, dtype)
        m.zero_grad(set_to_none=True)
        ((m(x) - y) ** 2).mean().backward()
        if master:
            for t, p in zip(masters, ps):
                t.grad.copy_(p.grad)
            opt.step()
            with torch.no_grad():
                for t, p in zip(masters, ps):
                    p.copy_(t)
        else:
            opt.step()
    return masters if master else params(m)


def check_accuracy(rank, world):
    steps = 20
    # fp32 model: FusedReducer(bf16) vs DDP + bf16_compress_hook, distance from the fp32 run.
    fp32 = train_accuracy(lambda: fused(build()), rank, world, torch.float32, steps)
    fr = train_accuracy(lambda: fused(build(), reduce_dtype=torch.bfloat16), rank, world,
                        torch.float32, steps)
    hook = train_accuracy(lambda: ddp_with_hook(build(), torch.bfloat16), rank, world,
                          torch.float32, steps)
    # bf16 model (fp32 master weights): reduced in fp32 vs in bf16, distance from fp64.
    # The reference starts from the bf16 model's (rounded) initial weights.
    ref = train_accuracy(lambda: fused(build(dtype=torch.bfloat16).double()), rank, world,
                         torch.float64, steps, master=True)
    in_fp32 = train_accuracy(lambda: fused(build(dtype=torch.bfloat16), reduce_dtype=torch.float32),
                             rank, world, torch.bfloat16, steps, master=True)
    in_bf16 = train_accuracy(lambda: fused(build(dtype=torch.bfloat16)), rank, world,
                             torch.bfloat16, steps, master=True)
    return {"fr_bf16_from_fp32": _distance(fr, fp32), "hook_from_fp32": _distance(hook, fp32),
            "reduce_fp32_from_fp64": _distance(in_fp32, ref),
            "reduce_bf16_from_fp64": _distance(in_bf16, ref)}


CHECKS_2 = [check_equivalence_with_ddp_hooks, check_bytes_halved,
            check_limits_count_reduce_dtype_bytes, check_property_semantics, check_errors,
            check_no_sync, check_find_unused, check_comm_hook_sees_reduce_dtype,
            check_autotune_keeps_reduce_dtype, check_accuracy]
CHECKS_3 = [check_equivalence_with_ddp_hooks, check_bytes_halved, check_no_sync, check_accuracy]


@pytest.fixture(scope="module")
def two():
    return run_checks(CHECKS_2, world_size=2, timeout=150)


@pytest.fixture(scope="module")
def three():
    return run_checks(CHECKS_3, world_size=3, timeout=150)


@pytest.fixture(params=[2, 3], ids=["2ranks", "3ranks"])
def world(request, two, three):
    return request.param, {2: two, 3: three}[request.param]


# -- tests ---------------------------------------------------------------------------------------

FINFO = {"torch.bfloat16": torch.finfo(torch.bfloat16).eps, "torch.float16": torch.finfo(torch.float16).eps}


def test_equivalence_with_ddp_compress_hooks(world):
    n, outcomes = world
    for rank, r in enumerate(per_rank(outcomes, "check_equivalence_with_ddp_hooks")):
        for dtype, row in r.items():
            assert row["grad_dtypes"] == {"torch.float32"}, (rank, dtype, row)
            if n == 2 and dtype == "torch.bfloat16":
                # Dividing by 2 is exact, a + b commutes: the same bits as DDP's hook.
                assert row["grad_diff0"] == 0 and row["param_diff"] == 0, (rank, dtype, row)
            else:
                # fp16 on 2 ranks: grads below 2 * 6.1e-5 are fp16 subnormals, where DDP's
                # hook rounds before halving and we after: the sum may then round either way.
                # DDP's hook rounds twice (cast, then divide in the low dtype), we once.
                tol = 4 * FINFO[dtype] * row["grad_scale"]
                assert row["grad_diff0"] <= tol, (rank, dtype, row, tol)
                assert row["param_diff"] <= 4 * LR * tol, (rank, dtype, row)


def test_allreduce_bytes_exactly_half(world):
    n, outcomes = world
    for rank, r in enumerate(per_rank(outcomes, "check_bytes_halved")):
        fp32 = r["fr_fp32"]["bytes"]
        assert fp32 == r["ddp_fp32"]["bytes"] > 0, r
        assert r["fr_fp32"]["dtypes"] == ["float"], r
        for name, dtype in (("fr_bf16", "c10::BFloat16"), ("fr_fp16", "c10::Half")):
            assert r[name]["dtypes"] == [dtype], (name, r[name])
            assert 2 * r[name]["bytes"] == fp32, (name, r[name], fp32)
            assert r[name]["stats_bytes"] == r[name]["bytes"], r[name]  # stats() agrees
            assert sum(r[name]["sizes"]) == r[name]["bytes"], r[name]  # bucket_sizes() too
            assert r[name]["count"] == r["fr_fp32"]["count"], r
        assert r["fr_bf16"]["stats_dtype"] == "torch.bfloat16"
        assert r["fr_fp32"]["stats_dtype"] is None
        assert r["ddp_bf16_hook"]["bytes"] == r["fr_bf16"]["bytes"], r


def test_bucket_limits_count_bytes_of_the_reduce_dtype(two):
    for r in per_rank(two, "check_limits_count_reduce_dtype_bytes"):
        fp32, bf16 = r["None"], r["torch.bfloat16"]
        assert fp32["sizes"] == [18720, 8448], fp32
        assert sorted(fp32["names"][1]) == ["fc1.bias", "fc1.weight"], fp32
        assert bf16["sizes"] == [13584], bf16


def test_property_semantics(two):
    for rank, r in enumerate(per_rank(two, "check_property_semantics")):
        assert r["initial"] == (None, None)
        # Set: readable at once, in force only after the next forward's rebuild.
        assert r["after_set_before_forward"] == (torch.bfloat16, None, 0), r
        assert r["applied"][2] == ["c10::BFloat16"], r["applied"]
        assert r["applied_stats"] == ("torch.bfloat16", 1, "torch.bfloat16", {"torch.float32"}), r
        # A rebuild for a new first bucket keeps it.
        assert r["after_limit_change"][2] == ["c10::BFloat16"], r
        assert r["after_limit_change"][0] > r["applied"][0], r  # more buckets: it did rebuild
        assert r["after_limit_stats"] == (torch.bfloat16, "torch.bfloat16", 2, 4096), r
        # Rank 0 set fp16, rank 1 fp32: every rank reduces fp16 and says so.
        assert r["disagree"][2] == ["c10::Half"], r
        assert r["disagree_stats"] == (torch.float16, "torch.float16"), (rank, r)
        assert "torch.bfloat16" in r["trace"] and "torch.float16" in r["trace"], r["trace"]
        assert r["none"][2] == ["float"] and r["none_stats"] == (None, None), r
        assert r["params_synced"]


def test_errors_bucket_view_and_bad_values(two):
    for r in per_rank(two, "check_errors"):
        kind, msg, is_value = r["view_at_construction"]
        assert kind == "FusedReducerError" and is_value, r
        assert "gradient_as_bucket_view" in msg and "torch.bfloat16" in msg \
            and "torch.float32" in msg and "fc1.weight" in msg, msg
        kind, msg, _ = r["view_setter"]
        assert kind == "FusedReducerError" and "torch.float16" in msg and "torch.float32" in msg
        assert r["view_setter_kept"] is None
        kind, msg, _ = r["bad_setter_int"]
        assert kind == "ValueError" and "torch.int64" in msg and "torch.bfloat16" in msg, msg
        kind, msg, _ = r["bad_setter_str"]
        assert kind == "TypeError" and "'bf16'" in msg and "torch.float16" in msg, msg
        assert r["view_same_dtype_diffs"] == [0.0, 0.0, 0.0], r
        assert r["view_same_dtype_is_view"]


@pytest.mark.parametrize("value, kind", [(torch.int32, ValueError), (torch.float64, ValueError),
                                         (torch.complex64, ValueError), ("bfloat16", TypeError),
                                         (16, TypeError)])
def test_bad_reduce_dtype_at_construction(value, kind):
    """Checked before anything collective (no process group needed)."""
    from fused_reducer import FusedReducer
    with pytest.raises(kind) as info:
        FusedReducer(nn.Linear(2, 2), reduce_dtype=value)
    msg = str(info.value)
    assert repr(value) in msg or str(value) in msg, msg
    for accepted in ("torch.bfloat16", "torch.float16", "torch.float32", "None"):
        assert accepted in msg, msg


def test_no_sync_accumulates_in_grad_dtype(world):
    n, outcomes = world
    for r in per_rank(outcomes, "check_no_sync"):
        assert r["dtypes"] == ["torch.float32"]
        if n == 2:
            assert r["diffs"] == [0.0, 0.0], r
        else:
            assert max(r["diffs"]) < 1e-3, r


def test_find_unused_parameters(two):
    for r in per_rank(two, "check_find_unused"):
        assert r["same_nones"], r
        assert r["diffs"] == [0.0, 0.0, 0.0], r
        assert any(any(s) for s in r["nones"])  # `extra` really had no gradient at some step


def test_comm_hook_sees_the_reduce_dtype(two):
    for r in per_rank(two, "check_comm_hook_sees_reduce_dtype"):
        assert r["seen"] == [("torch.bfloat16", ("torch.bfloat16",))], r
        assert r["diffs"] == [0.0, 0.0], r
        assert r["grad_dtypes"] == ["torch.float32"]


def test_autotune_keeps_reduce_dtype(two):
    for r in per_rank(two, "check_autotune_keeps_reduce_dtype"):
        assert r["reduce_dtype"] == torch.bfloat16 and r["stats"] == "torch.bfloat16", r
        assert r["trace"] == {"torch.bfloat16"}, r


def test_accuracy(world):
    n, outcomes = world
    for r in per_rank(outcomes, "check_accuracy"):
        # fp32 model: no farther from the fp32 run than DDP + bf16_compress_hook (+10 %).
        assert r["fr_bf16_from_fp32"] <= 1.10 * r["hook_from_fp32"], r
        assert r["fr_bf16_from_fp32"] > 0, r  # bf16 did round something
        # bf16 model: reducing in fp32 ends closer to the fp64 reference.
        if n == 3:  # on 2 ranks a/2 + b/2 rounds once either way: the same bits
            assert r["reduce_fp32_from_fp64"] < r["reduce_bf16_from_fp64"], r
        else:
            assert r["reduce_fp32_from_fp64"] <= r["reduce_bf16_from_fp64"], r


# -- the cast copy itself (no spawn) ---------------------------------------------------------------

FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _cast_case(src_dtype, dst_dtype, device):
    """Segments at odd offsets (scalar head and tail, vector body) of one source and one
    destination buffer; the expected result: the product formed in float (double when either
    side is fp64) and rounded once into the destination dtype (Note [Bucket copies])."""
    g = torch.Generator().manual_seed(3)
    src_buf = (torch.randn(5000, generator=g, dtype=torch.float64) * 10).to(src_dtype).to(device)
    dst_buf = torch.zeros(5000, dtype=dst_dtype, device=device)
    cuts = [(1, 7), (9, 2100), (2200, 64), (2300, 2601)]  # (offset, numel)
    srcs = [src_buf[o:o + n] for o, n in cuts]
    dsts = [dst_buf[o + 3:o + 3 + n] for o, n in cuts]
    math = torch.float64 if torch.float64 in (src_dtype, dst_dtype) else torch.float32
    expected = [(s.to(math) * (1 / 3)).to(dst_dtype) for s in srcs]
    return srcs, dsts, expected


@pytest.mark.parametrize("src_dtype", FLOATS, ids=str)
@pytest.mark.parametrize("dst_dtype", FLOATS, ids=str)
def test_cast_copy_cpu(src_dtype, dst_dtype):
    from fused_reducer import _C
    srcs, dsts, expected = _cast_case(src_dtype, dst_dtype, "cpu")
    assert _C.scaled_copy(srcs, dsts, 1 / 3) == 0
    for d, e in zip(dsts, expected):
        assert d.dtype == dst_dtype and torch.equal(d, e)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (the fused CUDA kernel)")
@pytest.mark.parametrize("src_dtype", FLOATS, ids=str)
@pytest.mark.parametrize("dst_dtype", FLOATS, ids=str)
def test_cast_copy_cuda_one_launch(src_dtype, dst_dtype):
    import fused_reducer
    from fused_reducer import _C
    if not fused_reducer.build_info()["cuda"]:
        pytest.skip("CPU-only build")
    srcs, dsts, expected = _cast_case(src_dtype, dst_dtype, "cuda")
    assert _C.scaled_copy(srcs, dsts, 1 / 3) == 1  # every pair: one fused launch
    torch.cuda.synchronize()
    for d, e in zip(dsts, expected):
        assert torch.equal(d, e), (src_dtype, dst_dtype, (d.double() - e.double()).abs().max())


def test_fp16_bucket_scales_before_casting():
    """70000 is beyond fp16 (max 65504): DDP's fp16_compress_hook casts first (inf); the copy
    into an fp16 bucket scales first (2 ranks: 35000, finite)."""
    from fused_reducer import _C
    src = torch.full((16,), 70000.0)
    dst = torch.empty(16, dtype=torch.float16)
    _C.scaled_copy([src], [dst], 0.5)
    assert torch.equal(dst, torch.full((16,), 35000.0, dtype=torch.float16))
    assert torch.isinf(src.to(torch.float16).div_(2)).all()  # what the DDP hook would send


def test_tuner_and_profile_count_gradient_bytes_in_the_reduce_dtype():
    """No spawn: what the autotuner and export_profile lay out is what the reducer buckets. With
    a reduce dtype, floating-point gradients count bytes of that dtype (and share its group);
    integer ones keep their own."""
    from fused_reducer.tuning.autotune import ParamInfo
    params = [torch.zeros(10), torch.zeros(6, dtype=torch.float64), torch.zeros(3, dtype=torch.int64)]
    plain = ParamInfo(params)
    assert plain.sizes == [40, 48, 24] and len(set(plain.groups)) == 3
    bf16 = ParamInfo(params, torch.bfloat16)
    assert bf16.sizes == [20, 12, 24]
    assert bf16.groups[0] == bf16.groups[1] != bf16.groups[2]
