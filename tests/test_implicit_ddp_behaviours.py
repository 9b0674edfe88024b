"""DDP behaviours a user relies on without knowing, each run under DDP and under
FusedReducer on 2 gloo ranks in one spawn: no_sync with unused parameters and with BatchNorm,
undefined gradients, reassigned buffers, two forwards per backward, create_graph, calling the
inner module directly, static_graph, broadcast_buffers=False, exceptions inside no_sync, eval and
no_grad forwards, forwards without backward, accumulation without zero_grad, tied parameters, two
wrappers in one process; then FusedReducer-only settings (trace_steps, first-bucket defaults) and
a stalled peer with timeout=.

Scenarios that could leave one rank waiting on a broken wrapper run on a side group with a short
timeout (ddp_comparison.risky_kwargs), so a failure is an error, not a hung spawn.
"""
import os
import time
from datetime import timedelta

import pytest
import torch

from dist_utils import per_rank, run_checks
from ddp_comparison import (
    BNNet, CheckpointedWithUnused, DictOut, ExtraNet, FR_IS_DDP, HIDDEN, Net, StatNet, TiedNet,
    TwoHeads, WRAP, assert_all_close, assert_close, build, buffers, data, fused, grads, loss_of,
    max_diff, outcome, params, risky_kwargs, same_on_all_ranks, sgd, side_group, step, train)

KINDS = ("ddp", "fr")


def pair(cls=Net, seed=1234, risky=False, ddp_kwargs=None, **kwargs):
    """The same model under DDP and FusedReducer, with their SGD optimizers."""
    models, opts = {}, {}
    for kind in KINDS:
        kw = dict(kwargs)
        if kind == "ddp" and ddp_kwargs is not None:
            kw = dict(ddp_kwargs)
        if risky:
            kw.update(risky_kwargs())
        models[kind] = WRAP[kind](build(cls, seed), **kw)
        opts[kind] = sgd(models[kind])
    return models, opts


def diffs(models, what=params):
    return max_diff(what(models["ddp"]), what(models["fr"]))


# -- checks --------------------------------------------------------------------------------------

def check_find_unused_with_no_sync_remembers_usage_of_the_window(rank, world):
    """`extra` is used only in the no_sync micro-step: DDP still averages its gradient."""
    models, opts = pair(ExtraNet, find_unused_parameters=True)
    out = {"grads": [], "params": [], "extra_synced": []}
    for i in range(3):
        for kind, m in models.items():
            opts[kind].zero_grad()
            with m.no_sync():
                x, y = data(rank, i, 0)
                loss_of(m(x, use_extra=True), y, rank).backward()
            x, y = data(rank, i, 1)
            loss_of(m(x, use_extra=False), y, rank).backward()
        out["grads"].append(diffs(models, grads))
        out["extra_synced"].append(same_on_all_ranks([models["fr"].module.extra.weight.grad]))
        for opt in opts.values():
            opt.step()
        out["params"].append(diffs(models))
    return out


def check_undefined_gradient_leaves_grad_none(rank, world):
    """forward returns (main, aux), the loss uses main only: aux's hooks fire with undefined
    gradients (find_unused_parameters=True); DDP leaves aux.*.grad None."""
    models, opts = pair(TwoHeads, find_unused_parameters=True)
    out = {"grads": [], "params": [], "none": {}}
    for i in range(2):
        for kind, m in models.items():
            opts[kind].zero_grad()
            x, y = data(rank, i)
            main, _aux = m(x)
            loss_of(main, y, rank).backward()
            out["none"][kind] = [n for n, p in m.module.named_parameters() if p.grad is None]
        out["grads"].append(diffs(models, grads))
        for opt in opts.values():
            opt.step()
        out["params"].append(diffs(models))
    return out


def check_reassigned_buffer_is_broadcast_at_next_forward(rank, world):
    models, opts = pair(StatNet)
    for kind, m in models.items():
        step(m, opts[kind], rank, 0)
    out = {"stat": {}, "params": []}
    for kind, m in models.items():
        m.module.stat = torch.full((HIDDEN,), float(rank + 1))  # a new tensor, different per rank
        step(m, opts[kind], rank, 1)
        out["stat"][kind] = m.module.stat.tolist()
    out["params"].append(diffs(models))
    out["buffers"] = diffs(models, buffers)
    return out


