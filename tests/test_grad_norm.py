"""model.grad_norm() / clip_grad_norm_ and ShardedOptimizer.grad_norm(): the value a
user gets, against references that do not come from FusedReducer (2 and 3 gloo ranks, a
spawn each):
- torch.nn.utils.get_total_norm over the param.grad the model holds at that moment (and the
  float64 norm of those tensors), for norm types 1, 2 and inf;
- torch's norm of DDP's param.grad after the same operations on the same data.
The norm from the copy (Reducer::copy_norms) describes what the unpack wrote into param.grad in
the last synchronised backward. Each scenario below makes it stale or incomplete in a way a user
can: parameters the reducer did not reduce in that step (a branch every rank skipped while its
gradient is kept, frozen parameters holding a .grad, DDP's ignore list, a partial zero_grad),
and param.grad changed after backward (torch's clip, mul_/add_, a mask that leaves the probed
elements alone, changes through .data, GradScaler.unscale_, a micro-step under no_sync, a second
backward, a replaced tensor). Controls (an untouched step, no_sync then a synchronising step, a
branch one rank used) must also give torch's value.
The ShardedOptimizer's norm: its dtype and value as torch's clip_grad_norm_ under DDP, for mixed
float32/bfloat16, bfloat16, float64 and float32+float64 models, reduce_dtype and master_dtype.
"""
import math

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from fused_reducer import FusedReducer, ShardedOptimizer
from dist_utils import SelectedChecks, per_rank

NORM_TYPES = (1.0, 2.0, math.inf)
checks = SelectedChecks()


class _Branchy(nn.Module):
    """trunk -> (+ 3 tanh(branch)) -> head; `frozen` (requires_grad=False) is not used."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Linear(16, 32)
        self.branch = nn.Linear(32, 32)
        self.head = nn.Linear(32, 4)
        self.frozen = nn.Linear(4, 4).requires_grad_(False)
        self.use_branch = True

    def forward(self, x):
        h = torch.tanh(self.trunk(x))
        if self.use_branch:
            h = h + 3.0 * torch.tanh(self.branch(h))
        return self.head(h)


def _batch(rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def _backward(model, rank, step, scale=1.0):
    x, y = _batch(rank, step)
    (nn.functional.mse_loss(model(x), y) * scale).backward()


def _probes(n):
    """The flat positions Reducer::gradient_probes reads of a dense n-element gradient."""
    spread = (n - 1) // 2
    return {0, spread, 2 * spread}


def _mask_off_probes(grad):
    """0 on every second element, but 1 on the probed ones: their values stay as they were."""
    flat = torch.arange(grad.numel())
    mask = (flat % 2 == 0)
    mask[list(_probes(grad.numel()))] = True
    return mask.reshape(grad.shape).to(grad.dtype)


def _zero_grad(module, set_to_none=True):
    for p in module.parameters():
        if p.grad is not None:
            if set_to_none:
                p.grad = None
            else:
                p.grad.zero_()


# -- the scenarios: each runs the same operations on FusedReducer and on DDP ------------------------
# setup(module, rank): before wrapping; run(model, module, rank, world): after.

def _fresh(model, module, rank, world):
    _backward(model, rank, 0)


def _branch_skipped_everywhere_grad_kept(model, module, rank, world):
    _backward(model, rank, 0)           # every parameter gets a gradient ...
    module.use_branch = False
    _backward(model, rank, 1)           # ... then no rank uses the branch: it keeps step 0's


def _branch_skipped_everywhere_set_to_none(model, module, rank, world):
    _backward(model, rank, 0)
    _zero_grad(module, set_to_none=True)
    module.use_branch = False
    _backward(model, rank, 1)           # the branch's grad stays None on every rank


def _branch_skipped_everywhere_zeroed(model, module, rank, world):
    _backward(model, rank, 0)
    _zero_grad(module, set_to_none=False)
    module.use_branch = False
    _backward(model, rank, 1)           # the branch's grad stays zeros


def _branch_used_by_rank0_only(model, module, rank, world):
    _backward(model, rank, 0)
    _zero_grad(module, set_to_none=True)
    module.use_branch = rank == 0
    _backward(model, rank, 1)           # the other ranks get the branch's average too


def _branch_used_by_rank0_only_grads_kept(model, module, rank, world):
    _backward(model, rank, 0)
    module.use_branch = rank == 0
    _backward(model, rank, 1)


def _partial_zero_grad_then_branch_skipped(model, module, rank, world):
    """Two optimizers (trunk+head, branch); only the first one's zero_grad(set_to_none) ran."""
    _backward(model, rank, 0)
    for layer in (module.trunk, module.head):
        _zero_grad(layer, set_to_none=True)
    module.use_branch = False
    _backward(model, rank, 1)


