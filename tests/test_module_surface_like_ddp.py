"""What a user sees of the wrapper is what DDP shows: nn.Module citizenship (names, methods,
repr), checkpoints both ways, casting before and after wrapping, pickling, constructor device
arguments, autocast, gradient clipping, SyncBatchNorm (GPU).

Each check runs the same user loop under DDP and under FusedReducer on 2 gloo ranks and returns
the differences; all checks share one spawn (a spawn costs seconds). Helpers and models:
ddp_comparison.py (FUSED_TESTS_AGAINST_DDP=1 turns the FusedReducer side into DDP, to check the tests).
"""
import io

import pytest
import torch
from torch import nn

from dist_utils import per_rank, run_checks
from ddp_comparison import (
    BNNet, FR_IS_DDP, Frozen, Net, WRAP, assert_all_close, assert_close, build, buffers, data,
    ddp, fused, grads, local_average_grads, loss_of, max_diff, outcome, params, roundtrip,
    same_on_all_ranks, sgd, train)


# -- checks (run on every rank) --------------------------------------------------------------------

def check_names_match_ddp(rank, world):
    out = {}
    for kind in ("ddp", "fr"):
        model = WRAP[kind](build(BNNet))
        out[kind] = {
            "state_dict": list(model.state_dict().keys()),
            "parameters": [n for n, _ in model.named_parameters()],
            "buffers": [n for n, _ in model.named_buffers()],
            "modules": [n for n, _ in model.named_modules()],
            "children": [n for n, _ in model.named_children()],
            "shapes": [tuple(t.shape) for t in model.state_dict().values()],
        }
    return out


def save_checkpoint(model, opt):
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    return buf


def resume(kind, buf, seed):
    model = WRAP[kind](build(BNNet, seed=seed))  # different init: the checkpoint must win
    opt = sgd(model)
    ckpt = torch.load(buf)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    return model, opt


def check_checkpoint_ddp_to_fused_and_back(rank, world):
    ref = ddp(build(BNNet))
    ref_opt = train(ref, rank, 2)
    fr, fr_opt = resume("fr", save_checkpoint(ref, ref_opt), seed=7)
    loaded = {"params": max_diff(params(ref), params(fr)), "buffers": max_diff(buffers(ref),
                                                                              buffers(fr))}
    train(ref, rank, 2, ref_opt, start=2)
    train(fr, rank, 2, fr_opt, start=2)
    ddp_to_fr = {"params": max_diff(params(ref), params(fr)),
                 "buffers": max_diff(buffers(ref), buffers(fr))}
    back, back_opt = resume("ddp", save_checkpoint(fr, fr_opt), seed=8)
    train(ref, rank, 2, ref_opt, start=4)
    train(back, rank, 2, back_opt, start=4)
    fr_to_ddp = {"params": max_diff(params(ref), params(back)),
                 "buffers": max_diff(buffers(ref), buffers(back))}
    return {"loaded": loaded, "ddp_to_fr": ddp_to_fr, "fr_to_ddp": fr_to_ddp}


def check_float64_model_cast_before_wrapping(rank, world):
    out = {}
    for how in ("double", "to"):
        models = {}
        for kind in ("ddp", "fr"):
            m = build(Net)
            m = m.double() if how == "double" else m.to(torch.float64)
            models[kind] = WRAP[kind](m)
            train(models[kind], rank, 3, dtype=torch.float64)
        out[how] = {"diff": max_diff(params(models["ddp"]), params(models["fr"])),
                    "dtypes": sorted({str(p.dtype) for p in models["fr"].parameters()})}
    return out


def check_cast_after_wrapping_raises_or_trains_correctly(rank, world):
    """Casting the wrapped model after construction: a clear error, or correct averages."""
    from ddp_comparison import risky_kwargs
    model = fused(build(Net), **risky_kwargs())
    opt = train(model, rank, 1)
    returned_self = model.to(torch.float64) is model
    state = {k: v.clone() for k, v in inner_state(model).items()}

    def one_step():
        opt.zero_grad()
        x, y = data(rank, 5, dtype=torch.float64)
        loss_of(model(x), y, rank).backward()
        return grads(model)

    result = outcome(one_step)
    if result[0] == "ok":  # outside outcome(): an error of the reference is the test's own
        expected = local_average_grads(state, lambda: build(Net).double(), rank, 5,
                                       dtype=torch.float64)
        result = ("ok", max_diff(expected, result[1]))
    return {"returned_self": returned_self, "outcome": result,
            "dtypes": sorted({str(p.dtype) for p in model.parameters()})}


def inner_state(model):
    return model.module.state_dict()


