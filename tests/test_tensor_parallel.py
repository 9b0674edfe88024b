"""Tensor parallel x data parallel (issue 40, point 1): a block whose parameters are DTensors
(parallelize_module: ColwiseParallel + RowwiseParallel MLP, and a LayerNorm replicated over the
tensor-parallel dimension) on a 2 x 2 DeviceMesh ("dp", "tp") of 4 gloo ranks, wrapped with
FusedReducer(model, device_mesh=mesh["dp"]) (Note [DTensor parameters] in
core/tensor_parallel.py):
- trains exactly as a float64 single-process model on the global batch, and as DDP with
  torch's _pre_dp_module_transform, and param.grad keeps the parameter's placements;
- the norm from the copy is torch.nn.utils.clip_grad_norm_'s over the DTensor gradients (the
  shards summed over the TP group, replicated parameters once), and clipping with it is exact;
- several buckets, reduce_dtype, check_finite, a DDP comm hook and the ShardedOptimizer (its
  clip_grad_norm_ over the DP and TP shards) work as on a plain model; a LayerNorm left plain
  (not a DTensor) and two forwards before their backwards are exact too;
- a parameter sharded over the data-parallel dimension is refused naming it and FSDP.
"""
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from fused_reducer import FusedReducer, FusedReducerError
from dist_utils import SelectedChecks, per_rank

WORLD = 4
STEPS = 3
LR = 0.1
ROWS = 4
TOL = 2e-6

checks = SelectedChecks()


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.up = nn.Linear(8, 32)
        self.down = nn.Linear(32, 8)

    def forward(self, x):
        return self.down(torch.relu(self.up(self.norm(x))))


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def _replicated_input(module, inputs, mesh):
    from torch.distributed.tensor import DTensor, Replicate
    return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False) for x in inputs)


def _local_output(module, output, mesh):
    return output.to_local()


def _tp_block(mesh, dtensor_norm=True):
    """The block, same initial values on every rank, its MLP split over mesh['tp'], its
    LayerNorm a replicated DTensor (dtensor_norm) or a plain module."""
    from torch.distributed.tensor import distribute_module
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    torch.manual_seed(0)
    block = Block()
    parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    if dtensor_norm:
        distribute_module(block.norm, mesh["tp"], input_fn=_replicated_input,
                          output_fn=_local_output)
    return block


def _data(dp_rank, step, k=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 * step + 10 * dp_rank + k)
    return torch.randn(ROWS, 8, generator=g).to(dtype)


def _reference(steps, micro=1, clip=None):
    """float64, one process, the global batch (every DP rank's rows; the TP ranks of one DP rank
    share them): gradients and norm before each step, parameters after the last."""
    torch.manual_seed(0)
    model = Block().double()
    grads, norms = [], []
    for step in range(steps):
        x = torch.cat([_data(d, step, k, torch.float64) for d in range(2) for k in range(micro)])
        model.zero_grad()
        model(x).pow(2).mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])))
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
    return grads, norms, {n: p.detach().clone() for n, p in model.named_parameters()}


def _full(t):
    from torch.distributed.tensor import DTensor
    return t.full_tensor() if isinstance(t, DTensor) else t


def _max_diff(ours, reference):
    return max(float((_full(ours[n]).detach().double() - reference[n]).abs().max())
               for n in reference)


def _train(model, mesh, steps, clip=None, order=None):
    """SGD steps on the DP rank's rows; per step the max difference of the gradients (full
    tensors) from the float64 reference and the norm FusedReducer reports; at the end the
    parameters' difference. order: microbatches by hand ("1f1b": F1 F2 B1 B2)."""
    module = model.module
    opt = torch.optim.SGD(module.parameters(), lr=LR, foreach=False)
    micro = 2 if order else 1
    ref_grads, ref_norms, ref_params = _reference(steps, micro, clip)
    dp = mesh["dp"].get_local_rank()
    out = {"grads": [], "norm": [], "norm_source": [], "placements_kept": True}
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        if order:
            l1 = model(_data(dp, step, 0)).pow(2).mean() / 2
            l2 = model(_data(dp, step, 1)).pow(2).mean() / 2
            l1.backward()
            l2.backward()
        else:
            model(_data(dp, step)).pow(2).mean().backward()
        named = dict(module.named_parameters())
        out["placements_kept"] &= all(
            type(p.grad) is type(p.data) and getattr(p.grad, "placements", None)
            == getattr(p, "placements", None) for p in named.values())
        out["grads"].append(_max_diff({n: p.grad for n, p in named.items()}, ref_grads[step]))
        if isinstance(model, FusedReducer):
            norm = (model.clip_grad_norm_(clip) if clip is not None else model.grad_norm())
            out["norm"].append(abs(float(norm) - ref_norms[step]))
            out["norm_source"].append(model._norm_source)
        opt.step()
    out["params"] = _max_diff(dict(module.named_parameters()), ref_params)
    out["local_params"] = {n: p.detach().to_local().clone() if hasattr(p, "to_local")
                           else p.detach().clone() for n, p in module.named_parameters()}
    return out


