"""The gradient route (hooks -> copy into the bucket -> launch -> wait -> gradients): when each
gradient is copied, in which order buckets launch, how it is scaled and averaged, over which
group and transport, and how long a wait may last.

Each test checks a behaviour against an independent reference (DDP on the same model and data,
a float64 average of locally computed gradients, the profiler's record of the collectives, or the
test's own count). The checks of the selected tests run in ONE spawn of 2 gloo ranks
(SelectedChecks, the module fixture).
"""
import contextlib
import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from behaviour_common import (ENV, MiB, SwappedBranches, collectives, fused,
                              fused_with_its_defaults, reference_grads)
from dist_utils import SelectedChecks, assert_small, results
from ddp_comparison import (HIDDEN, Net, build, data, grads, local_average_grads, loss_of,
                                max_diff, outcome, params, same_on_all_ranks, sgd, side_group,
                                step)


class Sometimes(nn.Module):
    """`sometimes` takes part only on rank step % world_size."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, HIDDEN)
        self.sometimes = nn.Linear(HIDDEN, HIDDEN)
        self.b = nn.Linear(HIDDEN, 4)

    def forward(self, x, use=False):
        h = torch.tanh(self.a(x))
        if use:
            h = torch.tanh(self.sometimes(h))
        return self.b(h)


class Huge(nn.Module):
    """loss = sum(w * c): the gradient of w is c, near float32's largest value."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(8))

    def forward(self, c):
        return (self.w * c).sum()


def raised(fn):
    """("ok",) or ("raised", type name, message, is RuntimeError, is ValueError)."""
    res = outcome(fn)
    return res[:1] if res[0] == "ok" else res


def check_launch_order(rank, world):
    """Buckets launch strictly in layout order on every rank, whatever order they complete in."""
    model = fused(build(SwappedBranches), first_bucket_mb=1e-6, bucket_cap_mb=1e-6,
                  process_group=side_group(20), timeout=timedelta(seconds=20))
    opt = sgd(model)
    out = {"vs_reference": [], "buckets": len(model.bucket_sizes())}
    for i in range(3):
        opt.zero_grad(set_to_none=True)
        x, y = data(rank, i)
        state = {k: v.clone() for k, v in model.module.state_dict().items()}
        loss_of(model(x), y, rank).backward()
        expected = reference_grads(state, SwappedBranches, (x, y), rank)
        out["vs_reference"].append(max_diff(expected, grads(model)))
        opt.step()
    return out


def check_inner_module_backward(rank, world):
    """After training, a backward through model.module (no FusedReducer forward armed it) gives
    the local gradients, as under DDP, and the next normal step is averaged again."""
    model = fused(build(Net), process_group=side_group(20), timeout=timedelta(seconds=20))
    opt = sgd(model)
    for i in range(2):
        opt.zero_grad()
        x, y = data(rank, i)
        loss_of(model(x), y, rank).backward()
        opt.step()
    opt.zero_grad(set_to_none=True)
    x, y = data(rank, 10)
    local = build(Net)
    local.load_state_dict(model.module.state_dict())
    loss_of(local(x), y, rank).backward()

    def inner_backward():
        loss_of(model.module(x), y, rank).backward()
    res = outcome(inner_backward)
    out = {"outcome": res[:3]}
    if res[0] == "ok":
        out["vs_local"] = max_diff(grads(local), grads(model.module))
    opt.zero_grad(set_to_none=True)
    x, y = data(rank, 11)
    state = {k: v.clone() for k, v in model.module.state_dict().items()}
    res = outcome(lambda: loss_of(model(x), y, rank).backward())
    out["next_step"] = res[:3]
    if res[0] == "ok":
        out["next_vs_reference"] = max_diff(reference_grads(state, Net, (x, y), rank),
                                            grads(model.module))
    return out