def check_module_methods_behave_as_on_ddp(rank, world):
    out = {}
    for kind in ("ddp", "fr"):
        module = build(BNNet)
        model = WRAP[kind](module)
        r = {}
        r["module_is_user_module"] = model.module is module
        r["parameters_are_module_parameters"] = (
            [id(p) for p in model.parameters()] == [id(p) for p in module.parameters()])
        r["buffers_are_module_buffers"] = (
            [id(b) for b in model.buffers()] == [id(b) for b in module.buffers()])
        r["eval_returns_self"] = model.eval() is model
        r["eval_flags"] = [m.training for m in model.modules()]
        r["train_returns_self"] = model.train() is model
        r["train_flags"] = [m.training for m in model.modules()]
        opt = train(model, rank, 1)
        r["zero_grad_to_none"] = (model.zero_grad() is None
                                  and all(p.grad is None for p in model.parameters()))
        r["requires_grad_off_returns_self"] = model.requires_grad_(False) is model
        r["requires_grad_off"] = [p.requires_grad for p in model.parameters()]
        model.requires_grad_(True)
        r["requires_grad_on"] = [p.requires_grad for p in model.parameters()]
        visited = []
        r["apply_returns_self"] = model.apply(lambda m: visited.append(m)) is model
        r["apply_visits"] = [type(m).__name__ for m in visited[:-1]]
        r["apply_visits_self_last"] = visited[-1] is model

        def init(m):
            if isinstance(m, nn.Linear):
                nn.init.constant_(m.weight, 0.05)
        model.apply(init)
        train(model, rank, 2, opt, start=1)
        model.load_state_dict(model.state_dict())  # strict round trip on itself
        r["params"] = params(model)
        r["buffers"] = buffers(model)
        text = repr(model)
        r["repr_head"] = text.split("(", 1)[0]
        r["repr_module_part"] = text[text.index("(module):"):] if "(module):" in text else text
        out[kind] = r
    for what in ("params", "buffers"):
        out[f"{what}_diff"] = max_diff(out["ddp"].pop(what), out["fr"].pop(what))
    return out


def check_pickled_copies_train_like_ddp(rank, world):
    originals = {kind: WRAP[kind](build(Net)) for kind in ("ddp", "fr")}
    for model in originals.values():
        train(model, rank, 1)
    out = {}
    for how in ("torch.save", "pickle", "deepcopy"):
        copies, r = {}, {}
        for kind, model in originals.items():
            res = outcome(lambda: roundtrip(model, how))
            if res[0] != "ok":
                r[kind] = res
                continue
            copies[kind] = res[1]
            r[f"{kind}_type"] = type(res[1]).__name__
            r[f"{kind}_equal_at_load"] = max_diff(params(model), params(res[1]))
            # every rank loads, then trains the copy in the initialised default group
            res = outcome(lambda: train(copies[kind], rank, 2, start=1))
            if res[0] != "ok":
                r[kind] = res
                del copies[kind]
        if len(copies) == 2:
            r["diff"] = max_diff(params(copies["ddp"]), params(copies["fr"]))
            r["synced"] = same_on_all_ranks(list(copies["fr"].parameters()))
        out[how] = r
    return out


def check_no_trainable_parameter_raises_runtime_error(rank, world):
    return {kind: outcome(lambda: WRAP[kind](build(Frozen))) for kind in ("ddp", "fr")}


def check_ddp_device_arguments(rank, world):
    """The one-line switch keeps DDP's device_ids/output_device: accepted where DDP accepts them
    for a CPU module (None), refused with a ValueError where DDP refuses them (a GPU id)."""
    out = {}
    for kind in ("ddp", "fr"):
        out[kind] = {
            "none": outcome(lambda: type(WRAP[kind](build(Net), device_ids=None,
                                                    output_device=None)).__name__),
            "gpu_id_for_cpu_module": outcome(lambda: WRAP[kind](build(Net), device_ids=[0])),
        }
    return out


def check_autocast_bf16_matches_ddp(rank, world):
    models = {kind: WRAP[kind](build(Net)) for kind in ("ddp", "fr")}
    opts = {kind: sgd(m) for kind, m in models.items()}
    diffs = []
    for i in range(3):
        for kind, model in models.items():
            opts[kind].zero_grad()
            x, y = data(rank, i)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x)
            loss_of(out.float(), y, rank).backward()
        diffs.append(max_diff(grads(models["ddp"]), grads(models["fr"])))
        for opt in opts.values():
            opt.step()
        diffs.append(max_diff(params(models["ddp"]), params(models["fr"])))
    return diffs


def check_grad_clipping_sees_averaged_grads(rank, world):
    models = {kind: WRAP[kind](build(Net)) for kind in ("ddp", "fr")}
    opts = {kind: sgd(m) for kind, m in models.items()}
    norms = {"ddp": [], "fr": []}
    for i in range(3):
        for kind, model in models.items():
            opts[kind].zero_grad()
            x, y = data(rank, i)
            loss_of(model(x), y, rank).backward()
            norms[kind].append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1).item())
            opts[kind].step()
    return {"norms": norms, "diff": max_diff(params(models["ddp"]), params(models["fr"])),
            "synced": same_on_all_ranks(list(models["fr"].parameters()))}


