"""Every argument of the installed torch's DistributedDataParallel constructor is handled
with DDP's meaning, checked against DDP itself at 2 and 3 ranks on both CPU transports, or
refused with a FusedReducerError naming it and what to use instead.

- The signature test enumerates inspect.signature(DistributedDataParallel.__init__), so a new
  torch release with a new argument fails here until it is handled.
- bucket_cap_mb_list: the bucket sizes of every step (DDP's from a recording comm hook) are
  DDP's, at the first step and after the rebuild; the runtime list (bucket_caps_bytes) persists
  across rebuilds, and rank 0's list wins.
- broadcast_buffers / forward_sync_buffers: the nine combinations give DDP's buffers at
  construction and after each forward, with DDP's warnings.
- skip_all_reduce_unused_params: DDP's gradients, without the unused parameters' bytes (counted
  by the profiler); where the unused set changes, every rank raises naming the parameter.
- init_sync=False, a 1-D device_mesh, mixed_precision(reduce_dtype), dim, batched_grad_copy,
  check_reduction: DDP's parameters, or gradients equal to DDP's.
"""
import inspect
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fused_reducer
from fused_reducer import FusedReducer, FusedReducerError
from dist_utils import per_rank, run_checks

BACKENDS = ("shm", "process_group")
MiB = 1024 * 1024

# How FusedReducer handles each argument of DDP's constructor. "ddp": DDP's meaning (tested
# below against DDP); "refused": a FusedReducerError naming it when set to a non-default value.
DDP_ARGUMENTS = {
    "module": "ddp", "device_ids": "ddp", "output_device": "ddp", "dim": "ddp",
    "broadcast_buffers": "ddp", "init_sync": "ddp", "process_group": "ddp",
    "bucket_cap_mb": "ddp", "find_unused_parameters": "ddp", "check_reduction": "ddp",
    "gradient_as_bucket_view": "ddp", "static_graph": "refused",
    "delay_all_reduce_named_params": "refused", "param_to_hook_all_reduce": "refused",
    "mixed_precision": "ddp", "device_mesh": "ddp",
    "skip_all_reduce_unused_params": "ddp", "bucket_cap_mb_list": "ddp",
    "batched_grad_copy": "ddp", "forward_sync_buffers": "ddp",
}
REFUSED_VALUES = {
    "static_graph": True,
    "delay_all_reduce_named_params": [("w", nn.Parameter(torch.zeros(1)))],
    "param_to_hook_all_reduce": nn.Parameter(torch.zeros(1)),
}


def test_every_ddp_constructor_argument_is_handled():
    """No spawn. Fails on an argument of the installed torch's DDP that FusedReducer does not
    take, or that this file does not say how it handles."""
    ddp = [n for n in inspect.signature(DDP.__init__).parameters if n != "self"]
    ours = inspect.signature(FusedReducer.__init__).parameters
    assert [n for n in ddp if n not in ours] == [], "DDP arguments FusedReducer does not take"
    assert [n for n in ddp if n not in DDP_ARGUMENTS] == [], "DDP arguments without a test here"
    assert [n for n in DDP_ARGUMENTS if n not in ddp] == [], "stale entries"
    for name in ddp:  # DDP's defaults are FusedReducer's
        assert ours[name].default == inspect.signature(DDP.__init__).parameters[name].default, \
            name


@pytest.mark.parametrize("name", sorted(REFUSED_VALUES))
def test_refused_arguments_raise_naming_the_argument_and_the_alternative(name):
    """No spawn: refused before any collective."""
    with pytest.raises(FusedReducerError, match=name) as info:
        FusedReducer(nn.Linear(2, 2), **{name: REFUSED_VALUES[name]})
    assert any(word in str(info.value) for word in ("instead", "leave it", "last_bucket_mb"))


def test_mixed_precision_param_and_buffer_dtypes_are_refused_naming_them():
    from torch.nn.parallel.distributed import _MixedPrecision
    for field in ("param_dtype", "buffer_dtype"):
        with pytest.raises(FusedReducerError, match=f"mixed_precision.{field}.*torch.autocast"):
            FusedReducer(nn.Linear(2, 2), mixed_precision=_MixedPrecision(**{field: torch.float16}))
    with pytest.raises(FusedReducerError, match="disagree"):
        FusedReducer(nn.Linear(2, 2), reduce_dtype=torch.float16,
                     mixed_precision=_MixedPrecision(reduce_dtype=torch.bfloat16))