def check_two_forwards_then_one_backward_with_batchnorm(rank, world):
    models, opts = pair(BNNet, risky=True)
    out = {"params": [], "buffers": []}
    for i in range(3):
        for kind, m in models.items():
            opts[kind].zero_grad()
            x1, y1 = data(rank, i, 0)
            x2, y2 = data(rank, i, 1)
            loss = loss_of(m(x1), y1, rank) + loss_of(m(x2), y2, rank)
            loss.backward()
            opts[kind].step()
        out["params"].append(diffs(models))
        out["buffers"].append(diffs(models, buffers))
    return out


def check_backward_with_create_graph(rank, world):
    """FusedReducer with backward(create_graph=True) vs DDP with a plain backward: the same
    first-order gradients. (DDP of torch 2.14 on CPU itself raises "a leaf Variable that requires
    grad is being used in an in-place operation" with create_graph=True.)"""
    models, opts = pair(Net, risky=True)
    out = {"grads": [], "params": [], "grad_synced": []}
    for i in range(2):
        for kind, m in models.items():
            opts[kind].zero_grad()
            x, y = data(rank, i)
            loss_of(m(x), y, rank).backward(create_graph=(kind == "fr"))
        out["grads"].append(diffs(models, grads))
        out["grad_synced"].append(same_on_all_ranks([p.grad for p in models["fr"].parameters()]))
        for opt in opts.values():
            opt.step()
        out["params"].append(diffs(models))
        for m in models.values():
            m.zero_grad(set_to_none=True)  # break the grad -> graph reference cycle
    return out


def check_direct_inner_module_call_backward_stays_local(rank, world):
    models, opts = pair(Net, risky=True)
    for kind, m in models.items():
        train(m, rank, 2, opts[kind])
    out = {}
    for kind, m in models.items():
        opts[kind].zero_grad()
        x, y = data(rank, 10)

        def local_backward():
            loss_of(m.module(x), y, rank).backward()
        out[kind] = outcome(local_backward)
    out["grads"] = diffs(models, grads)  # both local: rank-specific, equal to DDP's
    out["fr_grads_differ_across_ranks"] = same_on_all_ranks(
        [p.grad for p in models["fr"].parameters() if p.grad is not None] or [torch.zeros(1)])
    for kind, m in models.items():
        step(m, opts[kind], rank, 11)  # training goes on normally
    out["params_after_next_step"] = diffs(models)
    return out


def check_static_graph_is_refused_naming_the_alternative(rank, world):
    return outcome(lambda: type(fused(build(Net), static_graph=True)).__name__)


def check_reentrant_checkpoint_with_unused_param_without_static_graph(rank, world):
    """What users turn static_graph on for: reentrant checkpointing plus an unused parameter.
    DDP(static_graph=True) vs FusedReducer(find_unused_parameters=True)."""
    models, opts = pair(CheckpointedWithUnused, risky=True, find_unused_parameters=True,
                        ddp_kwargs=dict(static_graph=True))
    out = {"grads": [], "params": []}
    for i in range(3):
        for kind, m in models.items():
            opts[kind].zero_grad()
            x, y = data(rank, i)
            loss_of(m(x), y, rank).backward()
        out["grads"].append(diffs(models, grads))
        for opt in opts.values():
            opt.step()
        out["params"].append(diffs(models))
    return out


def check_batchnorm_running_stats_after_no_sync_window(rank, world):
    models, opts = pair(BNNet, risky=True)
    out = {"params": [], "buffers": []}
    for i in range(2):
        for kind, m in models.items():
            opts[kind].zero_grad()
            for micro in range(3):
                x, y = data(rank, i, micro)
                with m.no_sync():
                    loss_of(m(x), y, rank).backward()
            x, y = data(rank, i, 3)
            loss_of(m(x), y, rank).backward()
            opts[kind].step()
        out["params"].append(diffs(models))
        out["buffers"].append(diffs(models, buffers))
    return out


def check_broadcast_buffers_false_keeps_rank_buffers(rank, world):
    models, opts = pair(BNNet, broadcast_buffers=False)
    for kind, m in models.items():
        train(m, rank, 3, opts[kind])
    return {"params": diffs(models), "buffers": diffs(models, buffers),
            "ddp_buffers_differ": same_on_all_ranks(list(models["ddp"].buffers())[:2]),
            "fr_buffers_differ": same_on_all_ranks(list(models["fr"].buffers())[:2])}


