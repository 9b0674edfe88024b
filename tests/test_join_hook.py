"""What a joined rank does (the join hook): it shadows each bucket then the unused map, and
join with no_sync accumulation and BatchNorm trains like DDP's join.

Each test checks a behaviour against an independent reference (DDP on the same model and data,
a float64 average of locally computed gradients, the profiler's record of the collectives, or the
test's own count). The checks of the selected tests run in ONE spawn of 2 gloo ranks
(SelectedChecks, the module fixture).
"""
import torch
import torch.distributed as dist

from behaviour_common import wrap
from dist_utils import SelectedChecks, per_rank
from ddp_comparison import (BNNet, buffers, build, data, grads, loss_of, max_diff, outcome,
                                params, risky_kwargs, same_on_all_ranks, sgd)


JOIN_STEPS = {0: 4, 1: 2}


def check_join_no_sync_batchnorm(rank, world):
    """Rank 0 has 4 steps, rank 1 has 2; each step accumulates one micro-batch under no_sync
    and synchronises on the second. The same loop under DDP.join and FusedReducer.join."""
    out = {}
    for kind in ("ddp", "fr"):
        m = wrap(kind, build(BNNet), **risky_kwargs(15))  # a hang fails in 15 s
        opt = sgd(m)
        steps = 0

        def loop():
            nonlocal steps
            with m.join():
                for i in range(JOIN_STEPS[rank]):
                    opt.zero_grad()
                    with m.no_sync():
                        x, y = data(rank, i, 0)
                        loss_of(m(x), y, rank).backward()
                    x, y = data(rank, i, 1)
                    loss_of(m(x), y, rank).backward()
                    opt.step()
                    steps += 1
        out[kind] = {"outcome": outcome(loop)[:3], "steps": steps, "params": params(m),
                     "buffers": buffers(m), "grads": grads(m),
                     "synced": same_on_all_ranks(list(m.parameters()) + list(m.buffers()))}
        dist.barrier()
    return {"outcome": {k: (v["outcome"], v["steps"], v["synced"]) for k, v in out.items()},
            "params": max_diff(out["ddp"]["params"], out["fr"]["params"]),
            "buffers": max_diff(out["ddp"]["buffers"], out["fr"]["buffers"]),
            "grads": max_diff(out["ddp"]["grads"], out["fr"]["grads"]),
            "running_mean_moved": bool(out["fr"]["buffers"]["bn.running_mean"].abs().max() > 0)}


CHECKS = SelectedChecks()
outcomes = CHECKS.fixture(timeout=240)  # the selected tests' checks, in one spawn


def test_a_joined_rank_shadows_each_bucket_then_the_unused_map():
    """No spawn: FusedReducer's join hook on a stand-in model. Per shadowed step a joined rank
    issues what a training rank's backward issues, in the same order (DDP's join hook: one
    all-reduce per bucket, then the unused-parameter map with find_unused_parameters)."""
    import types
    from fused_reducer.core import join as join_module

    calls = []

    class Work:
        def wait(self):
            return None

    class Transport:
        def allreduce_sum(self, tensor):
            calls.append(("allreduce", tensor.dtype, tuple(tensor.shape)))
            return Work()

    class Reducer:
        def prepare_forward(self, will_sync):
            calls.append(("prepare_forward", will_sync))

        def zero_buckets(self):
            return [(torch.zeros(5), [], [0, 1], False), (torch.zeros(3), [], [2], True)]

        def shadow_health_exchange(self):
            calls.append(("shadow_health_exchange",))

        def note_shadowed_step(self):
            calls.append(("note_shadowed_step",))

        def joined_used_map(self):
            return torch.ones(3, dtype=torch.int32)

    for find_unused in (False, True):
        calls.clear()
        attachment = types.SimpleNamespace(reducer=Reducer(), transport=Transport(),
                                           has_comm_hook=False)
        model = types.SimpleNamespace(  # the wrapper's public attributes the hook reads
            find_unused_parameters=find_unused, forward_sync_buffers=False,
            require_forward_param_sync=True, require_backward_grad_sync=True,
            module=torch.nn.Linear(2, 2))
        hook = join_module.FusedReducerJoinHook(model, attachment)
        saved = join_module.sync_requested
        join_module.sync_requested = lambda a, syncing, joined: True  # the others synchronise this step
        try:
            hook.main_hook()
        finally:
            join_module.sync_requested = saved
        expected = [("prepare_forward", False),
                    ("allreduce", torch.float32, (5,)), ("allreduce", torch.float32, (3,))]
        if find_unused:
            expected.append(("allreduce", torch.int32, (3,)))
        expected += [("shadow_health_exchange",), ("note_shadowed_step",)]
        assert calls == expected, f"find_unused_parameters={find_unused}: {calls}"


@CHECKS.uses(check_join_no_sync_batchnorm)
def test_join_with_no_sync_accumulation_and_batchnorm_matches_ddp_join(outcomes):
    """Slip: a joined rank shadowing a no_sync forward's buffer broadcast (or missing the
    synchronised one after it), which moves the BatchNorm statistics or hangs the others."""
    for rank, r in enumerate(per_rank(outcomes, "check_join_no_sync_batchnorm")):
        ddp, fr = r["outcome"]["ddp"], r["outcome"]["fr"]
        assert ddp == (("ok", None), JOIN_STEPS[rank], 0.0), f"DDP side changed: {ddp}"
        assert fr == (("ok", None), JOIN_STEPS[rank], 0.0), f"rank {rank}: {fr}"
        assert r["running_mean_moved"]
        for what in ("params", "buffers", "grads"):
            assert isinstance(r[what], float) and r[what] <= 1e-6, f"rank {rank} {what}: {r[what]}"
