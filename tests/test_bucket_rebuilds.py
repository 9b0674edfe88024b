"""Bucket limits and rebuilds: what the layout is after each rebuild, which limits hold, and
the slots the gradients live in.

Each test checks a behaviour against an independent reference (DDP on the same model and data,
a float64 average of locally computed gradients, the profiler's record of the collectives, or the
test's own count). The checks of the selected tests run in ONE spawn of 2 gloo ranks
(SelectedChecks, the module fixture).
"""
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile

from behaviour_common import ConvNet, MiB, collectives, fused, fused_with_its_defaults
from dist_utils import ALLREDUCE_EVENTS, SelectedChecks, assert_small, observe_ready_order, results
from test_bucket_layout import expected_layout
from ddp_comparison import (build, data, grads, local_average_grads, loss_of, max_diff, params,
                                sgd, step)


class Wide(nn.Module):
    """4 x Linear(256, 256): 1,052,672 bytes of float32 gradients, just over 1 MiB."""

    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])

    def forward(self, x):
        return self.layers(x)


class OddConvNet(nn.Module):
    """Odd-sized parameters (packed element by element their slots would not start on 16-byte
    boundaries) and convolutions, used in channels_last."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 5, 3)
        self.conv2 = nn.Conv2d(5, 7, 3)
        self.odd = nn.Parameter(torch.randn(13))
        self.head = nn.Linear(7, 3)

    def forward(self, x):
        y = torch.relu(self.conv2(torch.relu(self.conv1(x))))
        return self.head(y.mean(dim=(2, 3))) + self.odd[:3].sum()


GLOO_DTYPE = {torch.float32: "float", torch.float64: "double", torch.int32: "int"}


class Ladder(nn.Module):
    """One dtype, odd layer sizes: with a 700-byte limit some buckets hold several parameters and
    some parameters are larger than the limit on their own."""

    def __init__(self):
        super().__init__()
        widths = (8, 12, 20, 16, 24, 4)
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths[:-1], widths[1:]))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.tanh(x)
        return x


class Mixed(nn.Module):
    """float32 and float64 layers interleaved; every numel a multiple of 4 (no slot padding, so a
    bucket's flat buffer is exactly its parameters' bytes)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 16).double()
        self.c = nn.Linear(16, 32)
        self.d = nn.Linear(32, 16).double()
        self.e = nn.Linear(16, 4)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        h = torch.tanh(self.b(h.double())).float()
        h = torch.tanh(self.c(h))
        h = torch.tanh(self.d(h.double())).float()
        return self.e(h)