def check_exception_inside_no_sync_leaves_sync_on(rank, world):
    models, opts = pair(Net, risky=True)
    for kind, m in models.items():
        try:
            with m.no_sync():
                x, y = data(rank, 0)
                loss_of(m(x), y, rank).backward()
                raise KeyError("user error inside no_sync")
        except KeyError:
            pass
    out = {}
    for kind, m in models.items():
        opts[kind].zero_grad()
        x, y = data(rank, 1)
        loss_of(m(x), y, rank).backward()
    out["grads"] = diffs(models, grads)
    out["fr_grads_synced"] = same_on_all_ranks([p.grad for p in models["fr"].parameters()])
    for opt in opts.values():
        opt.step()
    out["params"] = diffs(models)
    return out


def check_eval_and_no_grad_forwards_mixed_into_training(rank, world):
    models, opts = pair(BNNet, risky=True)
    out = {"params": [], "buffers": [], "eval_out": [], "no_grad_out": []}
    for i in range(3):
        evals = {}
        for kind, m in models.items():
            step(m, opts[kind], rank, i)
            xe, _ = data(rank, 100 + i)
            with torch.no_grad():  # validation, train mode, no grad
                no_grad_out = m(xe)
            m.eval()
            eval_out = m(xe)  # eval mode, grad enabled, never backpropagated
            m.train()
            evals[kind] = {"ng": no_grad_out.detach(), "ev": eval_out.detach()}
        out["no_grad_out"].append(max_diff({"o": evals["ddp"]["ng"]}, {"o": evals["fr"]["ng"]}))
        out["eval_out"].append(max_diff({"o": evals["ddp"]["ev"]}, {"o": evals["fr"]["ev"]}))
        out["params"].append(diffs(models))
        out["buffers"].append(diffs(models, buffers))
    return out


def check_forward_without_backward_then_normal_step(rank, world):
    out = {}
    for find_unused in (False, True):
        models, opts = pair(ExtraNet if find_unused else Net, risky=True,
                            find_unused_parameters=find_unused)
        fwd = {"use_extra": True} if find_unused else {}
        for kind, m in models.items():
            step(m, opts[kind], rank, 0)
            x, _ = data(rank, 50)
            m(x)  # e.g. a metric on the training batch: forward, no backward
            step(m, opts[kind], rank, 1)
            m(x, **fwd)
            step(m, opts[kind], rank, 2)
        out[f"find_unused={find_unused}"] = diffs(models)
    return out


def check_accumulation_without_zero_grad_across_synced_steps(rank, world):
    models, opts = pair(Net)
    out = {"grads": [], "params": []}
    for i in range(3):
        for kind, m in models.items():
            step(m, opts[kind], rank, i, zero=False)
        out["grads"].append(diffs(models, grads))
        out["params"].append(diffs(models))
    return out


def check_tied_parameters(rank, world):
    models, opts = pair(TiedNet, risky=True)
    out = {"params": [], "grads": []}
    for i in range(3):
        for kind, m in models.items():
            step(m, opts[kind], rank, i)
        out["grads"].append(diffs(models, grads))
        out["params"].append(diffs(models))
    out["tied_still"] = models["fr"].module.a.weight is models["fr"].module.b.weight
    out["state_dict_keys"] = [list(m.state_dict()) for m in models.values()]
    return out


def check_two_wrapped_models_in_one_process(rank, world):
    pairs = {}
    for kind in KINDS:
        a = WRAP[kind](build(Net, 1))
        b = WRAP[kind](build(BNNet, 2))
        pairs[kind] = (a, b, sgd(a), sgd(b))
    out = {"a": [], "b": []}
    for i in range(2):  # separate steps, one model after the other
        for kind, (a, b, oa, ob) in pairs.items():
            step(a, oa, rank, i)
            step(b, ob, rank, 100 + i)
    for kind, (a, b, oa, ob) in pairs.items():  # then one backward through both
        oa.zero_grad()
        ob.zero_grad()
        x, y = data(rank, 7)
        (loss_of(a(x), y, rank) + loss_of(b(x), y, rank)).backward()
        oa.step()
        ob.step()
    for name, idx in (("a", 0), ("b", 1)):
        out[name] = max_diff(params(pairs["ddp"][idx]), params(pairs["fr"][idx]))
    return out