def test_first_bucket_mb_with_a_list_is_refused_naming_both():
    with pytest.raises(ValueError, match="first_bucket_mb and bucket_cap_mb_list"):
        FusedReducer(nn.Linear(2, 2), first_bucket_mb=1, bucket_cap_mb_list=[2, 3])
    with pytest.raises(ValueError, match=r"bucket_cap_mb_list\[1\]"):
        FusedReducer(nn.Linear(2, 2), bucket_cap_mb_list=[2, 0])


# -- against DDP, in spawned ranks -------------------------------------------------------------

def _layers():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)])  # 263168 bytes per layer


def _x(rank, step):
    return torch.randn(4, 256, generator=torch.Generator().manual_seed(100 * step + rank))


def _ddp_with_recorder(module, **kwargs):
    """DDP and the list, per step, of the bytes of each bucket its comm hook was given."""
    ddp = DDP(module, **kwargs)
    launched = []

    def hook(_, bucket):
        launched[-1].append(bucket.buffer().numel() * bucket.buffer().element_size())
        return dist.all_reduce(bucket.buffer().div_(dist.get_world_size()),
                               async_op=True).get_future().then(lambda f: f.value()[0])

    ddp.register_comm_hook(None, hook)
    return ddp, launched


def _train(model, rank, steps, launched=None):
    """Per step: the bucket bytes (DDP: from its hook; FusedReducer: the layout in force) and
    the gradients as lists."""
    sizes, grads = [], []
    for step in range(steps):
        model.zero_grad()
        if launched is not None:
            launched.append([])
        model(_x(rank, step)).pow(2).sum().backward()
        if launched is not None:
            sizes.append(list(launched[-1]))
        elif isinstance(model, FusedReducer):
            sizes.append(model.bucket_sizes())
        grads.append([p.grad.clone() for p in model.parameters()])
    return sizes, grads


def _max_difference(a, b):
    return max((x - y).abs().max().item() for ga, gb in zip(a, b) for x, y in zip(ga, gb))


SIZE_ARGUMENTS = [dict(bucket_cap_mb_list=[0.3, 1]), dict(bucket_cap_mb_list=[1, 0.3]),
                  dict(bucket_cap_mb_list=[0.3, 0.6, 1]), dict(bucket_cap_mb=0.6),
                  dict(bucket_cap_mb_list=[0.3, 1], find_unused_parameters=True), {}]


def check_bucket_lists(rank, world):
    """DDP's bucket sizes per step and FusedReducer's, and the largest gradient difference."""
    out = {}
    for backend in BACKENDS:
        for i, kwargs in enumerate(SIZE_ARGUMENTS):
            ddp, launched = _ddp_with_recorder(_layers(), **kwargs)
            ddp_sizes, ddp_grads = _train(ddp, rank, 3, launched)
            ours = FusedReducer(_layers(), backend=backend, timeout=timedelta(seconds=60),
                                **kwargs)
            our_sizes, our_grads = _train(ours, rank, 3)
            out[(backend, i)] = (ddp_sizes, our_sizes, _max_difference(ddp_grads, our_grads),
                                 ours.bucket_caps_bytes)
            ours.close()
    return out