def _frozen_setup(module, rank):
    g = torch.Generator().manual_seed(7 + rank)
    for p in module.frozen.parameters():  # never reduced, yet holding a gradient (an earlier phase's)
        p.grad = 5.0 * torch.randn(p.shape, generator=g)


def _ignored_setup(module, rank):
    DDP._set_params_and_buffers_to_ignore_for_model(module, ["branch.weight"])


def _torch_clip(model, module, rank, world):
    _backward(model, rank, 0)
    torch.nn.utils.clip_grad_norm_(module.parameters(), 1e-2)


def _mul_all(model, module, rank, world):
    _backward(model, rank, 0)
    for p in module.parameters():
        if p.grad is not None:
            p.grad.mul_(3.0)


def _add_one(model, module, rank, world):
    _backward(model, rank, 0)
    module.branch.weight.grad.add_(0.25)


def _mask_in_place(model, module, rank, world):
    """A pruning mask applied in place, leaving the probed elements as they were."""
    _backward(model, rank, 0)
    for p in module.parameters():
        if p.grad is not None:
            p.grad.mul_(_mask_off_probes(p.grad))


def _data_mul(model, module, rank, world):
    _backward(model, rank, 0)
    for p in module.parameters():
        if p.grad is not None:
            p.grad.data.mul_(0.5)       # no version bump


def _data_assigned(model, module, rank, world):
    _backward(model, rank, 0)
    for p in module.parameters():
        if p.grad is not None:
            p.grad.data = p.grad.data * 4.0


def _unscale(model, module, rank, world):
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    x, y = _batch(rank, 0)
    scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
    scaler.unscale_(opt)


def _micro_step_after_sync(model, module, rank, world):
    _backward(model, rank, 0)
    with model.no_sync():
        _backward(model, rank, 1)       # local accumulation on top of the average


def _no_sync_then_sync(model, module, rank, world):
    with model.no_sync():
        _backward(model, rank, 0)
        _backward(model, rank, 1)
    _backward(model, rank, 2)


def _two_synced_backwards(model, module, rank, world):
    _backward(model, rank, 0)
    _backward(model, rank, 1)           # accumulates onto the first average


def _replaced_scaled(model, module, rank, world):
    _backward(model, rank, 0)
    for p in module.parameters():
        if p.grad is not None:
            p.grad = p.grad * 2.0


def _replaced_same_probes(model, module, rank, world):
    """New tensors (out of place: version 0) that agree with the old ones where probed."""
    _backward(model, rank, 0)
    for p in module.parameters():
        if p.grad is not None:
            p.grad = p.grad * _mask_off_probes(p.grad)


