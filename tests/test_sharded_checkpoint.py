"""Sharded checkpoints: a ShardedOptimizer saves and resumes through
torch.distributed.checkpoint, each rank writing only its fragments (Note [Sharded checkpoint
format] in python/fused_reducer/sharded/checkpoint.py).

The reference is a plain torch optimizer in ONE process on the same global batches (each step's
batch split evenly over the ranks): a job saved at one world size and bucket layout and resumed
at another (larger, smaller, 1; other limits, master weights on or off) must continue exactly
as that single process (1e-6, AdamW and SGD with momentum); resumed with reduce_dtype=bf16, as
the same job resumed from the plain consolidated state_dict (bit-identical). Also: a sharded
checkpoint loads into a plain optimizer (one process, no process group), a DDP job's plain
optimizer saved in the same format loads into a ShardedOptimizer, each rank's file holds about
1/world of the state, dcp.async_save saves the state of its step, and a checkpoint of another
model, another optimizer class or missing a rank's file raises naming what differs and loads
nothing. A resume takes the checkpoint's hyperparameters over the constructor's (as torch's own
AdamW resumed the same way); into a plain optimizer, a parameter saved without state has none (as
torch's fresh optimizer) and channels_last parameters get the state a plain AdamW trained in one
process holds.
"""
import json
import os
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from fused_reducer import FusedReducer, ShardedOptimizer, ShardedOptimizerError
from fused_reducer.sharded import checkpoint as sharded_checkpoint

from dist_utils import run_checks, per_rank

ROWS = 24       # the global batch: divisible by 1, 2, 3 and 4 ranks
SAVED_AT = 3    # steps before the checkpoint
STEPS = 6       # steps in all
KB = 1024

OPTIMIZERS = {
    "AdamW": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "SGD": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)),
}


