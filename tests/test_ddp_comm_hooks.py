"""DDP communication hooks run unchanged under FusedReducer.

Every hook of torch.distributed.algorithms.ddp_comm_hooks (allreduce, fp16/bf16 compression, the
compress wrappers, PowerSGD and batched PowerSGD with start_powerSGD_iter=2 so that compression is
reached) is registered with model.register_comm_hook(state, hook) on DDP and on FusedReducer with
the same bucket layout (DDP with its default cap, the only way it gets its 1 MiB first bucket;
FusedReducer with first_bucket_mb=1, bucket_cap_mb=25); the parameters must agree within 1e-5,
or the hook's own rounding. Each hook is wrapped to count its calls per step and
record what it sees of the bucket (GradBucket's interface). Then bad hooks: a tensor returned
instead of a Future, an exception inside the hook, registering twice, registering after training
started (as DDP).
"""
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as dh
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

from dist_utils import per_rank, run_checks
from ddp_comparison import (
    LR, WRAP, assert_all_close, build, grads, loss_of, max_diff, outcome, params, risky_kwargs,
    same_on_all_ranks)

KINDS = ("ddp", "fr")
STEPS = 4  # PowerSGD compresses from iteration 2 on


class HookNet(nn.Module):
    """~30 KB of float32: one bucket. 2-D weights large enough for PowerSGD to compress."""

    def __init__(self, d_in=32, hidden=64, d_out=8):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, d_out)

    def forward(self, x):
        return self.out(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


class TwoBucketNet(HookNet):
    """~2.1 MB: with DDP's 1 MiB first bucket, two buckets ([out, fc2] then [fc1])."""

    def __init__(self):
        super().__init__(d_in=32, hidden=512, d_out=8)


def hook_data(rank, i, d_in, d_out):
    g = torch.Generator().manual_seed(1000 * i + rank)
    return torch.randn(6, d_in, generator=g), torch.randn(6, d_out, generator=g)


def recording(hook, log, names):
    """`hook` unchanged, plus a record of each call: what the bucket looks like."""
    def recorded_hook(state, bucket):
        buf = bucket.buffer()
        grads_ = bucket.gradients()
        lo, hi = buf.data_ptr(), buf.data_ptr() + buf.numel() * buf.element_size()
        log.append({
            "index": bucket.index(),
            "is_last": bucket.is_last(),
            "params": [names.get(p.data_ptr(), "?") for p in bucket.parameters()],
            "grad_shapes": [tuple(g.shape) for g in grads_],
            "grads_are_views_of_buffer": all(lo <= g.data_ptr() < hi for g in grads_),
            "numel": buf.numel(),
            "dtype": str(buf.dtype),
        })
        return hook(state, bucket)
    return recorded_hook


def sum_hook(process_group, bucket):
    """All-reduce without dividing: shows whether the bucket holds the undivided local gradients."""
    fut = dist.all_reduce(bucket.buffer(), group=process_group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def powersgd_state(rank_, error_feedback, warm_start):
    def make(group):
        return ps.PowerSGDState(process_group=group, matrix_approximation_rank=rank_,
                                start_powerSGD_iter=2, use_error_feedback=error_feedback,
                                warm_start=warm_start)
    return make


def group_state(group):
    return group


# name: (hook, state factory(process group), model class, tolerance on params)
HOOKS = {
    "allreduce_hook": (dh.allreduce_hook, group_state, HookNet, 1e-5),
    "fp16_compress_hook": (dh.fp16_compress_hook, group_state, HookNet, 1e-4),
    "bf16_compress_hook": (dh.bf16_compress_hook, group_state, HookNet, 1e-3),
    "fp16_compress_wrapper_allreduce": (dh.fp16_compress_wrapper(dh.allreduce_hook), group_state,
                                        HookNet, 1e-4),
    "bf16_compress_wrapper_allreduce": (dh.bf16_compress_wrapper(dh.allreduce_hook), group_state,
                                        HookNet, 1e-3),
    "powerSGD_rank1_error_feedback_warm_start": (ps.powerSGD_hook, powersgd_state(1, True, True),
                                                 HookNet, 1e-5),
    "powerSGD_rank2_plain": (ps.powerSGD_hook, powersgd_state(2, False, False), HookNet, 1e-5),
    "batched_powerSGD_rank1_error_feedback": (ps.batched_powerSGD_hook,
                                              powersgd_state(1, True, False), HookNet, 1e-5),
    "batched_powerSGD_rank2": (ps.batched_powerSGD_hook, powersgd_state(2, False, False),
                               HookNet, 1e-5),
    # PowerSGD over two buckets deadlocks under DDP itself on gloo (its callback blocks in
    # .wait() on gloo's worker threads): two buckets are checked with plain hooks instead.
    "allreduce_hook_two_buckets": (dh.allreduce_hook, group_state, TwoBucketNet, 1e-5),
    "fp16_compress_hook_two_buckets": (dh.fp16_compress_hook, group_state, TwoBucketNet, 1e-4),
    "sum_hook_undivided_buffer": (sum_hook, group_state, HookNet, 1e-5),
}


def hook_trajectory(rank, kind, name):
    """Train under `kind` with the hook; per step: grads, params, hook calls (and the first
    exception, with its step: a hook that fails under DDP must fail the same way here)."""
    hook, make_state, cls, _ = HOOKS[name]
    # DDP's default bucket_cap_mb (None) is what gives it the 1 MiB first bucket; an explicit
    # bucket_cap_mb makes DDP's first bucket that size too. FusedReducer: first_bucket_mb=1, 25.
    m = WRAP[kind](build(cls))
    names = {p.data_ptr(): n for n, p in m.module.named_parameters()}
    log = []
    m.register_comm_hook(make_state(dist.group.WORLD), recording(hook, log, names))
    opt = torch.optim.SGD(m.parameters(), lr=LR, momentum=0.9)
    d_in, d_out = m.module.fc1.in_features, m.module.out.out_features
    t = {"grads": [], "params": [], "calls": [], "fp16_exact": [], "bf16_exact": [],
         "synced": [], "failure": None}
    for i in range(STEPS):
        before = len(log)

        def one_step():
            opt.zero_grad()
            x, y = hook_data(rank, i, d_in, d_out)
            loss_of(m(x), y, rank).backward()
        res = outcome(one_step)
        t["calls"].append(len(log) - before)
        if res[0] == "raised":
            t["failure"] = (i,) + res[1:3]
            break
        g = [p.grad for p in m.parameters()]
        t["fp16_exact"].append(all(torch.equal(x.half().float(), x) for x in g))
        t["bf16_exact"].append(all(torch.equal(x.bfloat16().float(), x) for x in g))
        t["synced"].append(same_on_all_ranks(g))
        t["grads"].append(grads(m))
        opt.step()
        t["params"].append(params(m))
    t["records"] = log[-t["calls"][-1]:] if t["calls"][-1] else []  # the settled layout
    return t


def run_hook(rank, name):
    ddp_t = hook_trajectory(rank, "ddp", name)
    dist.barrier()
    fr_t = hook_trajectory(rank, "fr", name)
    out = {"calls": {"ddp": ddp_t["calls"], "fr": fr_t["calls"]},
           "records": {"ddp": ddp_t["records"], "fr": fr_t["records"]},
           "failure": {"ddp": ddp_t["failure"], "fr": fr_t["failure"]},
           "fp16_exact": fr_t["fp16_exact"], "bf16_exact": fr_t["bf16_exact"],
           "synced": fr_t["synced"]}
    for what in ("grads", "params"):
        out[what] = [max_diff(a, b) for a, b in zip(ddp_t[what], fr_t[what])]
        if len(ddp_t[what]) != len(fr_t[what]):
            out[what].append(f"steps completed: ddp {len(ddp_t[what])}, fused {len(fr_t[what])}")
    return out


def make_hook_check(name):
    def check(rank, world):
        return run_hook(rank, name)
    check.__name__ = check.__qualname__ = f"check_hook_{name}"
    return check


for _name in HOOKS:  # module-level names: spawned ranks look checks up by qualified name
    globals()[f"check_hook_{_name}"] = make_hook_check(_name)


def check_interface_of_the_bucket_object(rank, world):
    """GradBucket's interface, seen from a hook, on DDP and FusedReducer."""
    out = {}
    for kind in KINDS:
        m = WRAP[kind](build(HookNet))
        seen = []

        def inspect(state, bucket):
            seen.append({
                "methods": [hasattr(bucket, a) for a in ("index", "buffer", "gradients",
                                                         "parameters", "is_last", "set_buffer")],
                "buffer_is_tensor": isinstance(bucket.buffer(), torch.Tensor),
                "buffer_is_flat": bucket.buffer().dim() == 1,
                "numel_matches": bucket.buffer().numel() == sum(p.numel()
                                                              for p in bucket.parameters()),
                "grads_match_params": [tuple(g.shape) for g in bucket.gradients()]
                == [tuple(p.shape) for p in bucket.parameters()],
            })
            return dh.allreduce_hook(state, bucket)
        m.register_comm_hook(None, inspect)
        x, y = hook_data(rank, 0, 32, 8)
        loss_of(m(x), y, rank).backward()
        out[kind] = seen
    return out


def bad_hook_run(rank, hook, steps=2):
    """Register `hook` on FusedReducer/DDP, train; where and what it raised, per kind."""
    out = {}
    for kind in KINDS:
        m = WRAP[kind](build(HookNet), **risky_kwargs())
        m.register_comm_hook(None, hook)
        where = None

        def train():
            nonlocal where
            for i in range(steps):
                x, y = hook_data(rank, i, 32, 8)
                where = f"forward {i}"
                loss = loss_of(m(x), y, rank)
                where = f"backward {i}"
                loss.backward()
                where = None
        res = outcome(train)
        out[kind] = res + (where,) if res[0] == "raised" else res
        dist.barrier()
    return out


def tensor_not_future(state, bucket):
    return bucket.buffer()


def raising_hook(state, bucket):
    raise ValueError("boom inside the comm hook")


def check_hook_returning_tensor_instead_of_future(rank, world):
    return bad_hook_run(rank, tensor_not_future)


def check_hook_raising_inside(rank, world):
    return bad_hook_run(rank, raising_hook)


def check_register_comm_hook_twice(rank, world):
    out = {}
    for kind in KINDS:
        m = WRAP[kind](build(HookNet))
        m.register_comm_hook(None, dh.allreduce_hook)
        out[kind] = outcome(lambda: m.register_comm_hook(None, dh.fp16_compress_hook))
    return out


def check_register_comm_hook_after_training_started(rank, world):
    models, opts = {}, {}
    out = {}
    for kind in KINDS:
        m = WRAP[kind](build(HookNet))
        opts[kind] = torch.optim.SGD(m.parameters(), lr=LR)
        for i in range(2):
            opts[kind].zero_grad()
            x, y = hook_data(rank, i, 32, 8)
            loss_of(m(x), y, rank).backward()
            opts[kind].step()
        out[kind] = outcome(lambda: m.register_comm_hook(None, dh.fp16_compress_hook))
        models[kind] = m
    if out["ddp"][0] == out["fr"][0] == "ok":  # both accept it: then both train the same
        for i in range(2, 4):
            for kind, m in models.items():
                opts[kind].zero_grad()
                x, y = hook_data(rank, i, 32, 8)
                loss_of(m(x), y, rank).backward()
                opts[kind].step()
        out["params"] = max_diff(params(models["ddp"]), params(models["fr"]))
    return out


POWERSGD = [n for n in HOOKS if "owerSGD" in n]
CHECKS = [globals()[f"check_hook_{n}"] for n in HOOKS if n not in POWERSGD] + [
    check_interface_of_the_bucket_object,
    check_register_comm_hook_twice,
    check_register_comm_hook_after_training_started,
    check_hook_returning_tensor_instead_of_future,
    check_hook_raising_inside,
]
# PowerSGD hooks wait on collectives inside future callbacks: a wrapper that runs them wrongly
# can deadlock, so they get a spawn of their own (a hang there fails only them).
POWERSGD_CHECKS = [globals()[f"check_hook_{n}"] for n in POWERSGD]


@pytest.fixture(scope="module")
def plain_outcomes():
    return run_checks(CHECKS, timeout=240)


@pytest.fixture(scope="module")
def powersgd_outcomes():
    return run_checks(POWERSGD_CHECKS, timeout=240)


@pytest.fixture
def outcomes(request):
    return request.getfixturevalue("plain_outcomes")


# -- tests ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(HOOKS))
def test_ddp_comm_hook_gives_ddps_parameters_with_the_same_buckets(request, name):
    tol = HOOKS[name][3]
    outcomes = request.getfixturevalue("powersgd_outcomes" if name in POWERSGD
                                       else "plain_outcomes")
    for rank, r in enumerate(per_rank(outcomes, f"check_hook_{name}")):
        if r["failure"]["ddp"] is not None:  # the hook itself fails (torch's batched PowerSGD)
            assert r["failure"]["fr"] is not None, (
                f"under DDP the hook raises at step {r['failure']['ddp'][0]} "
                f"({r['failure']['ddp'][1]}); FusedReducer trained on silently")
            assert r["failure"]["fr"][0] == r["failure"]["ddp"][0], r["failure"]
        else:
            assert r["failure"]["fr"] is None, f"FusedReducer raised: {r['failure']['fr']}"
        assert r["calls"]["fr"][1:] == r["calls"]["ddp"][1:], \
            f"hook calls per step: ddp {r['calls']['ddp']}, fused {r['calls']['fr']}"
        assert all(c >= 1 for c in r["calls"]["fr"]), f"hook not called: {r['calls']['fr']}"
        assert r["records"]["fr"] == r["records"]["ddp"], "what the hook saw of the buckets"
        assert_all_close(r["grads"], tol, f"{name}: grads")
        assert_all_close(r["params"], tol, f"{name}: params")
        assert len(r["grads"]) >= 2
        assert all(d == 0.0 for d in r["synced"]), f"grads differ across ranks: {r['synced']}"
        if name.startswith("fp16"):
            assert all(r["fp16_exact"]), "grads are not float16 values: hook result not used"
        if name.startswith("bf16"):
            assert all(r["bf16_exact"]), "grads are not bfloat16 values: hook result not used"


def test_two_bucket_model_has_ddps_two_buckets_with_the_same_parameters(outcomes):
    for r in per_rank(outcomes, "check_hook_allreduce_hook_two_buckets"):
        assert r["calls"]["ddp"][1:] == [2] * (STEPS - 1), "DDP side changed"
        assert r["calls"]["fr"][1:] == [2] * (STEPS - 1)
        assert [b["params"] for b in r["records"]["fr"]] == \
            [b["params"] for b in r["records"]["ddp"]]


def test_hook_sees_a_gradbucket_with_ddps_interface(outcomes):
    for r in per_rank(outcomes, "check_interface_of_the_bucket_object"):
        assert r["ddp"] and all(all(s["methods"]) for s in r["ddp"]), "DDP side changed"
        assert r["fr"] == r["ddp"]


def test_registering_a_comm_hook_twice_raises_runtime_error(outcomes):
    for r in per_rank(outcomes, "check_register_comm_hook_twice"):
        assert r["ddp"][0] == "raised" and r["ddp"][3], r["ddp"]
        assert r["fr"][0] == "raised", "second register_comm_hook accepted"
        assert r["fr"][3], f"not a RuntimeError: {r['fr'][1]}: {r['fr'][2]}"


def test_registering_a_comm_hook_after_training_started_behaves_as_ddp(outcomes):
    for r in per_rank(outcomes, "check_register_comm_hook_after_training_started"):
        assert r["fr"][0] == r["ddp"][0], f"ddp: {r['ddp']}, fused: {r['fr']}"
        if r["ddp"][0] == "raised":
            assert r["fr"][3] or not r["ddp"][3], r["fr"]
        else:
            assert isinstance(r["params"], float) and r["params"] <= 1e-4, r["params"]


def test_hook_returning_tensor_instead_of_future_raises_on_every_rank(outcomes):
    for r in per_rank(outcomes, "check_hook_returning_tensor_instead_of_future"):
        assert r["ddp"][0] == "raised", "DDP side changed"
        res = r["fr"]
        assert res[0] == "raised", "a hook returning a tensor was accepted"
        assert res[3] or res[4], f"not a RuntimeError/ValueError: {res[1]}: {res[2]}"


def test_exception_inside_comm_hook_surfaces_on_every_rank(outcomes):
    for r in per_rank(outcomes, "check_hook_raising_inside"):
        assert r["ddp"][0] == "raised" and "boom inside the comm hook" in r["ddp"][2], r["ddp"]
        res = r["fr"]
        assert res[0] == "raised", "the hook's exception was swallowed"
        assert "boom inside the comm hook" in res[2], f"{res[1]}: {res[2]}"
        assert res[5] in ("backward 0", "forward 1"), f"surfaced late, at {res[5]}"