SCENARIOS = {
    # name: (constructor kwargs, setup before wrapping, operations, ask for the norm first)
    "fresh_step": ({}, None, _fresh, True),
    "branch_skipped_everywhere_grad_kept": (dict(find_unused_parameters=True), None,
                                            _branch_skipped_everywhere_grad_kept, True),
    "branch_skipped_everywhere_set_to_none": (dict(find_unused_parameters=True), None,
                                              _branch_skipped_everywhere_set_to_none, True),
    "branch_skipped_everywhere_zeroed": (dict(find_unused_parameters=True), None,
                                         _branch_skipped_everywhere_zeroed, True),
    "branch_used_by_rank0_only": (dict(find_unused_parameters=True), None,
                                  _branch_used_by_rank0_only, True),
    "branch_used_by_rank0_only_grads_kept": (dict(find_unused_parameters=True), None,
                                             _branch_used_by_rank0_only_grads_kept, True),
    "partial_zero_grad_then_branch_skipped": (dict(find_unused_parameters=True), None,
                                              _partial_zero_grad_then_branch_skipped, True),
    "frozen_holding_grad": ({}, _frozen_setup, _fresh, True),
    "ignored_parameter": ({}, _ignored_setup, _fresh, True),
    "torch_clip": ({}, None, _torch_clip, True),
    "mul_all": ({}, None, _mul_all, True),
    "add_one": ({}, None, _add_one, True),
    "mask_in_place_off_probes": ({}, None, _mask_in_place, True),
    "data_mul": ({}, None, _data_mul, True),
    "data_assigned": ({}, None, _data_assigned, True),
    "unscale": ({}, None, _unscale, True),
    "unscale_first_ask": ({}, None, _unscale, False),
    "micro_step_after_sync": ({}, None, _micro_step_after_sync, True),
    "no_sync_then_sync": ({}, None, _no_sync_then_sync, True),
    "two_synced_backwards": ({}, None, _two_synced_backwards, True),
    "replaced_scaled": ({}, None, _replaced_scaled, True),
    "replaced_same_probes": ({}, None, _replaced_same_probes, True),
}


def _norms(grads, norm_type):
    """torch's norm of these tensors, and the float64 one."""
    torch_norm = torch.nn.utils.get_total_norm(grads, norm_type)
    exact = torch.linalg.vector_norm(torch.cat([g.double().flatten() for g in grads]), norm_type)
    return float(torch_norm), float(exact)


def check_reducer_norm_scenarios(rank, world):
    """Each scenario on a fresh FusedReducer and DDP: ours.grad_norm(1, 2, inf), torch's and the
    float64 norm of the param.grad ours and DDP hold then, and clip_grad_norm_ against torch's."""
    out = {}
    for name, (kwargs, setup, run, ask_first) in SCENARIOS.items():
        modules = (_Branchy(), _Branchy())
        if setup is not None:
            for module in modules:
                setup(module, rank)
        ours = FusedReducer(modules[0], bucket_cap_mb=1024 / 2**20, **kwargs)
        ddp = DDP(modules[1], **kwargs)
        if ask_first:
            ours.grad_norm()  # asked once: from now on it can come from the copy
        run(ours, modules[0], rank, world)
        run(ddp, modules[1], rank, world)
        mine_grads = [p.grad for p in modules[0].parameters() if p.grad is not None]
        ddp_grads = [p.grad for p in modules[1].parameters() if p.grad is not None]
        rows = {}
        for norm_type in NORM_TYPES:
            mine = ours.grad_norm(norm_type)
            rows[norm_type] = dict(mine=float(mine), dtype=str(mine.dtype),
                                   of_param_grad=_norms(mine_grads, norm_type),
                                   ddp=_norms(ddp_grads, norm_type), source=ours._norm_source)
        # clip_grad_norm_ returns the same norm, and scales by it as torch's clip does.
        clip_max = 1e-3
        mine_clip = float(ours.clip_grad_norm_(clip_max))
        ddp_clip = float(torch.nn.utils.clip_grad_norm_(modules[1].parameters(), clip_max))
        clipped = max((p.grad - q.grad).abs().max().item() / (q.grad.abs().max().item() + 1e-30)
                      for p, q in zip(modules[0].parameters(), modules[1].parameters())
                      if q.grad is not None)
        out[name] = dict(rows=rows, clip=(mine_clip, ddp_clip), clipped_rel_diff=clipped,
                         grads_match=len(mine_grads) == len(ddp_grads))
        ours.close()
    return out