def check_caps_persist(rank, world):
    """bucket_caps_bytes set while training: DDP's layout for that list from the next step on,
    kept by rebuild_buckets() and by setting another limit; rank 0's list wins."""
    reference = {}
    for caps_mb in ([0.6, 0.3], [0.6, 0.3, 1]):
        ddp, launched = _ddp_with_recorder(_layers(), bucket_cap_mb_list=caps_mb)
        reference[tuple(caps_mb)] = _train(ddp, rank, 2, launched)[0][-1]  # after its rebuild
    out = {"reference": reference}
    for backend in BACKENDS:
        model = FusedReducer(_layers(), backend=backend, bucket_cap_mb_list=[0.3, 0.6, 1],
                             timeout=timedelta(seconds=60))
        seen = {"constructed": model.bucket_caps_bytes}
        _train(model, rank, 2)
        wanted = [int(0.6 * MiB), int(0.3 * MiB)]
        model.bucket_caps_bytes = wanted if rank == 0 else [MiB]  # rank 0's wins
        seen["set"] = model.bucket_caps_bytes
        seen["after_set"] = _train(model, rank, 2)[0]
        model.rebuild_buckets()
        seen["after_rebuild_buckets"] = _train(model, rank, 1)[0]
        model.last_bucket_bytes = 0  # another limit set: a rebuild that keeps the list
        model.bucket_caps_bytes = wanted + [MiB]
        seen["three"] = _train(model, rank, 2)[0]
        model.first_bucket_bytes = int(0.3 * MiB)
        seen["first_set"] = (model.bucket_caps_bytes, model.first_bucket_bytes,
                             model.bucket_cap_bytes)
        seen["stats"] = {k: model.stats()[k] for k in ("bucket_caps_bytes", "first_bucket_bytes",
                                                      "bucket_cap_bytes")}
        out[backend] = seen
        model.close()
    return out


class WithBuffer(nn.Module):
    """A buffer that starts different on each rank and that every forward changes by rank."""

    def __init__(self, rank):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.register_buffer("count", torch.full((3,), float(10 * rank)))
        self.rank = rank

    def forward(self, x):
        self.count.add_(self.rank + 1)
        return self.lin(x) * self.count.sum()


BUFFER_FLAGS = (None, True, False)


def _buffer_history(make, rank):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = make(WithBuffer(rank))
    history = [model.module.count.tolist()]
    for step in range(2):
        model(_x(rank, step)[:, :4]).sum().backward()
        history.append(model.module.count.tolist())
    future = sorted(str(w.message).split(".")[0] for w in caught
                    if issubclass(w.category, FutureWarning))
    return history, future, model


def check_buffer_sync(rank, world):
    out = {}
    for backend in BACKENDS:
        for old in BUFFER_FLAGS:
            for new in BUFFER_FLAGS:
                kwargs = dict(broadcast_buffers=old, forward_sync_buffers=new)
                ddp_history, ddp_warned, ddp = _buffer_history(lambda m: DDP(m, **kwargs), rank)
                ours_history, ours_warned, ours = _buffer_history(
                    lambda m: FusedReducer(m, backend=backend, **kwargs), rank)
                out[(backend, old, new)] = (ddp_history, ours_history, len(ddp_warned),
                                            len(ours_warned),
                                            (ddp.broadcast_buffers, ours.broadcast_buffers,
                                             ddp.forward_sync_buffers, ours.forward_sync_buffers))
                ours.close()
    return out


def check_init_sync(rank, world):
    """Parameters (and buffers) that differ by rank: init_sync=False keeps them, as DDP does."""
    out = {}
    for backend in BACKENDS:
        for init_sync in (True, False):
            def fresh():
                torch.manual_seed(rank)
                return nn.Linear(4, 4)
            ddp = DDP(fresh(), init_sync=init_sync)
            ours = FusedReducer(fresh(), backend=backend, init_sync=init_sync)
            out[(backend, init_sync)] = (ddp.module.weight.tolist(), ours.module.weight.tolist(),
                                         fresh().weight.tolist())
            ours.close()
    return out


