"""Helpers for running the same user loop under DDP and under FusedReducer and comparing them:
the two wrappers (`WRAP`, `fused`, `ddp`), side groups with a short timeout, the small models,
data, loss and optimizer, and the differences between two runs. Shared by the side-by-side files
(test_module_surface_like_ddp.py, test_implicit_ddp_behaviours.py, test_torch_compile.py,
test_ddp_comm_hooks.py, test_join_uneven_inputs.py) and, for its models and helpers, most other
test files.

No tests here. Every scenario of the side-by-side files runs the same user loop twice on 2 gloo
ranks, once under torch's DistributedDataParallel and once under FusedReducer, and compares what
the user sees (parameters, gradients, buffers, exceptions).

Checking the tests themselves: with FUSED_TESTS_AGAINST_DDP=1 in the environment, `fused()` builds a
DDP instead of a FusedReducer (FusedReducer-only keyword arguments dropped), so every
DDP-vs-FusedReducer comparison becomes DDP-vs-DDP and must pass; the checks of FusedReducer-only
behaviour (static_graph refused, create_graph, timeout naming the bucket, step_history,
first-bucket settings, compiled autograd) are skipped then.
"""
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

FR_IS_DDP = os.environ.get("FUSED_TESTS_AGAINST_DDP", "") == "1"
TOL = 1e-5
LR = 0.05
D_IN, HIDDEN, D_OUT = 8, 16, 4
_FR_ONLY = ("first_bucket_mb", "last_bucket_mb", "timeout", "backend", "autotune")


# -- wrappers ------------------------------------------------------------------------------------

def fused(module, **kwargs):
    """FusedReducer(module, **kwargs) with DDP's first bucket (1 MiB) unless given."""
    if FR_IS_DDP:
        for key in _FR_ONLY:
            kwargs.pop(key, None)
        return DDP(module, **kwargs)
    from fused_reducer import FusedReducer
    kwargs.setdefault("first_bucket_mb", 1)
    return FusedReducer(module, **kwargs)


def ddp(module, **kwargs):
    for key in _FR_ONLY:
        kwargs.pop(key, None)
    return DDP(module, **kwargs)


WRAP = {"ddp": ddp, "fr": fused}


def side_group(seconds=30):
    """A fresh gloo group over all ranks whose collectives time out: for scenarios where a broken
    wrapper could leave one rank waiting for a collective the other never starts (the test then
    fails with the error instead of hanging the whole spawn). Pass it as process_group= and give
    FusedReducer the same timeout."""
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=seconds))


def risky_kwargs(seconds=30):
    """process_group= and timeout= for a scenario that could leave a rank waiting."""
    return dict(process_group=side_group(seconds), timeout=timedelta(seconds=seconds))


# -- models (module level: pickling and spawn need them importable) --------------------------------

class Net(nn.Module):
    def __init__(self, d_in=D_IN, hidden=HIDDEN, d_out=D_OUT):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, d_out)

    def forward(self, x):
        return self.out(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(D_IN, HIDDEN)
        self.bn = nn.BatchNorm1d(HIDDEN)
        self.out = nn.Linear(HIDDEN, D_OUT)

    def forward(self, x):
        return self.out(torch.tanh(self.bn(self.fc1(x))))


class StatNet(Net):
    """A registered buffer `stat` added to the hidden activations."""

    def __init__(self):
        super().__init__()
        self.register_buffer("stat", torch.zeros(HIDDEN))

    def forward(self, x):
        h = torch.tanh(self.fc1(x)) + self.stat
        return self.out(torch.tanh(self.fc2(h)))


class ExtraNet(Net):
    """`extra` takes part only when forward is called with use_extra=True."""

    def __init__(self):
        super().__init__()
        self.extra = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x, use_extra=False):
        h = torch.tanh(self.fc1(x))
        if use_extra:
            h = torch.tanh(self.extra(h))
        return self.out(torch.tanh(self.fc2(h)))


class TwoHeads(Net):
    """Returns (main, aux); a loss on `main` alone leaves aux's parameters with undefined grads."""

    def __init__(self):
        super().__init__()
        self.aux = nn.Linear(HIDDEN, 2)

    def forward(self, x):
        h = torch.tanh(self.fc2(torch.tanh(self.fc1(x))))
        return self.out(h), self.aux(h)


