"""Tensor parallel x data parallel: a block whose parameters are DTensors
(parallelize_module: ColwiseParallel + RowwiseParallel MLP, and a LayerNorm replicated over the
tensor-parallel dimension) on a 2 x 2 DeviceMesh ("dp", "tp") of 4 gloo ranks, wrapped with
FusedReducer(model, device_mesh=mesh["dp"]) (Note [DTensor parameters] in
core/tensor_parallel.py):
- trains exactly as a float64 single-process model on the global batch, and as DDP with
  torch's _pre_dp_module_transform, and param.grad keeps the parameter's placements;
- the norm from the copy is torch.nn.utils.clip_grad_norm_'s over the DTensor gradients (the
  shards summed over the TP group, replicated parameters once), and clipping with it is exact;
- several buckets, reduce_dtype, check_finite, a DDP comm hook and the ShardedOptimizer (its
  clip_grad_norm_ over the DP and TP shards; its 1- and inf-norms torch's) work as on a plain
  model; a LayerNorm left plain (not a DTensor) and two forwards before their backwards are exact
  too;
- a DTensor parameter tied between two modules gets both uses' gradients; a param.grad zeroed in
  place (set_to_none=False) or set by hand before a backward is what that backward adds to;
- a step adds no DTensor.from_local call to the bare TP block's (Note [One pass per step]), and a
  gradient that stays the same tensor (set_to_none=False, gradient_as_bucket_view) keeps its
  DTensor from step to step;
- tensor-parallel pipeline stages (mesh (pp, dp, tp) = (1, 2, 2)) under a split-backward schedule
  with find_unused_parameters stay exact and equal across the DP ranks;
- Megatron-style sequence parallelism (SequenceParallel LayerNorm, Shard(1) activations) is
  exact, its replicated LayerNorm's Partial gradient summed over the TP ranks by DTensor;
- a parameter sharded over the data-parallel dimension is refused naming it and FSDP;
- copies (Note [Copies of DTensor models]): copy.deepcopy of the parallelize_module model, and
  pickle / torch.save / deepcopy of a block whose TP conversions are written in its forward, give
  copies that attach again to the data-parallel group and train on exactly as the float64
  reference; pickling the parallelize_module model (torch's lambda hooks) raises
  FusedReducerError naming the hook and deepcopy / state_dict; a state_dict round trip keeps the
  DTensor parameters (their storage too) and training exact;
- torch.compile(model), model.compile() and FusedReducer(torch.compile(block)) (aot_eager) train
  as the eager wrapped model, with one all-reduce per bucket per step (the profiler's count equals
  the eager run's) and the forward captured in a graph.
"""
import copy
import pickle

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from fused_reducer import FusedReducer, FusedReducerError
from dist_utils import SelectedChecks, per_rank
from ddp_comparison import roundtrip

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


class HooklessBlock(Block):
    """The block with its tensor-parallel conversions in forward instead of torch's hooks
    (parallelize_module's are lambdas, which pickle cannot save): a picklable TP model."""

    def forward(self, x):
        from torch.distributed.tensor import DTensor, Replicate
        x = DTensor.from_local(x, self.up.weight.device_mesh, [Replicate()], run_check=False)
        return super().forward(x).full_tensor()