CHECKS = [check_names_match_ddp, check_checkpoint_ddp_to_fused_and_back,
          check_float64_model_cast_before_wrapping, check_module_methods_behave_as_on_ddp,
          check_pickled_copies_train_like_ddp, check_no_trainable_parameter_raises_runtime_error,
          check_autocast_bf16_matches_ddp, check_grad_clipping_sees_averaged_grads,
          check_cast_after_wrapping_raises_or_trains_correctly, check_ddp_device_arguments]


@pytest.fixture(scope="module")
def outcomes():
    return run_checks(CHECKS, timeout=240)


# -- tests ---------------------------------------------------------------------------------------

def test_state_dict_keys_are_exactly_ddps_with_module_prefix(outcomes):
    for r in per_rank(outcomes, "check_names_match_ddp"):
        assert r["fr"]["state_dict"] == r["ddp"]["state_dict"]
        assert r["fr"]["shapes"] == r["ddp"]["shapes"]
        assert all(k.startswith("module.") for k in r["fr"]["state_dict"])


def test_named_parameters_buffers_modules_and_children_are_ddps(outcomes):
    for r in per_rank(outcomes, "check_names_match_ddp"):
        for what in ("parameters", "buffers", "modules", "children"):
            assert r["fr"][what] == r["ddp"][what], what


def test_ddp_checkpoint_loads_into_fused_reducer_and_resumes_like_ddp(outcomes):
    for r in per_rank(outcomes, "check_checkpoint_ddp_to_fused_and_back"):
        assert r["loaded"]["params"] == 0.0 and r["loaded"]["buffers"] == 0.0, r["loaded"]
        assert_close(r["ddp_to_fr"]["params"], what="params after resuming")
        assert_close(r["ddp_to_fr"]["buffers"], what="buffers after resuming")


def test_fused_reducer_checkpoint_loads_into_ddp_and_resumes_identically(outcomes):
    for r in per_rank(outcomes, "check_checkpoint_ddp_to_fused_and_back"):
        assert_close(r["fr_to_ddp"]["params"], what="params after resuming in DDP")
        assert_close(r["fr_to_ddp"]["buffers"], what="buffers after resuming in DDP")


def test_model_cast_to_float64_before_wrapping_trains_like_ddp(outcomes):
    for r in per_rank(outcomes, "check_float64_model_cast_before_wrapping"):
        for how in ("double", "to"):
            assert r[how]["dtypes"] == ["torch.float64"], how
            assert_close(r[how]["diff"], 1e-12, f".{how}() before wrapping")


@pytest.mark.skipif(FR_IS_DDP, reason="DDP of torch 2.14 silently reduces wrong gradients here")
def test_cast_after_construction_raises_clear_runtime_error_or_reduces_correctly(outcomes):
    results = per_rank(outcomes, "check_cast_after_wrapping_raises_or_trains_correctly")
    kinds = {r["outcome"][0] for r in results}
    assert len(kinds) == 1, f"ranks disagree: {[r['outcome'] for r in results]}"
    for r in results:
        assert r["returned_self"]
        res = r["outcome"]
        if res[0] == "raised":
            _, name, message, is_runtime, _ = res
            assert is_runtime, f"{name}: {message}"
            assert any(w in message.lower() for w in ("dtype", "device", "float64", "moved",
                                                      "cast")), message
        else:
            assert r["dtypes"] == ["torch.float64"]
            assert_close(res[1], 1e-10, "gradients after .to(float64) vs local average")


def test_module_and_parameters_and_buffers_are_the_users_objects(outcomes):
    for r in per_rank(outcomes, "check_module_methods_behave_as_on_ddp"):
        for key in ("module_is_user_module", "parameters_are_module_parameters",
                    "buffers_are_module_buffers"):
            assert r["ddp"][key] and r["fr"][key], key


def test_train_eval_zero_grad_requires_grad_apply_behave_as_on_ddp(outcomes):
    for r in per_rank(outcomes, "check_module_methods_behave_as_on_ddp"):
        for key in ("eval_returns_self", "train_returns_self", "zero_grad_to_none",
                    "requires_grad_off_returns_self", "apply_returns_self",
                    "apply_visits_self_last"):
            assert r["fr"][key] == r["ddp"][key] == True, key  # noqa: E712
        for key in ("eval_flags", "train_flags", "requires_grad_off", "requires_grad_on",
                    "apply_visits"):
            assert r["fr"][key] == r["ddp"][key], key
        assert_close(r["params_diff"], what="params after apply(init) and training")
        assert_close(r["buffers_diff"], what="buffers")


