"""Tensor-parallel parameters under FusedReducer: a model whose parameters are DTensors
(torch.distributed.tensor.parallel.parallelize_module over a tensor-parallel mesh dimension) is
wrapped with ``FusedReducer(model, device_mesh=mesh["dp"])``; each parameter's local shard is
reduced over the data-parallel group only, and ``param.grad`` stays a DTensor with the
parameter's placements.

Note [DTensor parameters]
The C++ reducer moves plain tensors: its hooks sit on the gradient accumulators of the
parameters it is given, and it copies their gradients into flat buckets. A DTensor is a
wrapper whose gradient is a DTensor too; copying it into a plain bucket dispatches to DTensor's
operators, which refuse mixed operands ("got mixed torch.Tensor and DTensor"). DDP solves this
with _pre_dp_module_transform: the module's parameters are replaced for good by plain local
Parameters, and forward hooks rebuild DTensors from them for each forward; the user's model then
holds plain tensors (state_dict, optimizer and clip_grad_norm_ see local shards).
Here the model keeps its DTensor parameters. Each DTensor parameter P gets a plain leaf L that
shares P's local storage (``P.to_local().detach().requires_grad_()``), and the C++ reducer is
given L. For the duration of each FusedReducer.forward, P is replaced in its owning modules by
``DTensor.from_local(L, P's mesh and placements)``, a differentiable view: backward then
accumulates the local gradient (in the parameter's placements: DTensor's from_local backward
redistributes to them) into L.grad, where the reducer's hooks fire and average it over the DP
group as any other gradient (buckets, reduce_dtype, check_finite, comm hooks unchanged). After
the forward the module holds P again, so everything outside forward (state_dict, optimizers,
parameters(), clip_grad_norm_) sees DTensors; at the end of each backward P.grad is published as
a DTensor view of L.grad (same storage: clipping or zeroing P.grad acts on what the reducer
wrote, and an optimizer step on P updates L's storage). Before each forward L.grad follows
P.grad (zero_grad(set_to_none=True) on P clears L.grad; a P.grad set by hand becomes L.grad).
See Note [One pass per step] for what each step costs. Parameters sharded over mesh dimensions
that include data-parallel ranks are refused: their
shards differ across the DP group, so averaging them is meaningless (that is FSDP's layout).
A ShardedOptimizer maps the DTensor parameters it is given to the leaves (the attachment's
module_params) and shards the leaves' buckets; its norm sums the DP shards, then the TP shards
(norm_of_pieces). In sharded mode P.grad stays None after a synchronised backward: the averaged
gradient exists only as shards.

Note [One pass per step]
What a step runs in Python per DTensor parameter is kept to what cannot be avoided. Built once
(at attach): each parameter's leaf, its DTensor view (from_local's backward node saves no
tensors, so one view serves every forward and backward), and the list of module slots to swap.
Per forward, one pass: the slots swapped to the views and back (a dict store each), and each
P.grad read, because torch's zero_grad(set_to_none=True) clears it without telling anyone and
the leaf must follow: an identity test when P.grad is still what the last backward published.
Per backward, P.grad is published only where autograd made a new gradient tensor (after
set_to_none), through the DTensor constructor with the parameter's own spec (from_local costs
about 20 us a call: a new spec and an autograd Function; the constructor 2.4 us); a gradient
that is still the published one's (zeroed in place; a bucket view, even after set_to_none)
keeps its DTensor. DDP with
torch's _pre_dp_module_transform runs a pass over the parameters per forward as well. Measured
on 16 DTensor parameters, 4 ranks on 2 CPU cores: 0.5 ms per step in all, from 2.7 ms when each
forward built new views and each backward called from_local (bench/large_models_bench.py).

Note [Copies of DTensor models]
A copy of a FusedReducer (pickle, torch.save(model), copy.deepcopy) drops the group and the
reducer and attaches again at its first forward, as for a plain model; a plain model attaches to
the default group, which for a tensor-parallel model also holds the TP ranks (its shards would
be averaged with each other: refused by _refuse_sharded_over_dp). The copy of a model with
DTensor parameters therefore keeps the name of its data-parallel group and attaches to that group
again (group_named: as DeviceMesh finds its groups after unpickling); a process without a group
of that name raises, naming what to do. The plain leaves (the attachment's tensor_parallel) are
rebuilt from the copy's DTensor parameters when it attaches. parallelize_module and distribute_module register their
input/output conversions as lambdas, which pickle cannot save (the unwrapped module fails alike,
"Can't pickle local object 'distribute_module.<locals>.<lambda>'"): pickling such a model raises
FusedReducerError naming the hook and the ways that work (copy.deepcopy, which copies hooks by
reference; the state_dict or torch.distributed.checkpoint for saving). torch.compile needs
nothing more: the swap of Note [DTensor parameters] runs in the compiled forward (the DTensor
views enter the graph as inputs) and the bookkeeping stays outside it (torch.compiler.disable).
"""
import contextlib
import functools
import math
import types