def _hookless_tp_block(mesh):
    """HooklessBlock, same initial values as _tp_block: up column-wise, down row-wise, the
    LayerNorm replicated, over mesh['tp']."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    torch.manual_seed(0)
    block = HooklessBlock()
    layout = {"norm": (Replicate(), Replicate()), "up": (Shard(0), Shard(0)),
              "down": (Shard(1), Replicate())}
    for owner, placements in layout.items():
        module = getattr(block, owner)
        for attr, placement in zip(("weight", "bias"), placements):
            local = getattr(module, attr).detach()
            setattr(module, attr, nn.Parameter(distribute_tensor(local, mesh["tp"], [placement])))
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
    out = {"norm": [], "other_norms": []}
    for step in range(STEPS):
        opt.zero_grad()
        model(_data(dp, step)).pow(2).mean().backward()
        # The 1- and inf-norms over the same shards, against torch's on the float64 gradients.
        reference = list(ref_grads[step].values())
        out["other_norms"].append({
            p: (float(opt.grad_norm(p)), float(torch.nn.utils.get_total_norm(reference, p)))
            for p in (1.0, float("inf"))})
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


def check_sequence_parallel(rank, world):
    """Megatron-style sequence parallelism: the LayerNorm under SequenceParallel (a replicated
    parameter whose gradient comes out Partial over the TP ranks, each holding half of the
    sequence), up ColwiseParallel from Shard(1), down RowwiseParallel back to Shard(1). Each TP
    rank feeds its half of the tokens of the DP rank's sequences; the parameters after each step
    and the norm from the copy against the float64 model on the whole global batch."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)
    mesh = _mesh()
    dp, tp = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    tokens = 4
    torch.manual_seed(0)
    block = Block()
    reference = copy.deepcopy(block).double()
    parallelize_module(block, mesh["tp"], {
        "norm": SequenceParallel(), "up": ColwiseParallel(input_layouts=Shard(1)),
        "down": RowwiseParallel(output_layouts=Shard(1))})
    model = FusedReducer(block, device_mesh=mesh["dp"], bucket_cap_mb=0.0005,
                         first_bucket_mb=0.0005)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)

    def sequences(d, step):
        g = torch.Generator().manual_seed(100 * step + d)
        return torch.randn(ROWS, tokens, 8, generator=g)
    out = {"params": [], "norm": [], "placements_kept": True}
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        mine = sequences(dp, step)[:, tp * tokens // 2:(tp + 1) * tokens // 2]
        (model(mine).pow(2).sum() / (ROWS * tokens * 8)).backward()
        out["placements_kept"] &= all(p.grad.placements == p.placements
                                      for p in block.parameters())
        norm = float(model.grad_norm())
        opt.step()
        ref_opt.zero_grad()
        everything = torch.cat([sequences(d, step) for d in range(2)]).double()
        reference(everything).pow(2).mean().backward()
        ref_norm = float(torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()]))
        out["norm"].append(abs(norm - ref_norm) / ref_norm)
        ref_opt.step()
        out["params"].append(_max_diff(dict(block.named_parameters()),
                                       dict(reference.named_parameters())))
    out["buckets"] = len(model.bucket_sizes())
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


def _sgd_steps(model, mesh, steps):
    """SGD on the DP rank's rows of `steps`; whether every param.grad kept its parameter's
    placements."""
    opt = torch.optim.SGD(model.parameters(), lr=LR, foreach=False)
    dp = mesh["dp"].get_local_rank()
    kept = True
    for step in steps:
        opt.zero_grad(set_to_none=True)
        model(_data(dp, step)).pow(2).mean().backward()
        kept &= all(type(p.grad) is type(p.data) and getattr(p.grad, "placements", None)
                    == getattr(p, "placements", None) for p in model.parameters())
        opt.step()
    return kept


def _placements(module):
    return {n: tuple(getattr(p, "placements", ())) for n, p in module.named_parameters()}


def check_copies_train_on_exactly(rank, world):
    """Models trained one step (step 0) and copied by torch.save, pickle and deepcopy: each copy
    that is made trains steps 1 and 2 on (float64 reference: three steps), attached to the
    data-parallel group again; the original trains on too. A copy refused: the message."""
    mesh = _mesh()
    ref = _reference(STEPS)[2]
    dp_ranks = dist.get_process_group_ranks(mesh["dp"].get_group())
    originals = {
        "hookless, device_mesh": FusedReducer(_hookless_tp_block(mesh), device_mesh=mesh["dp"]),
        "parallelize_module, process_group": FusedReducer(
            _tp_block(mesh), process_group=mesh["dp"].get_group()),
    }
    out = {}
    for kind, model in originals.items():
        _sgd_steps(model, mesh, [0])
        for how in ("torch.save", "pickle", "deepcopy"):
            try:
                c = roundtrip(model, how)
            except FusedReducerError as e:
                out[kind, how] = str(e)
                continue
            r = {"type": type(c).__name__,
                 "equal_at_load": _max_diff(dict(c.module.named_parameters()),
                                            {n: _full(p).detach().double() for n, p
                                             in model.module.named_parameters()}),
                 "placements": _placements(c.module) == _placements(model.module)}
            r["placements_kept"] = _sgd_steps(c, mesh, range(1, STEPS))
            r["params"] = _max_diff(dict(c.module.named_parameters()), ref)
            r["dp_group"] = dist.get_process_group_ranks(c.process_group) == dp_ranks
            c.close()
            out[kind, how] = r
        try:
            pickle.dumps(model.module)
            out[kind, "unwrapped"] = "pickled"
        except Exception as e:  # noqa: BLE001 - torch's own limitation, recorded
            out[kind, "unwrapped"] = f"{type(e).__name__}: {e}"
        _sgd_steps(model, mesh, range(1, STEPS))
        out[kind, "original"] = _max_diff(dict(model.module.named_parameters()), ref)
    return out