class Flip(nn.Module):
    """a and b are computed in an order chosen by `flip`: autograd makes their gradients ready in
    that order reversed, so the observed gradient order changes with the argument."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.a = nn.Linear(8, 8, bias=False)
        self.b = nn.Linear(8, 8, bias=False)
        self.head = nn.Linear(8, 4)

    def forward(self, x, flip=False):
        h = torch.tanh(self.inp(x))
        if flip:
            yb, ya = self.b(h), self.a(h)
        else:
            ya, yb = self.a(h), self.b(h)
        return self.head(torch.tanh(ya) * torch.sigmoid(yb))


def rank0(value):
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values[0]


def recording_hook(module, log):
    """DDP's allreduce_hook, recording at each call (= launch) the bucket's parameter names."""
    names = {p.data_ptr(): n for n, p in module.named_parameters()}

    def hook(state, bucket):
        log.append((bucket.index(), [names[p.data_ptr()] for p in bucket.parameters()]))
        return default_hooks.allreduce_hook(state, bucket)
    return hook


def check_first_bucket_persists(rank, world):
    """A 16 MiB first bucket holds all 1.05 MB: one all-reduce per step (profiler count) after
    the automatic rebuild, after forced rebuilds, and after a runtime change to 2 MiB."""
    model = fused(build(Wide), first_bucket_mb=16)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(rank))
    out = {"steps": []}

    def record(label):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            model.zero_grad(set_to_none=True)
            model(x).sum().backward()
        out["steps"].append({
            "label": label, "first": model.first_bucket_bytes,
            "stats_first": model.stats()["first_bucket_bytes"],
            "buckets": len(model.bucket_sizes()),
            "allreduces": sum(1 for e in prof.events() if e.name in ALLREDUCE_EVENTS)})

    record("initial")
    record("after the automatic rebuild")
    model.rebuild_buckets()
    record("after rebuild_buckets()")
    model.first_bucket_bytes = 2 << 20
    record("after first_bucket_bytes = 2 MiB")
    model.rebuild_buckets()
    record("after another rebuild_buckets()")
    out["rebuilds"] = model.stats()["rebuilds"]
    return out


def check_slot_layout(rank, world):
    """gradient_as_bucket_view: every param.grad is a view of its bucket slot, starts on a
    16-byte boundary and has the parameter's strides (channels_last kept)."""
    out = {}
    for channels_last in (False, True):
        torch.manual_seed(0)
        module = OddConvNet()
        if channels_last:
            module = module.to(memory_format=torch.channels_last)
        model = fused(module, gradient_as_bucket_view=True, first_bucket_mb=1e-4,
                      bucket_cap_mb=2e-4)
        r = {"misaligned": [], "strides_changed": [], "buckets": len(model.bucket_sizes())}
        for i in range(2):
            x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(10 * rank + i))
            if channels_last:
                x = x.to(memory_format=torch.channels_last)
            model.zero_grad(set_to_none=True)
            model(x).square().sum().backward()
            for name, p in module.named_parameters():
                if p.grad.data_ptr() % 16:
                    r["misaligned"].append(f"step {i}: {name}")
                if p.grad.stride() != p.stride():
                    r["strides_changed"].append(f"step {i}: {name} {p.grad.stride()} vs {p.stride()}")
        out[f"channels_last={channels_last}"] = r
    return out


def check_rebuilt_layout_vs_ddp(rank, world):
    """After DDP's rebuild (first step), DDP(bucket_cap_mb=L) buckets with limits (L, L) in the
    ready order; FusedReducer(first_bucket_mb=L, bucket_cap_mb=L) must make the same buckets.
    DDP's buckets are read from a recording comm hook."""
    limit = 700 / MiB
    out = {}
    for cls in (Ladder, Mixed):
        log = []
        models = {"ddp": DDP(build(cls), bucket_cap_mb=limit),
                  "fr": fused_with_its_defaults(build(cls), first_bucket_mb=limit, bucket_cap_mb=limit)}
        models["ddp"].register_comm_hook(None, recording_hook(models["ddp"].module, log))
        opts = {k: sgd(m) for k, m in models.items()}
        diffs = []
        for i in range(3):
            del log[:]
            for kind, m in models.items():
                step(m, opts[kind], rank, i)
            diffs.append(max_diff(grads(models["ddp"]), grads(models["fr"])))
        out[cls.__name__] = {"ddp": [names for _, names in sorted(log)],
                             "fr": models["fr"].bucket_parameter_names(), "grads": diffs,
                             "params": max_diff(params(models["ddp"]), params(models["fr"]))}
    return out


def check_layout_is_what_moves(rank, world):
    """bucket_parameter_names() and bucket_sizes() against what each step launched (a recording
    comm hook wrapping DDP's allreduce_hook: called at each launch, in launch order) and what gloo
    moved (profiler: bytes and dtype of every all-reduce)."""
    limit = 700 / MiB
    m = fused_with_its_defaults(build(Mixed), first_bucket_mb=limit, bucket_cap_mb=limit)
    module = m.module
    launches = []
    m.register_comm_hook(None, recording_hook(module, launches))
    size_of = {n: p.numel() * p.element_size() for n, p in module.named_parameters()}
    dtype_of = {n: GLOO_DTYPE[p.dtype] for n, p in module.named_parameters()}
    opt = sgd(m)
    step(m, opt, rank, 0)

    def profiled(i):
        del launches[:]
        count, moved = collectives(lambda: step(m, opt, rank, i))
        layout = m.bucket_parameter_names()
        return {"launched": [names for _, names in launches],
                "indices": [index for index, _ in launches],
                "layout": layout, "sizes": m.bucket_sizes(), "count": count, "moved": moved,
                "expected_sizes": [sum(size_of[n] for n in b) for b in layout],
                "expected_moved": sorted((sum(size_of[n] for n in b), dtype_of[b[0]])
                                         for b in layout)}
    out = {"steps": [profiled(1), profiled(2)]}
    m.first_bucket_bytes = 3000
    m.bucket_cap_bytes = 5000
    out["right_after_set"] = (m.bucket_parameter_names(), m.bucket_sizes())
    out["steps"].append(profiled(3))
    return out


