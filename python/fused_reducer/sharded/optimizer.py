"""ShardedOptimizer: each rank keeps optimizer state for, and updates, 1/world of the parameters.

    model = fused_reducer.FusedReducer(module, bucket_cap_mb=25)
    opt = fused_reducer.ShardedOptimizer(model, torch.optim.AdamW, lr=3e-4, weight_decay=0.1)
    for x, y in loader:
        loss_fn(model(x), y).backward()   # each bucket reduce-scattered as soon as it is complete
        opt.clip_grad_norm_(1.0)          # the global norm, summed over the shards
        opt.step()                        # this rank's shard updated; parameters all-gathered
        opt.zero_grad()

Note [Sharded optimizer]
The reducer's buckets are flat buffers; in sharded mode (Note [Sharded mode] in ext/reducer.cpp)
each bucket is padded to world_size equal shards and reduce-scattered, so rank r's shard of each
bucket holds the averaged gradients of the parameter elements laid out there. A *fragment* is
the part of one parameter that falls into this rank's shard of its bucket: a 1-D view of the
parameter itself (in its storage order, which is the bucket's slot order), whose gradient is the
matching 1-D view of the bucket. The wrapped torch optimizer (`optimizer_class`) sees only this
rank's fragments, in the user's parameter groups, so its state is 1/world of the plain
optimizer's, and its update writes straight into the parameters. That is exact only for
optimizers whose update is elementwise (every state tensor shaped like its parameter, no norm
or reduction over a parameter): the list below; others are refused. After the update every
bucket's parameters are all-gathered, so every rank holds the whole updated model.

State moves with the layout: when the reducer rebuilds its buckets (after the first step, or when
a limit changes), the fragments change. Each parameter's state is assembled from the old
fragments of every rank, one parameter at a time, and the new fragments take their stretch of it
(_full_states, _move): the same path moves the stretches of a sharded checkpoint into the
fragments of another layout or world size, and builds the plain state_dict(), so there is one way
state moves and no rank ever holds more than its own state and one parameter's.

step() consumes the gradients (the all-gather reuses their buckets): a second step() before the
next backward updates nothing. Only the last synchronised backward's shard is kept, so two of
them before step() raise (accumulate micro-batches under model.no_sync() instead, which gives
the same gradients).

Master weights (master_dtype=torch.float32 with bf16 parameters): the optimizer updates a
master copy of each fragment in that dtype, copied back (rounded) into the parameter, whose
dtype the all-gather sends; state_dict() carries the masters as "master_param". A parameter
changed outside the optimizer (module.load_state_dict) wins over its master copy wherever the
master no longer rounds to it.

Note [Overlapped parameter all-gather]
By default step() waits for the parameter all-gathers. With overlap_param_gather=True it only
launches them: each bucket's is finished by a forward pre-hook of the first module owning one of
its parameters, so the all-gather of the last buckets (the first layers) overlaps the start of the
next forward, and what is left is finished when forward returns (FusedReducer.forward), before
backward writes the buckets again. The rule that makes it exact: every parameter is read in the
forward through a module that owns it (a module's own parameters, tied weights included); a
parameter read functionally by another module (F.linear(x, self.embed.weight) in a parent) or
outside forward (an EMA right after step()) would see its previous value until
finish_param_gather() (which step(), clip_grad_norm_, state_dict() and model.state_dict() call).
Under torch.compile the pre-hooks are traced, not run: where the model's forward is compiled or
contains a compiled module, all all-gathers are finished before the forward instead
(finish_before_forward), so there the overlap is lost, never the exactness.

After a synchronised backward in sharded mode the averaged gradients exist only as shards: the
local, unreduced gradients are released once their bucket is reduced, and param.grad holds a
placeholder (core/sharded_mode.py's ReleasedGradient: the parameter's shape and dtype, no values) until
zero_grad() or the next forward, through step() (where a plain optimizer leaves its gradients).
Reading it raises ShardedGradientError naming the parameter, so
torch.nn.utils.clip_grad_norm_(model.parameters()), GradScaler.unscale_ or a gradient norm logged
after step() fail loudly instead of computing something else: clip with ``opt.clip_grad_norm_``
(the norm over all shards). Note [Released gradients] in ext/reducer.cpp.
"""
import functools
import math
import sys

import torch
import torch.distributed as dist

from .. import _C
from ..errors import ShardedOptimizerError
from ..core.attachment import Attachment
from . import checkpoint
from .checkpoint import per_element as _per_element
from .checkpoint import storage_order as _storage_order  # the order of a bucket slot: Note [Slot layout]