def check_device_mesh_and_accepted_arguments(rank, world):
    """A 1-D device_mesh, dim, batched_grad_copy, check_reduction and
    mixed_precision(reduce_dtype): gradients against DDP with the same arguments (for
    mixed_precision: against FusedReducer's own reduce_dtype)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel.distributed import _MixedPrecision
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for backend in BACKENDS:
        cases = {"device_mesh": dict(device_mesh=mesh), "dim": dict(dim=1),
                 "batched_grad_copy": dict(batched_grad_copy=True),
                 "check_reduction": dict(check_reduction=True)}
        for name, kwargs in cases.items():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                ddp = DDP(_layers(), **kwargs)
                ours = FusedReducer(_layers(), backend=backend, **kwargs)
            difference = _max_difference(_train(ddp, rank, 2)[1], _train(ours, rank, 2)[1])
            out[(backend, name)] = (difference, dist.get_world_size(ours.process_group))
            ours.close()
        mixed = FusedReducer(_layers(), backend=backend,
                             mixed_precision=_MixedPrecision(reduce_dtype=torch.bfloat16))
        plain = FusedReducer(_layers(), backend=backend, reduce_dtype=torch.bfloat16)
        out[(backend, "mixed_precision")] = (
            _max_difference(_train(mixed, rank, 2)[1], _train(plain, rank, 2)[1]),
            str(mixed.reduce_dtype))
        mixed.close()
        plain.close()
        try:
            FusedReducer(_layers(), backend=backend,
                         device_mesh=init_device_mesh("cpu", (1, world)))
            out[(backend, "2-D mesh")] = "accepted"
        except FusedReducerError as e:
            out[(backend, "2-D mesh")] = str(e)
    return out


class Branchy(nn.Module):
    """`spare` is used only when asked (never, by default)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(16, 16)
        self.spare = nn.Linear(16, 16)
        self.b = nn.Linear(16, 4)

    def forward(self, x, use_spare=False):
        h = torch.tanh(self.a(x))
        return self.b(h + self.spare(h) if use_spare else h)


def check_skip_unused(rank, world):
    """Per backend: (largest gradient difference to DDP with the same arguments, the bytes the
    profiler saw all-reduced per step with and without skipping, the spare parameters' bytes,
    the error when a rank uses `spare` after all)."""
    from behaviour_common import collectives
    kwargs = dict(find_unused_parameters=True, skip_all_reduce_unused_params=True)
    out = {}
    for backend in BACKENDS:
        models = {"ddp": DDP(Branchy(), **kwargs),
                  "skip": FusedReducer(Branchy(), backend=backend, **kwargs),
                  "plain": FusedReducer(Branchy(), backend=backend, find_unused_parameters=True)}
        grads = {name: [] for name in models}
        moved = {name: [] for name in models}
        for step in range(3):
            for name, model in models.items():
                model.zero_grad()
                x = _x(rank, step)[:, :16]
                moved[name].append(sum(b for b, _ in collectives(
                    lambda: model(x).pow(2).sum().backward())[1]))
                grads[name].append([p.grad for p in model.parameters()])
        difference = max((a - b).abs().max().item() if a is not None else 0.0
                         for ga, gb in zip(grads["ddp"], grads["skip"]) for a, b in zip(ga, gb)
                         if a is not None or b is not None)
        untouched = all(g[2] is None and g[3] is None for g in grads["skip"])  # spare.*
        model = models["skip"]
        model.zero_grad()
        try:
            model(_x(rank, 3)[:, :16], use_spare=rank == world - 1).sum().backward()
            error = None
        except RuntimeError as e:
            error = (type(e).__name__, str(e))
        out[backend] = (difference, untouched, moved["skip"], moved["plain"],
                        sum(p.numel() * 4 for p in Branchy().spare.parameters()), error)
        models["skip"].close()
        models["plain"].close()
    return out


CHECKS = [check_skip_unused, check_bucket_lists, check_caps_persist, check_buffer_sync, check_init_sync,
          check_device_mesh_and_accepted_arguments]


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def outcomes(request):
    return request.param, run_checks(CHECKS, world_size=request.param, timeout=400)


def test_bucket_cap_mb_list_gives_ddps_layout_at_the_first_step_and_after_the_rebuild(outcomes):
    world, outcomes = outcomes
    for rank, r in enumerate(per_rank(outcomes, "check_bucket_lists")):
        for (backend, i), (ddp_sizes, our_sizes, difference, caps) in r.items():
            kwargs = SIZE_ARGUMENTS[i]
            where = (world, rank, backend, kwargs)
            if "bucket_cap_mb_list" in kwargs:
                assert our_sizes == ddp_sizes, where
            else:  # DDP's first layout is then one bucket; FusedReducer's [first, cap] (README)
                assert our_sizes[1:] == ddp_sizes[1:], where
            assert difference <= 1e-6, where
            if "bucket_cap_mb_list" in kwargs:
                assert caps == [int(mb * MiB) for mb in kwargs["bucket_cap_mb_list"]], where
            elif "bucket_cap_mb" in kwargs:  # an explicit cap is the first bucket's too, as DDP
                assert caps == [int(0.6 * MiB)] * 2, where
            else:
                assert caps == [MiB, 25 * MiB], where


