"""Behaviours a mutation probe showed the rest of the suite checking slowly, indirectly or not at
all (scripts/mutations.py names, per mutation, the test here that must fail; docs/TESTING.md).

Each test compares with what a user would see under DDP, or with an independent expectation (a
float64 average of locally computed gradients, the profiler's count of collectives, a held
reference to a tensor), never with FusedReducer's own bookkeeping alone. Every assertion is on a
value or a behaviour; none relies on a harness timeout to notice a bug.

Speed: the checks of the tests selected in this session (all of them in a full run, one or two
under scripts/mutants.py) run in one spawn of 2 gloo ranks, made by the module fixture.
"""
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile

from dist_utils import ALLREDUCE_EVENTS, SelectedChecks, assert_small, observe_ready_order, results
from test_dropin_common import (
    BNNet, ExtraNet, HIDDEN, Net, build, data, grads, loss_of, max_diff, outcome, params, sgd,
    same_on_all_ranks, side_group)



def fused(module, **kwargs):
    from fused_reducer import FusedReducer
    kwargs.setdefault("first_bucket_mb", 1)
    return FusedReducer(module, **kwargs)


def reference_grads(model_state, module_factory, inputs, rank, **fwd):
    """The average over ranks of locally computed gradients, in float64 with plain all_reduce
    (None where no rank produced a gradient)."""
    ref = module_factory()
    ref.load_state_dict(model_state)
    x, y = inputs
    loss_of(ref(x, **fwd), y, rank).backward()
    out = {}
    for name, p in ref.named_parameters():
        g = torch.zeros_like(p, dtype=torch.float64) if p.grad is None else p.grad.double()
        used = torch.tensor([0.0 if p.grad is None else 1.0], dtype=torch.float64)
        dist.all_reduce(g)
        dist.all_reduce(used)
        out[name] = None if used.item() == 0 else (g / dist.get_world_size()).to(p.dtype)
    return out


# -- models ---------------------------------------------------------------------------------------

class SwappedBranches(nn.Module):
    """Two bias-free branches of the same size computed in a rank-dependent order: autograd makes
    their gradients ready in a different order on each rank, and with one parameter per bucket
    their two buckets have the same size (a swap cannot show up as a size mismatch)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.a = nn.Linear(8, 8, bias=False)
        self.b = nn.Linear(8, 8, bias=False)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        if dist.get_rank() % 2 == 0:
            ya, yb = self.a(h), self.b(h)
        else:
            yb, ya = self.b(h), self.a(h)
        return self.head(torch.tanh(ya) * torch.sigmoid(yb))


class Wide(nn.Module):
    """4 x Linear(256, 256): 1,052,672 bytes of float32 gradients, just over 1 MiB."""

    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])

    def forward(self, x):
        return self.layers(x)


class _NoGradFor(torch.autograd.Function):
    """y = x + 0 * w.sum(): backward gives x its gradient and w an undefined one, so w's
    gradient hook fires with nothing in it (w is used by no rank)."""

    @staticmethod
    def forward(ctx, x, w):
        return x + 0 * w.sum()

    @staticmethod
    def backward(ctx, g):
        return g, None


class _SlowBackward(torch.autograd.Function):
    """Identity whose backward sleeps: the buckets launched before it have completed by the time
    the gradients after it become ready."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        time.sleep(0.3)
        return g


class GateNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, HIDDEN)
        self.mid = nn.Linear(HIDDEN, HIDDEN)
        self.gate = nn.Parameter(torch.ones(HIDDEN))
        self.out = nn.Linear(HIDDEN, 4)

    def forward(self, x):
        h = _SlowBackward.apply(torch.tanh(self.inp(x)))
        h = _NoGradFor.apply(torch.tanh(self.mid(h)), self.gate)
        return self.out(h)


class ScaledNet(Net):
    """A buffer multiplied into the activations: autograd saves it for backward."""

    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.linspace(0.5, 1.5, HIDDEN))

    def forward(self, x):
        h = torch.tanh(self.fc1(x)) * self.scale
        return self.out(torch.tanh(self.fc2(h)))