class _Scaled(nn.Module):
    """A 0-dim parameter beside the usual ones."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        return x * self.scale


def _net(seed=0, width=40):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, width), nn.Tanh(), nn.Linear(width, 33), nn.Tanh(),
                         nn.Linear(33, 7), _Scaled())


def _batch(step, rank, world):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(ROWS, 12, generator=g), torch.randn(ROWS, 7, generator=g)
    per = ROWS // world
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


def _train(model, opt, steps, rank, world):
    for step in steps:
        x, y = _batch(step, rank, world)
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()


def _config():
    return json.loads(os.environ["FR_CKPT_CONFIG"])


def _path(name):
    return os.path.join(os.environ["FR_CKPT_DIR"], name)


def _sharded(config, seed=0):
    """FusedReducer + ShardedOptimizer as `config` says: optimizer, limits, master weights."""
    cls, kwargs = OPTIMIZERS[config["optimizer"]]
    options = dict(bucket_cap_mb=config["cap_kb"] * KB / 2**20, first_bucket_mb=KB / 2**20)
    if config.get("reduce_dtype"):
        options["reduce_dtype"] = getattr(torch, config["reduce_dtype"])
    model = FusedReducer(_net(seed), **options)
    master = torch.float64 if config.get("master") else None
    return model, ShardedOptimizer(model, cls, master_dtype=master, **kwargs)


def _params(model):
    return [p.detach().clone() for p in model.module.parameters()]


# -- checks (each rank) ----------------------------------------------------------------------------

def check_save(rank, world):
    """Train SAVED_AT steps (a limit change included), then dcp.save model and optimizer."""
    config = _config()["save"]
    model, opt = _sharded(config)
    _train(model, opt, range(SAVED_AT - 1), rank, world)
    model.bucket_cap_mb = 3 * KB / 2**20  # the layout changes: the state moves with the fragments
    _train(model, opt, range(SAVED_AT - 1, SAVED_AT), rank, world)
    dcp.save({"model": model.module.state_dict(), "optim": opt.sharded_state_dict()},
             checkpoint_id=_path(config["name"]))
    plain = {"model": model.module.state_dict(), "optim": opt.state_dict()}  # consolidated
    if rank == 0:
        torch.save(plain, _path(config["name"]) + ".plain.pt")
    model.close()


def check_resume(rank, world):
    """A fresh job (other initial weights, another layout) loads the checkpoint the documented way
    and trains the remaining steps: its parameters."""
    config = _config()["resume"]
    model, opt = _sharded(config, seed=7)
    if config.get("via") == "plain":  # the plain format's load_state_dict, as a reference
        plain = torch.load(_path(config["from"]) + ".plain.pt")
        model.module.load_state_dict(plain["model"])
        opt.load_state_dict(plain["optim"])
    elif config.get("via") == "load_checkpoint":
        sharded_checkpoint.load_checkpoint(_path(config["from"]), model.module, opt)
    else:
        _load_the_documented_way(model, opt, _path(config["from"]))
    return _train_the_rest(model, opt, rank, world)


def _load_the_documented_way(model, opt, path):
    sd = {"model": model.module.state_dict(), "optim": opt.sharded_state_dict()}
    dcp.load(sd, checkpoint_id=path)
    model.module.load_state_dict(sd["model"])
    opt.load_sharded_state_dict(sd["optim"])


def _train_the_rest(model, opt, rank, world):
    """The steps after the checkpoint; the parameters they end with."""
    _train(model, opt, range(SAVED_AT, STEPS), rank, world)
    out = _params(model)
    model.close()
    return out


def check_save_before_any_step(rank, world):
    """A checkpoint of optimizers that have not stepped (no state at all), resumed at another
    world size: they must go on as fresh optimizers (Rprop's step sizes start at lr, not 0; SGD
    with dampening starts its buffer at the gradient)."""
    config = _config()
    out = []
    for name, (cls, kwargs) in STATELESS.items():
        path = _path(f"fresh-{name}")
        if config["phase"] == "save":
            model = FusedReducer(_net(), bucket_cap_mb=2 * KB / 2**20)
            opt = ShardedOptimizer(model, cls, **kwargs)
            dcp.save({"model": model.module.state_dict(), "optim": opt.sharded_state_dict()},
                     checkpoint_id=path)
        else:
            model = FusedReducer(_net(seed=7), bucket_cap_mb=5 * KB / 2**20)
            opt = ShardedOptimizer(model, cls, **kwargs)
            _load_the_documented_way(model, opt, path)
            _train(model, opt, range(SAVED_AT), rank, world)
            out.append(_params(model))
        model.close()
    return out


def check_rollback(rank, world):
    """A live job (a sharded layout, its own state) loads an earlier checkpoint of another world
    size in place (the documented pattern: dcp.load writes the live fragments) and trains on
    from there: a roll-back after a loss spike."""
    model, opt = _sharded(dict(optimizer="AdamW", cap_kb=3))
    _train(model, opt, range(STEPS - 1), rank, world)
    _load_the_documented_way(model, opt, _path(_config()["from"]))
    return _train_the_rest(model, opt, rank, world)


# hyperparameters changed by hand before the save (a schedule's decay, a tuned weight decay), and
# the ones the resumed job's constructor names: the checkpoint's must win, as torch's
# load_state_dict restores a plain optimizer's
SAVED_OPTIONS = dict(lr=3e-3, weight_decay=0.3)
RESUMED_OPTIONS = dict(lr=0.5, weight_decay=0.0)


def _train_changing_hyperparameters(model, opt, rank, world):
    """Step 0 with OPTIMIZERS["AdamW"]'s options, the steps up to SAVED_AT with SAVED_OPTIONS."""
    _train(model, opt, range(1), rank, world)
    for group in opt.param_groups:
        group.update(SAVED_OPTIONS)
    _train(model, opt, range(1, SAVED_AT), rank, world)


def check_resume_with_other_hyperparameters(rank, world):
    """Save after changing the hyperparameters, resume into a ShardedOptimizer constructed with
    others (another layout): the hyperparameters it resumes with and its parameters at the end."""
    cls, kwargs = OPTIMIZERS["AdamW"]
    model = FusedReducer(_net(), bucket_cap_mb=2 * KB / 2**20)
    opt = ShardedOptimizer(model, cls, **kwargs)
    _train_changing_hyperparameters(model, opt, rank, world)
    dcp.save({"model": model.module.state_dict(), "optim": opt.sharded_state_dict()},
             checkpoint_id=_path("hyperparameters"))
    model.close()
    model = FusedReducer(_net(seed=7), bucket_cap_mb=5 * KB / 2**20)
    opt = ShardedOptimizer(model, cls, **dict(kwargs, **RESUMED_OPTIONS))
    _load_the_documented_way(model, opt, _path("hyperparameters"))
    resumed = {k: opt.param_groups[0][k] for k in SAVED_OPTIONS}
    return resumed, _train_the_rest(model, opt, rank, world)