# -- checks ------------------------------------------------------------------------------------

def check_exact_against_float64_and_ddp(rank, world):
    from torch.distributed.tensor.parallel.ddp import _pre_dp_module_transform
    mesh = _mesh()
    ours = _train(FusedReducer(_tp_block(mesh), device_mesh=mesh["dp"]), mesh, STEPS)
    ddp_block = _tp_block(mesh)
    _pre_dp_module_transform(ddp_block)
    ddp = DDP(ddp_block, process_group=mesh["dp"].get_group())
    # The local Parameters the transform made: after a forward the module holds DTensors as
    # plain attributes (named_parameters() is then empty), so keep them from here.
    theirs = {n: p for n, p in ddp.module.named_parameters()}
    opt = torch.optim.SGD(theirs.values(), lr=LR, foreach=False)
    dp = mesh["dp"].get_local_rank()
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        ddp(_data(dp, step)).pow(2).mean().backward()
        opt.step()
    ours["vs_ddp"] = max(float((ours["local_params"][n] - theirs[n].detach()).abs().max())
                         for n in ours["local_params"])
    del ours["local_params"]
    return ours


def check_process_group_argument_and_plain_layernorm(rank, world):
    """process_group= the DP group; the LayerNorm a plain module (mixed plain and DTensor
    parameters: torch's clip_grad_norm_ refuses the mix, grad_norm() does not)."""
    mesh = _mesh()
    model = FusedReducer(_tp_block(mesh, dtensor_norm=False), process_group=mesh["dp"].get_group())
    out = _train(model, mesh, STEPS)
    del out["local_params"]
    return out


def check_clip_grad_norm_matches_torch(rank, world):
    mesh = _mesh()
    model = FusedReducer(_tp_block(mesh), device_mesh=mesh["dp"])
    dp = mesh["dp"].get_local_rank()
    out = {}
    for step in range(2):
        model.zero_grad(set_to_none=True)
        model(_data(dp, step)).pow(2).mean().backward()
        ours = {p: float(model.grad_norm(p)) for p in (1.0, 2.0, float("inf"))}
        torch_norms = {p: float(_full(torch.nn.utils.get_total_norm(
            [q.grad for q in model.parameters()], p))) for p in (1.0, 2.0, float("inf"))}
        out[step] = {"diff": max(abs(ours[p] - torch_norms[p]) / torch_norms[p] for p in ours),
                     "source": model._norm_source}
    out["clipped"] = _train(FusedReducer(_tp_block(mesh), device_mesh=mesh["dp"]), mesh, STEPS,
                            clip=0.05)
    del out["clipped"]["local_params"]
    return out


def check_buckets_reduce_dtype_check_finite_and_comm_hook(rank, world):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    mesh = _mesh()
    out = {}
    small = dict(bucket_cap_mb=0.0005, first_bucket_mb=0.0005)
    model = FusedReducer(_tp_block(mesh), device_mesh=mesh["dp"], check_finite=True, **small)
    out["buckets"] = _train(model, mesh, STEPS)
    out["buckets"]["count"] = len(model.bucket_sizes())
    out["buckets"]["allreduces"] = model.stats()["allreduces"]
    model = FusedReducer(_tp_block(mesh), device_mesh=mesh["dp"], reduce_dtype=torch.bfloat16)
    out["bf16"] = _train(model, mesh, STEPS)
    model = FusedReducer(_tp_block(mesh), device_mesh=mesh["dp"], backend="process_group", **small)
    model.register_comm_hook(mesh["dp"].get_group(), allreduce_hook)
    out["hook"] = _train(model, mesh, STEPS)
    for res in out.values():
        res.pop("local_params")
    return out