class TiedNet(nn.Module):
    """`b.weight` is `a.weight` (one Parameter, two modules) and `a` runs twice per forward."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D_IN, HIDDEN)
        self.a = nn.Linear(HIDDEN, HIDDEN)
        self.b = nn.Linear(HIDDEN, HIDDEN)
        self.b.weight = self.a.weight
        self.out = nn.Linear(HIDDEN, D_OUT)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.a(h))
        h = torch.tanh(self.b(h))
        h = torch.tanh(self.a(h))
        return self.out(h)


class CheckpointedWithUnused(Net):
    """fc2 under reentrant activation checkpointing, plus a parameter no forward uses."""

    def __init__(self):
        super().__init__()
        self.never = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint
        h = torch.tanh(self.fc1(x))
        h = torch.tanh(checkpoint(self.fc2, h, use_reentrant=True))
        return self.out(h)


class DictOut(Net):
    """Returns a dict; `aux` takes part only when asked (find_unused_parameters must look
    inside the dict for the output tensors)."""

    def __init__(self):
        super().__init__()
        self.aux = nn.Linear(HIDDEN, D_OUT)

    def forward(self, x, use_aux=True):
        h = torch.tanh(self.fc2(torch.tanh(self.fc1(x))))
        out = {"main": self.out(h)}
        if use_aux:
            out["aux"] = self.aux(h)
        return out


class Frozen(Net):
    def __init__(self):
        super().__init__()
        self.requires_grad_(False)


def build(cls=Net, seed=1234, **kwargs):
    torch.manual_seed(seed)
    return cls(**kwargs)


# -- data and loops ------------------------------------------------------------------------------

def data(rank, step, micro=0, n=6, d_in=D_IN, d_out=D_OUT, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return (torch.randn(n, d_in, generator=g).to(dtype),
            torch.randn(n, d_out, generator=g).to(dtype))


def loss_of(out, y, rank):
    return ((out - y) ** 2).mean() * (1 + rank)  # rank-dependent: a wrong average shows


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)


def step(model, opt, rank, i, micro=0, dtype=torch.float32, zero=True, **fwd):
    if zero:
        opt.zero_grad()
    x, y = data(rank, i, micro, dtype=dtype)
    loss = loss_of(model(x, **fwd), y, rank)
    loss.backward()
    opt.step()
    return loss.item()


def train(model, rank, steps, opt=None, start=0, **kwargs):
    opt = opt or sgd(model)
    for i in range(start, start + steps):
        step(model, opt, rank, i, **kwargs)
    return opt


# -- comparisons ---------------------------------------------------------------------------------

def inner(model):
    """The user's module inside a wrapper (or the module itself)."""
    return getattr(model, "module", model)


def params(model):
    return {n: p.detach().clone() for n, p in inner(model).named_parameters()}


def grads(model):
    return {n: (None if p.grad is None else p.grad.detach().clone())
            for n, p in inner(model).named_parameters()}


def buffers(model):
    return {n: b.detach().clone() for n, b in inner(model).named_buffers()}


def max_diff(a, b):
    """Largest |a - b| over same-named tensors (float), or a string naming the first mismatch
    in names, None-ness, dtype or shape."""
    if list(a) != list(b):
        return f"names differ: {list(a)} vs {list(b)}"
    worst = 0.0
    for name in a:
        x, y = a[name], b[name]
        if (x is None) != (y is None):
            return f"{name}: grad None on one side only (ddp None={x is None}, fr None={y is None})"
        if x is None:
            continue
        if x.dtype != y.dtype or x.shape != y.shape:
            return f"{name}: {x.dtype}{tuple(x.shape)} vs {y.dtype}{tuple(y.shape)}"
        worst = max(worst, (x.double() - y.double()).abs().max().item())
    return worst


def same_on_all_ranks(tensors):
    """Largest difference between this rank's tensors and rank 0's (0.0 when synchronised)."""
    flat = torch.cat([t.detach().double().flatten() for t in tensors])
    ref = flat.clone()
    dist.broadcast(ref, 0)
    return (flat - ref).abs().max().item()


def local_average_grads(model_state, cls, rank, i, micro=0, dtype=torch.float32, **fwd):
    """Reference: the gradients this step would give, computed locally on each rank and averaged
    in float64 with plain all_reduce (None where no rank produced a gradient)."""
    ref = cls()
    ref.load_state_dict(model_state)
    x, y = data(rank, i, micro, dtype=dtype)
    loss_of(ref(x, **fwd), y, rank).backward()
    out = {}
    for name, p in ref.named_parameters():
        g = torch.zeros_like(p, dtype=torch.float64) if p.grad is None else p.grad.double()
        used = torch.tensor([0.0 if p.grad is None else 1.0], dtype=torch.float64)
        dist.all_reduce(g)
        dist.all_reduce(used)
        out[name] = None if used.item() == 0 else (g / dist.get_world_size()).to(p.dtype)
    return out


def roundtrip(model, how):
    """A copy of `model` made by `how`: "torch.save" (and torch.load), "pickle" or "deepcopy"."""
    import copy
    import io
    import pickle
    if how == "torch.save":
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        return torch.load(buf, weights_only=False)
    if how == "pickle":
        return pickle.loads(pickle.dumps(model))
    return copy.deepcopy(model)


def outcome(fn):
    """("ok", result), or ("raised", type name, message, is RuntimeError, is ValueError)."""
    try:
        return ("ok", fn())
    except Exception as e:  # noqa: BLE001 - the test judges the exception
        return ("raised", type(e).__name__, str(e)[:2000], isinstance(e, RuntimeError),
                isinstance(e, ValueError))


def assert_close(diff, tol=TOL, what=""):
    assert isinstance(diff, float), f"{what}: {diff}"
    assert diff <= tol, f"{what}: max |ddp - fused| = {diff:.3g} > {tol:g}"


def assert_all_close(diffs, tol=TOL, what=""):
    assert diffs, f"{what}: nothing compared"
    for i, d in enumerate(diffs):
        assert_close(d, tol, f"{what} [{i}]")