class _Convs(nn.Module):
    """Two convolutions and a linear head; .to(memory_format=torch.channels_last) makes the
    convolutions' weights channels_last (memory order (out, kh, kw, in), not row-major)."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.convs = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Tanh(), nn.Conv2d(8, 4, 3), nn.Tanh())
        self.head = nn.Linear(4 * 4 * 4, 5)

    def forward(self, x):
        return self.head(self.convs(x).flatten(1))


def _convs(seed=0):
    return _Convs(seed).to(memory_format=torch.channels_last)


def _image_batch(step, rank, world):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(ROWS, 3, 8, 8, generator=g), torch.randn(ROWS, 5, generator=g)
    per = ROWS // world
    return (x[rank * per:(rank + 1) * per].contiguous(memory_format=torch.channels_last),
            y[rank * per:(rank + 1) * per])


def _train_images(model, opt, steps, rank, world):
    for step in steps:
        x, y = _image_batch(step, rank, world)
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()


def check_save_channels_last(rank, world):
    """A ShardedOptimizer over channels_last convolutions, SAVED_AT steps, then dcp.save."""
    model = FusedReducer(_convs(), bucket_cap_mb=2 * KB / 2**20)
    opt = ShardedOptimizer(model, torch.optim.AdamW, lr=1e-2)
    _train_images(model, opt, range(SAVED_AT), rank, world)
    dcp.save({"model": model.module.state_dict(), "optim": opt.sharded_state_dict()},
             checkpoint_id=_path("channels-last"))
    model.close()


STATELESS = {"Rprop": (torch.optim.Rprop, dict(lr=1e-3)),
             "SGD": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, dampening=0.5))}


def check_save_under_ddp(rank, world):
    """DDP + plain AdamW, the plain optimizer saved in the sharded checkpoint format."""
    model = DDP(_net())
    cls, kwargs = OPTIMIZERS["AdamW"]
    opt = cls(model.parameters(), **kwargs)
    _train(model, opt, range(SAVED_AT), rank, world)
    dcp.save({"model": model.module.state_dict(),
              "optim": sharded_checkpoint.plain_optimizer_state_dict(model.module, opt)},
             checkpoint_id=_path("ddp"))


def check_async_save(rank, world):
    """dcp.async_save (on a group of its own) while training goes on: the checkpoint holds the
    state of the step it was taken at, not of the steps after it."""
    model, opt = _sharded(dict(optimizer="AdamW", cap_kb=2))
    _train(model, opt, range(SAVED_AT), rank, world)
    group = dist.new_group(backend="gloo")
    future = dcp.async_save({"model": model.module.state_dict(),
                             "optim": opt.sharded_state_dict()},
                            checkpoint_id=_path("async"), process_group=group)
    _train(model, opt, range(SAVED_AT, STEPS), rank, world)  # the live state moves on meanwhile
    future.result()
    dist.destroy_process_group(group)
    model.close()


def check_loads_nothing_on_errors(rank, world):
    """Checkpoints that do not fit: each raises naming what differs; the model and the optimizer
    are what they were."""
    saved = _path("AdamW-2-2-False")
    errors = {}

    def attempt(what, model, opt, how):
        before = _params(model)
        try:
            if how == "dcp":
                sd = {"model": model.module.state_dict(), "optim": opt.sharded_state_dict()}
                dcp.load(sd, checkpoint_id=saved if what != "missing file" else _path("broken"))
                model.module.load_state_dict(sd["model"])
                opt.load_sharded_state_dict(sd["optim"])
            else:
                sharded_checkpoint.load_checkpoint(
                    saved if what != "missing file" else _path("broken"), model.module, opt)
        except BaseException as e:  # noqa: BLE001 - what the user sees (DCP raises a
            # CheckpointException, a BaseException)
            errors[(what, how)] = (type(e).__name__, str(e)[:3000],
                                   max((a - b).abs().max().item()
                                       for a, b in zip(before, _params(model))),
                                   len(opt.state) + (len(opt._inner.state) if opt._inner else 0))
        else:
            errors[(what, how)] = None

    if rank == 0:
        shutil.copytree(saved, _path("broken"), dirs_exist_ok=True)
        os.remove(os.path.join(_path("broken"), "__1_0.distcp"))
    dist.barrier()
    cls, kwargs = OPTIMIZERS["AdamW"]
    for how in ("dcp", "load_checkpoint"):
        wider = FusedReducer(_net(width=41))
        attempt("another shape", wider, ShardedOptimizer(wider, cls, **kwargs), how)
        renamed = FusedReducer(nn.Sequential(_net()))  # the same layers under other names
        attempt("other names", renamed, ShardedOptimizer(renamed, cls, **kwargs), how)
        model = FusedReducer(_net(seed=3))
        attempt("Adam for AdamW", model, ShardedOptimizer(model, torch.optim.Adam, lr=1e-2), how)
        model = FusedReducer(_net(seed=3))
        attempt("SGD for AdamW", model,
                ShardedOptimizer(model, torch.optim.SGD, lr=0.1, momentum=0.9), how)
        model = FusedReducer(_net(seed=3))
        attempt("missing file", model, ShardedOptimizer(model, cls, **kwargs), how)
    return errors


def check_file_shares(rank, world):
    """A wider model's checkpoint: the bytes of each rank's file."""
    torch.manual_seed(0)
    model = FusedReducer(nn.Sequential(nn.Linear(12, 256), nn.Tanh(), nn.Linear(256, 256),
                                       nn.Tanh(), nn.Linear(256, 7)), bucket_cap_mb=0.1,
                         first_bucket_mb=0.05)
    opt = ShardedOptimizer(model, torch.optim.AdamW, lr=1e-3)
    for step in range(2):
        x, _ = _batch(step, rank, world)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    path = _path(f"wide-{world}")
    dcp.save({"optim": opt.sharded_state_dict()}, checkpoint_id=path)
    dist.barrier()
    state_bytes = 2 * 4 * sum(p.numel() for p in model.module.parameters())  # fp32 moments
    model.close()
    return state_bytes, os.path.getsize(os.path.join(path, f"__{rank}_0.distcp"))


# -- the single-process reference -----------------------------------------------------------------

def _reference(optimizer, save_master, resume_master):
    """The plain optimizer in one process on the global batches, with fp64 master weights while
    the job had them (saved with, resumed with): the parameters after STEPS steps."""
    cls, kwargs = OPTIMIZERS[optimizer]
    model = _net()
    params = list(model.parameters())

    def make(master):
        weights = [p.detach().double().requires_grad_() for p in params] if master else params
        return weights, cls(weights, **kwargs)

    weights, opt = make(save_master)
    for step in range(STEPS):
        if step == SAVED_AT and resume_master != save_master:
            old, old_state = weights, opt.state
            weights, opt = make(resume_master)
            for w, o in zip(weights, old):  # the state carries over in the new dtype
                opt.state[w] = {k: v.clone() if k == "step" else v.to(w.dtype)
                                for k, v in old_state[o].items()}
        x, y = _batch(step, 0, 1)
        model.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        if weights is not params:
            for w, p in zip(weights, params):
                w.grad = p.grad.double()
        opt.step()
        if weights is not params:
            with torch.no_grad():
                for w, p in zip(weights, params):
                    p.copy_(w)
    return [p.detach().clone() for p in params]


def _max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def _run(check, world, monkeypatch, config):
    monkeypatch.setenv("FR_CKPT_CONFIG", json.dumps(config))
    return per_rank(run_checks([check], world, timeout=300), check.__name__)


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("dcp")


@pytest.fixture
def env(ckpt_dir, monkeypatch):
    monkeypatch.setenv("FR_CKPT_DIR", str(ckpt_dir))
    return monkeypatch


# -- tests -----------------------------------------------------------------------------------------

RESHARDS = [
    # (optimizer, saved at, its limit KB, master; resumed at, its limit KB, master)
    ("AdamW", 2, 2, False, 3, 5, False),
    ("AdamW", 2, 2, False, 1, 5, False),
    ("SGD", 3, 2, False, 2, 1, False),
    ("AdamW", 2, 2, True, 4, 5, True),
    ("SGD", 4, 1, True, 3, 3, False),
    ("SGD", 2, 2, True, 2, 5, True),
]


def _saved(env, optimizer, world, cap, master):
    name = f"{optimizer}-{world}-{cap}-{master}"
    if not os.path.exists(_path(name)):
        _run(check_save, world, env, {"save": dict(name=name, optimizer=optimizer, cap_kb=cap,
                                                   master=master)})
    return name


@pytest.mark.parametrize("case", RESHARDS, ids=[
    f"{o}-{a}to{b}" + ("-master" if m1 else "") + ("-then-plain" if m1 and not m2 else "")
    for o, a, _, m1, b, _, m2 in RESHARDS])
def test_a_checkpoint_resumes_exactly_at_another_world_size_and_layout(case, env):
    optimizer, saved_world, saved_cap, saved_master, world, cap, master = case
    name = _saved(env, optimizer, saved_world, saved_cap, saved_master)
    resume = {"from": name, "optimizer": optimizer, "cap_kb": cap, "master": master}
    got = _run(check_resume, world, env, {"resume": resume})
    expected = _reference(optimizer, saved_master, master)
    for rank, params in enumerate(got):
        assert _max_diff(params, expected) <= 1e-6, (rank, _max_diff(params, expected))


def test_master_weights_turned_on_at_resume_start_from_the_parameters(env):
    """A checkpoint without master weights resumed with master_dtype: load_checkpoint leaves the
    masters to start from the loaded parameters (the plain dcp.load pattern asks for the masters
    the optimizer would save, and DCP names the missing 'master_param')."""
    name = _saved(env, "AdamW", 3, 5, False)
    resume = {"from": name, "optimizer": "AdamW", "cap_kb": 2, "master": True,
              "via": "load_checkpoint"}
    for params in _run(check_resume, 2, env, {"resume": resume}):
        assert _max_diff(params, _reference("AdamW", False, True)) <= 1e-6


def test_a_checkpoint_resumes_into_reduce_dtype_bf16_as_the_plain_format_does(env):
    """reduce_dtype=bf16 rounds the gradients, so the single process is no reference: the same
    job resumed from the plain consolidated state_dict is, step for step."""
    name = _saved(env, "AdamW", 2, 2, False)
    got = {}
    for via in ("dcp", "plain"):
        resume = {"from": name, "optimizer": "AdamW", "cap_kb": 3, "reduce_dtype": "bfloat16",
                  "via": via}
        got[via] = _run(check_resume, 3, env, {"resume": resume})
    for ours, reference in zip(got["dcp"], got["plain"]):
        assert _max_diff(ours, reference) == 0.0


def test_a_sharded_checkpoint_loads_into_a_plain_optimizer_in_one_process(env):
    name = _saved(env, "AdamW", 2, 2, False)
    model = _net(seed=7)
    cls, kwargs = OPTIMIZERS["AdamW"]
    opt = cls(model.parameters(), **kwargs)
    sd = {"model": model.state_dict(),
          "optim": sharded_checkpoint.plain_optimizer_state_dict(model, opt)}
    dcp.load(sd, checkpoint_id=_path(name))  # no process group: DCP reads in this process
    model.load_state_dict(sd["model"])
    sharded_checkpoint.load_plain_optimizer_state_dict(model, opt, sd["optim"])
    assert int(opt.state[model[0].weight]["step"]) == SAVED_AT
    _train(model, opt, range(SAVED_AT, STEPS), 0, 1)
    assert _max_diff(list(model.parameters()), _reference("AdamW", False, False)) <= 1e-6


def test_a_ddp_jobs_plain_optimizer_checkpoint_resumes_in_a_sharded_optimizer(env):
    _run(check_save_under_ddp, 2, env, {})
    resume = {"from": "ddp", "optimizer": "AdamW", "cap_kb": 2}
    for params in _run(check_resume, 3, env, {"resume": resume}):
        assert _max_diff(params, _reference("AdamW", False, False)) <= 1e-6


def test_async_save_holds_the_state_of_its_step(env):
    _run(check_async_save, 2, env, {})
    resume = {"from": "async", "optimizer": "AdamW", "cap_kb": 3}
    for params in _run(check_resume, 2, env, {"resume": resume}):
        assert _max_diff(params, _reference("AdamW", False, False)) <= 1e-6


def test_each_ranks_file_holds_about_one_world_th_of_the_state(env):
    for world in (2, 4):
        shares = _run(check_file_shares, world, env, {})
        state_bytes = shares[0][0]
        metadata = dcp.FileSystemReader(_path(f"wide-{world}")).read_metadata()
        for rank, (_, size) in enumerate(shares):
            # every rank's shard of a bucket has the same number of elements (padding aside);
            # each item written costs DCP about 1.3 KB of framing
            items = sum(info.relative_path == f"__{rank}_0.distcp"
                        for info in metadata.storage_data.values())
            assert abs(size - state_bytes / world) <= 0.05 * state_bytes / world + 1400 * items, (
                world, rank, size, state_bytes, items)


def test_a_checkpoint_that_does_not_fit_raises_naming_what_differs_and_loads_nothing(env):
    name = _saved(env, "AdamW", 2, 2, False)
    errors = _run(check_loads_nothing_on_errors, 2, env, {})
    for rank, outcome in enumerate(errors):
        for (what, how), error in outcome.items():
            assert error is not None, f"rank {rank}: {what} via {how} loaded without an error"
            kind, message, changed, states = error
            # the optimizer never changes; the model neither where the error comes before
            # any read: always with load_checkpoint, with dcp.load where its plan fails
            assert states == 0, (what, how, states, message)
            if how == "load_checkpoint" or what in ("another shape", "other names",
                                                    "SGD for AdamW"):
                assert changed == 0.0, (what, how, changed, message)
            expected = {"another shape": ["0.weight", "41"],
                        "other names": ["0.weight"],
                        "Adam for AdamW": ["AdamW", "Adam"],
                        "SGD for AdamW": ["momentum"],
                        "missing file": ["__1_0.distcp"]}[what]
            if how == "load_checkpoint" or what == "Adam for AdamW":
                assert kind == "ShardedOptimizerError", (what, how, kind, message)
            for word in expected:
                assert word in message, (what, how, word, message)


def test_a_checkpoint_saved_before_any_step_resumes_as_fresh_optimizers(env):
    """Into ShardedOptimizers at another world size, and into plain optimizers in one process
    (load_plain_optimizer_state_dict): no state where none was saved, as torch's fresh optimizer."""
    _run(check_save_before_any_step, 2, env, {"phase": "save"})
    got = _run(check_save_before_any_step, 3, env, {"phase": "resume"})
    for i, (name, (cls, kwargs)) in enumerate(STATELESS.items()):
        model = _net()
        opt = cls(model.parameters(), **kwargs)
        _train(model, opt, range(SAVED_AT), 0, 1)
        for params in got:
            assert _max_diff(params[i], list(model.parameters())) <= 1e-6, name
        plain = _net(seed=7)
        plain_opt = cls(plain.parameters(), **kwargs)
        _load_into_plain(plain, plain_opt, _path(f"fresh-{name}"))
        assert dict(plain_opt.state) == {}, (name, plain_opt.state)
        _train(plain, plain_opt, range(SAVED_AT), 0, 1)
        assert _max_diff(list(plain.parameters()), list(model.parameters())) <= 1e-6, name


