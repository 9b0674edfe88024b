"""FusedReducer's averaged gradients equal DDP's on the same model, data and process group.

Each scenario builds the same model twice (same seed), wraps one copy in
torch.nn.parallel.DistributedDataParallel and the other in FusedReducer, feeds both the same
per-rank data (different on every rank) for several steps with an SGD step in between, and
compares every gradient and parameter. A third, unwrapped copy gives an independent reference:
per-rank gradients computed locally, averaged in float64 with plain dist.all_reduce.

All scenarios of one world size run in one spawned job (a spawn costs seconds on this machine);
each test then checks its own scenario's outcome.
"""
import traceback

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from dist_utils import run_ranks

TOL = 1e-6
STEPS = 4
LR = 0.05


# -- models ------------------------------------------------------------------------------------

class MLP(nn.Module):
    def __init__(self, widths=(12, 24, 24, 16, 6)):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths[:-1], widths[1:]))

    def forward(self, x, rank=0, step=0):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.tanh(x)
        return x


class WithUnused(nn.Module):
    """`never` takes part in no forward; `sometimes` only on rank step % world_size."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(12, 16)
        self.never = nn.Linear(16, 16)
        self.sometimes = nn.Linear(16, 16)
        self.b = nn.Linear(16, 6)

    def forward(self, x, rank=0, step=0):
        x = torch.tanh(self.a(x))
        if rank == step % dist.get_world_size():
            x = torch.tanh(self.sometimes(x))
        return self.b(x)


class MixedDtypes(nn.Module):
    def __init__(self):
        super().__init__()
        self.f32 = nn.Linear(12, 16)
        self.f64 = nn.Linear(16, 16).double()
        self.out = nn.Linear(16, 6)

    def forward(self, x, rank=0, step=0):
        x = torch.tanh(self.f32(x))
        x = torch.tanh(self.f64(x.double())).float()
        return self.out(x)


class WithBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(12, 16)
        self.bn = nn.BatchNorm1d(16)
        self.b = nn.Linear(16, 6)

    def forward(self, x, rank=0, step=0):
        return self.b(torch.tanh(self.bn(self.a(x))))


class ReentrantCheckpointed(MLP):
    """Layers 1 and 3 (the last) under torch.utils.checkpoint(use_reentrant=True): their
    gradients become ready inside nested backward passes, the last layer's first of all."""

    def forward(self, x, rank=0, step=0):
        from torch.utils.checkpoint import checkpoint
        for i, layer in enumerate(self.layers):
            x = checkpoint(layer, x, use_reentrant=True) if i in (1, 3) else layer(x)
            if i < len(self.layers) - 1:
                x = torch.tanh(x)
        return x


def with_frozen_first_layer():
    model = MLP()
    model.layers[0].requires_grad_(False)
    return model


def make_model(kind, seed=1234):
    torch.manual_seed(seed)
    return {"mlp": MLP, "unused": WithUnused, "mixed": MixedDtypes, "bn": WithBatchNorm,
            "reentrant": ReentrantCheckpointed, "frozen": with_frozen_first_layer}[kind]()


def batch(rank, step, micro=0):
    g = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
    return torch.randn(5, 12, generator=g), torch.randn(5, 6, generator=g)


def loss_fn(model, rank, step, micro=0):
    x, y = batch(rank, step, micro)
    out = model(x, rank=rank, step=step)
    return ((out - y) ** 2).mean() * (1 + rank)  # rank-dependent scale: averages must be right


# -- comparison helpers --------------------------------------------------------------------------

def max_diff(a, b):
    """Largest |a - b| over matching tensors; None-ness must match exactly."""
    worst = 0.0
    for name, (x, y) in zip(a.keys(), zip(a.values(), b.values())):
        if (x is None) != (y is None):
            return f"{name}: one grad is None, the other is not ({x is None}, {y is None})"
        if x is None:
            continue
        if x.dtype != y.dtype or x.shape != y.shape:
            return f"{name}: {x.dtype}{tuple(x.shape)} vs {y.dtype}{tuple(y.shape)}"
        worst = max(worst, (x.double() - y.double()).abs().max().item())
    return worst


def grads(module):
    return {n: (None if p.grad is None else p.grad.detach().clone()) for n, p in
            module.named_parameters()}


def params(module):
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def buffers(module):
    return {n: b.detach().clone().double() for n, b in module.named_buffers()}


def float64_reference(kind, state, rank, step, micros, find_unused):
    """Average over ranks of locally computed gradients, reduced in float64 with a plain
    all_reduce. A parameter no rank used keeps grad None (as in DDP)."""
    ref = make_model(kind)
    ref.load_state_dict(state)
    for m in range(micros):
        loss_fn(ref, rank, step, m).backward()
    out = {}
    for name, p in ref.named_parameters():
        local = torch.zeros_like(p, dtype=torch.float64) if p.grad is None else p.grad.double()
        used = torch.tensor([0.0 if p.grad is None else 1.0], dtype=torch.float64)
        dist.all_reduce(local)
        dist.all_reduce(used)
        if used.item() == 0:
            out[name] = None
        else:
            out[name] = (local / dist.get_world_size()).to(p.dtype)
    return out