# -- the sharded optimizer's norm ------------------------------------------------------------------

class _Two(nn.Module):
    def __init__(self, first, second):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(16, 32).to(first)
        self.b = nn.Linear(32, 4).to(second)

    def forward(self, x):
        h = torch.tanh(self.a(x.to(self.a.weight.dtype)))
        return self.b(h.to(self.b.weight.dtype))


SHARDED_MODELS = {
    # name: (dtypes of the two layers, FusedReducer kwargs, ShardedOptimizer kwargs, DDP hook)
    "bf16_then_fp32": ((torch.bfloat16, torch.float32), {}, {}, None),
    "fp32_then_bf16": ((torch.float32, torch.bfloat16), {}, {}, None),
    "bf16": ((torch.bfloat16, torch.bfloat16), {}, {}, None),
    "fp64": ((torch.float64, torch.float64), {}, {}, None),
    "fp32_then_fp64": ((torch.float32, torch.float64), {}, {}, None),
    "fp32_reduce_bf16": ((torch.float32, torch.float32), dict(reduce_dtype=torch.bfloat16), {},
                         "bf16"),
    "bf16_then_fp32_master_fp32": ((torch.bfloat16, torch.float32), {},
                                   dict(master_dtype=torch.float32), None),
    "bf16_master_fp32": ((torch.bfloat16, torch.bfloat16), {}, dict(master_dtype=torch.float32),
                         None),
}