def _load_into_plain(model, opt, path):
    """The documented load of a checkpoint into a plain optimizer in one process."""
    sd = {"model": model.state_dict(),
          "optim": sharded_checkpoint.plain_optimizer_state_dict(model, opt)}
    dcp.load(sd, checkpoint_id=path)  # no process group: DCP reads in this process
    model.load_state_dict(sd["model"])
    sharded_checkpoint.load_plain_optimizer_state_dict(model, opt, sd["optim"])


def _same_state(ours, theirs, tol):
    """Both optimizers hold state for the same parameters (by position), with the same keys, and
    every value within `tol`; the largest difference."""
    ours_params = [p for g in ours.param_groups for p in g["params"]]
    theirs_params = [p for g in theirs.param_groups for p in g["params"]]
    worst = 0.0
    for i, (mine, reference) in enumerate(zip(ours_params, theirs_params)):
        a, b = ours.state.get(mine, {}), theirs.state.get(reference, {})
        where = f"parameter {i} (shape {tuple(mine.shape)})"
        assert (mine in ours.state) == (reference in theirs.state), (
            f"{where}: state here {a}, the reference's {b or 'none'}")
        assert sorted(a) == sorted(b), (where, sorted(a), sorted(b))
        for key in a:
            assert torch.isfinite(a[key]).all(), (where, key, "non-finite", a[key])
            assert a[key].shape == b[key].shape, (where, key)
            worst = max(worst, (a[key].double() - b[key].double()).abs().max().item())
    assert worst <= tol, worst
    return worst