import torch
import torch.distributed as dist

from ..errors import FusedReducerError

try:
    from torch.distributed.tensor import DTensor, Replicate
except ImportError:  # pragma: no cover - torch without DTensor
    DTensor = None
    Replicate = None


def is_dtensor(t):
    return DTensor is not None and isinstance(t, DTensor)


def local_of(t):
    """The local tensor of a DTensor (detached), else `t` itself."""
    if is_dtensor(t):
        with torch.no_grad():
            return t.to_local().detach()
    return t


def _sharded_dims(p):
    """The mesh dimensions over which DTensor `p` is not replicated."""
    return tuple(i for i, pl in enumerate(p.placements) if not isinstance(pl, Replicate))


def _refuse_sharded_over_dp(name, p, dp_group):
    dp_ranks = set(dist.get_process_group_ranks(dp_group))
    for dim in _sharded_dims(p):
        dim_ranks = set(dist.get_process_group_ranks(p.device_mesh.get_group(dim)))
        if len(dim_ranks & dp_ranks) > 1:
            dim_name = (p.device_mesh.mesh_dim_names or [None] * p.device_mesh.ndim)[dim]
            label = f"'{dim_name}'" if dim_name else str(dim)
            raise FusedReducerError(
                f"FusedReducer: parameter '{name}' is a DTensor with placements "
                f"{tuple(p.placements)} on {p.device_mesh}: it is sharded ({p.placements[dim]}) "
                f"over mesh dimension {label}, whose ranks {sorted(dim_ranks)} include ranks of the "
                f"data-parallel group FusedReducer averages over ({sorted(dp_ranks)}). Its shards "
                "differ across that group, so they cannot be averaged. Shard parameters over the "
                "tensor-parallel dimension only (parallelize_module(model, mesh['tp'], plan)) and "
                "pass the data-parallel dimension to FusedReducer (device_mesh=mesh['dp']); for "
                "parameters sharded over the data-parallel dimension use FSDP "
                "(torch.distributed.fsdp.fully_shard).")


def group_named(name):
    """The process group registered under `name` (None for None): see Note [Copies of DTensor
    models]."""
    if name is None:
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group
    try:
        return _resolve_process_group(name)
    except RuntimeError as e:
        raise FusedReducerError(
            "FusedReducer: this copy of a model with DTensor parameters attaches again to the "
            f"data-parallel group it was wrapped with (process group '{name}'), but this process "
            "has no group of that name (loaded in another job?). Create the device mesh (or the "
            "groups) as the saving job did before the copy's first forward, or wrap its module "
            "again: FusedReducer(copy.module, device_mesh=mesh['dp']).") from e


def _local_function(hook):
    """`hook`'s function if pickle cannot save it (a lambda or a function defined inside
    another: pickle saves functions by qualified name), else None."""
    while isinstance(hook, functools.partial):
        hook = hook.func
    fn = getattr(hook, "__func__", hook)
    if isinstance(fn, types.FunctionType) and ("<locals>" in fn.__qualname__
                                               or "<lambda>" in fn.__qualname__):
        return fn
    return None