def test_bucket_caps_bytes_set_while_training_persists_across_rebuilds_and_rank0_wins(outcomes):
    world, outcomes = outcomes
    for rank, r in enumerate(per_rank(outcomes, "check_caps_persist")):
        ref = r["reference"]
        for backend in BACKENDS:
            seen = r[backend]
            where = (world, rank, backend)
            mib = [int(0.3 * MiB), int(0.6 * MiB), MiB]
            assert seen["constructed"] == mib, where
            # The value set reads back at once; the layout follows rank 0's from the next step.
            assert seen["set"] == ([int(0.6 * MiB), int(0.3 * MiB)] if rank == 0 else [MiB])
            assert seen["after_set"] == [ref[(0.6, 0.3)]] * 2, where
            assert seen["after_rebuild_buckets"] == [ref[(0.6, 0.3)]], where
            assert seen["three"] == [ref[(0.6, 0.3, 1)]] * 2, where
            caps, first, cap = seen["first_set"]
            assert caps == [int(0.3 * MiB), int(0.3 * MiB), MiB], where
            assert (first, cap) == (int(0.3 * MiB), MiB), where
            assert seen["stats"] == {"bucket_caps_bytes": [int(0.6 * MiB), int(0.3 * MiB), MiB],
                                     "first_bucket_bytes": int(0.6 * MiB),
                                     "bucket_cap_bytes": MiB}, where  # in force: not yet rebuilt


def test_broadcast_buffers_and_forward_sync_buffers_combine_as_in_ddp(outcomes):
    world, outcomes = outcomes
    for rank, r in enumerate(per_rank(outcomes, "check_buffer_sync")):
        for key, (ddp_history, ours_history, ddp_warned, ours_warned, flags) in r.items():
            where = (world, rank, key)
            assert ours_history == ddp_history, where
            assert ours_warned == ddp_warned, where
            assert flags[0] == flags[1] and flags[2] == flags[3], where


def test_skip_all_reduce_unused_params_drops_their_bytes_and_raises_when_the_set_changes(outcomes):
    world, outcomes = outcomes
    for rank, r in enumerate(per_rank(outcomes, "check_skip_unused")):
        for backend, (difference, untouched, skip, plain, spare, error) in r.items():
            where = (world, rank, backend)
            assert difference <= 1e-6 and untouched, where
            assert skip[0] == plain[0], where  # the first step decides what no rank uses
            assert [p - s for p, s in zip(plain[1:], skip[1:])] == [spare, spare], where
            assert error is not None and error[0] == "RuntimeError", (where, error)
            assert "'spare." in error[1] and "skip_all_reduce_unused_params" in error[1], where


def test_init_sync_false_keeps_rank_local_parameters_like_ddp(outcomes):
    world, outcomes = outcomes
    results = per_rank(outcomes, "check_init_sync")
    for rank, r in enumerate(results):
        for (backend, init_sync), (ddp_weight, our_weight, local) in r.items():
            assert our_weight == ddp_weight, (world, rank, backend, init_sync)
            expected = local if not init_sync else results[0][(backend, init_sync)][2]
            assert our_weight == expected, (world, rank, backend, init_sync)


def test_device_mesh_and_accepted_arguments_give_ddps_gradients(outcomes):
    world, outcomes = outcomes
    for rank, r in enumerate(per_rank(outcomes, "check_device_mesh_and_accepted_arguments")):
        for backend in BACKENDS:
            for name in ("device_mesh", "dim", "batched_grad_copy", "check_reduction"):
                difference, group_size = r[(backend, name)]
                assert difference <= 1e-6 and group_size == world, (world, rank, backend, name)
            difference, dtype = r[(backend, "mixed_precision")]
            assert difference == 0 and dtype == "torch.bfloat16", (world, rank, backend)
            assert "1-D device_mesh" in r[(backend, "2-D mesh")], (world, rank, backend)