def check_copy_at_hook(rank, world):
    """A user hook on fc1.weight (ready last) changes out.weight.grad (ready first, same bucket)
    in place. DDP copied out.weight's gradient into its bucket at its own hook, so the change
    does not reach the average; FusedReducer must do the same."""
    models = {"ddp": DDP(build(Net)), "fr": fused(build(Net))}
    opts = {k: sgd(m) for k, m in models.items()}
    for m in models.values():
        module = m.module

        def tamper(p, module=module):
            module.out.weight.grad.add_(1000.0)
        module.fc1.weight.register_post_accumulate_grad_hook(tamper)
    out = {"grads": [], "params": []}
    for i in range(2):
        for kind, m in models.items():
            opts[kind].zero_grad(set_to_none=True)
            x, y = data(rank, i)
            loss_of(m(x), y, rank).backward()
        out["grads"].append(max_diff(grads(models["ddp"].module), grads(models["fr"].module)))
        for opt in opts.values():
            opt.step()
        out["params"].append(max_diff(params(models["ddp"].module), params(models["fr"].module)))
    return out


def check_private_grads(rank, world):
    """gradient_as_bucket_view=False: every param.grad FusedReducer creates is the user's own
    tensor. Held across the next step it keeps its value (under a bucket view the next
    collective would overwrite it), and no two gradients share storage."""
    model = fused(build(Sometimes), find_unused_parameters=True)
    opt = sgd(model)
    held, held_values, out = {}, {}, {"changed": [], "shared": [], "vs_reference": []}
    for i in range(3):
        opt.zero_grad(set_to_none=True)
        x, y = data(rank, i)
        use = rank == i % world
        state = {k: v.clone() for k, v in model.module.state_dict().items()}
        loss_of(model(x, use=use), y, rank).backward()
        out["vs_reference"].append(max_diff(reference_grads(state, Sometimes, (x, y), rank,
                                                            use=use), grads(model.module)))
        for name, p in model.module.named_parameters():
            if p.grad is not None:
                held.setdefault(i, {})[name] = p.grad
                held_values.setdefault(i, {})[name] = p.grad.clone()
        storages = [p.grad.untyped_storage().data_ptr() for p in model.module.parameters()
                    if p.grad is not None]
        out["shared"].append(len(storages) - len(set(storages)))
        opt.step()
    for i, tensors in held.items():
        for name, t in tensors.items():
            if not torch.equal(t, held_values[i][name]):
                out["changed"].append(f"step {i}: {name}")
    return out


def check_stalled_peer_timeout(rank, world):
    """rank 1 is alive but sleeps 12 s before backward; with timeout=3 s rank 0 raises within
    seconds, naming the bucket: on the shared-memory transport (its own waits) and on the
    process group (the reducer's wait on the group's work)."""
    return {backend: _stalled_peer(rank, backend) for backend in ("shm", "process_group")}


def _stalled_peer(rank, backend):
    group = side_group(60)
    model = fused(build(Net), process_group=group, timeout=timedelta(seconds=3), backend=backend)
    opt = sgd(model)
    for i in range(2):
        opt.zero_grad()
        x, y = data(rank, i)
        loss_of(model(x), y, rank).backward()
        opt.step()
    opt.zero_grad()
    x, y = data(rank, 2)
    loss = loss_of(model(x), y, rank)
    if rank == 1:
        time.sleep(12)
    start = time.monotonic()
    res = outcome(loss.backward)
    seconds = time.monotonic() - start
    outcome(model.close)  # the failed collective may be reported again: not this check's concern
    return {"outcome": res[:3], "seconds": seconds}


def check_defaults_and_stats(rank, world):
    """All defaults; stats()['step'] counts the synchronised backward passes the test ran."""
    os.environ.pop(ENV, None)  # nothing set: the documented 1 MiB
    m = fused_with_its_defaults(build(Net))
    out = {"limits": (m.first_bucket_bytes, m.bucket_cap_bytes, m.last_bucket_bytes,
                      m.reduce_dtype),
           "autotune": m.autotune_report()["state"], "transport": m.stats()["transport"],
           "step_before": m.stats()["step"]}
    opt = sgd(m)
    step(m, opt, rank, 0)
    step(m, opt, rank, 1)
    with m.no_sync():  # accumulates, not a synchronised step
        step(m, opt, rank, 2)
    x, y = data(rank, 3)
    loss_of(m.module(x), y, rank).backward()  # not armed: local, not a step
    state = {k: v.clone() for k, v in m.module.state_dict().items()}
    step(m, opt, rank, 4)
    out["step"] = m.stats()["step"]
    out["history_steps"] = [s["step"] for s in m.step_history()]
    out["vs_reference"] = max_diff(local_average_grads(state, Net, rank, 4), grads(m))
    out["grads_are_views"] = [n for n, p in m.module.named_parameters() if p.grad._base is not None]
    return out