def check_no_op_to_and_float_after_wrapping_keep_training(rank, world):
    """.to("cpu"), .float(), .to(torch.float32) on a CPU float32 model change nothing: training
    goes on as under DDP (no error)."""
    models, opts = pair(Net, risky=True)
    out = {}
    for kind, m in models.items():
        step(m, opts[kind], rank, 0)
        res = outcome(lambda: (m.to("cpu"), m.float(), m.to(torch.float32), m.cpu(),
                               train(m, rank, 2, opts[kind], start=1)) and None)
        out[kind] = res
    out["params"] = diffs(models)
    return out


def check_freezing_a_layer_after_wrapping_with_find_unused(rank, world):
    """Fine-tuning: fc1.requires_grad_(False) after some steps, find_unused_parameters=True."""
    models, opts = pair(Net, risky=True, find_unused_parameters=True)
    out = {"params": [], "grads": [], "none": {}}
    for i in range(4):
        if i == 2:
            for m in models.values():
                m.module.fc1.requires_grad_(False)
        for kind, m in models.items():
            step(m, opts[kind], rank, i)
            out["none"][kind] = [n for n, p in m.module.named_parameters() if p.grad is None]
        out["grads"].append(diffs(models, grads))
        out["params"].append(diffs(models))
    return out


def check_dict_output_with_find_unused_parameters(rank, world):
    models, opts = pair(DictOut, risky=True, find_unused_parameters=True)
    out = {"params": [], "grads": []}
    for i in range(3):
        for kind, m in models.items():
            opts[kind].zero_grad()
            x, y = data(rank, i)
            res = m(x, use_aux=(i != 1))
            loss = loss_of(res["main"], y, rank)
            if "aux" in res:
                loss = loss + loss_of(res["aux"], y, rank)
            loss.backward()
            opts[kind].step()
        out["grads"].append(diffs(models, grads))
        out["params"].append(diffs(models))
    return out


def check_no_sync_around_forward_only_decides_the_backward(rank, world):
    """DDP decides at forward: a forward inside no_sync() whose backward runs after the block
    accumulates locally; a forward outside whose backward runs inside the block is averaged."""
    models, opts = pair(Net, risky=True)
    out = {}
    for kind, m in models.items():
        opts[kind].zero_grad()
        x, y = data(rank, 0)
        with m.no_sync():
            loss = loss_of(m(x), y, rank)
        loss.backward()
    out["forward_in_no_sync"] = diffs(models, grads)
    out["forward_in_no_sync_local"] = same_on_all_ranks(
        [p.grad for p in models["fr"].parameters()])
    for kind, m in models.items():
        opts[kind].zero_grad()
        x, y = data(rank, 1)
        loss = loss_of(m(x), y, rank)
        with m.no_sync():
            loss.backward()
    out["backward_in_no_sync"] = diffs(models, grads)
    out["backward_in_no_sync_synced"] = same_on_all_ranks(
        [p.grad for p in models["fr"].parameters()])
    for kind, m in models.items():
        step(m, opts[kind], rank, 2)
    out["params"] = diffs(models)
    return out


def check_step_history_after_shrinking_trace_steps(rank, world):
    m = fused(build(Net))
    opt = train(m, rank, 5)
    out = {"before": len(m.step_history())}
    m.trace_steps = 2
    out["trace_steps"] = m.trace_steps
    out["right_after"] = len(m.step_history())
    train(m, rank, 3, opt, start=5)
    out["after_more_steps"] = len(m.step_history())
    return out


def check_explicit_default_first_bucket_wins_over_env(rank, world):
    import fused_reducer
    env = "FUSED_REDUCER_FIRST_BUCKET_BYTES"
    old = os.environ.get(env)
    out = {}
    try:
        os.environ[env] = str(3 << 20)
        out["env_only"] = fused_reducer.get_default_first_bucket_bytes()
        fused_reducer.set_default_first_bucket_bytes(2 << 20)
        out["after_call"] = fused_reducer.get_default_first_bucket_bytes()
        os.environ[env] = str(5 << 20)  # changed after the call: the call still wins
        out["env_changed_later"] = fused_reducer.get_default_first_bucket_bytes()
        out["reducer"] = fused(build(Net), first_bucket_mb=None).first_bucket_bytes
    finally:
        fused_reducer.set_default_first_bucket_bytes(1 << 20)  # DDP's, for later checks
        if old is None:
            os.environ.pop(env, None)
        else:
            os.environ[env] = old
    return out