def check_sharded_norm_dtypes(rank, world):
    """For each model: ours (ShardedOptimizer.grad_norm, its clip_grad_norm_, and the model's
    grad_norm without a ShardedOptimizer) against torch's norm of DDP's param.grad."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook
    out = {}
    for name, (dtypes, kwargs, opt_kwargs, hook) in SHARDED_MODELS.items():
        for sharded in (True, False):
            ours = FusedReducer(_Two(*dtypes), bucket_cap_mb=1024 / 2**20, **kwargs)
            ddp = DDP(_Two(*dtypes))
            if hook == "bf16":
                ddp.register_comm_hook(None, bf16_compress_hook)
            opt = (ShardedOptimizer(ours, torch.optim.SGD, lr=0.1, **opt_kwargs) if sharded
                   else None)
            if not sharded:
                ours.grad_norm()  # asked once: from now on it can come from the copy
            for model in (ours, ddp):
                _backward(model, rank, 0, scale=10.0)
            ddp_grads = [p.grad for p in ddp.parameters()]
            rows = {}
            for norm_type in NORM_TYPES:
                mine = opt.grad_norm(norm_type) if sharded else ours.grad_norm(norm_type)
                theirs = torch.nn.utils.get_total_norm(ddp_grads, norm_type)
                rows[norm_type] = dict(mine=float(mine), dtype=str(mine.dtype),
                                       theirs=float(theirs), their_dtype=str(theirs.dtype),
                                       exact=_norms(ddp_grads, norm_type)[1])
                if not sharded:  # the float64 norm of the param.grad ours holds
                    rows[norm_type]["own_exact"] = _norms(
                        [p.grad for p in ours.parameters()], norm_type)[1]
            clip = opt.clip_grad_norm_ if sharded else ours.clip_grad_norm_
            mine = clip(1e-3)
            theirs = torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1e-3)
            rows["clip"] = dict(mine=float(mine), dtype=str(mine.dtype), theirs=float(theirs),
                                their_dtype=str(theirs.dtype))
            out[(name, sharded)] = rows
            ours.close()
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def outcomes(request):
    return request.param, checks.run(request, world_size=request.param, timeout=240)


def _rel(a, b):
    return abs(a - b) / max(abs(b), 1e-30)


def _assert_norms_are_torchs(outcomes, scenario, tol=1e-6):
    """The value of ours for every norm type: torch's norm of the param.grad ours holds (float64
    of them, tol relative; torch's float32 one within 1e-5) and of DDP's param.grad."""
    _, outcomes = outcomes
    for rank, out in enumerate(per_rank(outcomes, "check_reducer_norm_scenarios")):
        result = out[scenario]
        assert result["grads_match"], (rank, scenario)
        for norm_type, row in result["rows"].items():
            torch_norm, exact = row["of_param_grad"]
            ddp_torch, ddp_exact = row["ddp"]
            what = (rank, scenario, norm_type, row)
            assert row["dtype"] == "torch.float32", what
            assert _rel(row["mine"], exact) <= tol, what
            assert _rel(row["mine"], torch_norm) <= 1e-5, what
            assert _rel(row["mine"], ddp_exact) <= 1e-5, what
            assert _rel(row["mine"], ddp_torch) <= 1e-5, what
        mine_clip, ddp_clip = result["clip"]
        assert _rel(mine_clip, ddp_clip) <= 1e-5, (rank, scenario, result["clip"])
        assert result["clipped_rel_diff"] <= 1e-5, (rank, scenario, result["clipped_rel_diff"])


@checks.uses(check_reducer_norm_scenarios)
def test_grad_norm_of_an_untouched_step_is_torchs_norm_and_comes_from_the_copy(outcomes):
    _assert_norms_are_torchs(outcomes, "fresh_step")
    for out in per_rank(outcomes[1], "check_reducer_norm_scenarios"):
        # The scenarios below only test the fallback if the copy is used where it may be.
        assert all(row["source"] == "copy" for row in out["fresh_step"]["rows"].values())


@checks.uses(check_reducer_norm_scenarios)
def test_grad_norm_after_a_step_where_every_rank_skipped_a_branch_that_kept_its_grad_is_torchs_norm_of_param_grad(
        outcomes):
    _assert_norms_are_torchs(outcomes, "branch_skipped_everywhere_grad_kept")
    _assert_norms_are_torchs(outcomes, "partial_zero_grad_then_branch_skipped")


@checks.uses(check_reducer_norm_scenarios)
def test_grad_norm_after_a_step_where_every_rank_skipped_a_zeroed_or_none_branch_is_torchs_norm(
        outcomes):
    _assert_norms_are_torchs(outcomes, "branch_skipped_everywhere_set_to_none")
    _assert_norms_are_torchs(outcomes, "branch_skipped_everywhere_zeroed")


@checks.uses(check_reducer_norm_scenarios)
def test_grad_norm_after_a_branch_only_rank_0_used_is_torchs_norm_of_the_averaged_grads(outcomes):
    _assert_norms_are_torchs(outcomes, "branch_used_by_rank0_only")
    _assert_norms_are_torchs(outcomes, "branch_used_by_rank0_only_grads_kept")


@checks.uses(check_reducer_norm_scenarios)
def test_grad_norm_counts_frozen_and_ignored_parameters_holding_a_grad_as_torch_does(outcomes):
    _assert_norms_are_torchs(outcomes, "frozen_holding_grad")
    _assert_norms_are_torchs(outcomes, "ignored_parameter")


@checks.uses(check_reducer_norm_scenarios)
def test_grad_norm_after_grads_changed_in_place_is_torchs_norm_of_param_grad(outcomes):
    for scenario in ("torch_clip", "mul_all", "add_one", "mask_in_place_off_probes"):
        _assert_norms_are_torchs(outcomes, scenario)


@checks.uses(check_reducer_norm_scenarios)
def test_grad_norm_after_changes_without_a_version_bump_is_torchs_norm_of_param_grad(outcomes):
    """.data changes and GradScaler.unscale_, also on the model's first grad_norm() call."""
    for scenario in ("data_mul", "data_assigned", "unscale", "unscale_first_ask"):
        _assert_norms_are_torchs(outcomes, scenario)