def refuse_unpicklable_hooks(module):
    """Pickling a model with DTensor parameters: refused, naming the hook, if a module hook is a
    function pickle cannot save (Note [Copies of DTensor models])."""
    for name, sub in module.named_modules():
        for attr, hooks in vars(sub).items():
            if not (attr.endswith("_hooks") and isinstance(hooks, dict)):
                continue
            for hook in hooks.values():
                fn = _local_function(hook)
                if fn is None:
                    continue
                where = f"module '{name}'" if name else "the wrapped module"
                raise FusedReducerError(
                    f"FusedReducer: this tensor-parallel model cannot be pickled (pickle, "
                    f"torch.save(model)): {where} has the hook {fn.__module__}.{fn.__qualname__} "
                    f"({attr}), a function pickle cannot save. torch.distributed.tensor's "
                    "parallelize_module and distribute_module register such hooks, so the module "
                    "cannot be pickled unwrapped either. For a copy in this job use "
                    "copy.deepcopy(model) (it attaches again to the same data-parallel group at its "
                    "first forward); to save the model save its weights, "
                    "torch.save(model.state_dict()) or torch.distributed.checkpoint, and load them "
                    "with load_state_dict into a model built, parallelized and wrapped the same way.")


def _key(sharding):
    """None for a replicated parameter, else (mesh, sharded dims) as a hashable key."""
    return None if sharding is None or not sharding[1] else (id(sharding[0]), sharding[1])


class _Entry:
    """One DTensor parameter: its plain leaf, the modules holding it, and the two DTensors the
    step reuses (Note [One pass per step]): `view`, the differentiable view of the leaf the
    modules hold during a forward, and `published`, the last P.grad made from `published_from`
    (the leaf's gradient it views)."""
    __slots__ = ("name", "param", "leaf", "owners", "view", "published", "published_from")

    def __init__(self, name, param, owners):
        self.name = name
        self.param = param
        with torch.no_grad():
            local = param.to_local()
        self.leaf = local.detach().requires_grad_(True)
        self.owners = owners  # [(module, attribute)] holding `param` (tied: several)
        with torch.enable_grad():  # its backward node saves nothing: reusable by every backward
            self.view = DTensor.from_local(self.leaf, param.device_mesh, param.placements,
                                           run_check=False, shape=param.shape,
                                           stride=param.stride())
        self.published = self.published_from = None

    def replaced(self):
        """Whether the parameter, or its local storage, is no longer what the leaf shares."""
        local = self.param._local_tensor
        if local.data_ptr() != self.leaf.data_ptr() or local.shape != self.leaf.shape:
            return True
        for owner, attr in self.owners:
            if owner._parameters.get(attr) is not self.param:
                return True
        return False

    def gradient_of(self, local_grad):
        """A DTensor gradient viewing `local_grad`, with the parameter's own spec: the DTensor
        constructor, since from_local rebuilds the spec and runs an autograd Function (about 10
        times the cost, per parameter and step; Note [One pass per step])."""
        return DTensor(local_grad, self.param._spec, requires_grad=False)