# -- scenarios -----------------------------------------------------------------------------------

SCENARIOS = {
    # name: (model kind, common kwargs, FusedReducer-only kwargs, micro-steps per step, zero_grad)
    "fp32_tiny_cap": ("mlp", dict(bucket_cap_mb=1e-6), dict(first_bucket_mb=1e-6), 1, "none"),
    "fp32_default_cap": ("mlp", dict(), dict(), 1, "none"),
    "fp32_huge_cap": ("mlp", dict(bucket_cap_mb=4096), dict(first_bucket_mb=4096), 1, "none"),
    "grad_as_bucket_view": ("mlp", dict(gradient_as_bucket_view=True, bucket_cap_mb=1e-3), {}, 1,
                            "alternate"),
    "grad_as_bucket_view_one_bucket": ("mlp", dict(gradient_as_bucket_view=True), {}, 1,
                                       "alternate"),
    "no_sync": ("mlp", dict(bucket_cap_mb=1e-3), {}, 3, "none"),
    "no_sync_grad_as_bucket_view": ("mlp", dict(bucket_cap_mb=1e-3, gradient_as_bucket_view=True),
                                    {}, 3, "alternate"),
    "unused_params": ("unused", dict(find_unused_parameters=True), {}, 1, "none"),
    "unused_params_no_sync": ("unused", dict(find_unused_parameters=True), {}, 3, "zeros"),
    "mixed_dtypes": ("mixed", dict(bucket_cap_mb=1e-3), {}, 1, "none"),
    "mixed_dtypes_one_bucket_each": ("mixed", dict(), {}, 1, "zeros"),
    # Initial weights differ by rank: both wrappers must start from rank 0's.
    "rank_dependent_init": ("mlp", dict(), {}, 1, "none"),
    # BatchNorm running stats: broadcast from rank 0 before each forward, like DDP.
    "buffers_broadcast": ("bn", dict(broadcast_buffers=True), {}, 1, "none"),
    "reentrant_checkpoint": ("reentrant", dict(bucket_cap_mb=1e-3), {}, 1, "none"),
    # requires_grad=False parameters are left alone (grad stays None), like DDP.
    "frozen_layer": ("frozen", dict(bucket_cap_mb=1e-3), {}, 1, "none"),
}


def step_with(model, rank, step, micros):
    """micros - 1 micro-steps under no_sync, then a synchronised one."""
    for m in range(micros - 1):
        with model.no_sync():
            loss_fn(model, rank, step, m).backward()
    loss_fn(model, rank, step, micros - 1).backward()


def run_scenario(rank, world_size, name):
    import fused_reducer

    kind, common, fr_only, micros, zero = SCENARIOS[name]
    seed = 1234 + (rank if name == "rank_dependent_init" else 0)
    ddp = DDP(make_model(kind, seed), **common)
    fr = fused_reducer.FusedReducer(make_model(kind, seed), **common, **fr_only)
    opt_ddp = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=0.9)
    opt_fr = torch.optim.SGD(fr.parameters(), lr=LR, momentum=0.9)
    report = {"grad_vs_ddp": [], "grad_vs_f64": [], "param_vs_ddp": [], "buckets": [],
              "shared_storage": [], "buffer_vs_ddp": []}
    report["param_vs_ddp"].append(max_diff(params(ddp.module), params(fr.module)))
    rank0 = [torch.cat([p.detach().flatten().double() for p in fr.module.parameters()])]
    dist.broadcast(rank0[0], 0)
    report["param_vs_rank0_after_wrap"] = max_diff(
        {"all": rank0[0]}, {"all": torch.cat([p.detach().flatten().double()
                                              for p in fr.module.parameters()])})
    for step in range(STEPS):
        set_to_none = {"none": True, "zeros": False, "alternate": step % 2 == 0}[zero]
        opt_ddp.zero_grad(set_to_none=set_to_none)
        opt_fr.zero_grad(set_to_none=set_to_none)
        state = {k: v.clone() for k, v in fr.module.state_dict().items()}
        step_with(ddp, rank, step, micros)
        step_with(fr, rank, step, micros)
        expected = float64_reference(kind, state, rank, step, micros,
                                     common.get("find_unused_parameters", False))
        got = grads(fr.module)
        report["grad_vs_ddp"].append(max_diff(grads(ddp.module), got))
        report["grad_vs_f64"].append(max_diff(expected, got))
        report["buckets"].append(len(fr.bucket_sizes()))
        if common.get("gradient_as_bucket_view"):
            storages = {p.grad.untyped_storage().data_ptr() for p in fr.module.parameters()}
            report["shared_storage"].append(len(storages))
        opt_ddp.step()
        opt_fr.step()
        report["param_vs_ddp"].append(max_diff(params(ddp.module), params(fr.module)))
        report["buffer_vs_ddp"].append(max_diff(buffers(ddp.module), buffers(fr.module)))
    report["n_params"] = len(list(fr.parameters()))
    return report