def check_state_dict_round_trip(rank, world):
    """state_dict after step 0, two more steps, load_state_dict: the parameters are the same
    DTensors (same local storage: the reducer's leaves) holding step 0's values, and steps 1 and
    2 again end at the float64 reference's three steps; the same for a fresh wrapped model
    (perturbed first) loading it. load_state_dict(assign=True) is refused at the next forward."""
    mesh = _mesh()
    ref = _reference(STEPS)[2]
    model = FusedReducer(_tp_block(mesh), device_mesh=mesh["dp"])
    _sgd_steps(model, mesh, [0])
    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    params = dict(model.module.named_parameters())
    ptrs = {n: p.to_local().data_ptr() for n, p in params.items()}
    out = {"keys": sorted(saved) == sorted(f"module.{n}" for n in params),
           "saved_dtensors": all(tuple(getattr(saved[f"module.{n}"], "placements", ()))
                                 == tuple(p.placements) for n, p in params.items())}
    _sgd_steps(model, mesh, range(1, STEPS))
    model.load_state_dict(saved)
    now = dict(model.module.named_parameters())
    out["same_parameters"] = all(now[n] is params[n] and now[n].to_local().data_ptr() == ptrs[n]
                                 for n in params)
    out["restored"] = _max_diff(now, {n: _full(saved[f"module.{n}"]).double() for n in params})
    out["placements_kept"] = _sgd_steps(model, mesh, range(1, STEPS))
    out["params"] = _max_diff(dict(model.module.named_parameters()), ref)
    fresh = FusedReducer(_tp_block(mesh), device_mesh=mesh["dp"])
    with torch.no_grad():
        for p in fresh.parameters():
            p.mul_(0.5)
    fresh.load_state_dict(saved)
    _sgd_steps(fresh, mesh, range(1, STEPS))
    out["fresh"] = _max_diff(dict(fresh.module.named_parameters()), ref)
    assigned = FusedReducer(_tp_block(mesh), device_mesh=mesh["dp"])
    assigned.load_state_dict(saved, assign=True)
    try:
        _sgd_steps(assigned, mesh, [1])
        out["assign"] = "accepted"
    except FusedReducerError as e:
        out["assign"] = str(e)
    return out