def check_timeout_with_stalled_peer_names_the_bucket(rank, world):
    """rank 1 is alive but sleeps 10 s before backward; rank 0 must give up after ~3 s."""
    group = side_group(40)
    m = fused(build(Net), process_group=group, timeout=timedelta(seconds=3))
    opt = train(m, rank, 2)  # past the first-step rebuild
    opt.zero_grad()
    x, y = data(rank, 2)
    loss = loss_of(m(x), y, rank)
    if rank == 1:
        time.sleep(10)
    start = time.monotonic()
    result = outcome(loss.backward)
    return {"outcome": result, "seconds": time.monotonic() - start}


def check_require_backward_grad_sync_set_directly_keeps_a_micro_step_local(rank, world):
    """Gradient accumulation by DDP's flag (custom loops, accelerate, Lightning set it): a
    micro-step with require_backward_grad_sync=False stays local, the next one reduces the
    sum; no_sync() reads as the flag False."""
    models, opts = pair(Net)
    out = {"local_grads": None, "grads": None, "params": None, "flag_in_no_sync": {}}
    for kind, m in models.items():
        opts[kind].zero_grad()
        m.require_backward_grad_sync = False
        x, y = data(rank, 0, 0)
        loss_of(m(x), y, rank).backward()
        m.require_backward_grad_sync = True
        with m.no_sync():
            out["flag_in_no_sync"][kind] = m.require_backward_grad_sync
    out["local_grads"] = diffs(models, grads)
    out["local_synced"] = same_on_all_ranks(list(grads(models["fr"]).values()))
    for kind, m in models.items():
        x, y = data(rank, 0, 1)
        loss_of(m(x), y, rank).backward()
        opts[kind].step()
    out["grads"], out["params"] = diffs(models, grads), diffs(models)
    return out


class IgnoringNet(Net):
    """Net whose fc1.bias and a buffer of fc2 hold rank-local values, ignored as DDP's
    _set_params_and_buffers_to_ignore_for_model marks them."""

    def __init__(self, rank):
        super().__init__()
        with torch.no_grad():
            self.fc1.bias.fill_(rank + 1.0)
        self.fc2.register_buffer("local_buf", torch.full((3,), rank + 1.0))
        torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            self, ["fc1.bias", "fc2.local_buf"])


def check_ignored_parameters_and_buffers_stay_rank_local(rank, world):
    models, opts = {}, {}
    for kind in KINDS:
        torch.manual_seed(1234)
        models[kind] = WRAP[kind](IgnoringNet(rank))
        opts[kind] = sgd(models[kind])
    for i in range(2):
        for kind, m in models.items():
            step(m, opts[kind], rank, i)
    fr = models["fr"].module
    return dict(params=diffs(models), grads=diffs(models, grads), buffers=diffs(models, buffers),
                bias=fr.fc1.bias.detach().clone(), local_buf=fr.fc2.local_buf.clone())


def check_frozen_parameters_are_broadcast_at_construction(rank, world):
    """A frozen layer that differs across ranks (weights loaded on rank 0 only): DDP broadcasts
    every parameter, frozen ones too."""
    models = {}
    for kind in KINDS:
        module = build(Net)
        module.fc1.requires_grad_(False)
        with torch.no_grad():
            module.fc1.weight.add_(rank)
        models[kind] = WRAP[kind](module)
    return dict(params=diffs(models),
                synced=same_on_all_ranks([models["fr"].module.fc1.weight]))


def check_ddps_attributes_read_as_on_ddp(rank, world):
    """device_ids, output_device, static_graph and bucket_bytes_cap exist as on DDP (CPU)."""
    names = ("device_ids", "output_device", "static_graph")
    out = {kind: {n: getattr(WRAP[kind](build(Net)), n, "missing") for n in names}
           for kind in KINDS}
    out["bucket_bytes_cap"] = {kind: getattr(WRAP[kind](build(Net)), "bucket_bytes_cap", None)
                               for kind in KINDS}
    return out


def check_sync_batch_norm_on_cpu_is_refused_at_construction(rank, world):
    return {kind: outcome(lambda kind=kind: WRAP[kind](torch.nn.SyncBatchNorm.convert_sync_batchnorm(
        build(BNNet))) and "constructed") for kind in KINDS}