def run_all(rank, world_size):
    results = {}
    for name in SCENARIOS:
        try:
            results[name] = ("ok", run_scenario(rank, world_size, name))
        except Exception as e:  # noqa: BLE001 - report per scenario, keep the others
            results[name] = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        dist.barrier()
    return results


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def outcomes(request):
    return request.param, run_ranks(run_all, request.param, timeout=400)


def reports(outcomes, name):
    world_size, per_rank = outcomes
    out = []
    for rank, results in enumerate(per_rank):
        status, payload = results[name]
        assert status == "ok", f"rank {rank} of {world_size}: {payload}"
        out.append(payload)
    return out


def assert_matches(outcomes, name):
    for rank, r in enumerate(reports(outcomes, name)):
        assert r["param_vs_rank0_after_wrap"] == 0.0, (name, rank)
        for key in ("grad_vs_ddp", "grad_vs_f64", "param_vs_ddp", "buffer_vs_ddp"):
            for step, diff in enumerate(r[key]):
                assert isinstance(diff, float) and diff <= TOL, (
                    f"{name}, rank {rank}, step {step}: {key} = {diff}")


# -- tests ---------------------------------------------------------------------------------------

def test_fp32_grads_match_ddp_with_tiny_cap_one_bucket_per_param(outcomes):
    assert_matches(outcomes, "fp32_tiny_cap")
    for r in reports(outcomes, "fp32_tiny_cap"):
        assert r["buckets"] == [r["n_params"]] * STEPS


def test_fp32_grads_match_ddp_with_default_cap(outcomes):
    assert_matches(outcomes, "fp32_default_cap")


def test_fp32_grads_match_ddp_with_huge_cap_single_bucket(outcomes):
    assert_matches(outcomes, "fp32_huge_cap")
    for r in reports(outcomes, "fp32_huge_cap"):
        assert r["buckets"] == [1] * STEPS


def test_gradient_as_bucket_view_matches_ddp_with_zero_grad_to_none_and_to_zeros(outcomes):
    assert_matches(outcomes, "grad_as_bucket_view")


def test_gradient_as_bucket_view_grads_share_the_single_bucket_storage(outcomes):
    assert_matches(outcomes, "grad_as_bucket_view_one_bucket")
    for r in reports(outcomes, "grad_as_bucket_view_one_bucket"):
        assert r["buckets"] == [1] * STEPS
        assert r["shared_storage"] == [1] * STEPS  # every grad is a view of one flat buffer


def test_no_sync_accumulation_then_synced_step_matches_ddp_no_sync(outcomes):
    assert_matches(outcomes, "no_sync")


def test_no_sync_with_gradient_as_bucket_view_matches_ddp(outcomes):
    assert_matches(outcomes, "no_sync_grad_as_bucket_view")


def test_unused_and_rank_dependent_params_match_ddp_find_unused(outcomes):
    assert_matches(outcomes, "unused_params")


def test_unused_params_with_no_sync_and_zeroed_grads_match_ddp(outcomes):
    assert_matches(outcomes, "unused_params_no_sync")


def test_mixed_float32_float64_model_matches_ddp(outcomes):
    assert_matches(outcomes, "mixed_dtypes")


def test_mixed_dtypes_get_separate_buckets_and_match_ddp(outcomes):
    assert_matches(outcomes, "mixed_dtypes_one_bucket_each")
    for r in reports(outcomes, "mixed_dtypes_one_bucket_each"):
        assert r["buckets"] == [2] * STEPS  # one float32 and one float64 bucket


def test_initial_weights_differing_by_rank_start_from_rank0_and_match_ddp(outcomes):
    assert_matches(outcomes, "rank_dependent_init")


def test_batchnorm_buffers_broadcast_from_rank0_match_ddp(outcomes):
    assert_matches(outcomes, "buffers_broadcast")
    for r in reports(outcomes, "buffers_broadcast"):
        assert len(r["buffer_vs_ddp"]) == STEPS


def test_reentrant_checkpointing_with_each_param_used_once_matches_ddp(outcomes):
    assert_matches(outcomes, "reentrant_checkpoint")


def test_frozen_parameters_are_skipped_and_the_rest_matches_ddp(outcomes):
    assert_matches(outcomes, "frozen_layer")  # includes: frozen grads are None as in DDP