def check_rebuild_from_last_observed_order(rank, world):
    """Rebuilds (automatic, rebuild_buckets(), a limit set) use the gradient order observed in
    the last step (plain PyTorch hooks, rank 0's), at the next forward, and nothing else does."""
    first, cap = 300, 300
    m = fused_with_its_defaults(build(Flip), first_bucket_mb=first / MiB, bucket_cap_mb=cap / MiB)
    module = m.module
    order, handles = observe_ready_order(module)
    opt = sgd(m)
    n = len(list(module.parameters()))
    out = {"initial": m.bucket_parameter_names(),
           "initial_expected": expected_layout(module, list(range(n - 1, -1, -1)), first, cap),
           "steps": []}

    def run(i, flip):
        del order[:]
        state = {k: v.clone() for k, v in module.state_dict().items()}
        x, y = data(rank, i)
        opt.zero_grad(set_to_none=True)
        output = m(x, flip=flip)  # a rebuild happens in this forward, if any
        layout = m.bucket_parameter_names()
        loss_of(output, y, rank).backward()
        ref = local_average_grads(state, Flip, rank, i, flip=flip)
        opt.step()
        observed = rank0(list(order))
        out["steps"].append({"layout": layout, "order": observed,
                             "limits": (m.first_bucket_bytes, m.bucket_cap_bytes,
                                        m.stats()["first_bucket_bytes"],
                                        m.stats()["bucket_cap_bytes"]),
                             "vs_reference": max_diff(ref, grads(m))})
        return layout, observed

    _, order_a = run(0, False)
    layout1, _ = run(1, True)  # automatic rebuild after the first step: from order_a
    out["after_first_step_expected"] = expected_layout(module, order_a, first, cap)
    layout2, order_b = run(2, True)
    out["order_changed"] = (order_a, order_b)
    out["no_rebuild_unasked"] = (layout1, layout2)
    m.rebuild_buckets()
    out["pending_after_rebuild_buckets"] = m.bucket_parameter_names()
    layout3, order_a2 = run(3, False)
    out["rebuild_buckets"] = (layout3, expected_layout(module, order_b, first, cap))
    m.first_bucket_bytes = 600
    m.bucket_cap_bytes = 100
    out["pending_after_set"] = m.bucket_parameter_names()
    layout4, order_b2 = run(4, True)
    out["limits_set"] = (layout4, expected_layout(module, order_a2, 600, 100))
    m.rebuild_buckets()
    layout5, _ = run(5, False)
    out["limits_kept"] = (layout5, expected_layout(module, order_b2, 600, 100))
    for h in handles:
        h.remove()
    return out


def check_limit_before_first_step(rank, world):
    """A limit set right after construction, before any step: the README says the layout is
    rebuilt at the next forward (there is no observed order yet: the initial one)."""
    m = fused_with_its_defaults(build(Flip))  # default limits: one bucket
    module = m.module
    n = len(list(module.parameters()))
    m.first_bucket_bytes = 300
    m.bucket_cap_bytes = 300
    opt = sgd(m)
    count, _ = collectives(lambda: step(m, opt, rank, 0))
    return {"allreduces": count, "in_force": m.stats()["first_bucket_bytes"],
            "layout": m.bucket_parameter_names(),
            "expected": expected_layout(module, list(range(n - 1, -1, -1)), 300, 300)}