def test_repr_names_fused_reducer_and_shows_the_module_like_ddp(outcomes):
    for r in per_rank(outcomes, "check_module_methods_behave_as_on_ddp"):
        assert r["fr"]["repr_head"] == ("DistributedDataParallel" if FR_IS_DDP else "FusedReducer")
        assert r["fr"]["repr_module_part"] == r["ddp"]["repr_module_part"]


@pytest.mark.parametrize("how", ["torch.save", "pickle", "deepcopy"])
def test_pickled_or_copied_model_reloads_and_trains_like_ddp(outcomes, how):
    for r in per_rank(outcomes, "check_pickled_copies_train_like_ddp"):
        r = r[how]
        assert "ddp" not in r, f"DDP side failed: {r.get('ddp')}"
        assert "fr" not in r, f"FusedReducer: {r['fr']}"
        assert r["fr_type"] == ("DistributedDataParallel" if FR_IS_DDP else "FusedReducer")
        assert r["fr_equal_at_load"] == 0.0
        assert_close(r["diff"], what=f"{how}: params after training the copies")
        assert r["synced"] == 0.0, "the copy's parameters differ across ranks"


def test_module_without_trainable_parameters_raises_runtime_error_like_ddp(outcomes):
    for r in per_rank(outcomes, "check_no_trainable_parameter_raises_runtime_error"):
        assert r["ddp"][0] == "raised" and r["ddp"][3], r["ddp"]
        assert r["fr"][0] == "raised", "FusedReducer accepted a module with nothing to reduce"
        assert r["fr"][3], f"not a RuntimeError: {r['fr'][1]}: {r['fr'][2]}"


def test_ddp_device_ids_and_output_device_are_accepted_or_refused_like_ddp(outcomes):
    for r in per_rank(outcomes, "check_ddp_device_arguments"):
        assert r["ddp"]["none"][0] == "ok", "DDP side changed"
        assert r["fr"]["none"][0] == "ok", r["fr"]["none"]
        assert r["ddp"]["gpu_id_for_cpu_module"][0] == "raised", "DDP side changed"
        refused = r["fr"]["gpu_id_for_cpu_module"]
        assert refused[0] == "raised" and refused[4], refused  # a ValueError, as DDP's
        assert "device_ids=[0]" in refused[2] and "cpu" in refused[2], refused[2]


def test_autocast_bf16_training_loop_matches_ddp(outcomes):
    for diffs in per_rank(outcomes, "check_autocast_bf16_matches_ddp"):
        assert_all_close(diffs, what="grads/params under torch.autocast(cpu, bf16)")


def test_clip_grad_norm_after_backward_sees_averaged_grads_like_ddp(outcomes):
    for r in per_rank(outcomes, "check_grad_clipping_sees_averaged_grads"):
        assert r["norms"]["fr"] == pytest.approx(r["norms"]["ddp"], rel=1e-5, abs=1e-6)
        assert_close(r["diff"], what="params after clipped steps")
        assert r["synced"] <= 1e-7


# -- SyncBatchNorm: CUDA only, even under DDP ----------------------------------------------------

def check_syncbatchnorm_on_cuda_matches_ddp(rank, world):
    n_dev = torch.cuda.device_count()
    dev = torch.device("cuda", rank % n_dev)
    torch.cuda.set_device(dev)
    models = {}
    for kind in ("ddp", "fr"):
        m = nn.SyncBatchNorm.convert_sync_batchnorm(build(BNNet)).to(dev)
        if kind == "ddp":
            models[kind] = ddp(m, device_ids=[dev.index])
        else:  # two ranks on one GPU cannot share NCCL: use the (gloo) process group then
            models[kind] = fused(m, backend="auto" if n_dev >= world else "process_group")
    opts = {k: sgd(m) for k, m in models.items()}
    for i in range(3):
        for kind, model in models.items():
            opts[kind].zero_grad()
            x, y = data(rank, i)
            loss_of(model(x.to(dev)), y.to(dev), rank).backward()
            opts[kind].step()
    cpu = {k: {n: t.cpu() for n, t in params(m).items()} for k, m in models.items()}
    bufs = {k: {n: t.cpu() for n, t in buffers(m).items()} for k, m in models.items()}
    return {"params": max_diff(cpu["ddp"], cpu["fr"]), "buffers": max_diff(bufs["ddp"],
                                                                           bufs["fr"])}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="SyncBatchNorm runs only on CUDA")
def test_syncbatchnorm_converted_model_trains_like_ddp_on_cuda():
    outcomes = run_checks([check_syncbatchnorm_on_cuda_matches_ddp], timeout=300)
    for r in per_rank(outcomes, "check_syncbatchnorm_on_cuda_matches_ddp"):
        assert_close(r["params"], 1e-4, "params")
        assert_close(r["buffers"], 1e-4, "SyncBatchNorm running stats")
