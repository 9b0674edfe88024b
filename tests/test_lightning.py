"""fused_reducer.lightning.FusedReducerStrategy trains like Lightning's strategy="ddp".

One launch of 2 CPU ranks (gloo) runs every scenario: this file re-runs itself as the worker
under `python -m torch.distributed.run --nproc-per-node 2` (Lightning's own launcher would re-run
pytest; under torchrun Lightning sees a TorchElastic environment and launches nothing). Each
scenario is a Trainer.fit of a tiny model with BatchNorm (so buffers travel too) on fixed data
that differs per rank; every rank saves its results and each test checks its own scenario:
parameters equal to strategy="ddp"'s after the same steps, checkpoint save and resume
(ModelCheckpoint, both strategies), gradient accumulation through FusedReducer.no_sync, manual
optimization with two backward passes per step, DDP comm hooks passed to the strategy, and
bucket limits changed from a callback. About 20-30 s on 2 cores.
"""
import importlib
import importlib.util
import os
import signal
import subprocess
import sys
import time
import traceback
from contextlib import contextmanager

import pytest

TOL = 1e-5
STEPS = 6               # 2 epochs of 3 batches per rank
BATCHES_PER_EPOCH = 3
LAUNCH_TIMEOUT_S = 240  # the whole launch; a hang fails the tests instead of the suite

def _installed(name):
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # ValueError: sys.modules[name] is None
        return False


_HAVE_LIGHTNING = _installed("pytorch_lightning") or _installed("lightning")


# -- the launch (pytest side) ------------------------------------------------------------------