def check_slot_strides(rank, world):
    """channels_last convolutions, with and without gradient_as_bucket_view: param.grad has
    DDP's strides (with the view: the bucket slot's own), the values are DDP's."""
    out = {}
    for view in (False, True):
        models = {}
        for kind in ("ddp", "fr"):
            module = build(ConvNet).to(memory_format=torch.channels_last)
            models[kind] = (DDP(module, gradient_as_bucket_view=view) if kind == "ddp"
                            else fused_with_its_defaults(module, gradient_as_bucket_view=view,
                                       first_bucket_mb=1000 / MiB, bucket_cap_mb=1000 / MiB))
        opts = {k: sgd(m) for k, m in models.items()}
        for i in range(2):
            x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(10 * rank + i))
            for kind, m in models.items():
                opts[kind].zero_grad()
                m(x.to(memory_format=torch.channels_last)).square().mean().mul(1 + rank).backward()
                opts[kind].step()
        r = {kind: {n: (tuple(p.grad.stride()), tuple(p.stride()),
                        p.grad._base is not None)
                    for n, p in m.module.named_parameters()} for kind, m in models.items()}
        r["buckets"] = len(models["fr"].bucket_sizes())
        r["params"] = max_diff(params(models["ddp"]), params(models["fr"]))
        out[view] = r
    return out


CHECKS = SelectedChecks()
outcomes = CHECKS.fixture(timeout=240)  # the selected tests' checks, in one spawn


@CHECKS.uses(check_first_bucket_persists)
def test_first_bucket_limit_survives_every_rebuild(outcomes):
    for r in results(outcomes, check_first_bucket_persists):
        first = [s for s in r["steps"] if "2 MiB" not in s["label"] and "another" not in s["label"]]
        later = [s for s in r["steps"] if s not in first]
        for s in first:
            assert (s["first"], s["stats_first"]) == (16 << 20, 16 << 20), s
            assert s["buckets"] == 1 and s["allreduces"] == 1, s
        for s in later:
            assert (s["first"], s["stats_first"]) == (2 << 20, 2 << 20), s
            assert s["buckets"] == 1 and s["allreduces"] == 1, s
        assert r["rebuilds"] == 4, r


def test_set_default_first_bucket_bytes_wins_over_the_environment(monkeypatch):
    """No spawn: the process-wide default is plain Python."""
    import fused_reducer
    from fused_reducer import settings
    monkeypatch.setattr(settings, "_default_first_bucket_bytes", None)
    monkeypatch.setenv(settings.ENV_FIRST_BUCKET_BYTES, str(3 << 20))
    assert fused_reducer.get_default_first_bucket_bytes() == 3 << 20
    fused_reducer.set_default_first_bucket_bytes(2 << 20)
    assert fused_reducer.get_default_first_bucket_bytes() == 2 << 20
    monkeypatch.setenv(settings.ENV_FIRST_BUCKET_BYTES, str(5 << 20))  # changed later
    assert fused_reducer.get_default_first_bucket_bytes() == 2 << 20
    monkeypatch.delenv(settings.ENV_FIRST_BUCKET_BYTES)
    assert fused_reducer.get_default_first_bucket_bytes() == 2 << 20


@CHECKS.uses(check_slot_layout)
def test_bucket_view_grads_are_16_byte_aligned_and_keep_the_parameters_strides(outcomes):
    for r in results(outcomes, check_slot_layout):
        for label, s in r.items():
            assert s["buckets"] > 1, s  # several slots per bucket, several buckets
            assert s["misaligned"] == [], f"{label}: {s['misaligned']}"
            assert s["strides_changed"] == [], f"{label}: {s['strides_changed']}"