CHECKS = [
    check_find_unused_with_no_sync_remembers_usage_of_the_window,
    check_undefined_gradient_leaves_grad_none,
    check_reassigned_buffer_is_broadcast_at_next_forward,
    check_two_forwards_then_one_backward_with_batchnorm,
    check_backward_with_create_graph,
    check_direct_inner_module_call_backward_stays_local,
    check_static_graph_is_refused_naming_the_alternative,
    check_reentrant_checkpoint_with_unused_param_without_static_graph,
    check_batchnorm_running_stats_after_no_sync_window,
    check_broadcast_buffers_false_keeps_rank_buffers,
    check_exception_inside_no_sync_leaves_sync_on,
    check_eval_and_no_grad_forwards_mixed_into_training,
    check_forward_without_backward_then_normal_step,
    check_accumulation_without_zero_grad_across_synced_steps,
    check_tied_parameters,
    check_two_wrapped_models_in_one_process,
    check_no_op_to_and_float_after_wrapping_keep_training,
    check_freezing_a_layer_after_wrapping_with_find_unused,
    check_dict_output_with_find_unused_parameters,
    check_no_sync_around_forward_only_decides_the_backward,
    check_step_history_after_shrinking_trace_steps,
    check_explicit_default_first_bucket_wins_over_env,
    check_require_backward_grad_sync_set_directly_keeps_a_micro_step_local,
    check_ignored_parameters_and_buffers_stay_rank_local,
    check_frozen_parameters_are_broadcast_at_construction,
    check_ddps_attributes_read_as_on_ddp,
    check_sync_batch_norm_on_cpu_is_refused_at_construction,
    check_timeout_with_stalled_peer_names_the_bucket,  # last: leaves a stalled collective behind
]


@pytest.fixture(scope="module")
def outcomes():
    return run_checks(CHECKS, timeout=270)


def results(outcomes, check):
    return per_rank(outcomes, check.__name__)


# -- tests ---------------------------------------------------------------------------------------

def test_find_unused_parameters_with_no_sync_averages_a_param_used_only_in_the_window(outcomes):
    for r in results(outcomes, check_find_unused_with_no_sync_remembers_usage_of_the_window):
        assert_all_close(r["grads"], what="grads")
        assert all(d == 0.0 for d in r["extra_synced"]), \
            f"'extra' gradient not averaged: differs across ranks by {r['extra_synced']}"
        assert_all_close(r["params"], what="params")


def test_parameter_with_undefined_gradient_keeps_grad_none_like_ddp(outcomes):
    for r in results(outcomes, check_undefined_gradient_leaves_grad_none):
        assert r["none"]["ddp"] == ["aux.weight", "aux.bias"], "DDP side changed"
        assert r["none"]["fr"] == r["none"]["ddp"]
        assert_all_close(r["grads"], what="grads")
        assert_all_close(r["params"], what="params")


def test_buffer_reassigned_after_construction_is_broadcast_from_rank0_at_next_forward(outcomes):
    for r in results(outcomes, check_reassigned_buffer_is_broadcast_at_next_forward):
        assert r["stat"]["ddp"] == [1.0] * HIDDEN, "DDP side changed"
        assert r["stat"]["fr"] == r["stat"]["ddp"], "rank 0's new buffer was not broadcast"
        assert_all_close(r["params"], what="params")
        assert_close(r["buffers"], what="buffers")


def test_two_forwards_before_one_backward_with_batchnorm_works_like_ddp(outcomes):
    for r in results(outcomes, check_two_forwards_then_one_backward_with_batchnorm):
        assert_all_close(r["params"], what="params")
        assert_all_close(r["buffers"], what="BatchNorm buffers")


@pytest.mark.skipif(FR_IS_DDP, reason="DDP of torch 2.14 raises with create_graph=True on CPU")
def test_backward_with_create_graph_gives_ddps_averaged_gradients(outcomes):
    for r in results(outcomes, check_backward_with_create_graph):
        assert_all_close(r["grads"], what="grads")
        assert all(d <= 1e-7 for d in r["grad_synced"]), r["grad_synced"]
        assert_all_close(r["params"], what="params")


def test_backward_through_inner_module_after_training_is_local_and_does_not_raise(outcomes):
    for rank, r in enumerate(results(outcomes,
                                     check_direct_inner_module_call_backward_stays_local)):
        assert r["ddp"][0] == "ok", f"DDP side: {r['ddp']}"
        assert r["fr"][0] == "ok", f"FusedReducer raised: {r['fr'][1]}: {r['fr'][2]}"
        assert_close(r["grads"], what="local grads")
        if rank == 1:
            assert r["fr_grads_differ_across_ranks"] > 0, "grads were averaged: expected local"
        assert_close(r["params_after_next_step"], what="params after the next normal step")