@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    if not _installed("pytorch_lightning"):
        pytest.importorskip("lightning.pytorch", reason="Lightning is not installed "
                            "(pip install fused_reducer[lightning])")
    import torch
    from fused_reducer.testing.launch import reserved_port
    out_dir = tmp_path_factory.mktemp("lightning")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               PL_DISABLE_FORK="1", FUSED_REDUCER_TEST_OUT=str(out_dir))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", None, __file__]
    start = time.monotonic()
    # The port stays reserved until the run has ended (fused_reducer.testing.launch).
    with reserved_port() as port:
        cmd[cmd.index(None)] = str(port)
        proc = subprocess.Popen(cmd, env=env, cwd=str(out_dir), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            log, _ = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # torchrun and both ranks
            log, _ = proc.communicate()
            pytest.fail(f"the 2-rank Lightning run did not finish within {LAUNCH_TIMEOUT_S}s "
                        f"(hang?); its output:\n{log[-6000:]}")
    elapsed = time.monotonic() - start
    results = []
    for rank in range(2):
        path = out_dir / f"rank{rank}.pt"
        if not path.exists():
            pytest.fail(f"rank {rank} wrote no results (exit code {proc.returncode}); "
                        f"output:\n{log[-6000:]}")
        results.append(torch.load(path, weights_only=False))
    print(f"2-rank Lightning run: {elapsed:.1f}s")
    return results


def _ok(outcomes, scenario):
    """The results of `scenario` on every rank; fails the test with a rank's error otherwise."""
    out = []
    for rank, results in enumerate(outcomes):
        status, payload = results[scenario]
        assert status == "ok", f"rank {rank}, scenario {scenario}:\n{payload}"
        out.append(payload)
    return out


def _assert_same_params(got, want, what):
    import torch
    assert got.keys() == want.keys(), what
    for key in want:
        if want[key].is_floating_point():
            diff = (got[key] - want[key]).abs().max().item()
            assert diff <= TOL, f"{what}: {key} differs by {diff}"
        else:
            assert torch.equal(got[key], want[key]), f"{what}: {key}"


needs_lightning = pytest.mark.skipif(not _HAVE_LIGHTNING, reason="Lightning is not installed")


# -- the tests ---------------------------------------------------------------------------------

@needs_lightning
def test_trains_like_strategy_ddp(outcomes):
    ddp = _ok(outcomes, "ddp")
    fused = _ok(outcomes, "fused")
    for rank in range(2):
        _assert_same_params(fused[rank]["params"], ddp[rank]["params"],
                            f"rank {rank}: FusedReducerStrategy vs strategy='ddp'")
        _assert_same_params(fused[rank]["params"], fused[0]["params"], f"rank {rank} vs rank 0")
        steps = fused[rank]["steps"]
        assert len(steps) == STEPS
        for s in steps:  # the strategy's model is the reducer, built with the given kwargs
            assert s["model"] == "FusedReducer"
            assert s["first_bucket_bytes"] == 16 << 20
            assert s["bucket_cap_bytes"] == 1 << 20
            assert s["last_bucket_bytes"] == 0
        assert [s["synced_steps"] for s in steps] == list(range(1, STEPS + 1))
        assert fused[rank]["model_after_fit"] == "lightning_module"  # unwrapped at teardown
        assert ddp[rank]["steps"][0]["model"] == "DistributedDataParallel"


@needs_lightning
def test_runtime_tuning_from_a_callback(outcomes):
    ddp = _ok(outcomes, "ddp")
    tuned = _ok(outcomes, "tuned")
    for rank in range(2):
        steps = tuned[rank]["steps"]
        before, after = steps[1], steps[-1]  # the callback sets the limits before the 3rd step
        assert before["first_bucket_bytes"] == 16 << 20 and len(before["bucket_sizes"]) == 1
        assert after["first_bucket_bytes"] == 1024 and after["bucket_cap_bytes"] == 2048
        assert len(after["bucket_sizes"]) > 1, after["bucket_sizes"]
        assert sum(after["bucket_sizes"]) == sum(before["bucket_sizes"])
        assert after["bucket_sizes"] == tuned[0]["steps"][-1]["bucket_sizes"]  # same on all ranks
        # Gradients stay exact while the layout changes.
        _assert_same_params(tuned[rank]["params"], ddp[rank]["params"],
                            f"rank {rank}: tuned FusedReducerStrategy vs strategy='ddp'")


@needs_lightning
def test_checkpoint_save_and_resume(outcomes):
    ddp = _ok(outcomes, "ddp")
    fused = _ok(outcomes, "fused")
    resumed = _ok(outcomes, "fused_resumed")
    ddp_resumed = _ok(outcomes, "ddp_resumed_from_fused_checkpoint")
    assert fused[0]["checkpoints"] == [f"fused-step={STEPS // 2}.ckpt", f"fused-step={STEPS}.ckpt"]
    # The checkpoint holds the LightningModule's state (keys as without a wrapper), saved by rank 0.
    _assert_same_params(fused[0]["final_checkpoint"], fused[0]["params"], "checkpoint after fit")
    for rank in range(2):
        assert resumed[rank]["steps"][0]["global_step"] == STEPS // 2 + 1  # resumed, not restarted
        assert len(resumed[rank]["steps"]) == STEPS // 2
        _assert_same_params(resumed[rank]["params"], ddp[rank]["params"],
                            f"rank {rank}: saved after {STEPS // 2} steps, resumed to {STEPS}")
        _assert_same_params(ddp_resumed[rank]["params"], ddp[rank]["params"],
                            f"rank {rank}: strategy='ddp' resumed from a FusedReducerStrategy checkpoint")


@needs_lightning
def test_gradient_accumulation_uses_no_sync(outcomes):
    ddp = _ok(outcomes, "ddp_accumulate")
    fused = _ok(outcomes, "fused_accumulate")
    for rank in range(2):
        _assert_same_params(fused[rank]["params"], ddp[rank]["params"],
                            f"rank {rank}: accumulate_grad_batches=2")
        # Reductions happen only at the optimizer steps; the other backward passes ran inside
        # FusedReducer.no_sync(). Epochs have 3 batches and Lightning also steps at an epoch's
        # last batch: batches 1-2 | 3 (end of epoch 1) | 4-5 -> 3 optimizer steps.
        steps = fused[rank]["steps"]
        assert [s["syncing_in_backward"] for s in steps] == [False, True, True, False, True]
        assert [s["synced_steps"] for s in steps] == [0, 1, 2, 2, 3]


@needs_lightning
def test_manual_optimization_two_backward_passes_per_step(outcomes):
    """Every manual_backward of a training_step is reduced (DDPStrategy: prepare_for_backward
    before each; FusedReducerStrategy re-arms the reducer), so the ranks stay identical."""
    ddp = _ok(outcomes, "ddp_manual")
    fused = _ok(outcomes, "fused_manual")
    for rank in range(2):
        # Parameters only: under manual optimization DDPStrategy stops DDP's buffer broadcast
        # after the first step (see docs/LIGHTNING.md); FusedReducer broadcasts every step.
        weights = {k: v for k, v in fused[rank]["params"].items() if "running" not in k}
        _assert_same_params(weights, {k: ddp[rank]["params"][k] for k in weights},
                            f"rank {rank}: manual optimization, 2 optimizers")
        _assert_same_params(weights, {k: fused[0]["params"][k] for k in weights},
                            f"rank {rank} vs rank 0, manual optimization")
        assert fused[rank]["steps"][-1]["synced_steps"] == 4  # 2 batches x 2 backward passes


@needs_lightning
def test_ddp_comm_hook_arguments(outcomes):
    """DDPStrategy's ddp_comm_hook / ddp_comm_wrapper go to FusedReducer.register_comm_hook (on
    CPU too): fp16 compression leaves its rounding in the result, and nothing more."""
    ddp = _ok(outcomes, "ddp")
    hooked = _ok(outcomes, "fused_comm_hook")
    for rank in range(2):
        diff = max((hooked[rank]["params"][k] - ddp[rank]["params"][k]).abs().max().item()
                   for k in ddp[rank]["params"] if ddp[rank]["params"][k].is_floating_point())
        assert 0 < diff <= 1e-3, diff
        _assert_same_params(hooked[rank]["params"], hooked[0]["params"], f"rank {rank} vs rank 0")


@needs_lightning
def test_strategy_registry_and_arguments(outcomes):
    registry = _ok(outcomes, "registry")[0]
    assert registry["by_name"] == ("FusedReducerStrategy", True, {})
    assert registry["find_unused_by_name"] == {"find_unused_parameters": True}
    assert registry["kwargs"] == {"first_bucket_mb": 16, "last_bucket_mb": 1, "autotune": False}
    assert registry["backend"] == "gloo" and registry["reducer_before_fit"] is None
    assert "first_bucket_mbb" in registry["unknown_kwarg"]
    assert "device_ids" in registry["ddp_only_kwarg"]


def test_import_error_names_the_extra(monkeypatch):
    """Without Lightning, importing the module raises an ImportError naming the extra."""
    for name in ("pytorch_lightning", "lightning", "lightning.pytorch"):
        monkeypatch.setitem(sys.modules, name, None)  # `import name` now raises ImportError
    monkeypatch.delitem(sys.modules, "fused_reducer.lightning", raising=False)
    with pytest.raises(ImportError) as error:
        importlib.import_module("fused_reducer.lightning")
    assert "pip install fused_reducer[lightning]" in str(error.value)
    assert "pytorch-lightning" in str(error.value)


# -- the worker (each of the 2 ranks, under torchrun) -----------------------------------------

def _worker():
    import warnings
    warnings.filterwarnings("ignore")
    import logging
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    torch.set_num_threads(1)
    from fused_reducer import FusedReducer
    from fused_reducer.lightning import FusedReducerStrategy, LIGHTNING_PACKAGE
    pl = importlib.import_module(LIGHTNING_PACKAGE)

    rank = int(os.environ["RANK"])
    out_dir = os.environ["FUSED_REDUCER_TEST_OUT"]
    world = 2
    gen = torch.Generator().manual_seed(1)
    n = world * BATCHES_PER_EPOCH * 4  # batch size 4 per rank
    x, y = torch.randn(n, 8, generator=gen), torch.randn(n, 4, generator=gen)
    xv, yv = torch.randn(8, 8, generator=gen), torch.randn(8, 4, generator=gen)

    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(),
                                     nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
            self.syncing_in_backward = None

        def forward(self, inputs):
            return self.net(inputs)

        def training_step(self, batch, batch_idx):
            inputs, targets = batch
            return nn.functional.mse_loss(self(inputs), targets)

        def on_before_backward(self, loss):
            # Whether this backward runs inside FusedReducer.no_sync() (spied on by Recorder).
            if isinstance(self.trainer.strategy.model, FusedReducer):
                self.syncing_in_backward = not no_sync_entered[0]

        def validation_step(self, batch, batch_idx):
            inputs, targets = batch
            self.log("val_loss", nn.functional.mse_loss(self(inputs), targets), sync_dist=True)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

        def train_dataloader(self):
            return DataLoader(TensorDataset(x, y), batch_size=4)

        def val_dataloader(self):
            return DataLoader(TensorDataset(xv, yv), batch_size=4)

    no_sync_entered = [False]

    class TwoOptimizers(Net):
        """Manual optimization with two backward passes per training_step (as a GAN's)."""

        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            inputs, targets = batch
            for scale, optimizer in enumerate(self.optimizers(), start=1):
                optimizer.zero_grad()
                self.manual_backward(scale * nn.functional.mse_loss(self(inputs), targets))
                optimizer.step()

        def configure_optimizers(self):
            return [torch.optim.SGD(self.net[:3].parameters(), lr=0.05),
                    torch.optim.SGD(self.net[3:].parameters(), lr=0.05, momentum=0.9)]

    class Recorder(pl.Callback):
        """What the strategy's model is and does after every training batch; spies on the
        reducer's no_sync() to see which backward passes Lightning runs inside it."""

        def __init__(self):
            self.steps = []

        def on_train_start(self, trainer, pl_module):
            model = trainer.strategy.model
            if isinstance(model, FusedReducer):
                real_no_sync = model.no_sync

                @contextmanager
                def spy_no_sync():
                    with real_no_sync():
                        no_sync_entered[0] = True
                        try:
                            yield
                        finally:
                            no_sync_entered[0] = False

                model.no_sync = spy_no_sync

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            model = trainer.strategy.model
            record = {"model": type(model).__name__, "global_step": trainer.global_step,
                      "syncing_in_backward": pl_module.syncing_in_backward}
            if isinstance(model, FusedReducer):
                assert trainer.strategy.reducer is model
                record.update(first_bucket_bytes=model.first_bucket_bytes,
                              bucket_cap_bytes=model.bucket_cap_bytes,
                              last_bucket_bytes=model.last_bucket_bytes,
                              bucket_sizes=model.bucket_sizes(),
                              synced_steps=model.stats()["step"])
            self.steps.append(record)

    class Tune(pl.Callback):
        """Runtime tuning as a user writes it: new bucket limits before the 3rd step."""

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 2:
                trainer.strategy.model.first_bucket_bytes = 1024
                trainer.strategy.model.bucket_cap_bytes = 2048

    def fit(strategy, max_steps, callbacks=(), ckpt_path=None, accumulate=1, perturb=False,
            model=Net):
        pl.seed_everything(0, verbose=False)  # also seeds Lightning's DistributedSampler
        module = model()
        if perturb:  # a different start: only the checkpoint can make the result match
            with torch.no_grad():
                for tensor in module.state_dict().values():
                    if tensor.is_floating_point():
                        tensor.add_(0.5)
        recorder = Recorder()
        checkpointing = any(isinstance(c, pl.callbacks.ModelCheckpoint) for c in callbacks)
        trainer = pl.Trainer(
            strategy=strategy, accelerator="cpu", devices=2, max_steps=max_steps,
            accumulate_grad_batches=accumulate, callbacks=[recorder, *callbacks], logger=False,
            enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=checkpointing,
            num_sanity_val_steps=0, limit_val_batches=1, use_distributed_sampler=True)
        trainer.fit(module, ckpt_path=ckpt_path)
        return {"params": {k: v.detach().clone() for k, v in module.state_dict().items()},
                "steps": recorder.steps,
                "model_after_fit": ("lightning_module" if trainer.strategy.model is module
                                    else type(trainer.strategy.model).__name__)}

    checkpoint_dir = os.path.join(out_dir, "checkpoints")
    half = os.path.join(checkpoint_dir, f"fused-step={STEPS // 2}.ckpt")

    def fused():
        # Lightning's ModelCheckpoint saves after steps 3 and 6 (the standard way to checkpoint).
        saver = pl.callbacks.ModelCheckpoint(dirpath=checkpoint_dir, filename="fused-{step}",
                                             every_n_train_steps=STEPS // 2, save_top_k=-1)
        strategy = FusedReducerStrategy(first_bucket_mb=16, bucket_cap_mb=1, last_bucket_mb=None,
                                        broadcast_buffers=True, find_unused_parameters=False)
        result = fit(strategy, STEPS, callbacks=[saver])
        result["checkpoints"] = sorted(os.listdir(checkpoint_dir))
        final = torch.load(os.path.join(checkpoint_dir, f"fused-step={STEPS}.ckpt"),
                           weights_only=False)
        result["final_checkpoint"] = final["state_dict"]
        return result

    def fused_resumed():
        # From a different start: only the checkpoint can make the result match.
        return fit(FusedReducerStrategy(first_bucket_mb=16), STEPS, ckpt_path=half, perturb=True)

    def registry():
        common = dict(accelerator="cpu", devices=2, logger=False, enable_progress_bar=False,
                      enable_model_summary=False)
        by_name = pl.Trainer(strategy="fused_reducer", **common).strategy
        out = {"by_name": (type(by_name).__name__,
                           isinstance(by_name, pl.strategies.DDPStrategy)
                           and isinstance(by_name, FusedReducerStrategy), by_name.reducer_kwargs)}
        out["find_unused_by_name"] = pl.Trainer(
            strategy="fused_reducer_find_unused_parameters_true", **common).strategy.reducer_kwargs
        strategy = FusedReducerStrategy(first_bucket_mb=16, last_bucket_mb=1, autotune=False,
                                        process_group_backend="gloo")
        out.update(kwargs=strategy.reducer_kwargs, backend=strategy.process_group_backend,
                   reducer_before_fit=strategy.reducer)
        for key, kwargs in (("unknown_kwarg", {"first_bucket_mbb": 16}),
                            ("ddp_only_kwarg", {"device_ids": [0]})):
            try:
                FusedReducerStrategy(**kwargs)
                out[key] = "no error"
            except TypeError as e:
                out[key] = str(e)
        return out

    scenarios = {
        "registry": registry,
        "ddp": lambda: fit("ddp", STEPS),
        "fused": fused,
        "tuned": lambda: fit(FusedReducerStrategy(first_bucket_mb=16), STEPS, callbacks=[Tune()]),
        "fused_resumed": fused_resumed,
        "ddp_resumed_from_fused_checkpoint": lambda: fit("ddp", STEPS, ckpt_path=half,
                                                         perturb=True),
        "fused_comm_hook": lambda: fit(FusedReducerStrategy(
            first_bucket_mb=16, ddp_comm_hook=default_hooks.allreduce_hook,
            ddp_comm_wrapper=default_hooks.fp16_compress_wrapper), STEPS),
        # Each training_step steps 2 optimizers: 4 steps = 2 batches.
        "ddp_manual": lambda: fit("ddp", 4, model=TwoOptimizers),
        "fused_manual": lambda: fit(FusedReducerStrategy(first_bucket_mb=16), 4,
                                    model=TwoOptimizers),
        "ddp_accumulate": lambda: fit("ddp", STEPS // 2, accumulate=2),
        "fused_accumulate": lambda: fit(FusedReducerStrategy(first_bucket_mb=16), STEPS // 2,
                                        accumulate=2),
    }
    results = {}
    for name, scenario in scenarios.items():
        try:
            results[name] = ("ok", scenario())
        except Exception as e:  # noqa: BLE001 - each scenario's error goes back to its test
            results[name] = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        if dist.is_initialized():
            dist.barrier()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


if __name__ == "__main__":
    _worker()