# Optimizers whose update of an element depends only on that element's gradient, state and the
# group's hyperparameters (and a per-parameter step count).
ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax,
               torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adagrad, torch.optim.RMSprop,
               torch.optim.Adadelta, torch.optim.Rprop)


class _Fragment:
    """The part [begin, end) (storage order) of parameter `index` in this rank's shard of
    bucket `bucket`, at element `at` of the bucket's flat buffer."""
    __slots__ = ("index", "bucket", "begin", "end", "at", "view", "opt")

    def __init__(self, index, bucket, begin, end, at, param, master_dtype):
        self.index, self.bucket, self.begin, self.end, self.at = index, bucket, begin, end, at
        self.view = _storage_order(param.detach())[begin:end]
        # What the torch optimizer updates: the parameter's own elements, or a master copy of
        # them in master_dtype (copied back into the parameter after each update).
        self.opt = (self.view.to(master_dtype, copy=True)
                    if master_dtype is not None and master_dtype != param.dtype else self.view)


def _compiled_inside(module):
    """`module` or a module in it runs as a torch.compile graph (torch.compile(m), m.compile()),
    so forward hooks of the modules in it are traced, not run eagerly."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return any((eval_frame is not None and isinstance(m, eval_frame.OptimizedModule))
               or getattr(m, "_compiled_call_impl", None) is not None for m in module.modules())


def _norm_dtype(grad):
    """What a shard's p-norm is accumulated in: at least float32 (as before for fp32/bf16/fp16),
    float64 for float64, and a complex dtype for complex shards, whose norm is that of their
    magnitudes, as torch's clip_grad_norm_ (a real cast would drop the imaginary part)."""
    if grad.is_complex():
        return torch.promote_types(grad.dtype, torch.complex64)
    return torch.promote_types(grad.dtype, torch.float32)


def _dense(tensor):
    """Its elements fill one stretch of memory without gaps or overlaps (any order)."""
    if tensor.numel() <= 1:
        return True
    if any(stride < 0 for stride in tensor.stride()):
        return False
    span = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return span == tensor.numel()