class TensorParallelParameters:
    """The DTensor parameters of a wrapped module and their plain leaves: see Note [DTensor
    parameters]. `reduced(named)` is what the C++ reducer is given."""

    def __init__(self, module, named, dp_group, grads_are_bucket_views=False):
        # With gradient_as_bucket_view the leaf's gradient is the same tensor at every step:
        # its DTensor is kept across zero_grad(set_to_none=True) (it holds no memory of its own).
        self._keep_published = grads_are_bucket_views
        owners = {}
        for qualified, p in module.named_parameters(remove_duplicate=False):
            if is_dtensor(p):
                owner_name, _, attr = qualified.rpartition(".")
                owners.setdefault(id(p), []).append((module.get_submodule(owner_name), attr))
        self.entries = {}  # id(param) -> _Entry
        for name, p in named:
            if is_dtensor(p):
                _refuse_sharded_over_dp(name, p, dp_group)
                self.entries[id(p)] = _Entry(name, p, owners[id(p)])
        # The module slots a forward swaps: (their dict, attribute, view, parameter).
        self._swaps = [(owner._parameters, attr, e.view, e.param)
                       for e in self.entries.values() for owner, attr in e.owners]
        # Per reduced parameter (reducer index): the mesh dims its local shard is split over.
        self.sharding = [(self.entries[id(p)].param.device_mesh, _sharded_dims(p))
                         if id(p) in self.entries else None for _, p in named]

    def __bool__(self):
        return bool(self.entries)

    def module_params(self, reduced):
        """The module's parameter for each of the reducer's (`reduced`, by index)."""
        by_leaf = {id(e.leaf): e.param for e in self.entries.values()}
        return [by_leaf.get(id(t), t) for t in reduced]

    def reduced(self, named):
        """The tensors the C++ reducer reduces: the leaf of each DTensor parameter, the others
        as they are."""
        return [self.entries[id(p)].leaf if id(p) in self.entries else p for _, p in named]

    @contextlib.contextmanager
    def swapped_in(self):
        """During a forward: each DTensor parameter replaced by its DTensor view of the leaf, so
        that backward accumulates into the leaf."""
        try:
            for slots, attr, view, _ in self._swaps:
                slots[attr] = view
            yield
        finally:
            for slots, attr, _, param in self._swaps:
                slots[attr] = param

    def adopt_gradients(self):
        """Before a forward: each leaf's .grad follows its parameter's (see Note [DTensor
        parameters]); a parameter replaced in its module, or whose local storage was replaced,
        is refused (the swap would otherwise put the old parameter back after the forward)."""
        for e in self.entries.values():
            if e.replaced():
                raise FusedReducerError(
                    f"FusedReducer: DTensor parameter '{e.name}' or its local tensor was replaced "
                    "after wrapping (param.data = ..., load_state_dict(assign=True), a new "
                    "DTensor or Parameter set on the module): the reducer still holds the old "
                    "storage. Update parameters in place (load_state_dict without assign, "
                    "param.copy_), or wrap the module again.")
            grad = e.param.grad
            if grad is not None and grad is e.published:
                continue  # still the view of the leaf's gradient published after the backward
            if grad is None:
                e.leaf.grad = None
                if not self._keep_published:  # else: a bucket view, published again as it was
                    e.published = e.published_from = None
            else:  # set by hand: the leaf takes its local tensor
                e.published = e.published_from = None
                local_grad = grad.to_local() if is_dtensor(grad) else grad
                if e.leaf.grad is None or local_grad.data_ptr() != e.leaf.grad.data_ptr():
                    e.leaf.grad = local_grad.detach()

    def publish_gradients(self):
        """After a backward: P.grad = a DTensor view of L.grad (None where L has none, or holds
        the placeholder of a gradient released to a ShardedOptimizer's shards); the DTensor of
        the previous step where L.grad is still the tensor it views (a bucket view, a gradient
        zeroed in place)."""
        with torch.no_grad():
            for e in self.entries.values():
                grad = e.leaf.grad
                if grad is None or type(grad) is not torch.Tensor:
                    e.param.grad = e.published = e.published_from = None
                    continue
                current = e.param.grad
                if grad is e.published_from and (current is None or current is e.published):
                    e.param.grad = e.published
                    continue
                if not (is_dtensor(current) and current._local_tensor.data_ptr() == grad.data_ptr()
                        and current._local_tensor.shape == grad.shape):  # else: set by hand, kept
                    current = e.param.grad = e.gradient_of(grad)
                e.published, e.published_from = current, grad

    def clip_targets(self, params):
        """Tensors whose .grad clipping scales, for `params` (those with a gradient): a DTensor
        parameter's leaf (its DTensor .grad is a view of the leaf's), else the parameter (a
        frozen DTensor one: the local view of its gradient, wrapped in a throwaway leaf)."""
        out = []
        for p in params:
            e = self.entries.get(id(p))
            if e is not None:
                out.append(e.leaf)
            elif is_dtensor(p.grad):
                local = local_of(p.grad)
                holder = local.detach().requires_grad_()
                holder.grad = local
                out.append(holder)
            else:
                out.append(p)
        return [t for t in out if t.grad is not None]

    # -- the global norm -----------------------------------------------------------------------
    def _parts(self, indexed_grads, norm_type, extra=()):
        """Per-rank sums of |g|^p (max |g| for inf) of gradient pieces [(reducer index, tensor)]
        and of `extra` tensors (counted as replicated), split into the replicated part (slot 0)
        and one part per tensor-parallel sharding, in an order every rank agrees on (the
        reducer's parameters' shardings): (float64 tensor of parts, their shardings)."""
        keys, shardings = [None], [None]
        for sharding in self.sharding:
            if _key(sharding) not in keys:
                keys.append(_key(sharding))
                shardings.append(sharding)
        parts = [0.0] * len(keys)
        inf = norm_type == math.inf
        pieces = [(keys.index(_key(self.sharding[i])), g) for i, g in indexed_grads]
        for slot, grad in pieces + [(0, g) for g in extra]:
            if grad is None or not grad.numel():
                continue
            grad = grad.detach()
            if inf:
                parts[slot] = max(parts[slot], float(grad.abs().max()))
            else:
                parts[slot] += float(torch.linalg.vector_norm(grad, norm_type,
                                                              dtype=torch.float64)) ** norm_type
        return torch.tensor(parts, dtype=torch.float64), shardings

    @staticmethod
    def _total(parts, shardings, norm_type):
        """Each sharded part reduced over the mesh dimensions it is split over, then combined
        with the replicated one: the norm as a float64 CPU tensor."""
        inf = norm_type == math.inf
        op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
        total = float(parts[0])
        for slot in range(1, len(shardings)):
            mesh, dims = shardings[slot]
            part = parts[slot:slot + 1].clone()
            for dim in dims:
                dist.all_reduce(part, op=op, group=mesh.get_group(dim))
            total = max(total, float(part[0])) if inf else total + float(part[0])
        return torch.tensor(total if inf else total ** (1.0 / norm_type), dtype=torch.float64)

    def global_norm(self, reduced_grads, norm_type, device, from_copy=None, extra=()):
        """The norm torch.nn.utils.clip_grad_norm_ computes over DTensor gradients: local shards
        of sharded parameters summed over the mesh dimensions they are split over, replicated
        ones counted once. `reduced_grads`: the reducer's parameters' local (averaged)
        gradients, None where absent, by reducer index; `extra`: local gradients of parameters
        outside the reducer, counted as replicated; `from_copy`: (sum of squares, sum of abs,
        max abs) the reducer's copy accumulated over all of `reduced_grads` (Note [Statistics
        from the copy]), or None. With one sharding, the copy gives the sharded part as what is
        left after the replicated part (one pass over the replicated gradients only).
        Collective over the tensor-parallel groups (on `device`)."""
        sharded = [i for i, s in enumerate(self.sharding) if _key(s) is not None]
        replicated = [i for i, s in enumerate(self.sharding) if _key(s) is None]
        indexed = list(enumerate(reduced_grads))
        if from_copy is not None and len({_key(self.sharding[i]) for i in sharded}) == 1 \
                and not extra:
            parts, shardings = self._parts([indexed[i] for i in replicated], norm_type)
            copied = {2.0: from_copy[0], 1.0: from_copy[1], math.inf: from_copy[2]}[norm_type]
            parts[1] = copied if norm_type == math.inf else max(copied - float(parts[0]), 0.0)
        else:
            parts, shardings = self._parts(indexed, norm_type, extra)
        return self._total(parts.to(device), shardings, norm_type).cpu()

    def norm_of_pieces(self, indexed_grads, norm_type, dp_group, device):
        """The global norm of gradient pieces [(reducer index, tensor)], each DP rank holding
        some (a ShardedOptimizer's shards): the per-rank parts summed (max for inf) over the DP
        group, then each sharded part over the mesh dimensions it is split over. A float64
        tensor on the CPU."""
        parts, shardings = self._parts(indexed_grads, norm_type)
        parts = parts.to(device)
        inf = norm_type == math.inf
        dist.all_reduce(parts, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=dp_group)
        return self._total(parts, shardings, norm_type).cpu()