@CHECKS.uses(check_rebuilt_layout_vs_ddp)
def test_rebuilt_layout_is_ddps_for_one_and_for_mixed_dtypes(outcomes):
    for r in results(outcomes, check_rebuilt_layout_vs_ddp):
        one, mixed = r["Ladder"], r["Mixed"]
        assert len(one["ddp"]) >= 4 and any(len(b) > 1 for b in one["ddp"]), one["ddp"]
        assert one["fr"] == one["ddp"], "one dtype: same buckets, same launch order"
        # Mixed dtypes: the same buckets (each one dtype); DDP orders them by when they closed.
        assert sorted(mixed["fr"]) == sorted(mixed["ddp"]), (mixed["fr"], mixed["ddp"])
        for s in (one, mixed):
            assert_small(s["grads"], "grads vs DDP", 1e-5)
            assert_small([s["params"]], "params vs DDP", 1e-5)


@CHECKS.uses(check_layout_is_what_moves)
def test_bucket_sizes_and_names_are_what_moves_in_launch_order(outcomes):
    for r in results(outcomes, check_layout_is_what_moves):
        s1, s2, s3 = r["steps"]
        for s in r["steps"]:
            assert len(s["layout"]) >= 3, s
            assert s["launched"] == s["layout"], "launch order is not bucket_parameter_names()"
            assert s["indices"] == list(range(len(s["layout"]))), s["indices"]
            assert s["sizes"] == s["expected_sizes"], s
            assert s["count"] == len(s["layout"]) and s["moved"] == s["expected_moved"], s
        assert s1["layout"] == s2["layout"]
        # Set, not yet in force: the layout of the last step until the next forward.
        assert r["right_after_set"] == (s2["layout"], s2["sizes"])
        assert s3["layout"] != s2["layout"], "the new limits changed nothing"


@CHECKS.uses(check_rebuild_from_last_observed_order)
def test_limits_and_rebuild_buckets_rebuild_from_the_last_observed_order_and_persist(outcomes):
    for r in results(outcomes, check_rebuild_from_last_observed_order):
        order_a, order_b = r["order_changed"]
        assert order_a != order_b, "precondition: flip must change the gradient order"
        assert r["initial"] == r["initial_expected"]
        layout1, layout2 = r["no_rebuild_unasked"]
        assert layout1 == r["after_first_step_expected"], "rebuild after the first step"
        assert layout2 == layout1, "rebuilt although nothing asked for it"
        assert r["pending_after_rebuild_buckets"] == layout2, "rebuilt before the next forward"
        got, expected = r["rebuild_buckets"]
        assert expected != layout2, "precondition: the new order must change the layout"
        assert got == expected, "rebuild_buckets(): not from the last observed order"
        assert r["pending_after_set"] == got
        assert r["limits_set"][1] != expected, "precondition: the limits must change the layout"
        got, expected = r["limits_set"]
        assert got == expected, "setting the limits: not from the last observed order"
        got, expected = r["limits_kept"]
        assert got == expected, "a later rebuild did not keep the limits"
        assert r["steps"][-1]["limits"] == (600, 100, 600, 100), r["steps"][-1]
        assert_small([s["vs_reference"] for s in r["steps"]], "grads vs float64 average")


@CHECKS.uses(check_limit_before_first_step)
def test_a_limit_set_before_the_first_step_applies_at_the_next_forward(outcomes):
    for r in results(outcomes, check_limit_before_first_step):
        assert r["in_force"] == 300, f"limit in force after the next forward: {r['in_force']}"
        assert r["layout"] == r["expected"]
        assert r["allreduces"] == len(r["expected"]), r


@CHECKS.uses(check_slot_strides)
def test_bucket_slots_keep_the_parameters_strides_like_ddps(outcomes):
    for r in results(outcomes, check_slot_strides):
        for view, s in r.items():
            assert s["buckets"] > 1, s
            conv = s["ddp"]["conv1.weight"]
            assert conv[0] == conv[1] != (27, 9, 3, 1), f"DDP side changed: {conv}"
            assert s["fr"] == s["ddp"], f"gradient_as_bucket_view={view}: strides (grad, " \
                f"param, is a view) differ from DDP's: {s['fr']} vs {s['ddp']}"
            assert_small([s["params"]], f"gradient_as_bucket_view={view}: params vs DDP", 1e-5)
