"""fused_reducer.accelerate / fused_reducer.transformers in one process: what they
refuse, and the version checks of what they rely on beyond accelerate's and transformers'
public API. The 2-rank training runs against DDP are in tests/test_hf.py."""
import pytest
import torch
from torch import nn

accelerate = pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

import fused_reducer  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from accelerate.utils import DistributedDataParallelKwargs, DistributedType  # noqa: E402
from fused_reducer.accelerate import TESTED_ACCELERATE, Accelerator  # noqa: E402
from fused_reducer.transformers import (TESTED_TRANSFORMERS, FusedReducerTrainer,  # noqa: E402
                                        with_fused_reducer)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """accelerate keeps its state in process-wide singletons: none survives a test."""
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def tiny_gpt2():
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def training_args(tmp_path):
    return transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[],
                                          max_steps=1, disable_tqdm=True)


def test_unknown_fused_reducer_kwargs_are_refused_naming_them():
    with pytest.raises(TypeError, match=r"'first_bucket'.*first_bucket_mb"):
        Accelerator(fused_reducer_kwargs={"first_bucket": 16})
    with pytest.raises(TypeError, match=r"FusedReducerTrainer: fused_reducer_kwargs has 'bogus'"):
        FusedReducerTrainer(model=tiny_gpt2(), fused_reducer_kwargs={"bogus": 1})


def test_a_sharded_optimizer_through_the_trainer_needs_optimizer_class_not_a_ready_one(tmp_path):
    with pytest.raises(TypeError, match=r"needs kwargs\['optimizer_class'\]"):
        FusedReducerTrainer(model=tiny_gpt2(), args=training_args(tmp_path),
                            optimizer_cls_and_kwargs=(fused_reducer.ShardedOptimizer, {"lr": 1.0}))
    ready_made = fused_reducer.ShardedOptimizer.__new__(fused_reducer.ShardedOptimizer)
    with pytest.raises(TypeError, match=r"ready-made ShardedOptimizer.*optimizer_cls_and_kwargs"):
        FusedReducerTrainer(model=tiny_gpt2(), args=training_args(tmp_path),
                            optimizers=(ready_made, None))


def test_with_fused_reducer_subclasses_any_trainer_subclass(tmp_path):
    class MyTrainer(transformers.Trainer):
        pass

    wrapped = with_fused_reducer(MyTrainer)
    assert issubclass(wrapped, MyTrainer) and wrapped.__name__ == "FusedReducerMyTrainer"
    assert with_fused_reducer(wrapped) is wrapped
    assert issubclass(FusedReducerTrainer, transformers.Trainer)
    trainer = wrapped(model=tiny_gpt2(), args=training_args(tmp_path))
    assert isinstance(trainer.accelerator, Accelerator)
    with pytest.raises(TypeError, match="expected transformers.Trainer"):
        with_fused_reducer(nn.Module)


def test_a_trainer_that_builds_its_accelerator_another_way_fails_naming_both_versions(
        tmp_path, monkeypatch):
    def expected(message):
        return (f"transformers {transformers.__version__} does not do (tested with "
                f"transformers {TESTED_TRANSFORMERS})") in message

    other = type("Other", (accelerate.Accelerator,), {})
    monkeypatch.setattr(transformers.trainer, "Accelerator", other)
    with pytest.raises(RuntimeError) as raised:
        FusedReducerTrainer(model=tiny_gpt2(), args=training_args(tmp_path))
    assert expected(str(raised.value)), raised.value
    monkeypatch.undo()

    class OwnAccelerator(transformers.Trainer):  # e.g. a trainer library building its own
        def create_accelerator_and_postprocess(self):
            self.accelerator = accelerate.Accelerator(cpu=True)

    with pytest.raises(RuntimeError) as raised:
        with_fused_reducer(OwnAccelerator)(model=tiny_gpt2(), args=training_args(tmp_path))
    assert expected(str(raised.value)), raised.value


def test_an_accelerate_without_what_it_relies_on_fails_naming_both_versions(monkeypatch):
    monkeypatch.delattr(DistributedDataParallelKwargs, "register_comm_hook")
    with pytest.raises(RuntimeError, match=(
            rf"register_comm_hook\(\), which the installed accelerate {accelerate.__version__} "
            rf"does not have \(tested with accelerate {TESTED_ACCELERATE}\)")):
        Accelerator(cpu=True)


@pytest.mark.parametrize("kind", [DistributedType.FSDP, DistributedType.DEEPSPEED])
def test_setups_without_ddp_are_refused_rather_than_run_without_fused_reducer(kind, monkeypatch):
    monkeypatch.setattr(accelerate.Accelerator, "distributed_type", property(lambda self: kind))
    with pytest.raises(ValueError, match=r"does not use under \w+; use accelerate.Accelerator"):
        Accelerator(cpu=True)


def test_one_process_has_no_ddp_to_replace():
    model = nn.Linear(2, 2)
    assert Accelerator(cpu=True).prepare(model) is model  # as accelerate: no wrapper at all