def check_backend(rank, world):
    """backend="auto" (shared memory: both ranks on this host) and "process_group" with CPU
    parameters: one all-reduce per bucket (profiler); "nccl" for CPU parameters and an unknown
    name are refused."""
    out = {}
    limit = 600 / MiB  # Net in 2 buckets
    for backend in ("auto", "process_group"):
        m = fused_with_its_defaults(build(Net), backend=backend, first_bucket_mb=limit, bucket_cap_mb=limit)
        opt = sgd(m)
        step(m, opt, rank, 0)  # the first-step rebuild happens at the next forward
        state = {k: v.clone() for k, v in m.module.state_dict().items()}
        count, moved = collectives(lambda: step(m, opt, rank, 1))
        out[backend] = {"transport": m.stats()["transport"], "backend": m.backend,
                        "count": count, "moved": moved,
                        "sizes": m.bucket_sizes(),
                        "vs_reference": max_diff(local_average_grads(state, Net, rank, 1),
                                                 grads(m))}
    out["nccl"] = raised(lambda: fused_with_its_defaults(build(Net), backend="nccl"))
    out["unknown"] = raised(lambda: fused_with_its_defaults(build(Net), backend="mpi"))
    return out


def check_process_group(rank, world):
    """Each rank wraps its model with a process group of its own (world size 1): nothing is
    averaged with the other rank and its own initial weights are kept."""
    groups = [dist.new_group([r], backend="gloo") for r in range(world)]  # collective: all ranks
    module = build(Net, seed=100 + rank)
    initial = params(module)
    m = fused_with_its_defaults(module, process_group=groups[rank])
    out = {"weights_kept": max_diff(initial, params(m))}
    state = {k: v.clone() for k, v in m.module.state_dict().items()}
    x, y = data(rank, 0)
    loss_of(m(x), y, rank).backward()
    local = Net()
    local.load_state_dict(state)
    loss_of(local(x), y, rank).backward()
    out["vs_local"] = max_diff(grads(local), grads(m))
    out["ranks_differ"] = same_on_all_ranks([p.grad for p in m.parameters()])
    return out


def check_prepare_for_backward(rank, world):
    """Two backward passes of one forward (manual optimization): the second is averaged too,
    with prepare_for_backward() before it or without; inside no_sync() it stays local."""
    m = fused_with_its_defaults(build(Net))
    opt = sgd(m)
    step(m, opt, rank, 0)
    step(m, opt, rank, 1)
    out = {}
    for seed, how in enumerate(("prepare_for_backward", "plain", "no_sync")):
        state = {k: v.clone() for k, v in m.module.state_dict().items()}
        x, y = data(rank, 5 + seed)
        m.zero_grad(set_to_none=True)
        output = m(x)
        loss_of(output, y, rank).backward(retain_graph=True)
        if how == "prepare_for_backward":
            m.prepare_for_backward()
        with m.no_sync() if how == "no_sync" else contextlib.nullcontext():
            count, _ = collectives(lambda: ((output ** 2).mean() * (1 + rank)).backward())
        # References: each backward's local gradients, averaged in float64 with all_reduce.
        ref = Net()
        ref.load_state_dict(state)
        o = ref(x)
        ps = list(ref.parameters())
        g1 = torch.autograd.grad(loss_of(o, y, rank), ps, retain_graph=True)
        g2 = torch.autograd.grad((o ** 2).mean() * (1 + rank), ps)
        names = [name for name, _ in ref.named_parameters()]
        averaged, local = {}, {}
        for name, a, b in zip(names, g1, g2):
            a, b = a.double(), b.double()
            dist.all_reduce(a)
            both = b.clone()
            dist.all_reduce(both)
            averaged[name] = ((a + both) / world).float()
            local[name] = (a / world + b).float()
        out[how] = {"allreduces": count, "vs_both_averaged": max_diff(averaged, grads(m)),
                    "vs_second_local": max_diff(local, grads(m))}
    return out


