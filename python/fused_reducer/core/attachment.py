"""The attachment: what a FusedReducer is attached to, as the modules working beside the wrapper
see it.

Join (core/join.py), the sharded optimizer (sharded/optimizer.py), the autotuner and the profile
export (tuning/), and the pipelining stage (pipelining.py) need the process group, the
transport, the C++ reducer and the parameters in the reducer's order, and a few of the
wrapper's step decisions. They get them from ``model._attachment`` and from nowhere else: this
class names everything they may read or change, so the wrapper's other attributes stay its own.
Like DDP's ``_get_ddp_logging_data`` / join hook arguments, it is internal (no promise to users).

It reads the wrapper afresh at each access (a model re-attaches after unpickling: the group,
transport and reducer change) and holds it weakly: an attachment kept by a helper never keeps the
model, and so its communicator, alive.
"""
import weakref


class Attachment:
    __slots__ = ("_model_ref",)

    def __init__(self, model):
        self._model_ref = weakref.ref(model)

    @property
    def _model(self):
        model = self._model_ref()
        if model is None:
            raise ReferenceError("the FusedReducer of this attachment was garbage collected")
        return model

    # -- what the wrapper is attached to ---------------------------------------------------------
    @property
    def group(self):
        """The process group (None before re-attaching after unpickling)."""
        return self._model.process_group

    @property
    def transport(self):
        """The transport the buckets travel by (_C.make_transport's object)."""
        return self._model._transport

    @property
    def reducer(self):
        """The C++ reducer (None once closed)."""
        return self._model._reducer

    @property
    def control_device(self):
        """The device of the library's own small collectives on the process group."""
        return self._model._control_device

    @property
    def timeout_s(self):
        """Seconds a collective may wait (the resolved ``timeout``)."""
        return self._model._timeout_s

    @property
    def params(self):
        """The trainable parameters, in the reducer's index order."""
        return self._model._reducer_params()

    @property
    def module_params(self):
        """The module's own parameter objects, in the same order: a DTensor parameter where the
        reducer holds its plain leaf (Note [DTensor parameters]), else the same tensors as
        ``params``."""
        return self._model._module_params()

    @property
    def autograd_leaves(self):
        """The tensors backward accumulates the module's gradients into, in the reducer's order
        and then the trainable parameters the reducer leaves out (DDP-ignored ones): a DTensor
        parameter's plain leaf (Note [DTensor parameters]), else the parameter itself."""
        leaves = list(self.params)
        reduced = {id(p) for p in self.module_params}
        return leaves + [p for p in self._model.module.parameters()
                         if p.requires_grad and id(p) not in reduced]

    def publish_gradients(self):
        """After a backward that did not pass through the module's outputs (a pipeline stage's
        weight half): each DTensor parameter's ``.grad`` made to view its leaf's again (Note
        [DTensor parameters]); nothing for a model without DTensor parameters."""
        tp = self._model._tp
        if tp:
            tp.publish_gradients()

    @property
    def sharded_optimizer(self):
        """The model's live ShardedOptimizer, or None: with one, the averaged gradients exist
        only as its shards."""
        return self._model._live_sharded_optimizer()

    def tensor_parallel_norm(self, indexed_grads, norm_type):
        """The global norm of averaged gradient pieces [(reducer index, tensor)] spread over
        the DP ranks (each rank passes its own), with DTensor parameters' shards summed over
        their tensor-parallel groups (torch's norm for DTensor gradients); None for a model
        without DTensor parameters. Collective over the DP and TP groups."""
        tp = self._model._tp
        if not tp:
            return None
        return tp.norm_of_pieces(indexed_grads, norm_type, self._model.process_group,
                                 self._model._control_device)

    @property
    def param_names(self):
        """Their qualified names, in the same order."""
        return self._model._param_names

    # -- the step: read by join, whose hook shadows the collectives of the ranks still training --
    @property
    def syncing(self):
        """False inside no_sync() (require_backward_grad_sync=False)."""
        return self._model._syncing

    @property
    def has_comm_hook(self):
        return self._model._comm_hook is not None

    def run_comm_hook(self, index, is_last, flat, views, params):
        """The registered communication hook on one bucket: its future."""
        return self._model._run_comm_hook(index, is_last, flat, views, params)

    def will_sync_buffers(self):
        """Whether this forward broadcasts the buffers (DDP's rule)."""
        return self._model._will_sync_buffers()

    def sync_buffers(self, joined):
        self._model._sync_buffers(joined=joined)

    def broadcast(self, tensors, source):
        """Broadcast `tensors` from `source` on the process group (coalesced)."""
        self._model._broadcast(tensors, source)

    def set_join_options(self, divide_by_initial_world_size):
        """What ``join(divide_by_initial_world_size=...)`` asked for this join."""
        self._model._divide_by_initial_world_size = divide_by_initial_world_size

    def set_forward_param_sync(self, should_sync):
        """DDP's require_forward_param_sync: whether the next forward syncs the buffers."""
        self._model._require_forward_param_sync = should_sync

    # -- the sharded optimizer -------------------------------------------------------------------
    def use_sharded_optimizer(self, optimizer):
        """Reduce-scatter from the next forward on, for `optimizer` (collective in effect)."""
        self._model._use_sharded_optimizer(optimizer)

    def live_sharded_optimizer(self):
        """The model's ShardedOptimizer, None if there is none (or it was dropped)."""
        return self._model._live_sharded_optimizer()