def test_a_parameter_without_state_loads_into_a_plain_optimizer_without_state(env):
    """A plain optimizer's checkpoint (SGD with dampening) in which one parameter never had a
    gradient, loaded into a fresh plain optimizer: that parameter has no state (not the zeros
    the format carries for it), the others the saved state, and the steps after it are those of
    the saving optimizer going on (SGD with dampening starts a new buffer at the gradient)."""
    cls, kwargs = STATELESS["SGD"]
    model = _net()
    opt = cls(model.parameters(), **kwargs)
    scale = model[-1].scale
    scale.requires_grad_(False)  # no gradient, so no momentum buffer, before the save
    _train(model, opt, range(SAVED_AT), 0, 1)
    scale.requires_grad_(True)
    assert scale not in opt.state and len(opt.state) == len(list(model.parameters())) - 1
    dcp.save({"model": model.state_dict(),
              "optim": sharded_checkpoint.plain_optimizer_state_dict(model, opt)},
             checkpoint_id=_path("plain-without-state"))
    resumed = _net(seed=7)
    resumed_opt = cls(resumed.parameters(), **kwargs)
    _load_into_plain(resumed, resumed_opt, _path("plain-without-state"))
    _same_state(resumed_opt, opt, 0.0)
    _train(model, opt, range(SAVED_AT, STEPS), 0, 1)
    _train(resumed, resumed_opt, range(SAVED_AT, STEPS), 0, 1)
    assert _max_diff(list(resumed.parameters()), list(model.parameters())) == 0.0