def check_scaled_before_summed(rank, world):
    """Gradients near float32's largest value (3e38 on rank 0, 2e38 on rank 1): scaled by 1/2
    and then summed, the average 2.5e38 is finite; summed first, 5e38 overflows to inf."""
    c = (3.0 - rank) * 1e38
    out = {}
    for kind in ("ddp", "fr"):
        m = DDP(build(Huge)) if kind == "ddp" else fused_with_its_defaults(build(Huge))
        for _ in range(2):
            m.zero_grad()
            m(c).backward()
        out[kind] = m.module.w.grad.clone()
    return {"finite": bool(torch.isfinite(out["fr"]).all()),
            "ddp_finite": bool(torch.isfinite(out["ddp"]).all()),
            "vs_ddp": max_diff({"w": out["ddp"]}, {"w": out["fr"]}),
            "value": out["fr"][0].item()}


def check_grad_scaler(rank, world):
    """GradScaler with a non-finite loss on rank 1 at step 1: the averaged gradients are not
    finite on every rank, so every rank skips that step and lowers the scale, as under DDP."""
    models = {"ddp": DDP(build(Net)), "fr": fused_with_its_defaults(build(Net))}
    opts = {k: sgd(m) for k, m in models.items()}
    scalers = {k: torch.amp.GradScaler("cpu", init_scale=1024.0) for k in models}
    out = {"params": [], "scale": {k: [] for k in models}, "skipped": {k: [] for k in models}}
    for i in range(4):
        for kind, m in models.items():
            before = params(m)
            opts[kind].zero_grad()
            x, y = data(rank, i)
            loss = loss_of(m(x), y, rank)
            if i == 1 and rank == 1:
                loss = loss * float("inf")
            scalers[kind].scale(loss).backward()
            scalers[kind].step(opts[kind])
            scalers[kind].update()
            out["scale"][kind].append(scalers[kind].get_scale())
            out["skipped"][kind].append(max_diff(before, params(m)) == 0.0)
        out["params"].append(max_diff(params(models["ddp"]), params(models["fr"])))
    out["synced"] = same_on_all_ranks(list(models["fr"].parameters()))
    return out


CHECKS = SelectedChecks()
outcomes = CHECKS.fixture(timeout=240)  # the selected tests' checks, in one spawn


@CHECKS.uses(check_launch_order)
def test_buckets_launch_in_layout_order_when_ranks_complete_them_differently(outcomes):
    for r in results(outcomes, check_launch_order):
        assert r["buckets"] >= 5, r  # one parameter per bucket
        assert_small(r["vs_reference"], "grads vs float64 average of local grads")


@CHECKS.uses(check_copy_at_hook)
def test_gradient_is_copied_into_its_slot_at_its_own_hook_like_ddp(outcomes):
    for r in results(outcomes, check_copy_at_hook):
        assert_small(r["grads"], "grads vs DDP", 1e-5)
        assert_small(r["params"], "params vs DDP", 1e-5)


@CHECKS.uses(check_private_grads)
def test_without_bucket_view_grads_are_private_copies(outcomes):
    for r in results(outcomes, check_private_grads):
        assert_small(r["vs_reference"], "grads vs float64 average")
        assert r["changed"] == [], f"held gradients changed by later steps: {r['changed']}"
        assert r["shared"] == [0, 0, 0], f"gradients sharing storage per step: {r['shared']}"


@CHECKS.uses(check_inner_module_backward)
def test_backward_of_the_inner_module_stays_local(outcomes):
    for r in results(outcomes, check_inner_module_backward):
        assert r["outcome"] == ("ok", None), r["outcome"]
        assert_small([r["vs_local"]], "grads vs this rank's local grads")
        assert r["next_step"][0] == "ok", r["next_step"]
        assert_small([r["next_vs_reference"]], "next step's grads vs float64 average")


@CHECKS.uses(check_stalled_peer_timeout)
def test_timeout_bounds_the_wait_for_a_stalled_peer(outcomes):
    for backend, r0 in results(outcomes, check_stalled_peer_timeout)[0].items():
        assert r0["outcome"][0] == "raised", \
            f"{backend}: rank 0 waited {r0['seconds']:.1f}s for a peer 12 s late and did not " \
            f"raise (timeout 3 s)"
        assert r0["seconds"] < 9, \
            f"{backend}: rank 0 raised only after {r0['seconds']:.1f}s (timeout 3 s)"
        assert "bucket" in r0["outcome"][2].lower(), (backend, r0["outcome"])