class ShardedOptimizer(torch.optim.Optimizer):
    """Shards `optimizer_class`'s state and work across the ranks of `model` (a FusedReducer).
    `params` as torch optimizers take them (None: every parameter of the model); `defaults` are
    the optimizer's keyword arguments. Collective to construct; switches the reducer to
    reduce-scatter (sharded mode) from its next forward."""

    def __init__(self, model, optimizer_class, params=None, master_dtype=None,
                 overlap_param_gather=False, **defaults):
        # A FusedReducer's attachment (the optimizer needs nothing else of the wrapper).
        if not isinstance(getattr(model, "attachment", None), Attachment):
            raise ShardedOptimizerError(
                f"ShardedOptimizer: model must be a fused_reducer.FusedReducer attached to its "
                f"process group (not closed), got {type(model).__name__}")
        if optimizer_class not in ELEMENTWISE:
            name = getattr(optimizer_class, "__name__", repr(optimizer_class))
            raise ShardedOptimizerError(
                f"ShardedOptimizer: {name} is not supported: each rank updates only the "
                "fragments of parameters in its shard, which is exact only for optimizers whose "
                "update is elementwise (LBFGS, Adafactor and other factored or norm-based "
                "updates read whole parameters). Supported: "
                + ", ".join(c.__name__ for c in ELEMENTWISE)
                + ". Use a plain optimizer with this model instead.")
        if params is None:
            params = model.module.parameters()
        # The optimizer's own defaults for what was not given (AdamW's betas, eps, ...), so
        # that param_groups and state_dict() are the plain optimizer's.
        defaults = optimizer_class([torch.empty(0)], **defaults).defaults
        super().__init__(params, defaults)
        self.optimizer_class = optimizer_class
        self.model = model
        self.master_dtype = master_dtype
        # See Note [Overlapped parameter all-gather]
        self.overlap_param_gather = bool(overlap_param_gather)
        self._gathers = {}        # bucket -> (pending all-gather, its flat buffer)
        self._gather_hooks = []   # forward pre-hooks of the modules owning each bucket's params
        self._hooks_traced = False  # some of them run inside a torch.compile graph
        # The model's parameters (DTensors too: Note [DTensor parameters]) and the reducer's.
        self._index = {id(p): i for params in (model.attachment.params,
                                               model.attachment.module_params)
                       for i, p in enumerate(params)}
        self._group_of = {}
        for g, group in enumerate(self.param_groups):
            self._adopt(g, group)
        model.attachment.use_sharded_optimizer(self)
        self._layout = None      # (bucket_params, bucket_offsets, bucket_numels) of _fragments
        self._fragments = []     # this rank's fragments, bucket by bucket
        self._inner = None       # optimizer_class over the fragments
        # The reducer's step (count of synchronised backward passes) whose gradients the
        # fragments hold, and the one zero_grad() cleared: a step() with no backward since
        # zero_grad() updates nothing, as with a plain optimizer.
        self._attached_step = None
        self._cleared_step = model.attachment.reducer.completed_steps()
        self._zeros_kept = False  # the last zero_grad() was set_to_none=False
        self._layout_changed = False
        # {param index: (begin, end, state)}: stretches of a sharded checkpoint loaded before the
        # first sharded layout (Note [Sharded checkpoint format])
        self._loaded_pieces = None

    def _adopt(self, g, group):
        """Checks group `g`'s parameters and maps the model's to it. Frozen parameters
        (requires_grad=False, not reduced) are kept in the group and never updated, as a plain
        optimizer never updates a parameter without a gradient."""
        for p in group["params"]:
            if id(p) not in self._index:
                if p.requires_grad:
                    raise ShardedOptimizerError(
                        "ShardedOptimizer: a parameter of the given params (shape "
                        f"{tuple(p.shape)}) is not a parameter of the model wrapped by this "
                        "FusedReducer")
                continue
            if not _dense(self.model.attachment.params[self._index[id(p)]]):
                name = self.model.attachment.param_names[self._index[id(p)]]
                raise ShardedOptimizerError(
                    f"ShardedOptimizer: parameter '{name}' (sizes {tuple(p.shape)}, strides "
                    f"{p.stride()}) is not dense in memory (a view with gaps); shards are cut in "
                    "memory order. Make it a contiguous parameter (nn.Parameter(t.contiguous()))")
            self._group_of[self._index[id(p)]] = g

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        if hasattr(self, "_group_of"):  # after construction: the fragments are rebuilt (state kept)
            self._adopt(len(self.param_groups) - 1, self.param_groups[-1])
            self._layout_changed = True

    def __getstate__(self):
        raise ShardedOptimizerError(
            "ShardedOptimizer cannot be pickled or deep-copied (it holds views of the model's "
            "parameters and its communicator); save opt.state_dict(), which is the plain "
            "optimizer's format, and load it into a new ShardedOptimizer")

    # -- the fragments ---------------------------------------------------------------------------
    def _current_layout(self):
        reducer = self.model.attachment.reducer
        if not reducer.sharded_layout():
            return None  # sharded mode starts at the next forward
        return (reducer.bucket_params(), reducer.bucket_offsets(), reducer.bucket_numels())

    def _ensure_fragments(self):
        """Build the fragments for the layout in force; when the layout changed, move the state
        (Note [Sharded optimizer])."""
        layout = self._current_layout()
        if layout is None or (layout == self._layout and not self._layout_changed):
            return
        self._layout_changed = False
        self.finish_param_gather()
        # The state moves with its elements: from the old fragments, or from the stretches a
        # sharded checkpoint loaded before the first sharded layout existed.
        pieces = self._fragment_pieces() if self._inner is not None else self._loaded_pieces
        self._loaded_pieces = None
        self._build(layout)
        if pieces is not None:
            self._move(pieces)
        elif self.state:
            self._distribute_loaded()  # a plain state_dict loaded before the first layout

    def _build(self, layout):
        bucket_params, bucket_offsets, numels = layout
        params = self.model.attachment.params
        world = dist.get_world_size(self.model.process_group)
        rank = dist.get_rank(self.model.process_group)
        fragments = []
        for b, (indices, offsets, numel) in enumerate(zip(*layout)):
            shard = numel // world
            lo, hi = rank * shard, (rank + 1) * shard
            for index, offset in zip(indices, offsets):
                begin, end = max(lo, offset), min(hi, offset + params[index].numel())
                if begin < end:
                    master = self.master_dtype if index in self._group_of else None
                    fragments.append(_Fragment(index, b, begin - offset, end - offset, begin,
                                               params[index], master))
        self._layout = layout
        self._fragments = fragments
        self._by_bucket = [[] for _ in numels]   # this rank's fragments of each bucket
        self._of_param = {}                      # ... and of each parameter index
        for f in fragments:
            self._by_bucket[f.bucket].append(f)
            self._of_param.setdefault(f.index, []).append(f)
        groups = []
        for g, group in enumerate(self.param_groups):
            options = {k: v for k, v in group.items() if k != "params"}
            # An empty tensor first: torch optimizers refuse empty groups, and a rank may own no
            # fragment of a group; it never has a gradient, so it is never updated.
            mine = [torch.empty(0, device=self.model.device)]
            mine += [f.opt for f in fragments if self._group_of.get(f.index) == g]
            groups.append(dict(options, params=mine))
        self._inner = self.optimizer_class(groups)
        self._attached_step = None

    # -- gradients -------------------------------------------------------------------------------
    def _attach_gradients(self):
        """Point each fragment's .grad at its averaged gradient in the bucket, once per
        synchronised backward (None for parameters no rank used, as DDP leaves them)."""
        self._ensure_fragments()
        if self._inner is None:
            return
        reducer = self.model.attachment.reducer
        step = reducer.completed_steps()
        if step == self._attached_step:
            return
        self._attached_step = step
        if step == self._cleared_step:
            # No synchronised backward since zero_grad() (or the last step()): no gradient, or
            # zeros after zero_grad(set_to_none=False), as a plain optimizer would see.
            for f in self._fragments:
                f.opt.grad = torch.zeros_like(f.opt) if self._zeros_kept else None
            return
        if step > self._cleared_step + 1:
            raise ShardedOptimizerError(
                f"ShardedOptimizer: {step - self._cleared_step} synchronised backward passes "
                "since the last step() or zero_grad(); with sharded gradients only the last one "
                "is kept. Accumulate micro-batches inside model.no_sync() and synchronise only "
                "the last backward (the same gradients, less communication), or call step() "
                "after each backward.")
        flats = reducer.bucket_flats()
        used = reducer.joined_used_map() if self.model.find_unused_parameters else None
        used = used.cpu() if used is not None else None
        params = self.model.attachment.params
        for f in self._fragments:
            if used is not None and int(used[f.index]) == 0:
                f.opt.grad = torch.zeros_like(f.opt) if self._zeros_kept else None
                continue
            grad = flats[f.bucket][f.at:f.at + (f.end - f.begin)]
            f.opt.grad = grad if grad.dtype == f.opt.dtype else grad.to(f.opt.dtype)

    @torch.no_grad()
    def divide_gradients(self, divisor):
        """Divide this step's averaged gradients by `divisor` before step(): what a pipeline
        schedule's ``scale_grads`` does to param.grad (by the number of microbatches), done to
        the shards, the only gradients there are (param.grad holds a placeholder)."""
        self._attach_gradients()
        if divisor != 1:
            for f in self._fragments:
                if f.opt.grad is not None:
                    f.opt.grad.div_(divisor)

    def _gradients(self):
        return [f.opt.grad for f in self._fragments
                if f.opt.grad is not None and f.index in self._group_of]

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm, norm_type=2.0, error_if_nonfinite=False):
        """torch.nn.utils.clip_grad_norm_ over every parameter of this optimizer, as under DDP:
        the norm of all averaged gradients (summed over the shards: collective), and every shard
        scaled by max_norm / (norm + 1e-6) when that is below 1. Returns the total norm."""
        grads, total = self._total_norm(norm_type)
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(f"ShardedOptimizer.clip_grad_norm_: the total norm of order "
                               f"{float(norm_type)} is non-finite, so it cannot be clipped")
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coefficient.to(g.device, g.dtype))
        return total

    def grad_norm(self, norm_type=2.0):
        """The norm clip_grad_norm_ would clip by, without clipping (collective)."""
        return self._total_norm(norm_type)[1]

    def _check_current(self):
        """One model takes one ShardedOptimizer: the latest (a resumed one replaces the old).
        An older one would read the buckets the newer one's all-gather fills with parameters
        as its gradients."""
        if self.model.attachment.sharded_optimizer is not self:
            raise ShardedOptimizerError(
                "ShardedOptimizer: a newer ShardedOptimizer was made for this model and replaced "
                "this one; one model takes one. For different settings per part of the model, "
                "give one ShardedOptimizer parameter groups (params=[{'params': body, 'lr': ...}, "
                "{'params': head, ...}])")

    def _total_norm(self, norm_type):
        self._check_current()
        self.finish_param_gather()
        self._attach_gradients()
        grads = self._gradients()
        norm_type = float(norm_type)
        if not norm_type > 0:
            raise ShardedOptimizerError(f"ShardedOptimizer: norm_type must be positive (a p-norm, "
                                        f"or inf), got {norm_type}")
        tensor_parallel = self.model.attachment.tensor_parallel_norm(
            [(f.index, f.opt.grad) for f in self._fragments
             if f.opt.grad is not None and f.index in self._group_of], norm_type)
        if tensor_parallel is not None:  # shards summed over their TP groups too
            return grads, tensor_parallel.to(self._norm_result_dtype())
        device = self.model.attachment.control_device
        # Every rank sends float64 (its shards' dtypes can differ from another rank's, and a rank
        # may hold none); the norm comes back in the parameters' widest real dtype, as torch's.
        if norm_type == float("inf"):
            # torch's max keeps a NaN (Python's max and gloo's MAX drop it): it travels as a
            # flag beside the maximum of the numbers.
            maxima = [g.detach().abs().max().double() for g in grads if g.numel()]
            local = (torch.stack(maxima).max().to(device) if maxima  # one copy to `device`
                     else torch.zeros((), dtype=torch.float64, device=device))
            is_nan = torch.isnan(local)
            total = torch.stack([torch.where(is_nan, 0.0, local), is_nan.double()]).to(device)
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=self.model.process_group)
            total = torch.where(total[1] > 0, math.nan, total[0])
        else:
            local = sum((torch.linalg.vector_norm(g.detach(), norm_type, dtype=_norm_dtype(g))
                         .double() ** norm_type for g in grads),
                        torch.tensor(0.0, dtype=torch.float64))
            total = local.reshape(1).to(device)
            dist.all_reduce(total, group=self.model.process_group)
            total = total[0] ** (1.0 / norm_type)
        return grads, total.cpu().to(self._norm_result_dtype())

    def _norm_result_dtype(self):
        """torch's (get_total_norm under DDP): the promoted real dtype of this optimizer's reduced
        parameters (bfloat16 for a bfloat16 model, master_dtype or not; float32 for bfloat16 +
        float32; float64 with a float64 or complex128 one): the same on every rank (all know
        every parameter)."""
        params = self.model.attachment.params
        dtypes = [params[i].dtype.to_real() for i in self._group_of]
        return functools.reduce(torch.promote_types, dtypes) if dtypes else torch.float32

    # -- the step --------------------------------------------------------------------------------
    # GradScaler then hands itself to step() instead of unscaling param.grad (None here).
    _step_supports_amp_scaling = True

    @torch.no_grad()
    def step(self, closure=None, grad_scaler=None):
        self._check_current()
        if grad_scaler is not None:
            raise ShardedOptimizerError(
                "ShardedOptimizer: torch.amp.GradScaler (fp16 loss scaling) is not supported yet: "
                "the gradients exist only as shards, so an inf/nan found on one rank would have to "
                "skip the step on every rank. Train with bf16 autocast (no loss scaling needed), "
                "or use a plain optimizer with GradScaler.")
        loss = None
        self.finish_param_gather()
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._attach_gradients()
        if self._inner is None:
            return loss  # no synchronised backward in sharded mode yet: nothing to update
        for mine, group in zip(self._inner.param_groups, self.param_groups):
            for key, value in group.items():  # LR schedulers change the outer groups
                if key != "params":
                    mine[key] = value
        masters = [f for f in self._fragments if f.opt is not f.view]
        for f in masters:
            # A parameter changed outside the optimizer (module.load_state_dict, a re-initialised
            # head) no longer matches its master's rounding: the parameter's value wins there.
            changed = f.view != f.opt.to(f.view.dtype)
            f.opt.copy_(torch.where(changed, f.view.to(f.opt.dtype), f.opt))  # no host sync
        self._inner.step()
        _C.scaled_copy([f.opt for f in masters], [f.view for f in masters], 1.0)
        # The gradients are consumed: the all-gather reuses their buckets. A second step()
        # before the next backward updates nothing.
        for f in self._fragments:
            f.opt.grad = None
        self._cleared_step = self._attached_step
        self._all_gather_parameters()
        return loss

    def _all_gather_parameters(self):
        """Every bucket's parameters from their owners: this rank's fragments (just updated)
        into a flat buffer shaped like the bucket, all-gathered in place, then copied out. The
        buffer is the bucket itself where the dtypes agree: its gradients were consumed by the
        update, and the next backward overwrites it anyway (no memory beyond DDP's buckets).
        All are launched at once; they are finished here, or with overlap_param_gather by the
        next forward (Note [Overlapped parameter all-gather])."""
        params = self.model.attachment.params
        bucket_params, _, numels = self._layout
        buckets = self.model.attachment.reducer.bucket_flats()
        transport = self.model.attachment.transport
        for b, (indices, numel) in enumerate(zip(bucket_params, numels)):
            dtype = params[indices[0]].dtype
            flat = (buckets[b] if buckets[b].dtype == dtype
                    else torch.empty(numel, dtype=dtype, device=self.model.device))
            mine = self._by_bucket[b]
            _C.scaled_copy([f.view for f in mine],
                           [flat[f.at:f.at + (f.end - f.begin)] for f in mine], 1.0)
            self._gathers[b] = (transport.all_gather(flat, f"parameters of bucket {b}"), flat)
        if self.overlap_param_gather:
            self._install_gather_hooks()
        else:
            self.finish_param_gather()

    def finish_param_gather(self, buckets=None):
        """Wait for the parameter all-gathers still in flight (of `buckets`, default all) and
        copy them into the parameters. Only needed by hand with overlap_param_gather=True,
        before reading parameters outside the model's forward (an EMA, a checkpoint of
        model.module): forward, step(), clip_grad_norm_(), state_dict() and model.state_dict()
        call it."""
        params = self.model.attachment.params
        bucket_params, bucket_offsets, _ = self._layout if self._layout else ((), (), ())
        for b in sorted(self._gathers if buckets is None else buckets):
            if b not in self._gathers:
                continue
            work, flat = self._gathers.pop(b)
            work.wait(self.model.attachment.timeout_s)
            indices, offsets = bucket_params[b], bucket_offsets[b]
            _C.scaled_copy([flat[o:o + params[i].numel()] for i, o in zip(indices, offsets)],
                           [_storage_order(params[i].detach()) for i in indices], 1.0)

    def finish_before_forward(self, traced):
        """Called by the model's forward before its module runs. Module pre-hooks only finish
        the all-gathers when they run eagerly: where the forward is `traced` by torch.compile
        (torch.compile(model), a compiled training step) or a module inside it is compiled
        (FusedReducer(torch.compile(module)), torch.compile of a block), every all-gather is
        finished here instead, before the graph reads the parameters (no overlap with forward,
        as without overlap_param_gather)."""
        if self._gathers and (traced or self._hooks_traced):
            self.finish_param_gather()

    def _install_gather_hooks(self):
        """Once per layout: a forward pre-hook on every module that owns parameters (its own,
        not its children's), finishing the all-gathers of their buckets just before it runs."""
        if self._gather_hooks and self._gather_hooks[0] is self._layout:
            return
        for handle in self._gather_hooks[1:]:
            handle.remove()
        self._hooks_traced = _compiled_inside(self.model.module)
        bucket_of = {index: b for b, indices in enumerate(self._layout[0]) for index in indices}
        position = {id(p): i for i, p in enumerate(self.model.attachment.params)}
        handles = [self._layout]
        for module in self.model.module.modules():
            owned = {bucket_of[position[id(p)]] for p in module.parameters(recurse=False)
                     if id(p) in position}
            if owned:
                def finish(module, args, owned=tuple(sorted(owned))):
                    if torch.compiler.is_compiling():
                        return  # traced into a graph: finish_before_forward did it
                    if self._gathers:
                        self.finish_param_gather(owned)
                handles.append(module.register_forward_pre_hook(finish))
        self._gather_hooks = handles

    def zero_grad(self, set_to_none=True):
        self.model.attachment.reducer.clear_released_gradients()
        for group in self.param_groups:
            for p in group["params"]:
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()
        for f in self._fragments:
            f.opt.grad = None
        self._zeros_kept = not set_to_none
        self._cleared_step = self.model.attachment.reducer.completed_steps()
        self._attached_step = None

    # -- checkpoints: the plain optimizer's format ------------------------------------------------
    def state_dict(self):
        """The plain optimizer's state_dict (what optimizer_class over the same parameter groups
        would return, e.g. under DDP): consolidated from every rank's fragments. Collective."""
        self.finish_param_gather()
        self._ensure_fragments()
        # param_groups with parameter indices; self.state holds only a state loaded before the
        # first sharded layout existed (then that is the answer).
        saved = super().state_dict()
        if self._inner is not None:
            saved["state"] = self._plain_state()
        return saved

    def load_state_dict(self, state_dict):
        """Takes the plain optimizer's format (also one saved under DDP, at any world size);
        each rank keeps its fragments' part of it."""
        # torch casts floating state to the parameter's dtype: keep the checkpoint's own (fp32
        # moments and masters of bf16 parameters); each fragment takes its optimizer's dtype.
        params_in_order = [p for group in self.param_groups for p in group["params"]]
        tensors = {(i, k): v for i, s in state_dict["state"].items() for k, v in s.items()
                   if _per_element(k, v, params_in_order[int(i)])}
        super().load_state_dict(state_dict)  # groups' hyperparameters; full state in self.state
        for (i, key), value in tensors.items():
            self.state[params_in_order[i]][key] = value.to(params_in_order[i].device)
        self._ensure_fragments()
        if self._inner is not None:
            self._distribute_loaded()

    def _plain_state(self):
        """{plain index: {key: full tensor or value}}, from the fragments of every rank."""
        params = self.model.attachment.params
        plain_of = {self._index[id(p)]: i for i, p in
                    enumerate(p for group in self.param_groups for p in group["params"])
                    if id(p) in self._index}
        result = {}
        for index, state in self._full_states(self._live_pieces()):
            for key, value in state.items():
                if _per_element(key, value, params[index]):
                    shaped = torch.empty_like(params[index], dtype=value.dtype)
                    _storage_order(shaped).copy_(value)
                    state[key] = shaped
            result[plain_of[index]] = state
        return dict(sorted(result.items()))

    def _full_states(self, pieces):
        """Yield (param index, {key: the whole flat state tensor, or a value}) one parameter at a
        time, in the same order on every rank, from `pieces` ({param index: (begin, end,
        state)}: this rank's stretches). Collective; a parameter's pieces are dropped once it is
        assembled, so no rank holds more than its stretches and one parameter's state."""
        params = self.model.attachment.params
        group = self.model.process_group
        # What each parameter's state is, from any rank holding a stretch of it (small): the
        # per-element keys' dtypes, the scalars' values (kept on their device: CPU for Adam's).
        local = {index: {key: (("tensor", value.dtype) if _per_element(key, value, params[index])
                               else ("value", (value.cpu(), str(value.device))
                                     if torch.is_tensor(value) else value))
                         for key, value in state.items()}
                 for index, (_, _, state) in pieces.items()}
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, local, group=group)
        kinds = {}
        for theirs in everyone:
            for index, entry in theirs.items():
                for key, kind in entry.items():
                    kinds.setdefault(index, {}).setdefault(key, kind)
        for index in sorted(kinds):
            begin, end, mine = pieces.pop(index, (0, 0, {}))
            state = {}
            for key in sorted(kinds[index]):
                kind, value = kinds[index][key]
                if kind == "value":
                    state[key] = value[0].to(value[1]) if isinstance(value, tuple) else value
                    continue
                full = torch.zeros(params[index].numel(), dtype=value, device=self.model.device)
                if key in mine:
                    full[begin:end] = mine[key].reshape(-1)
                dist.all_reduce(full, group=group)  # the other ranks hold zeros there
                state[key] = full
            del mine
            yield index, state

    def _move(self, pieces):
        """The fragments of the layout in force take their state from `pieces` (this rank's
        stretches under another layout, world size or an even split). Collective."""
        for index, state in self._full_states(pieces):
            for f in self._of_param.get(index, ()):
                mine = {}
                for key, value in state.items():
                    if not _per_element(key, value, self.model.attachment.params[index]):
                        mine[key] = value.clone() if torch.is_tensor(value) else value
                    elif key != "master_param":
                        mine[key] = value[f.begin:f.end].to(f.opt.dtype, copy=True)
                    elif f.opt is not f.view:
                        f.opt.copy_(value[f.begin:f.end])
                self._inner.state[f.opt] = mine

    def _fragment_pieces(self):
        """{param index: (begin, end, state)}: this rank's fragments' state (one fragment per
        parameter: a parameter is in one bucket, and a rank's shard of it is one stretch)."""
        return {f.index: (f.begin, f.end, state) for f in self._fragments
                if (state := self._fragment_state(f))}

    def _live_pieces(self):
        """This rank's stretches of the state, wherever the state is now: the fragments, the
        stretches loaded before the first sharded layout, or a plain state_dict loaded before
        it (cut into the even split)."""
        if self._inner is not None:
            return self._fragment_pieces()
        if self._loaded_pieces is not None:
            return dict(self._loaded_pieces)
        pieces = {}
        params = self.model.attachment.params
        world = dist.get_world_size(self.model.process_group)
        rank = dist.get_rank(self.model.process_group)
        for index in self._group_of:
            full = self.state.get(params[index])
            stretch = checkpoint.even_range(params[index].numel(), world, rank)
            if full and stretch:
                begin, end = stretch
                pieces[index] = (begin, end, {
                    key: (_storage_order(checkpoint.dense_like(value, params[index]))[begin:end]
                          if _per_element(key, value, params[index]) else value)
                    for key, value in full.items()})
        return pieces

    # -- sharded checkpoints: torch.distributed.checkpoint ----------------------------------------
    def sharded_state_dict(self, fresh=False):
        """This rank's part of the optimizer state for torch.distributed.checkpoint: dcp.save
        writes each rank's fragments (views, nothing copied), dcp.load fills it in place for
        load_sharded_state_dict, at any world size and bucket layout. fresh=True: zeros to be
        filled instead of views of the live state (a load that fails then changes nothing). Call
        it on every rank. Note [Sharded checkpoint format] in sharded/checkpoint.py."""
        self.finish_param_gather()
        self._ensure_fragments()
        params = self.model.attachment.params
        name_of = checkpoint.names_of(self.model.module)
        world = dist.get_world_size(self.model.process_group)
        rank = dist.get_rank(self.model.process_group)
        live = {} if fresh else self._live_pieces()
        state, has_state, templates = {}, {}, {}
        for index in sorted(self._group_of):
            p, name = params[index], name_of[id(params[index])]
            if self._inner is not None:
                mine = self._of_param.get(index)
                stretch = (mine[0].begin, mine[0].end) if mine else None
            else:
                stretch = checkpoint.even_range(p.numel(), world, rank)
            if stretch is None:
                continue  # another rank holds all of it
            held = live.get(index)
            has_state[name] = bool(held)
            if held:
                begin, _, values = held
                state[name] = {k: (checkpoint.as_piece(v, p.numel(), begin)
                                   if _per_element(k, v, p) else v) for k, v in values.items()}
                continue
            master = (self.master_dtype if self.master_dtype not in (None, p.dtype) else None)
            key = (self._group_of[index], master or p.dtype)
            if key not in templates:
                options = {k: v for k, v in self.param_groups[key[0]].items() if k != "params"}
                templates[key] = checkpoint.state_template(self.optimizer_class, options, key[1],
                                                           p.device)
                if master:
                    templates[key]["master_param"] = (True, torch.zeros(1, dtype=master))
            state[name] = checkpoint.template_entry(templates[key], p.numel(), *stretch,
                                                    p.device)
        return {"optimizer": self.optimizer_class.__name__,
                "param_groups": checkpoint.groups_by_name(self.param_groups, name_of),
                "has_state": has_state, "state": state}

    def load_sharded_state_dict(self, state_dict):
        """Apply what sharded_state_dict() returned once dcp.load filled it: saved at any world
        size, bucket layout, reduce_dtype or master_dtype, or from a plain optimizer
        (fused_reducer.sharded.checkpoint.plain_optimizer_state_dict). A checkpoint of another
        optimizer class or other parameter groups raises and changes nothing. Collective."""
        self.finish_param_gather()
        self._ensure_fragments()
        params = self.model.attachment.params
        name_of = checkpoint.names_of(self.model.module)
        checkpoint.check_loadable(self.optimizer_class, self.param_groups, name_of, state_dict)
        index_of = {name_of[id(params[i])]: i for i in self._group_of}
        pieces = {}
        for name, entry in state_dict["state"].items():
            if not state_dict["has_state"].get(name) or name not in index_of:
                continue
            index = index_of[name]
            stretch, values = None, {}
            for key, value in entry.items():
                if _per_element(key, value, params[index]):
                    stretch = checkpoint.piece_range(value)
                    value = value.detach().reshape(-1)  # a plain tensor again
                values[key] = value
            if stretch is not None:
                pieces[index] = (*stretch, values)
        checkpoint.apply_group_options(self.param_groups, state_dict)
        self.state.clear()
        if self._inner is None:
            self._loaded_pieces = pieces  # moved into the fragments of the first layout
            return
        self._inner.state.clear()
        # The same layout as the one the dict was made for: every fragment adopts its stretch.
        same = all((f.begin, f.end) == pieces[f.index][:2]
                   for f in self._fragments if f.index in pieces)
        same = torch.tensor([int(same and len(pieces) == len(
            {f.index for f in self._fragments if f.index in pieces}))],
            device=self.model.attachment.control_device)
        dist.all_reduce(same, op=dist.ReduceOp.MIN, group=self.model.process_group)  # all or none
        if not bool(same.item()):
            self._move(pieces)
            return
        for f in self._fragments:
            if f.index not in pieces:
                continue
            mine = {}
            for key, value in pieces[f.index][2].items():
                if not _per_element(key, value, params[f.index]):
                    mine[key] = value
                elif key != "master_param":
                    mine[key] = value.to(f.opt.dtype)
                elif f.opt is not f.view:
                    f.opt.copy_(value)
            self._inner.state[f.opt] = mine

    def _fragment_state(self, f):
        """The optimizer's state of fragment `f`, with its master copy as "master_param"."""
        state = dict(self._inner.state.get(f.opt, {}))
        if state and f.opt is not f.view:
            state["master_param"] = f.opt
        return state

    def _distribute_loaded(self):
        """self.state (full tensors, keyed by parameter) -> the fragments' state; then drops it."""
        params = self.model.attachment.params
        for f in self._fragments:
            full = self.state.get(params[f.index])
            if not full:
                continue
            mine = {}
            for key, value in full.items():
                if _per_element(key, value, params[f.index]):
                    piece = _storage_order(
                        checkpoint.dense_like(value, params[f.index]))[f.begin:f.end]
                    if key != "master_param":
                        mine[key] = piece.to(f.opt.dtype, copy=True)
                    elif f.opt is not f.view:
                        f.opt.copy_(piece)
                else:
                    mine[key] = value.clone() if torch.is_tensor(value) else value
            self._inner.state[f.opt] = mine
        self.state.clear()