def test_a_checkpoint_of_channels_last_parameters_loads_into_a_plain_optimizer(env):
    """A ShardedOptimizer's checkpoint over channels_last convolutions (state in their memory
    order) loaded into a plain AdamW in one process: its state is that of a plain AdamW trained
    on the same global batches in one process, element for element (no uninitialised or
    misplaced values), and so are the steps after it."""
    _run(check_save_channels_last, 2, env, {})
    model = _convs()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train_images(model, opt, range(SAVED_AT), 0, 1)
    resumed = _convs(seed=7)
    resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    _load_into_plain(resumed, resumed_opt, _path("channels-last"))
    assert resumed.convs[0].weight.is_contiguous(memory_format=torch.channels_last)
    _same_state(resumed_opt, opt, 1e-7)  # measured 2e-9 (moments about 1e-2)
    _train_images(model, opt, range(SAVED_AT, STEPS), 0, 1)
    _train_images(resumed, resumed_opt, range(SAVED_AT, STEPS), 0, 1)
    assert _max_diff(list(resumed.parameters()), list(model.parameters())) <= 1e-6


def test_a_resume_takes_the_checkpoints_hyperparameters_over_the_constructors(env):
    """Saved after lr and weight_decay were changed by hand, resumed into a ShardedOptimizer (and
    a plain AdamW in one process) constructed with others: both go on with the saved ones, as
    torch's AdamW constructed with the others and given the saved state_dict."""
    got = _run(check_resume_with_other_hyperparameters, 2, env, {})
    cls, kwargs = OPTIMIZERS["AdamW"]
    model = _net()
    opt = cls(model.parameters(), **kwargs)
    _train_changing_hyperparameters(model, opt, 0, 1)
    reference_opt = cls(model.parameters(), **dict(kwargs, **RESUMED_OPTIONS))
    reference_opt.load_state_dict(opt.state_dict())  # torch's own resume
    assert {k: reference_opt.param_groups[0][k] for k in SAVED_OPTIONS} == SAVED_OPTIONS
    plain = _net(seed=7)
    plain_opt = cls(plain.parameters(), **dict(kwargs, **RESUMED_OPTIONS))
    _load_into_plain(plain, plain_opt, _path("hyperparameters"))
    _train(model, reference_opt, range(SAVED_AT, STEPS), 0, 1)
    for resumed, params in got:
        assert resumed == SAVED_OPTIONS, resumed
        assert _max_diff(params, list(model.parameters())) <= 1e-6, _max_diff(
            params, list(model.parameters()))
    assert {k: plain_opt.param_groups[0][k] for k in SAVED_OPTIONS} == SAVED_OPTIONS
    _train(plain, plain_opt, range(SAVED_AT, STEPS), 0, 1)
    assert _max_diff(list(plain.parameters()), list(model.parameters())) <= 1e-6


def test_a_live_job_rolls_back_to_a_checkpoint_of_another_world_size(env):
    name = _saved(env, "AdamW", 2, 2, False)
    for params in _run(check_rollback, 3, env, {"from": name}):
        assert _max_diff(params, _reference("AdamW", False, False)) <= 1e-6