@CHECKS.uses(check_scaled_before_summed)
def test_gradients_are_scaled_before_they_are_summed_like_ddp(outcomes):
    for r in results(outcomes, check_scaled_before_summed):
        assert r["ddp_finite"], "DDP side changed"
        assert r["finite"], "the sum overflowed: gradients were summed before scaling"
        assert r["vs_ddp"] == 0.0, r
        assert r["value"] == pytest.approx(2.5e38, rel=1e-6)


@CHECKS.uses(check_prepare_for_backward)
def test_prepare_for_backward_averages_one_more_backward_of_the_same_forward(outcomes):
    for r in results(outcomes, check_prepare_for_backward):
        for how in ("prepare_for_backward", "plain"):  # plain: the backward re-arms itself
            assert r[how]["allreduces"] >= 1, (how, r)
            assert_small([r[how]["vs_both_averaged"]], f"both backward passes averaged ({how})")
            assert r[how]["vs_second_local"] > 1e-4, (how, r)
        # Inside no_sync() the second backward stays local, as asked.
        control = r["no_sync"]
        assert control["allreduces"] == 0, control
        assert_small([control["vs_second_local"]], "no_sync: second backward local")
        assert control["vs_both_averaged"] > 1e-4, r


@CHECKS.uses(check_defaults_and_stats)
def test_defaults_and_stats_step_count_synchronised_backwards(outcomes):
    for r in results(outcomes, check_defaults_and_stats):
        # bucket_cap_mb=25, first bucket 1 MiB when nothing is set, last bucket off, own dtype
        assert r["limits"] == (MiB, 25 * MiB, 0, None), r["limits"]
        assert r["autotune"] == "not started"
        assert r["transport"] == "shm"  # CPU ranks of one host
        assert r["step_before"] == 0
        # 3 synchronised backward passes; neither the no_sync one nor the unarmed one counts
        assert r["step"] == 3, r
        assert r["history_steps"] == [1, 2, 3], r
        assert_small([r["vs_reference"]], "grads vs float64 average")
        assert r["grads_are_views"] == [], "gradient_as_bucket_view is off by default"


@CHECKS.uses(check_process_group)
def test_process_group_argument_is_the_group_averaged_over(outcomes):
    for rank, r in enumerate(results(outcomes, check_process_group)):
        assert r["weights_kept"] == 0.0, "weights broadcast from outside the group"
        assert_small([r["vs_local"]], "grads vs this rank's local grads (a group of one)")
        if rank == 1:
            assert r["ranks_differ"] > 0, "gradients were averaged across the two ranks"


@CHECKS.uses(check_backend)
def test_backend_routes_buckets_through_shared_memory_or_the_process_group_or_is_refused(
        outcomes):
    import fused_reducer
    for r in results(outcomes, check_backend):
        assert (r["auto"]["transport"], r["auto"]["backend"]) == ("shm", "shm"), r["auto"]
        assert r["process_group"]["transport"] == "process_group(gloo)", r["process_group"]
        assert r["process_group"]["backend"] == "process_group", r["process_group"]
        for backend in ("auto", "process_group"):
            s = r[backend]
            assert len(s["sizes"]) == 2, (backend, s)
            assert s["count"] == 2, f"{backend}: {s['count']} all-reduces"
            assert s["moved"] == sorted((b, "float") for b in s["sizes"]), (backend, s)
            assert_small([s["vs_reference"]], f"{backend}: grads vs float64 average")
        assert r["nccl"][0] == "raised", "backend='nccl' with CPU parameters was accepted"
        kind, message = r["nccl"][1:3]
        if fused_reducer.build_info()["cuda"]:
            assert kind == "ValueError" and "nccl" in message and "cpu" in message, r["nccl"]
        else:
            assert kind == "RuntimeError" and "without CUDA" in message, r["nccl"]
        assert r["unknown"][:2] == ("raised", "ValueError") and "'mpi'" in r["unknown"][2], r


@CHECKS.uses(check_grad_scaler)
def test_grad_scaler_skips_the_same_steps_on_every_rank_like_ddp(outcomes):
    for r in results(outcomes, check_grad_scaler):
        assert r["skipped"]["ddp"] == [False, True, False, False], "DDP side changed"
        assert r["skipped"]["fr"] == r["skipped"]["ddp"], r["skipped"]
        assert r["scale"]["fr"] == r["scale"]["ddp"], r["scale"]
        assert_small(r["params"], "params vs DDP", 1e-5)
        assert r["synced"] == 0.0
