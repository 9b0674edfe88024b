"""No silently wrong gradient: plain regression tests beside the property test
(tests/test_graph_shapes.py).

- Reentrant checkpointing of the last layer with find_unused_parameters=True is exact (the step
  ends with the backward that reaches the module's outputs), on both CPU transports; where the
  outputs cannot be seen, the late gradient raises on every rank naming the parameter.
- no_sync() nests like DDP's: the previous setting is restored, also when the body raises.
- One averaging arithmetic: each gradient scaled by 1/world in the copy (DDP's mul_out; the
  in-place div_ for a gradient that is its bucket view), then summed. fp32: bit-identical to DDP
  on 2 ranks; on 3 ranks every element is one of the fp32 sums of DDP's scaled contributions (the
  order of a 3-term sum depends on the element's place in the collective's chunks); bf16 and fp16
  parameters: no further from float64 than DDP.
"""
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

import fused_reducer
from dist_utils import per_rank, run_checks

BACKENDS = ("shm", "process_group")


class LastLayerCheckpointed(nn.Module):
    """Two layers, the second (the first gradients of backward) checkpointed: the smallest model
    whose reentrant checkpoint ends a backward before the module's outputs are reached."""

    def __init__(self, wrap_output=False):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)
        self.wrap_output = wrap_output

    def forward(self, x):
        out = checkpoint(self.b, torch.tanh(self.a(x)), use_reentrant=True)
        return Opaque(out) if self.wrap_output else out


class Opaque:
    """An output container FusedReducer cannot look into (not a pytree node)."""

    def __init__(self, value):
        self.value = value


def _build(cls=LastLayerCheckpointed, dtype=torch.float32, **kwargs):
    torch.manual_seed(0)
    return cls(**kwargs).to(dtype)