def check_torch_compile(rank, world):
    """torch.compile(model), model.compile() and FusedReducer(torch.compile(block)), backend
    aot_eager, three buckets: per step the parameters' difference from the eager wrapped model's,
    the profiler's all-reduces (the buckets' and the TP layers' own) against the eager run's and
    the reducer's count; the graphs dynamo captured; at the end the float64 reference."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    from fused_reducer.testing.collectives import count_allreduces
    mesh = _mesh()
    small = dict(bucket_cap_mb=0.0005, first_bucket_mb=0.0005)
    dp = mesh["dp"].get_local_rank()
    ref = _reference(STEPS)[2]

    def run(model, wrapper, module):
        opt = torch.optim.SGD(module.parameters(), lr=LR, foreach=False)
        res = {"params": [], "allreduces": [], "reducer": [], "placements_kept": True}
        for step in range(STEPS):
            opt.zero_grad(set_to_none=True)
            res["allreduces"].append(count_allreduces(
                lambda: model(_data(dp, step)).pow(2).mean().backward()))
            res["reducer"].append(wrapper.stats()["allreduces"])
            res["placements_kept"] &= all(
                tuple(getattr(p.grad, "placements", ())) == tuple(p.placements)
                for p in module.parameters())
            opt.step()
            res["params"].append({n: _full(p).detach().clone()
                                  for n, p in module.named_parameters()})
        return res

    wrapper = FusedReducer(_tp_block(mesh), device_mesh=mesh["dp"], **small)
    eager = run(wrapper, wrapper, wrapper.module)
    out = {"buckets": len(wrapper.bucket_sizes()), "eager_allreduces": eager["allreduces"],
           "eager_reducer": eager["reducer"]}
    for how in ("torch.compile", "model.compile", "inner"):
        torch._dynamo.reset()
        counters.clear()
        if how == "inner":
            compiled = torch.compile(_tp_block(mesh), backend="aot_eager")
            wrapper = model = FusedReducer(compiled, device_mesh=mesh["dp"], **small)
            module = compiled._orig_mod
        else:
            wrapper = FusedReducer(_tp_block(mesh), device_mesh=mesh["dp"], **small)
            module = wrapper.module
            if how == "model.compile":
                wrapper.compile(backend="aot_eager")
                model = wrapper
            else:
                model = torch.compile(wrapper, backend="aot_eager")
        res = run(model, wrapper, module)
        out[how] = {
            "vs_eager": [max(float((ours[n] - theirs[n]).abs().max()) for n in ours)
                         for ours, theirs in zip(res["params"], eager["params"])],
            "params": _max_diff(res["params"][-1], ref),
            "allreduces": res["allreduces"], "reducer": res["reducer"],
            "placements_kept": res["placements_kept"],
            "graphs": counters["stats"]["unique_graphs"]}
        wrapper.close()
    torch._dynamo.reset()
    return out


class TiedBlock(Block):
    """The block with a second column-wise Linear `gate` whose weight is tied to up's (one
    parameter owned by two modules; its own bias)."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(8, 32)

    def forward(self, x):
        x = self.norm(x)
        return self.down(torch.relu(self.up(x)) * torch.sigmoid(self.gate(x)))


def check_tied_dtensor_parameter(rank, world):
    """up.weight and gate.weight one DTensor parameter (tied after parallelize_module): the
    gradients of both uses reach it, as in the float64 model with the same tie on the global
    batch; grads and parameters per step."""
    from torch.distributed.tensor import distribute_module
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    mesh = _mesh()
    dp = mesh["dp"].get_local_rank()
    torch.manual_seed(0)
    block = TiedBlock()
    reference = copy.deepcopy(block).double()
    reference.gate.weight = reference.up.weight
    parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "gate": ColwiseParallel(),
                                           "down": RowwiseParallel()})
    distribute_module(block.norm, mesh["tp"], input_fn=_replicated_input,
                      output_fn=_local_output)
    block.gate.weight = block.up.weight
    model = FusedReducer(block, device_mesh=mesh["dp"])
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    out = {"grads": [], "params": [], "tied": block.gate.weight is block.up.weight,
           "placements_kept": True}
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        model(_data(dp, step)).pow(2).mean().backward()
        ref_opt.zero_grad()
        x = torch.cat([_data(d, step, dtype=torch.float64) for d in range(2)])
        reference(x).pow(2).mean().backward()
        named = dict(block.named_parameters())
        out["placements_kept"] &= all(p.grad.placements == p.placements for p in named.values())
        out["grads"].append(_max_diff({n: p.grad for n, p in named.items()},
                                      {n: p.grad for n, p in reference.named_parameters()}))
        opt.step()
        ref_opt.step()
        out["params"].append(_max_diff(named, dict(reference.named_parameters())))
    out["tied"] &= block.gate.weight is block.up.weight
    return out


def check_gradients_kept_or_set_by_hand(rank, world):
    """param.grad of the DTensor parameters not cleared between steps: (a) zero_grad(
    set_to_none=False) (zeroed in place), (b) set by hand to new DTensors before each backward
    (0.01 * param, as a weight-decay term would be; the backward accumulates onto it). Per step
    the gradients and parameters against the float64 model on the global batch doing the
    same."""
    mesh = _mesh()
    dp = mesh["dp"].get_local_rank()
    out = {}
    for how in ("set_to_none=False", "set by hand"):
        torch.manual_seed(0)
        reference = Block().double()
        model = FusedReducer(_tp_block(mesh), device_mesh=mesh["dp"])
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
        res = {"grads": [], "params": [], "placements_kept": True}
        for step in range(STEPS):
            for o, m in ((opt, model), (ref_opt, reference)):
                o.zero_grad(set_to_none=False)
                if how == "set by hand":
                    for p in m.parameters():
                        p.grad = 0.01 * p.detach()
            model(_data(dp, step)).pow(2).mean().backward()
            x = torch.cat([_data(d, step, dtype=torch.float64) for d in range(2)])
            reference(x).pow(2).mean().backward()
            named = dict(model.module.named_parameters())
            res["placements_kept"] &= all(p.grad.placements == p.placements
                                          for p in named.values())
            res["grads"].append(_max_diff({n: p.grad for n, p in named.items()},
                                          {n: p.grad for n, p in reference.named_parameters()}))
            opt.step()
            ref_opt.step()
        res["params"] = _max_diff(dict(model.module.named_parameters()),
                                  dict(reference.named_parameters()))
        out[how] = res
    return out


