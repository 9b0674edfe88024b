"""torch.compile and FusedReducer: FusedReducer(torch.compile(model)) and
torch.compile(FusedReducer(model)) train to DDP's parameters when DDP is wrapped the same way,
with backend "eager" and "inductor"; compiled autograd works or raises at once a RuntimeError
naming compiled autograd.

Marks: all tests here are `compile`; the inductor ones also `slow` (inductor compiles C++ on
this CPU machine: the first run fills the on-disk cache and takes longest). Select or deselect
with -m compile / -m "not slow". Eager-backend checks share one spawn, inductor checks another.
"""
import pytest
import torch

from dist_utils import per_rank, run_checks
from ddp_comparison import (
    FR_IS_DDP, Net, WRAP, assert_all_close, build, data, local_average_grads, loss_of,
    max_diff, outcome, sgd)

pytestmark = pytest.mark.compile
KINDS = ("ddp", "fr")


def compiled_pair(order, backend):
    """DDP and FusedReducer wrapped the same way around torch.compile."""
    import torch._dynamo
    torch._dynamo.reset()
    models = {}
    for kind in KINDS:
        if order == "inner":  # wrapper(torch.compile(model))
            models[kind] = WRAP[kind](torch.compile(build(Net), backend=backend))
        else:  # torch.compile(wrapper(model))
            models[kind] = torch.compile(WRAP[kind](build(Net)), backend=backend)
    return models


def user_params(model):
    """Parameters by name with the wrappers' prefixes (_orig_mod., module.) removed."""
    out = {}
    for name, p in model.named_parameters():
        for prefix in ("_orig_mod.", "module.", "_orig_mod."):
            if name.startswith(prefix):
                name = name[len(prefix):]
        out[name] = p.detach().clone()
    return out


def user_grads(model):
    return {n: (None if p.grad is None else p.grad.detach().clone())
            for n, p in zip(user_params(model), model.parameters())}


def train_compiled(rank, order, backend, steps=3):
    models = compiled_pair(order, backend)
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for k, m in models.items()}
    out = {"grads": [], "params": []}
    for i in range(steps):
        for kind, m in models.items():
            opts[kind].zero_grad()
            x, y = data(rank, i)
            loss_of(m(x), y, rank).backward()
        out["grads"].append(max_diff(user_grads(models["ddp"]), user_grads(models["fr"])))
        for opt in opts.values():
            opt.step()
        out["params"].append(max_diff(user_params(models["ddp"]), user_params(models["fr"])))
    return out


def check_fused_reducer_around_compiled_model_eager(rank, world):
    return train_compiled(rank, "inner", "eager")


def check_compiled_fused_reducer_eager(rank, world):
    return train_compiled(rank, "outer", "eager")


def check_fused_reducer_around_compiled_model_inductor(rank, world):
    return train_compiled(rank, "inner", "inductor", steps=2)


def check_compiled_fused_reducer_inductor(rank, world):
    return train_compiled(rank, "outer", "inductor", steps=2)


def compiled_autograd_run(rank, how):
    import contextlib
    import functools
    import torch._dynamo
    import torch._dynamo.compiled_autograd as ca
    torch._dynamo.reset()
    if how == "config_flag":  # torch.compile(FusedReducer(model)) with the config flag
        model = torch.compile(WRAP["fr"](build(Net)), backend="eager")

        def enabled():
            torch._dynamo.config.compiled_autograd = True
            return contextlib.nullcontext()
    else:  # FusedReducer(model), backward under the compiled-autograd context manager
        model = WRAP["fr"](build(Net))

        def enabled():
            return ca._enable(functools.partial(torch.compile, backend="eager"))
    opt = sgd(model)
    out = {"steps": []}
    try:
        for i in range(2):
            state = {k: v.clone() for k, v in user_params(model).items()}

            def one_step():
                with enabled():
                    opt.zero_grad()
                    x, y = data(rank, i)
                    loss_of(model(x), y, rank).backward()
                return user_grads(model)
            res = outcome(one_step)
            torch._dynamo.config.compiled_autograd = False  # the reference runs uncompiled
            if res[0] == "raised":
                out["raised"] = (i,) + res[1:4]
                break
            out["steps"].append(max_diff(local_average_grads(state, Net, rank, i), res[1]))
            opt.step()
    finally:
        torch._dynamo.config.compiled_autograd = False
        torch._dynamo.reset()
    return out


def check_compiled_autograd_works_or_raises_at_once(rank, world):
    """Compiled autograd, switched on by torch._dynamo.config.compiled_autograd (around
    torch.compile(FusedReducer(model))) or by its context manager (around FusedReducer(model)):
    correct averaged gradients, or a RuntimeError naming compiled autograd at the first step."""
    return {how: compiled_autograd_run(rank, how) for how in ("config_flag", "context_manager")}


EAGER = [check_fused_reducer_around_compiled_model_eager, check_compiled_fused_reducer_eager,
         check_compiled_autograd_works_or_raises_at_once]
INDUCTOR = [check_fused_reducer_around_compiled_model_inductor,
            check_compiled_fused_reducer_inductor]


@pytest.fixture(scope="module")
def eager_outcomes():
    return run_checks(EAGER, timeout=240)


@pytest.fixture(scope="module")
def inductor_outcomes():
    return run_checks(INDUCTOR, timeout=280)


def assert_trains_like_ddp(outcomes, check):
    for r in per_rank(outcomes, check):
        assert_all_close(r["grads"], what="grads")
        assert_all_close(r["params"], what="params")


def test_fused_reducer_around_compiled_model_eager_backend_trains_like_ddp(eager_outcomes):
    assert_trains_like_ddp(eager_outcomes, "check_fused_reducer_around_compiled_model_eager")


def test_compiled_fused_reducer_eager_backend_trains_like_compiled_ddp(eager_outcomes):
    assert_trains_like_ddp(eager_outcomes, "check_compiled_fused_reducer_eager")


@pytest.mark.skipif(FR_IS_DDP, reason="FusedReducer's contract (DDP has its own support)")
def test_compiled_autograd_gives_averaged_grads_or_raises_runtime_error_at_once(eager_outcomes):
    per_how = per_rank(eager_outcomes, "check_compiled_autograd_works_or_raises_at_once")
    for how in ("config_flag", "context_manager"):
        results = [r[how] for r in per_how]
        assert len({"raised" in r for r in results}) == 1, f"{how}: ranks disagree: {results}"
        check_compiled_autograd_outcome(results)


def check_compiled_autograd_outcome(results):
    for r in results:
        if "raised" in r:
            step, name, message, is_runtime = r["raised"]
            assert step == 0, f"raised only at step {step}, after a step ran: {name}: {message}"
            assert is_runtime, f"not a RuntimeError: {name}: {message}"
            assert "compiled autograd" in message.lower(), message
        else:
            assert_all_close(r["steps"], what="grads under compiled autograd vs local average")
            assert len(r["steps"]) == 2


@pytest.mark.slow
def test_fused_reducer_around_compiled_model_inductor_trains_like_ddp(inductor_outcomes):
    assert_trains_like_ddp(inductor_outcomes,
                           "check_fused_reducer_around_compiled_model_inductor")


@pytest.mark.slow
def test_compiled_fused_reducer_inductor_trains_like_compiled_ddp(inductor_outcomes):
    assert_trains_like_ddp(inductor_outcomes, "check_compiled_fused_reducer_inductor")