def check_sharded_optimizer(rank, world):
    """ShardedOptimizer over the DP group: each DP rank updates its shard of the local (TP)
    gradients; its clip_grad_norm_ is the global norm over the DP shards and the TP shards."""
    import fused_reducer
    mesh = _mesh()
    clip = 0.05
    model = FusedReducer(_tp_block(mesh), device_mesh=mesh["dp"])
    opt = fused_reducer.ShardedOptimizer(model, torch.optim.SGD, lr=LR)
    ref_grads, ref_norms, ref_params = _reference(STEPS, clip=clip)
    dp = mesh["dp"].get_local_rank()
    out = {"norm": []}
    for step in range(STEPS):
        opt.zero_grad()
        model(_data(dp, step)).pow(2).mean().backward()
        out["norm"].append(abs(float(opt.clip_grad_norm_(clip)) - ref_norms[step]))
        opt.step()
    out["params"] = _max_diff(dict(model.module.named_parameters()), ref_params)
    out["placements_kept"] = all(
        getattr(p, "placements", None) is not None for p in model.module.parameters())
    return out


def check_several_forwards_before_backwards(rank, world):
    mesh = _mesh()
    out = _train(FusedReducer(_tp_block(mesh), device_mesh=mesh["dp"]), mesh, STEPS,
                 order="1f1b")
    del out["local_params"]
    return out


def check_parameter_sharded_over_dp_is_refused(rank, world):
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = _mesh()
    block = _tp_block(mesh)
    torch.manual_seed(1)
    block.extra = nn.Parameter(distribute_tensor(torch.randn(4, 8), mesh["dp"], [Shard(0)]))
    try:
        FusedReducer(block, device_mesh=mesh["dp"])
    except FusedReducerError as e:
        return str(e)
    return "accepted"


# -- tests ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def outcomes(request):
    return checks.run(request, world_size=WORLD, timeout=240)


def _assert_exact(res, what):
    assert max(res["grads"]) < TOL and res["params"] < TOL, (what, res)
    assert res["placements_kept"], (what, res)


@checks.uses(check_exact_against_float64_and_ddp)
def test_tp_times_dp_matches_float64_global_batch_and_ddp(outcomes):
    for r in per_rank(outcomes, "check_exact_against_float64_and_ddp"):
        _assert_exact(r, "device_mesh=mesh['dp']")
        # From the copy from the second step on (the first grad_norm() call is torch's: see
        # FusedReducer.grad_norm).
        assert max(r["norm"]) < TOL and r["norm_source"][1:] == ["copy"] * (STEPS - 1), r
        assert r["vs_ddp"] < TOL, r


@checks.uses(check_process_group_argument_and_plain_layernorm)
def test_process_group_argument_with_a_plain_layernorm(outcomes):
    for r in per_rank(outcomes, "check_process_group_argument_and_plain_layernorm"):
        _assert_exact(r, "plain LayerNorm")
        assert max(r["norm"]) < TOL, r


@checks.uses(check_clip_grad_norm_matches_torch)
def test_norm_from_the_copy_is_torchs_dtensor_norm(outcomes):
    for r in per_rank(outcomes, "check_clip_grad_norm_matches_torch"):
        for step in (0, 1):
            assert r[step]["diff"] < 1e-5, r
        # inf was asked last: from the copy (a max over the TP group)
        assert r[1]["source"] == "copy", r
        _assert_exact(r["clipped"], "clip_grad_norm_")
        assert max(r["clipped"]["norm"]) < TOL, r


@checks.uses(check_buckets_reduce_dtype_check_finite_and_comm_hook)
def test_buckets_reduce_dtype_check_finite_and_comm_hooks(outcomes):
    for r in per_rank(outcomes, "check_buckets_reduce_dtype_check_finite_and_comm_hook"):
        _assert_exact(r["buckets"], "buckets + check_finite")
        assert r["buckets"]["count"] > 2 and r["buckets"]["allreduces"] == r["buckets"]["count"]
        assert max(r["bf16"]["grads"]) < 2e-3 and r["bf16"]["params"] < 2e-3, r["bf16"]
        assert r["bf16"]["placements_kept"]
        _assert_exact(r["hook"], "comm hook")


@checks.uses(check_sharded_optimizer)
def test_sharded_optimizer_with_dtensor_parameters_clips_by_the_global_norm(outcomes):
    for r in per_rank(outcomes, "check_sharded_optimizer"):
        assert r["params"] < TOL and max(r["norm"]) < TOL and r["placements_kept"], r


@checks.uses(check_several_forwards_before_backwards)
def test_tp_with_two_forwards_before_their_backwards(outcomes):
    for r in per_rank(outcomes, "check_several_forwards_before_backwards"):
        _assert_exact(r, "F1 F2 B1 B2")


@checks.uses(check_parameter_sharded_over_dp_is_refused)
def test_parameter_sharded_over_the_dp_dimension_is_refused_naming_fsdp(outcomes):
    for r in per_rank(outcomes, "check_parameter_sharded_over_dp_is_refused"):
        assert "'extra'" in r and "fully_shard" in r and "FSDP" in r, r