@checks.uses(check_reducer_norm_scenarios)
def test_grad_norm_after_no_sync_and_repeated_backwards_is_torchs_norm_of_param_grad(outcomes):
    for scenario in ("micro_step_after_sync", "no_sync_then_sync", "two_synced_backwards"):
        _assert_norms_are_torchs(outcomes, scenario)


@checks.uses(check_reducer_norm_scenarios)
def test_grad_norm_after_param_grad_was_replaced_is_torchs_norm_of_the_new_tensors(outcomes):
    for scenario in ("replaced_scaled", "replaced_same_probes"):
        _assert_norms_are_torchs(outcomes, scenario)


def _assert_sharded(outcomes, names, sharded):
    """dtype: torch's under DDP. Value: torch's rounds each low-precision gradient's norm to its
    dtype (within 2**-7 of it then), so the tight check is against the float64 norm of DDP's
    gradients: within the rounding of the result dtype, or of float32 where a float32 or
    bfloat16 gradient's norm is accumulated in float32 (as torch does). At 3 ranks bfloat16
    averages (and a bfloat16 reduction's) differ from DDP's in their last bit: there the tight
    check is against the float64 norm of the param.grad ours holds (without a
    ShardedOptimizer), DDP's within bfloat16's rounding."""
    world, outcomes = outcomes
    for rank, out in enumerate(per_rank(outcomes, "check_sharded_norm_dtypes")):
        for name in names:
            dtypes, kwargs = SHARDED_MODELS[name][:2]
            low = torch.bfloat16 in dtypes or kwargs.get("reduce_dtype") == torch.bfloat16
            for key, row in out[(name, sharded)].items():
                what = (rank, name, sharded, key, row)
                assert row["dtype"] == row["their_dtype"], what
                loose = 2.0**-7 if low else 1e-6
                assert _rel(row["mine"], row["theirs"]) <= loose, what
                if "exact" in row:
                    tight = (2.0**-8 if row["dtype"] == "torch.bfloat16" else
                             1e-12 if set(dtypes) == {torch.float64} else 1e-6)
                    if "own_exact" in row:
                        assert _rel(row["mine"], row["own_exact"]) <= tight, what
                    ddp_tol = 2.0**-8 if world > 2 and low else tight
                    assert _rel(row["mine"], row["exact"]) <= ddp_tol, what


@checks.uses(check_sharded_norm_dtypes)
def test_sharded_norm_of_a_mixed_bf16_fp32_model_is_float32_and_torchs_value_under_ddp(outcomes):
    _assert_sharded(outcomes, ("bf16_then_fp32", "fp32_then_bf16", "bf16_then_fp32_master_fp32"),
                    sharded=True)


@checks.uses(check_sharded_norm_dtypes)
def test_sharded_norm_of_float64_parameters_is_float64_and_torchs_value_under_ddp(outcomes):
    _assert_sharded(outcomes, ("fp64", "fp32_then_fp64"), sharded=True)


@checks.uses(check_sharded_norm_dtypes)
def test_sharded_norm_with_reduce_dtype_bf16_is_float32_and_torchs_value_under_ddp_with_bf16_hook(
        outcomes):
    _assert_sharded(outcomes, ("fp32_reduce_bf16",), sharded=True)


@checks.uses(check_sharded_norm_dtypes)
def test_sharded_norm_of_a_bf16_model_has_torchs_dtype_and_value_under_ddp(outcomes):
    _assert_sharded(outcomes, ("bf16", "bf16_master_fp32"), sharded=True)


@checks.uses(check_sharded_norm_dtypes)
def test_grad_norm_without_a_sharded_optimizer_has_torchs_dtype_and_value_for_every_model(
        outcomes):
    _assert_sharded(outcomes, tuple(SHARDED_MODELS), sharded=False)