def _input(rank, step, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(5, 8, generator=g).to(dtype)


def _float64_average(rank, world, steps_done_params, step):
    """Average over ranks of each rank's local gradient, float64, computed on this rank alone."""
    total = None
    for r in range(world):
        ref = _build(dtype=torch.float64)
        ref.load_state_dict({k: v.double() for k, v in steps_done_params.items()})
        ref(_input(r, step, torch.float64)).pow(2).sum().backward()
        g = [p.grad for p in ref.parameters()]
        total = g if total is None else [t + x for t, x in zip(total, g)]
    return [t / world for t in total]


def _checkpoint_exact(rank, world, backend):
    model = fused_reducer.FusedReducer(_build(), backend=backend, find_unused_parameters=True,
                                       timeout=timedelta(seconds=30))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    errors = []
    for step in range(3):
        state = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
        opt.zero_grad()
        try:
            model(_input(rank, step)).pow(2).sum().backward()
        except RuntimeError as e:  # a refusal is a wrong answer here: the shape is exact
            model.close()
            return f"step {step} raised: {e}"
        want = _float64_average(rank, world, state, step)
        errors.append(max(((p.grad.double() - w).norm() / w.norm()).item()
                          for p, w in zip(model.parameters(), want)))
        opt.step()
    model.close()
    return errors


def check_hidden_outputs_raise_naming_parameter(rank, world):
    model = fused_reducer.FusedReducer(_build(wrap_output=True), backend="process_group",
                                       find_unused_parameters=True, timeout=timedelta(seconds=30))
    try:
        model(_input(rank, 0)).value.pow(2).sum().backward()
    except RuntimeError as e:
        return str(e)
    finally:
        model.close()
    return None


# -- no_sync nesting ---------------------------------------------------------------------------

def _nested_no_sync_grads(model, rank, raise_inside):
    """outer no_sync { inner no_sync {} ; backward }: still inside the outer window, so local."""
    model.zero_grad()
    with model.no_sync():
        if raise_inside:
            try:
                with model.no_sync():
                    raise KeyError("body")
            except KeyError:
                pass
        else:
            with model.no_sync():
                pass
        model(_input(rank, 0)).pow(2).sum().backward()
    local = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(_input(rank, 1)).pow(2).sum().backward()  # outside every window: synchronised
    return local, [p.grad.clone() for p in model.parameters()]


def check_nested_no_sync(rank, world):
    out = {}
    for raise_inside in (False, True):
        fused = fused_reducer.FusedReducer(_build(), backend="process_group")
        ddp = DDP(_build())
        (f_local, f_sync), (d_local, d_sync) = (
            _nested_no_sync_grads(m, rank, raise_inside) for m in (fused, ddp))
        ref = _build()
        ref(_input(rank, 0)).pow(2).sum().backward()  # the purely local gradient
        out[raise_inside] = dict(
            local_is_local=all(torch.equal(f, p.grad) for f, p in zip(f_local, ref.parameters())),
            local_equals_ddp=all(torch.equal(f, d) for f, d in zip(f_local, d_local)),
            # (summation order of 3 ranks: see the arithmetic test)
            sync_equals_ddp=all(torch.allclose(f, d, rtol=1e-6, atol=1e-7)
                                for f, d in zip(f_sync, d_sync)),
            syncing_after=fused.require_backward_grad_sync)
        fused.close()
    return out


# -- averaging arithmetic ----------------------------------------------------------------------

class Wide(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(32, 64)
        self.b = nn.Linear(64, 32)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _wide(dtype=torch.float32):
    torch.manual_seed(7)
    return Wide().to(dtype)


def _wide_input(rank, step, dtype):
    g = torch.Generator().manual_seed(50 + 10 * step + rank)
    return torch.randn(16, 32, generator=g).to(dtype)


def _two_steps(model, rank, dtype):
    """Two steps with zero_grad(set_to_none=False): with gradient_as_bucket_view the second
    step's gradients are the bucket views (DDP divides them in place)."""
    out = []
    for step in range(2):
        model.zero_grad(set_to_none=False)
        model(_wide_input(rank, step, dtype)).pow(2).mean().backward()
        out.append([p.grad.detach().clone() for p in model.parameters()])
    return out


def _local_grads(rank, step, dtype):
    ref = _wide(dtype)
    ref(_wide_input(rank, step, dtype)).pow(2).mean().backward()
    return [p.grad for p in ref.parameters()]


def _is_a_sum_of(result, contributions):
    """Every element of `result` equals one of the fp32 sums of the contributions in some order."""
    ok = torch.zeros_like(result, dtype=torch.bool)
    n = len(contributions)
    for first in range(n):
        rest = [c for i, c in enumerate(contributions) if i != first]
        acc = contributions[first].clone()
        for c in rest:
            acc = acc + c
        ok |= acc == result
        if n == 3:  # the other association: first + (second + third)
            ok |= (contributions[first] + (rest[0] + rest[1])) == result
    return bool(ok.all()), int((~ok).sum())


def _arithmetic(rank, world, backend):
    out = {}
    for view in (False, True):
        fused = fused_reducer.FusedReducer(_wide(), backend=backend,
                                           gradient_as_bucket_view=view)
        ddp = DDP(_wide(), gradient_as_bucket_view=view)
        f_steps, d_steps = _two_steps(fused, rank, torch.float32), _two_steps(ddp, rank,
                                                                               torch.float32)
        fused.close()
        bitwise = all(torch.equal(f, d) for fs, ds in zip(f_steps, d_steps)
                      for f, d in zip(fs, ds))
        # DDP's contributions: grad * float(1/world) (mul_out); in place (a bucket view,
        # from the second step on with gradient_as_bucket_view) grad / world.
        misses = []
        for step, (fs, ds) in enumerate(zip(f_steps, d_steps)):
            local = _local_grads(rank, step, torch.float32)
            gathered = []
            for g in local:
                parts = [torch.empty_like(g) for _ in range(world)]
                dist.all_gather(parts, g)
                gathered.append(parts)
            for i, parts in enumerate(gathered):
                if view and step == 1:
                    scaled = [p / world for p in parts]
                else:
                    scaled = [p * torch.tensor(1.0 / world, dtype=torch.float32)
                              for p in parts]
                for who, got in (("fused", fs[i]), ("ddp", ds[i])):
                    ok, count = _is_a_sum_of(got, scaled)
                    if not ok:
                        misses.append((who, step, i, count))
        out[view] = dict(bitwise=bitwise, misses=misses)
    return out


def _half_precision(rank, world, backend):
    out = {}
    for dtype in (torch.bfloat16, torch.float16):
        fused = fused_reducer.FusedReducer(_wide(dtype), backend=backend)
        ddp = DDP(_wide(dtype))
        errors = {}
        for name, model in (("fused", fused), ("ddp", ddp)):
            model.zero_grad()
            model(_wide_input(rank, 0, dtype)).pow(2).mean().backward()
            errors[name] = 0.0
            for p, w in zip(model.parameters(), _exact_average(rank, world, dtype)):
                errors[name] += (p.grad.double() - w).norm().item() ** 2
        fused.close()
        out[str(dtype)] = errors
    return out


def _exact_average(rank, world, dtype):
    """float64 average of the ranks' (half-precision) local gradients."""
    local = _local_grads(rank, 0, dtype)
    out = []
    for g in local:
        g = g.double()
        dist.all_reduce(g)
        out.append(g / world)
    return out


def checkpoint_exact_shm(rank, world):
    return _checkpoint_exact(rank, world, "shm")


def checkpoint_exact_process_group(rank, world):
    return _checkpoint_exact(rank, world, "process_group")


def arithmetic_shm(rank, world):
    return _arithmetic(rank, world, "shm")


def arithmetic_process_group(rank, world):
    return _arithmetic(rank, world, "process_group")


def half_precision_shm(rank, world):
    return _half_precision(rank, world, "shm")


def half_precision_process_group(rank, world):
    return _half_precision(rank, world, "process_group")


CHECKS = [checkpoint_exact_shm, checkpoint_exact_process_group,
          check_hidden_outputs_raise_naming_parameter, check_nested_no_sync,
          arithmetic_shm, arithmetic_process_group, half_precision_shm,
          half_precision_process_group]


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def outcomes(request):
    return request.param, run_checks(CHECKS, world_size=request.param, timeout=270)


@pytest.mark.parametrize("backend", BACKENDS)
def test_reentrant_checkpoint_of_last_layer_with_find_unused_parameters_is_exact(outcomes,
                                                                                 backend):
    _, results = outcomes
    for rank, errors in enumerate(per_rank(results, f"checkpoint_exact_{backend}")):
        assert not isinstance(errors, str), f"rank {rank}: {errors}"
        assert max(errors) < 1e-5, f"rank {rank}: relative errors per step {errors}"


def test_outputs_hidden_from_fused_reducer_make_the_late_gradient_raise_on_every_rank(outcomes):
    _, results = outcomes
    for rank, message in enumerate(per_rank(results, "check_hidden_outputs_raise_naming_parameter")):
        assert message is not None, f"rank {rank}: no error (the gradients were silently wrong)"
        assert "'a." in message and "use_reentrant=False" in message, message


def test_no_sync_nests_like_ddp_and_restores_the_previous_setting_when_the_body_raises(outcomes):
    _, results = outcomes
    for rank, result in enumerate(per_rank(results, "check_nested_no_sync")):
        for raise_inside, r in result.items():
            assert r == dict(local_is_local=True, local_equals_ddp=True, sync_equals_ddp=True,
                             syncing_after=True), f"rank {rank}, raise_inside={raise_inside}: {r}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp32_averages_are_ddps_arithmetic_scaled_in_the_copy_then_summed(outcomes, backend):
    world, results = outcomes
    for rank, result in enumerate(per_rank(results, f"arithmetic_{backend}")):
        for view, r in result.items():
            assert not r["misses"], (f"rank {rank}, gradient_as_bucket_view={view}: elements "
                                     f"that are no sum of DDP's scaled contributions "
                                     f"(who, step, param, count): {r['misses']}")
            if world == 2:  # a + b == b + a: the order cannot matter
                assert r["bitwise"], f"rank {rank}, gradient_as_bucket_view={view}: not DDP's bits"


@pytest.mark.parametrize("backend", BACKENDS)
def test_half_precision_averages_are_no_further_from_float64_than_ddps(outcomes, backend):
    _, results = outcomes
    for rank, result in enumerate(per_rank(results, f"half_precision_{backend}")):
        for dtype, errors in result.items():
            assert errors["fused"] <= errors["ddp"] * 1.05 + 1e-12, f"rank {rank} {dtype}: {errors}"