@pytest.mark.skipif(FR_IS_DDP, reason="FusedReducer-only behaviour")
def test_static_graph_raises_clear_error_naming_static_graph_and_alternative(outcomes):
    for r in results(outcomes, check_static_graph_is_refused_naming_the_alternative):
        assert r[0] == "raised", "static_graph=True was accepted silently"
        message = r[2]
        assert "static_graph" in message, message
        assert "find_unused_parameters" in message or "checkpoint" in message, message
        assert "unexpected keyword" not in message, f"not a clear error: {message}"


@pytest.mark.skipif(FR_IS_DDP, reason="DDP needs static_graph=True here; FusedReducer must not")
def test_reentrant_checkpoint_with_unused_param_matches_ddp_static_graph_without_it(outcomes):
    for r in results(outcomes,
                     check_reentrant_checkpoint_with_unused_param_without_static_graph):
        assert_all_close(r["grads"], what="grads")
        assert_all_close(r["params"], what="params")


def test_batchnorm_running_stats_after_no_sync_window_equal_ddps(outcomes):
    for r in results(outcomes, check_batchnorm_running_stats_after_no_sync_window):
        assert_all_close(r["buffers"], what="BatchNorm buffers per rank")
        assert_all_close(r["params"], what="params")


def test_broadcast_buffers_false_leaves_rank_buffers_different_like_ddp(outcomes):
    for rank, r in enumerate(results(outcomes, check_broadcast_buffers_false_keeps_rank_buffers)):
        assert_close(r["params"], what="params")
        assert_close(r["buffers"], what="buffers")
        if rank == 1:
            assert r["ddp_buffers_differ"] > 0, "DDP side changed"
            assert r["fr_buffers_differ"] > 0


def test_exception_inside_no_sync_block_leaves_syncing_on(outcomes):
    for r in results(outcomes, check_exception_inside_no_sync_leaves_sync_on):
        assert_close(r["grads"], what="grads of the step after the exception")
        assert r["fr_grads_synced"] <= 1e-7, "the step after the exception was not averaged"
        assert_close(r["params"], what="params")


def test_eval_and_no_grad_forwards_mixed_into_training_match_ddp(outcomes):
    for r in results(outcomes, check_eval_and_no_grad_forwards_mixed_into_training):
        for key in ("no_grad_out", "eval_out", "params", "buffers"):
            assert_all_close(r[key], what=key)


def test_forward_without_backward_then_normal_step_matches_ddp(outcomes):
    for r in results(outcomes, check_forward_without_backward_then_normal_step):
        for key, diff in r.items():
            assert_close(diff, what=key)


def test_accumulating_grads_without_zero_grad_across_synced_steps_matches_ddp(outcomes):
    for r in results(outcomes, check_accumulation_without_zero_grad_across_synced_steps):
        assert_all_close(r["grads"], what="grads")
        assert_all_close(r["params"], what="params")


def test_tied_parameter_used_twice_matches_ddp(outcomes):
    for r in results(outcomes, check_tied_parameters):
        assert r["tied_still"]
        assert r["state_dict_keys"][0] == r["state_dict_keys"][1]
        assert_all_close(r["grads"], what="grads")
        assert_all_close(r["params"], what="params")


def test_two_wrapped_models_in_one_process_train_like_two_ddps(outcomes):
    for r in results(outcomes, check_two_wrapped_models_in_one_process):
        assert_close(r["a"], what="first model")
        assert_close(r["b"], what="second model")


def test_no_op_to_and_float_after_wrapping_do_not_break_training(outcomes):
    for r in results(outcomes, check_no_op_to_and_float_after_wrapping_keep_training):
        assert r["ddp"][0] == "ok", f"DDP side: {r['ddp']}"
        assert r["fr"][0] == "ok", f"{r['fr'][1]}: {r['fr'][2]}"
        assert_close(r["params"], what="params")


def test_freezing_a_layer_after_wrapping_with_find_unused_parameters_matches_ddp(outcomes):
    for r in results(outcomes, check_freezing_a_layer_after_wrapping_with_find_unused):
        assert r["none"]["ddp"] == ["fc1.weight", "fc1.bias"], "DDP side changed"
        assert r["none"]["fr"] == r["none"]["ddp"]
        assert_all_close(r["grads"], what="grads")
        assert_all_close(r["params"], what="params")