class Sometimes(nn.Module):
    """`sometimes` takes part only on rank step % world_size."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, HIDDEN)
        self.sometimes = nn.Linear(HIDDEN, HIDDEN)
        self.b = nn.Linear(HIDDEN, 4)

    def forward(self, x, use=False):
        h = torch.tanh(self.a(x))
        if use:
            h = torch.tanh(self.sometimes(h))
        return self.b(h)


# -- checks (one per test, run on every rank) -----------------------------------------------------

def check_launch_order(rank, world):
    """Buckets launch strictly in layout order on every rank, whatever order they complete in."""
    model = fused(build(SwappedBranches), first_bucket_mb=1e-6, bucket_cap_mb=1e-6,
                  process_group=side_group(20), timeout=timedelta(seconds=20))
    opt = sgd(model)
    out = {"vs_reference": [], "buckets": len(model.bucket_sizes())}
    for i in range(3):
        opt.zero_grad(set_to_none=True)
        x, y = data(rank, i)
        state = {k: v.clone() for k, v in model.module.state_dict().items()}
        loss_of(model(x), y, rank).backward()
        expected = reference_grads(state, SwappedBranches, (x, y), rank)
        out["vs_reference"].append(max_diff(expected, grads(model)))
        opt.step()
    return out


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


def check_no_sync_usage(rank, world):
    """`extra` is used only in the no_sync micro-step: its accumulated gradient is averaged at
    the synchronised step (DDP's local_used_map persists across no_sync)."""
    models = {"ddp": DDP(build(ExtraNet), find_unused_parameters=True),
              "fr": fused(build(ExtraNet), find_unused_parameters=True)}
    opts = {k: sgd(m) for k, m in models.items()}
    out = {"grads": [], "extra_synced": [], "params": []}
    for i in range(3):
        for kind, m in models.items():
            opts[kind].zero_grad()
            with m.no_sync():
                x, y = data(rank, i, 0)
                loss_of(m(x, use_extra=True), y, rank).backward()
            x, y = data(rank, i, 1)
            loss_of(m(x, use_extra=False), y, rank).backward()
        out["grads"].append(max_diff(grads(models["ddp"].module), grads(models["fr"].module)))
        out["extra_synced"].append(same_on_all_ranks([models["fr"].module.extra.weight.grad]))
        for opt in opts.values():
            opt.step()
        out["params"].append(max_diff(params(models["ddp"].module), params(models["fr"].module)))
    return out


def check_inner_module_backward(rank, world):
    """After training, a backward through model.module (no FusedReducer forward armed it) gives
    the local gradients, as under DDP, and the next normal step is averaged again."""
    model = fused(build(Net), process_group=side_group(20), timeout=timedelta(seconds=20))
    opt = sgd(model)
    for i in range(2):
        opt.zero_grad()
        x, y = data(rank, i)
        loss_of(model(x), y, rank).backward()
        opt.step()
    opt.zero_grad(set_to_none=True)
    x, y = data(rank, 10)
    local = build(Net)
    local.load_state_dict(model.module.state_dict())
    loss_of(local(x), y, rank).backward()

    def inner_backward():
        loss_of(model.module(x), y, rank).backward()
    res = outcome(inner_backward)
    out = {"outcome": res[:3]}
    if res[0] == "ok":
        out["vs_local"] = max_diff(grads(local), grads(model.module))
    opt.zero_grad(set_to_none=True)
    x, y = data(rank, 11)
    state = {k: v.clone() for k, v in model.module.state_dict().items()}
    res = outcome(lambda: loss_of(model(x), y, rank).backward())
    out["next_step"] = res[:3]
    if res[0] == "ok":
        out["next_vs_reference"] = max_diff(reference_grads(state, Net, (x, y), rank),
                                            grads(model.module))
    return out


def check_copy_at_hook(rank, world):
    """A user hook on fc1.weight (ready last) changes out.weight.grad (ready first, same bucket)
    in place. DDP copied out.weight's gradient into its bucket at its own hook, so the change
    does not reach the average; FusedReducer must do the same."""
    models = {"ddp": DDP(build(Net)), "fr": fused(build(Net))}
    opts = {k: sgd(m) for k, m in models.items()}
    for m in models.values():
        module = m.module

        def tamper(p, module=module):
            module.out.weight.grad.add_(1000.0)
        module.fc1.weight.register_post_accumulate_grad_hook(tamper)
    out = {"grads": [], "params": []}
    for i in range(2):
        for kind, m in models.items():
            opts[kind].zero_grad(set_to_none=True)
            x, y = data(rank, i)
            loss_of(m(x), y, rank).backward()
        out["grads"].append(max_diff(grads(models["ddp"].module), grads(models["fr"].module)))
        for opt in opts.values():
            opt.step()
        out["params"].append(max_diff(params(models["ddp"].module), params(models["fr"].module)))
    return out


def check_unused_grad_none_early_bucket(rank, world):
    """find_unused_parameters: `gate`'s hook fires with an undefined gradient on every rank, so
    no rank used it and DDP leaves gate.grad None. Its bucket completes early in backward (one
    parameter per bucket, a slow op after it): unpacking it before the used map is known would
    give gate a zero gradient."""
    kwargs = dict(find_unused_parameters=True, bucket_cap_mb=1e-6)
    models = {"ddp": DDP(build(GateNet), **kwargs),
              "fr": fused(build(GateNet), first_bucket_mb=1e-6, **kwargs)}
    opts = {k: sgd(m) for k, m in models.items()}
    out = {"gate_grad": {"ddp": [], "fr": []}, "grads": [], "params": []}
    for i in range(3):
        for kind, m in models.items():
            opts[kind].zero_grad(set_to_none=True)
            x, y = data(rank, i)
            loss_of(m(x), y, rank).backward()
            g = m.module.gate.grad
            out["gate_grad"][kind].append(None if g is None else float(g.abs().sum()))
        out["grads"].append(max_diff(grads(models["ddp"].module), grads(models["fr"].module)))
        for opt in opts.values():
            opt.step()
        out["params"].append(max_diff(params(models["ddp"].module), params(models["fr"].module)))
    return out


def check_private_grads(rank, world):
    """gradient_as_bucket_view=False: every param.grad FusedReducer creates is the user's own
    tensor. Held across the next step it keeps its value (under a bucket view the next
    collective would overwrite it), and no two gradients share storage."""
    model = fused(build(Sometimes), find_unused_parameters=True)
    opt = sgd(model)
    held, held_values, out = {}, {}, {"changed": [], "shared": [], "vs_reference": []}
    for i in range(3):
        opt.zero_grad(set_to_none=True)
        x, y = data(rank, i)
        use = rank == i % world
        state = {k: v.clone() for k, v in model.module.state_dict().items()}
        loss_of(model(x, use=use), y, rank).backward()
        out["vs_reference"].append(max_diff(reference_grads(state, Sometimes, (x, y), rank,
                                                            use=use), grads(model.module)))
        for name, p in model.module.named_parameters():
            if p.grad is not None:
                held.setdefault(i, {})[name] = p.grad
                held_values.setdefault(i, {})[name] = p.grad.clone()
        storages = [p.grad.untyped_storage().data_ptr() for p in model.module.parameters()
                    if p.grad is not None]
        out["shared"].append(len(storages) - len(set(storages)))
        opt.step()
    for i, tensors in held.items():
        for name, t in tensors.items():
            if not torch.equal(t, held_values[i][name]):
                out["changed"].append(f"step {i}: {name}")
    return out


def check_stalled_peer_timeout(rank, world):
    """rank 1 is alive but sleeps 12 s before backward; with timeout=3 s rank 0 raises within
    seconds, naming the bucket: on the shared-memory transport (its own waits) and on the
    process group (the reducer's wait on the group's work)."""
    return {backend: _stalled_peer(rank, backend) for backend in ("shm", "process_group")}


def _stalled_peer(rank, backend):
    group = side_group(60)
    model = fused(build(Net), process_group=group, timeout=timedelta(seconds=3), backend=backend)
    opt = sgd(model)
    for i in range(2):
        opt.zero_grad()
        x, y = data(rank, i)
        loss_of(model(x), y, rank).backward()
        opt.step()
    opt.zero_grad()
    x, y = data(rank, 2)
    loss = loss_of(model(x), y, rank)
    if rank == 1:
        time.sleep(12)
    start = time.monotonic()
    res = outcome(loss.backward)
    seconds = time.monotonic() - start
    outcome(model.close)  # the failed collective may be reported again: not this check's concern
    return {"outcome": res[:3], "seconds": seconds}


def check_buffer_rules(rank, world):
    """BatchNorm running stats, per rank, equal DDP's: (a) broadcast_buffers=False never
    broadcasts; (b) broadcast_buffers=True with a gradient-accumulation window: the forward
    after a no_sync forward does not broadcast."""
    out = {}
    for label, kwargs, micro in (("broadcast_buffers=False", dict(broadcast_buffers=False), 1),
                                 ("no_sync window", dict(), 3)):
        models = {"ddp": DDP(build(BNNet), **kwargs), "fr": fused(build(BNNet), **kwargs)}
        opts = {k: sgd(m) for k, m in models.items()}
        diffs = []
        for i in range(3):
            for kind, m in models.items():
                opts[kind].zero_grad()
                for j in range(micro - 1):
                    with m.no_sync():
                        x, y = data(rank, i, j)
                        loss_of(m(x), y, rank).backward()
                x, y = data(rank, i, micro - 1)
                loss_of(m(x), y, rank).backward()
                opts[kind].step()
            diffs.append(max_diff({n: b.double() for n, b in models["ddp"].module.named_buffers()},
                                  {n: b.double() for n, b in models["fr"].module.named_buffers()}))
        out[label] = {"buffers": diffs,
                      "params": max_diff(params(models["ddp"].module), params(models["fr"].module)),
                      "ddp_ranks_differ": same_on_all_ranks(list(models["ddp"].module.buffers())[:2]),
                      "fr_ranks_differ": same_on_all_ranks(list(models["fr"].module.buffers())[:2])}
    return out


def check_no_sync_exception(rank, world):
    """An exception inside `with model.no_sync():` must not leave synchronisation off."""
    models = {"ddp": DDP(build(Net)), "fr": fused(build(Net), process_group=side_group(20),
                                                    timeout=timedelta(seconds=20))}
    for m in models.values():
        try:
            with m.no_sync():
                x, y = data(rank, 0)
                loss_of(m(x), y, rank).backward()
                raise KeyError("user error inside no_sync")
        except KeyError:
            pass
    opts = {k: sgd(m) for k, m in models.items()}
    for kind, m in models.items():
        opts[kind].zero_grad()
        x, y = data(rank, 1)
        loss_of(m(x), y, rank).backward()
    return {"grads": max_diff(grads(models["ddp"].module), grads(models["fr"].module)),
            "fr_synced": same_on_all_ranks([p.grad for p in models["fr"].module.parameters()])}


def check_two_forwards_saved_buffer(rank, world):
    """Two forwards, then one backward of their summed loss, with a buffer that autograd saved
    in the first forward: the buffer broadcast before the second forward must not bump its
    version counter (DDP's does not); the gradients equal DDP's."""
    models = {"ddp": DDP(build(ScaledNet)), "fr": fused(build(ScaledNet))}
    opts = {k: sgd(m) for k, m in models.items()}
    out = {}
    for kind, m in models.items():
        def two_forwards(m=m, kind=kind):
            for i in range(2):
                opts[kind].zero_grad()
                x1, y1 = data(rank, i, 0)
                x2, y2 = data(rank, i, 1)
                first = loss_of(m(x1), y1, rank)
                (first + loss_of(m(x2), y2, rank)).backward()
                opts[kind].step()
        out[kind] = outcome(two_forwards)[:3]
    out["params"] = max_diff(params(models["ddp"].module), params(models["fr"].module))
    return out


def check_pickled_copies(rank, world):
    """torch.save / pickle / deepcopy of a trained FusedReducer: the copy loads with equal
    parameters and trains like a copy of DDP, its parameters equal on every rank."""
    import copy
    import io
    import pickle

    def roundtrip(model, how):
        if how == "torch.save":
            buf = io.BytesIO()
            torch.save(model, buf)
            buf.seek(0)
            return torch.load(buf, weights_only=False)
        if how == "pickle":
            return pickle.loads(pickle.dumps(model))
        return copy.deepcopy(model)

    originals = {"ddp": DDP(build(Net)), "fr": fused(build(Net))}
    for kind, m in originals.items():
        opt = sgd(m)
        opt.zero_grad()
        x, y = data(rank, 0)
        loss_of(m(x), y, rank).backward()
        opt.step()
    out = {}
    for how in ("torch.save", "pickle", "deepcopy"):
        res = outcome(lambda: roundtrip(originals["fr"], how))
        if res[0] != "ok":
            out[how] = {"outcome": res[:3]}
            continue
        copies = {"ddp": roundtrip(originals["ddp"], how), "fr": res[1]}
        r = {"outcome": ("ok",), "type": type(copies["fr"]).__name__,
             "equal_at_load": max_diff(params(originals["fr"].module), params(copies["fr"].module))}

        def train_copies():
            for kind, m in copies.items():
                opt = sgd(m)
                for i in (1, 2):
                    opt.zero_grad()
                    x, y = data(rank, i)
                    loss_of(m(x), y, rank).backward()
                    opt.step()
        res = outcome(train_copies)
        r["train"] = res[:3]
        if res[0] == "ok":
            r["diff"] = max_diff(params(copies["ddp"].module), params(copies["fr"].module))
            r["synced"] = same_on_all_ranks(list(copies["fr"].module.parameters()))
        out[how] = r
    return out


def check_close(rank, world):
    """close() twice raises nothing; a forward after close() raises naming close()."""
    model = fused(build(Net))
    x, y = data(rank, 0)
    loss_of(model(x), y, rank).backward()
    out = {"first_close": outcome(model.close)[:3], "second_close": outcome(model.close)[:3]}
    out["forward_after_close"] = outcome(lambda: model(x))[:3]
    return out


def check_trace_steps(rank, world):
    model = fused(build(Net))
    opt = sgd(model)

    def steps(n, start):
        for i in range(start, start + n):
            opt.zero_grad()
            x, y = data(rank, i)
            loss_of(model(x), y, rank).backward()
            opt.step()
    steps(5, 0)
    out = {"before": len(model.step_history())}
    model.trace_steps = 2
    out["right_after"] = len(model.step_history())
    steps(3, 5)
    out["after_more_steps"] = len(model.step_history())
    out["last_steps"] = [s["step"] for s in model.step_history()]
    return out


def check_autotune_agreement(rank, world):
    """autotune() with explicit candidates: the plan (trials, predictions) and every trial's step
    times are rank 0's / the slowest rank's, identical on every rank, and so is the choice."""
    model = fused(build(Net, d_in=8, hidden=64), first_bucket_mb=1e-3, bucket_cap_mb=1e-3)
    opt = sgd(model)
    candidates = [(4096, 4096, 0), (1 << 20, 1 << 20, 0), (1024, 8192, 1024)]
    steps = 0

    def one():
        nonlocal steps
        opt.zero_grad()
        x, y = data(rank, steps, d_in=8)
        if rank == 1:
            time.sleep(0.002 * (steps % 3))  # step times that differ by rank
        loss_of(model(x), y, rank).backward()
        opt.step()
        steps += 1
    for _ in range(2):
        one()
    model.autotune(candidates=candidates, round_steps=(2, 2))
    while not model.autotune_report()["done"]:
        one()
        assert steps < 80, "autotune did not finish"
    report = model.autotune_report()
    return {"trials": [(t["first_bucket_bytes"], t["bucket_cap_bytes"], t["last_bucket_bytes"],
                        t["predicted_ms"], t["samples_ms"]) for t in report["trials"]],
            "choice": report["choice"],
            "limits": (model.first_bucket_bytes, model.bucket_cap_bytes, model.last_bucket_bytes)}


def check_layout_agreement(rank, world):
    """The rebuilt layout is computed from rank 0's observed order and rank 0's limits on every
    rank: compared (gathered, before any bucket collective of the new layout runs) with an
    independent statement of the rule applied to rank 0's order as seen by plain PyTorch hooks.
    A backward runs only when the ranks agree, so a wrong layout fails here, not in gloo."""
    from test_bucket_assignment import reference_assign
    model = fused(build(SwappedBranches), first_bucket_mb=1e-6, bucket_cap_mb=1e-6)
    module = model.module
    names = [n for n, _ in module.named_parameters()]
    sizes = [p.numel() * p.element_size() for p in module.parameters()]
    order, handles = observe_ready_order(module)
    x, y = data(rank, 0)
    loss_of(model(x), y, rank).backward()
    for h in handles:
        h.remove()
    orders = [None] * world
    dist.all_gather_object(orders, list(order))
    out = {"orders_differ": orders[0] != orders[1], "phases": []}

    def phase(label, first, cap, limits):
        x, y = data(rank, len(out["phases"]) + 1)
        state = {k: v.clone() for k, v in module.state_dict().items()}
        output = model(x)  # the rebuild happens in this forward
        layout = model.bucket_parameter_names()
        layouts = [None] * world
        dist.all_gather_object(layouts, layout)
        expected = [[names[i] for i in b] for b in reference_assign(sizes, [0] * len(sizes),
                                                                     orders[0], first, cap)]
        record = {"label": label, "layout": layout, "expected": expected,
                  "same_on_all_ranks": all(lay == layouts[0] for lay in layouts),
                  "limits": limits()}
        out["phases"].append(record)
        if record["same_on_all_ranks"]:
            model.zero_grad(set_to_none=True)
            loss_of(output, y, rank).backward()
            record["vs_reference"] = max_diff(reference_grads(state, SwappedBranches, (x, y), rank),
                                              grads(module))
        return record["same_on_all_ranks"]

    def limits():
        s = model.stats()
        return (model.first_bucket_bytes, model.bucket_cap_bytes,
                s["first_bucket_bytes"], s["bucket_cap_bytes"])
    if not phase("rebuild after the first step", 1, 1, limits):
        return out
    # Different limits on different ranks: rank 0's (300, 300) win at the rebuild.
    model.first_bucket_bytes = 300 + 300 * rank
    model.bucket_cap_bytes = 300 + 300 * rank
    phase("limits set differently per rank", 300, 300, limits)
    return out


def check_reduce_dtype_agreement(rank, world):
    """Ranks that set different reduce dtypes all reduce rank 0's from the rebuilding forward on:
    gathered right after that forward, before any bucket of the new layout is all-reduced (a
    disagreement would otherwise surface as a gloo abort, not as a value)."""
    model = fused(build(Net))
    x, y = data(rank, 0)
    loss_of(model(x), y, rank).backward()
    model.reduce_dtype = torch.bfloat16 if rank == 0 else torch.float16
    x, y = data(rank, 1)
    output = model(x)  # the rebuild happens in this forward
    seen = (str(model.reduce_dtype), model.stats()["reduce_dtype"], model.bucket_sizes())
    everyone = [None] * world
    dist.all_gather_object(everyone, seen)
    out = {"seen": everyone}
    if all(s == everyone[0] for s in everyone):
        loss_of(output, y, rank).backward()
        out["stepped"] = True
    return out


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


# -- the spawn: only the checks of the selected tests ---------------------------------------------

CHECKS = SelectedChecks()
uses = CHECKS.uses


@pytest.fixture(scope="module")
def outcomes(request):
    return CHECKS.run(request, 2, timeout=240)


# -- tests ------------------------------------------------------------------------------------------

@uses(check_launch_order)
def test_buckets_launch_in_layout_order_when_ranks_complete_them_differently(outcomes):
    for r in results(outcomes, check_launch_order):
        assert r["buckets"] >= 5, r  # one parameter per bucket
        assert_small(r["vs_reference"], "grads vs float64 average of local grads")


@uses(check_first_bucket_persists)
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


@uses(check_no_sync_usage)
def test_usage_inside_no_sync_counts_for_find_unused_parameters(outcomes):
    for r in results(outcomes, check_no_sync_usage):
        assert all(d == 0.0 for d in r["extra_synced"]), \
            f"'extra' gradient not averaged: differs across ranks by {r['extra_synced']}"
        assert_small(r["grads"], "grads vs DDP", 1e-5)
        assert_small(r["params"], "params vs DDP", 1e-5)


@uses(check_inner_module_backward)
def test_backward_of_the_inner_module_stays_local(outcomes):
    for r in results(outcomes, check_inner_module_backward):
        assert r["outcome"] == ("ok", None), r["outcome"]
        assert_small([r["vs_local"]], "grads vs this rank's local grads")
        assert r["next_step"][0] == "ok", r["next_step"]
        assert_small([r["next_vs_reference"]], "next step's grads vs float64 average")


@uses(check_copy_at_hook)
def test_gradient_is_copied_into_its_slot_at_its_own_hook_like_ddp(outcomes):
    for r in results(outcomes, check_copy_at_hook):
        assert_small(r["grads"], "grads vs DDP", 1e-5)
        assert_small(r["params"], "params vs DDP", 1e-5)


@uses(check_unused_grad_none_early_bucket)
def test_globally_unused_parameter_keeps_grad_none_when_its_bucket_finishes_early(outcomes):
    for r in results(outcomes, check_unused_grad_none_early_bucket):
        assert r["gate_grad"]["ddp"] == [None] * 3, "DDP side changed"
        assert r["gate_grad"]["fr"] == [None] * 3, r["gate_grad"]
        assert_small(r["grads"], "grads vs DDP", 1e-5)
        assert_small(r["params"], "params vs DDP", 1e-5)


@uses(check_private_grads)
def test_without_bucket_view_grads_are_private_copies(outcomes):
    for r in results(outcomes, check_private_grads):
        assert_small(r["vs_reference"], "grads vs float64 average")
        assert r["changed"] == [], f"held gradients changed by later steps: {r['changed']}"
        assert r["shared"] == [0, 0, 0], f"gradients sharing storage per step: {r['shared']}"


@uses(check_stalled_peer_timeout)
def test_timeout_bounds_the_wait_for_a_stalled_peer(outcomes):
    for backend, r0 in results(outcomes, check_stalled_peer_timeout)[0].items():
        assert r0["outcome"][0] == "raised", \
            f"{backend}: rank 0 waited {r0['seconds']:.1f}s for a peer 12 s late and did not " \
            f"raise (timeout 3 s)"
        assert r0["seconds"] < 9, \
            f"{backend}: rank 0 raised only after {r0['seconds']:.1f}s (timeout 3 s)"
        assert "bucket" in r0["outcome"][2].lower(), (backend, r0["outcome"])


@uses(check_buffer_rules)
def test_buffer_broadcast_rules_match_ddp(outcomes):
    for rank, r in enumerate(results(outcomes, check_buffer_rules)):
        for label, s in r.items():
            assert_small(s["buffers"], f"{label}: running stats vs DDP's on rank {rank}", 1e-5)
            assert_small([s["params"]], f"{label}: params vs DDP", 1e-5)
            if rank == 1:
                assert s["ddp_ranks_differ"] > 0, f"{label}: DDP side changed"
                assert s["fr_ranks_differ"] > 0, f"{label}: running stats were broadcast"


@uses(check_no_sync_exception)
def test_exception_inside_no_sync_leaves_sync_on(outcomes):
    for r in results(outcomes, check_no_sync_exception):
        assert r["fr_synced"] <= 1e-7, "the step after the exception was not averaged"
        assert_small([r["grads"]], "grads vs DDP", 1e-5)


@uses(check_two_forwards_saved_buffer)
def test_two_forwards_then_backward_with_a_buffer_saved_for_backward(outcomes):
    for r in results(outcomes, check_two_forwards_saved_buffer):
        assert r["ddp"] == ("ok", None), f"DDP side: {r['ddp']}"
        assert r["fr"] == ("ok", None), r["fr"]
        assert_small([r["params"]], "params vs DDP", 1e-5)


@uses(check_pickled_copies)
def test_pickled_and_deep_copied_models_train_like_ddp(outcomes):
    for r in results(outcomes, check_pickled_copies):
        for how, s in r.items():
            assert s["outcome"] == ("ok",), f"{how}: {s['outcome']}"
            assert s["type"] == "FusedReducer"
            assert s["equal_at_load"] == 0.0, how
            assert s["train"] == ("ok", None), f"{how}: training the copy: {s['train']}"
            assert_small([s["diff"]], f"{how}: params vs DDP's copy", 1e-5)
            assert s["synced"] == 0.0, f"{how}: the copy's parameters differ across ranks"


@uses(check_close)
def test_close_is_idempotent_and_final(outcomes):
    for r in results(outcomes, check_close):
        assert r["first_close"] == ("ok", None), r
        assert r["second_close"] == ("ok", None), r
        assert r["forward_after_close"][:2] == ("raised", "RuntimeError"), r
        assert "close" in r["forward_after_close"][2], r


@uses(check_trace_steps)
def test_trace_steps_bounds_the_step_history(outcomes):
    for r in results(outcomes, check_trace_steps):
        assert r["before"] == 5
        assert r["right_after"] == 2
        assert r["after_more_steps"] == 2
        assert r["last_steps"] == [7, 8]


@uses(check_autotune_agreement)
def test_autotune_plan_and_choice_are_rank0s(outcomes):
    a, b = results(outcomes, check_autotune_agreement)
    assert len(a["trials"]) >= 2
    assert a["trials"] == b["trials"], "ranks measured different plans or step times"
    assert a["choice"] == b["choice"]
    assert a["limits"] == b["limits"] == (a["choice"]["first_bucket_bytes"],
                                          a["choice"]["bucket_cap_bytes"],
                                          a["choice"]["last_bucket_bytes"])


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


@uses(check_layout_agreement)
def test_rebuilt_layout_is_rank0s_on_every_rank_before_any_bucket_moves(outcomes):
    for r in results(outcomes, check_layout_agreement):
        assert r["orders_differ"], "precondition: the ranks' ready orders must differ"
        for phase in r["phases"]:
            assert phase["layout"] == phase["expected"], phase
            assert phase["same_on_all_ranks"], f"{phase['label']}: layouts differ across ranks"
            assert_small([phase["vs_reference"]], f"{phase['label']}: grads vs float64 average")
        assert len(r["phases"]) == 2, r
        assert r["phases"][1]["limits"] == (300, 300, 300, 300), r["phases"][1]


@uses(check_reduce_dtype_agreement)
def test_reduce_dtype_in_force_is_rank0s_on_every_rank_before_any_bucket_moves(outcomes):
    for r in results(outcomes, check_reduce_dtype_agreement):
        for rank, (prop, in_force, sizes) in enumerate(r["seen"]):
            assert (prop, in_force) == ("torch.bfloat16", "torch.bfloat16"), (rank, r["seen"])
            assert sizes == r["seen"][0][2], f"bucket sizes differ across ranks: {r['seen']}"
        assert r.get("stepped"), r


@uses(check_slot_layout)
def test_bucket_view_grads_are_16_byte_aligned_and_keep_the_parameters_strides(outcomes):
    for r in results(outcomes, check_slot_layout):
        for label, s in r.items():
            assert s["buckets"] > 1, s  # several slots per bucket, several buckets
            assert s["misaligned"] == [], f"{label}: {s['misaligned']}"
            assert s["strides_changed"] == [], f"{label}: {s['strides_changed']}"


def test_a_joined_rank_shadows_each_bucket_then_the_unused_map():
    """No spawn: FusedReducer's join hook on a stand-in model. Per shadowed step a joined rank
    issues what a training rank's backward issues, in the same order (DDP's join hook: one
    all-reduce per bucket, then the unused-parameter map with find_unused_parameters)."""
    from fused_reducer import join as join_module
    from fused_reducer.core.attachment import Attachment

    class StandIn:  # the wrapper's attributes the attachment reads (weakly referenced)
        def __init__(self, **attributes):
            self.__dict__.update(attributes)
            self._attachment = Attachment(self)

    calls = []

    class Work:
        def wait(self):
            return None

    class Transport:
        def allreduce_sum(self, tensor):
            calls.append(("allreduce", tensor.dtype, tuple(tensor.shape)))
            return Work()

    class Reducer:
        def prepare_forward(self, will_sync):
            calls.append(("prepare_forward", will_sync))

        def zero_buckets(self):
            return [(torch.zeros(5), [], [0, 1], False), (torch.zeros(3), [], [2], True)]

        def shadow_health_exchange(self):
            calls.append(("shadow_health_exchange",))

        def note_shadowed_step(self):
            calls.append(("note_shadowed_step",))

        def joined_used_map(self):
            return torch.ones(3, dtype=torch.int32)

    for find_unused in (False, True):
        calls.clear()
        model = StandIn(
            _reducer=Reducer(), _transport=Transport(), _comm_hook=None,
            find_unused_parameters=find_unused, _param_names=["a", "b", "c"],
            device=torch.device("cpu"), _will_sync_buffers=lambda: False)
        hook = join_module.FusedReducerJoinHook(model, divide_by_initial_world_size=True)
        saved = join_module.sync_requested
        join_module.sync_requested = lambda m, joined: True  # the others synchronise this step
        try:
            hook.main_hook()
        finally:
            join_module.sync_requested = saved
        expected = [("prepare_forward", False),
                    ("allreduce", torch.float32, (5,)), ("allreduce", torch.float32, (3,))]
        if find_unused:
            expected.append(("allreduce", torch.int32, (3,)))
        expected += [("shadow_health_exchange",), ("note_shadowed_step",)]
        assert calls == expected, f"find_unused_parameters={find_unused}: {calls}"