def check_per_step_cost(rank, world):
    """Note [One pass per step]: DTensor.from_local calls per step of the wrapped block against
    the bare TP block (its own input/output conversions), counted by patching torch's
    from_local; with zero_grad(set_to_none=False) and with gradient_as_bucket_view=True, whether
    each P.grad stays the same DTensor object from step to step, and the gradients against the
    float64 model on the global batch."""
    from torch.distributed.tensor import DTensor
    mesh = _mesh()
    dp = mesh["dp"].get_local_rank()
    calls = [0]
    original = DTensor.from_local

    def counting(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    def from_local_calls(module, steps=2):
        module(_data(dp, 0)).pow(2).mean().backward()  # warm: the first forward builds
        DTensor.from_local = staticmethod(counting)
        try:
            calls[0] = 0
            for step in range(steps):
                module.zero_grad(set_to_none=True)
                module(_data(dp, step)).pow(2).mean().backward()
        finally:
            DTensor.from_local = staticmethod(original)
        return calls[0]

    out = {"bare": from_local_calls(_tp_block(mesh)),
           "wrapped": from_local_calls(FusedReducer(_tp_block(mesh), device_mesh=mesh["dp"]))}
    for how, kwargs, set_to_none in (("set_to_none=False", {}, False),
                                     ("gradient_as_bucket_view", {"gradient_as_bucket_view": True},
                                      True)):
        torch.manual_seed(0)
        reference = Block().double()
        model = FusedReducer(_tp_block(mesh), device_mesh=mesh["dp"], **kwargs)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
        res = {"grads": [], "same_grad_objects": []}
        previous = None
        for step in range(STEPS):
            opt.zero_grad(set_to_none=set_to_none)
            ref_opt.zero_grad()
            model(_data(dp, step)).pow(2).mean().backward()
            x = torch.cat([_data(d, step, dtype=torch.float64) for d in range(2)])
            reference(x).pow(2).mean().backward()
            named = dict(model.module.named_parameters())
            grads = [id(p.grad) for n, p in named.items() if hasattr(p, "to_local")]
            if previous is not None:
                res["same_grad_objects"].append(grads == previous)
            previous = grads
            res["grads"].append(_max_diff({n: p.grad for n, p in named.items()},
                                          {n: p.grad for n, p in reference.named_parameters()}))
            opt.step()
            ref_opt.step()
        out[how] = res
    return out


def check_split_backward_with_find_unused_parameters(rank, world):
    """TP=2 x DP=2, the two stages of a pipeline on each DP rank (mesh (pp, dp, tp) = (1, 2, 2))
    under ScheduleInterleavedZeroBubble, each stage an MLP (ColwiseParallel + RowwiseParallel) in
    a FusedReducer(find_unused_parameters=True) over mesh['dp']: the second stage's split weight
    halves stay local and REDUCE_GRAD reduces them (Note [Split backward]). Per step: the
    parameters against the float64 model of both stages on the global batch, how far the two DP
    ranks' parameters are apart, the reductions per stage."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import ScheduleInterleavedZeroBubble
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    from fused_reducer.pipelining import PipelineStage
    mesh = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    dp = mesh["dp"].get_local_rank()
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8)) for _ in range(2)]
    reference = copy.deepcopy(nn.Sequential(*blocks)).double()
    models, stages = [], []
    for index, block in enumerate(blocks):
        parallelize_module(block, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        model = FusedReducer(block, device_mesh=mesh["dp"], find_unused_parameters=True,
                             bucket_cap_mb=0.0005, first_bucket_mb=0.0005)
        models.append(model)
        stages.append(PipelineStage(model, index, 2, torch.device("cpu"),
                                    group=mesh["pp"].get_group()))

    def loss_fn(out, target):
        return (out - target).pow(2).mean()
    schedule = ScheduleInterleavedZeroBubble(stages, n_microbatches=4, loss_fn=loss_fn)
    opt = torch.optim.SGD([p for m in models for p in m.parameters()], lr=LR)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)

    def batch(d, step, dtype=torch.float32):
        g = torch.Generator().manual_seed(100 * step + d)
        return torch.randn(8, 8, generator=g).to(dtype), torch.randn(8, 8, generator=g).to(dtype)
    out = {"params": [], "dp_spread": [], "reductions": []}
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        before = [m.stats()["step"] for m in models]
        x, y = batch(dp, step)
        schedule.step(x, target=y)
        out["reductions"].append([m.stats()["step"] - b for m, b in zip(models, before)])
        opt.step()
        ref_opt.zero_grad()
        xs, ys = zip(*(batch(d, step, torch.float64) for d in range(2)))
        loss_fn(reference(torch.cat(xs)), torch.cat(ys)).backward()
        ref_opt.step()
        ours = {f"{i}.{n}": p for i, b in enumerate(blocks) for n, p in b.named_parameters()}
        out["params"].append(_max_diff(ours, dict(reference.named_parameters())))
        spread = 0.0
        for p in ours.values():  # max - min over the DP group, elementwise
            local = p.detach().to_local()
            hi, lo = local.clone(), -local
            dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=mesh["dp"].get_group())
            dist.all_reduce(lo, op=dist.ReduceOp.MAX, group=mesh["dp"].get_group())
            spread = max(spread, float((hi + lo).abs().max()))
        out["dp_spread"].append(spread)
    return out


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


@checks.uses(check_sharded_optimizer)
def test_sharded_optimizer_with_dtensor_parameters_reports_the_global_1_and_inf_norms(outcomes):
    """The inf-norm is the largest |g| over every DP and TP shard (a maximum, not a sum, over
    the DP group), the 1-norm their sum: torch's norms of the float64 model's gradients."""
    for r in per_rank(outcomes, "check_sharded_optimizer"):
        for norms in r["other_norms"]:
            for p, (ours, reference) in norms.items():
                assert abs(ours - reference) < 1e-6 * max(1.0, reference), (p, norms)


@checks.uses(check_several_forwards_before_backwards)
def test_tp_with_two_forwards_before_their_backwards(outcomes):
    for r in per_rank(outcomes, "check_several_forwards_before_backwards"):
        _assert_exact(r, "F1 F2 B1 B2")


@checks.uses(check_sequence_parallel)
def test_sequence_parallel_matches_float64_global_batch(outcomes):
    for r in per_rank(outcomes, "check_sequence_parallel"):
        assert max(r["params"]) < TOL and max(r["norm"]) < 1e-6, r
        assert r["placements_kept"] and r["buckets"] > 1, r


@checks.uses(check_parameter_sharded_over_dp_is_refused)
def test_parameter_sharded_over_the_dp_dimension_is_refused_naming_fsdp(outcomes):
    for r in per_rank(outcomes, "check_parameter_sharded_over_dp_is_refused"):
        assert "'extra'" in r and "fully_shard" in r and "FSDP" in r, r


@checks.uses(check_copies_train_on_exactly)
def test_copies_of_a_tp_model_attach_to_the_dp_group_and_train_exactly(outcomes):
    hookless, tp_hooks = "hookless, device_mesh", "parallelize_module, process_group"
    for r in per_rank(outcomes, "check_copies_train_on_exactly"):
        copies = [(hookless, how) for how in ("torch.save", "pickle", "deepcopy")]
        copies.append((tp_hooks, "deepcopy"))
        for key in copies:
            c = r[key]
            assert c["type"] == "FusedReducer" and c["equal_at_load"] == 0.0, (key, c)
            assert c["placements"] and c["placements_kept"] and c["dp_group"], (key, c)
            assert c["params"] < TOL, (key, c)
        for how in ("torch.save", "pickle"):  # torch's lambda hooks: refused, saying what works
            message = r[tp_hooks, how]
            assert isinstance(message, str), (how, message)
            for part in ("distribute_module.<locals>.<lambda>", "copy.deepcopy(model)",
                         "state_dict", "torch.distributed.checkpoint"):
                assert part in message, (how, message)
        assert r[hookless, "unwrapped"] == "pickled"
        assert "Can't pickle local object" in r[tp_hooks, "unwrapped"], r[tp_hooks, "unwrapped"]
        assert r[hookless, "original"] < TOL and r[tp_hooks, "original"] < TOL, r


@checks.uses(check_state_dict_round_trip)
def test_state_dict_round_trip_keeps_dtensor_parameters_and_training_exact(outcomes):
    for r in per_rank(outcomes, "check_state_dict_round_trip"):
        assert r["keys"] and r["saved_dtensors"] and r["same_parameters"], r
        assert r["restored"] == 0.0 and r["placements_kept"], r
        assert r["params"] < TOL and r["fresh"] < TOL, r
        assert "assign=True" in r["assign"], r["assign"]


@checks.uses(check_torch_compile)
def test_torch_compile_of_a_tp_model_trains_as_eager_reducing_once_per_bucket(outcomes):
    for r in per_rank(outcomes, "check_torch_compile"):
        buckets = r["buckets"]
        assert buckets == 3 and r["eager_reducer"] == [buckets] * STEPS, r
        for how in ("torch.compile", "model.compile", "inner"):
            c = r[how]
            assert max(c["vs_eager"]) < 1e-6 and c["params"] < TOL, (how, c)
            assert c["placements_kept"] and c["graphs"] >= 1, (how, c)
            # the profiler's count: the buckets' all-reduces and the TP layers', as in eager
            assert c["allreduces"] == r["eager_allreduces"], (how, c, r["eager_allreduces"])
            assert c["reducer"] == [buckets] * STEPS, (how, c)


@checks.uses(check_tied_dtensor_parameter)
def test_dtensor_parameter_tied_between_two_modules_gets_both_uses_gradients(outcomes):
    for r in per_rank(outcomes, "check_tied_dtensor_parameter"):
        assert r["tied"] and r["placements_kept"], r
        assert max(r["grads"]) < TOL and max(r["params"]) < TOL, r


@checks.uses(check_gradients_kept_or_set_by_hand)
def test_dtensor_gradients_kept_or_set_by_hand_are_accumulated_onto(outcomes):
    """A param.grad zeroed in place or replaced by hand before a backward is what the backward
    adds to (and the reducer averages), not the previous step's gradient."""
    for r in per_rank(outcomes, "check_gradients_kept_or_set_by_hand"):
        for how, res in r.items():
            assert max(res["grads"]) < TOL and res["params"] < TOL, (how, res)
            assert res["placements_kept"], (how, res)


@checks.uses(check_per_step_cost)
def test_dtensor_views_and_gradients_are_not_rebuilt_every_step(outcomes):
    """The wrapper adds no DTensor.from_local call to a step (the views of the leaves are built
    once; a new gradient gets the cheap constructor), and a gradient that stays the same tensor
    (zeroed in place, or a bucket view) keeps its DTensor across steps, exactly."""
    for r in per_rank(outcomes, "check_per_step_cost"):
        assert r["bare"] > 0 and r["wrapped"] == r["bare"], r
        assert r["set_to_none=False"]["same_grad_objects"] == [True] * (STEPS - 1), r
        # Bucket views: from the second step on (the rebuild after the first makes new ones).
        assert r["gradient_as_bucket_view"]["same_grad_objects"][1:] == [True] * (STEPS - 2), r
        for how in ("set_to_none=False", "gradient_as_bucket_view"):
            assert max(r[how]["grads"]) < TOL, (how, r)


@checks.uses(check_split_backward_with_find_unused_parameters)
def test_tp_stages_split_backward_with_find_unused_parameters_stay_exact_and_in_step(outcomes):
    """find_unused_parameters with tensor-parallel stages under a split-backward schedule:
    REDUCE_GRAD's reduction of the weight halves reaches the DTensor parameters' leaves, so the
    DP ranks stay equal and match the float64 model; each stage reduces once per step."""
    for r in per_rank(outcomes, "check_split_backward_with_find_unused_parameters"):
        assert max(r["dp_spread"]) == 0.0, r
        assert max(r["params"]) < TOL, r
        assert r["reductions"] == [[1, 1]] * STEPS, r