def test_dict_output_with_a_branch_unused_on_some_steps_matches_ddp(outcomes):
    for r in results(outcomes, check_dict_output_with_find_unused_parameters):
        assert_all_close(r["grads"], what="grads")
        assert_all_close(r["params"], what="params")


def test_no_sync_applies_to_the_forward_it_wraps_like_ddp(outcomes):
    for rank, r in enumerate(results(outcomes,
                                     check_no_sync_around_forward_only_decides_the_backward)):
        assert_close(r["forward_in_no_sync"], what="forward in no_sync, backward after")
        assert_close(r["backward_in_no_sync"], what="forward before no_sync, backward in it")
        assert r["backward_in_no_sync_synced"] <= 1e-7
        if rank == 1:
            assert r["forward_in_no_sync_local"] > 0, "averaged: DDP keeps this one local"
        assert_close(r["params"], what="params")


@pytest.mark.skipif(FR_IS_DDP, reason="FusedReducer-only API")
def test_step_history_keeps_at_most_trace_steps_after_shrinking(outcomes):
    for r in results(outcomes, check_step_history_after_shrinking_trace_steps):
        assert r["before"] == 5
        assert r["trace_steps"] == 2
        assert r["right_after"] == 2
        assert r["after_more_steps"] == 2


@pytest.mark.skipif(FR_IS_DDP, reason="FusedReducer-only API")
def test_set_default_first_bucket_bytes_wins_over_env_variable(outcomes):
    for r in results(outcomes, check_explicit_default_first_bucket_wins_over_env):
        assert r["env_only"] == 3 << 20
        assert r["after_call"] == 2 << 20
        assert r["env_changed_later"] == 2 << 20
        assert r["reducer"] == 2 << 20


@pytest.mark.skipif(FR_IS_DDP, reason="FusedReducer-only option")
def test_timeout_with_stalled_live_peer_raises_within_seconds_naming_the_bucket(outcomes):
    r0 = results(outcomes, check_timeout_with_stalled_peer_names_the_bucket)[0]
    res = r0["outcome"]
    assert res[0] == "raised", f"rank 0 waited {r0['seconds']:.1f}s and did not raise"
    assert r0["seconds"] < 8, f"rank 0 raised only after {r0['seconds']:.1f}s (timeout 3 s)"
    assert "bucket" in res[2].lower(), f"{res[1]}: {res[2]}"


def test_require_backward_grad_sync_set_directly_keeps_a_micro_step_local(outcomes):
    check = check_require_backward_grad_sync_set_directly_keeps_a_micro_step_local
    for rank, out in enumerate(results(outcomes, check)):
        assert out["flag_in_no_sync"] == {"ddp": False, "fr": False}, out
        assert_close(out["local_grads"], what="the local micro-step's gradients")
        assert rank == 0 or out["local_synced"] > 0, out  # local: unlike rank 0's
        assert_close(out["grads"], what="gradients after the synchronised micro-step")
        assert_close(out["params"], what="parameters after the step")


def test_ignored_parameters_and_buffers_stay_rank_local_as_in_ddp(outcomes):
    for rank, out in enumerate(results(outcomes, check_ignored_parameters_and_buffers_stay_rank_local)):
        for what in ("params", "grads", "buffers"):
            assert_close(out[what], what=what)
        assert torch.equal(out["local_buf"], torch.full((3,), rank + 1.0)), out  # not broadcast


def test_frozen_parameters_are_broadcast_at_construction_as_in_ddp(outcomes):
    for out in results(outcomes, check_frozen_parameters_are_broadcast_at_construction):
        assert_close(out["params"], what="params")
        assert out["synced"] == 0.0, out


def test_ddps_attributes_read_as_on_ddp(outcomes):
    for out in results(outcomes, check_ddps_attributes_read_as_on_ddp):
        assert out["fr"] == out["ddp"], out
        assert out["bucket_bytes_cap"]["fr"] == out["bucket_bytes_cap"]["ddp"], out


def test_sync_batch_norm_on_cpu_is_refused_at_construction_as_in_ddp(outcomes):
    for out in results(outcomes, check_sync_batch_norm_on_cpu_is_refused_at_construction):
        assert out["ddp"][0] == "raised" and out["ddp"][1] == "ValueError", out
        assert out["fr"][0] == "raised" and out["fr"][1] == "ValueError", out
        assert "SyncBatchNorm" in out["fr"][2], out
