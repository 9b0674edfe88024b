"""Hugging Face on FusedReducer: transformers' Trainer and accelerate's Accelerator,
each against the same run on DDP, on 2 CPU ranks (gloo) launched by torchrun and by
`accelerate launch`. Tiny GPT-2 and BERT built from configs (nothing downloaded); the runs are
tests/hf_worker.py (its docstring: 6 optimizer steps of 2 accumulated micro-batches,
max_grad_norm 0.5, evaluation and checkpoints every 3 steps).

Bit-identical at 2 ranks: FusedReducer averages as DDP does (each gradient scaled by 1/2 in its
bucket copy, then summed), so the parameters, every logged loss, gradient norm and eval loss are
DDP's to the bit. The one bound: with a ShardedOptimizer the gradient norm is summed over shards
(ShardedOptimizer.clip_grad_norm_), not per tensor as torch's clip_grad_norm_ does, so it agrees
with DDP's to 1e-6 relative (measured: up to 1.0e-7); the clipping there is kept inactive
(max_norm 1e9) so that the parameters can still be compared bit for bit (an active clip scales by the norm, and
AdamW amplifies a last-bit difference: 9e-3 after 6 steps, measured). Checked both through
accelerate's custom loop and through the Trainer's optimizer_cls_and_kwargs.
"""
import os
import signal
import subprocess
import sys

import pytest
import torch

from fused_reducer.testing.launch import reserved_port
from test_torchrun_restart import require_torchrun, worker_environment

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "hf_worker.py")
LAUNCH_TIMEOUT_S = 240  # a run takes 11-15 s here; the workers end themselves at 200 s
LOGGED = ("step", "epoch", "loss", "grad_norm", "learning_rate", "eval_loss", "train_loss")


class Runs:
    """Each named run launched once per test session, its per-rank results cached."""

    def __init__(self, outdir):
        self.outdir = str(outdir)
        self.results = {}

    def get(self, name, mode, *options, launcher="torchrun"):
        if name not in self.results:
            launch(self.outdir, launcher, [mode, self.outdir, name, *options])
            self.results[name] = [torch.load(os.path.join(self.outdir, f"{name}_rank{r}.pt"),
                                             weights_only=False) for r in range(2)]
        return self.results[name]


def launch(outdir, launcher, worker_args):
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2"]
    else:  # accelerate's torchrun-based launcher; the worker asks for the CPU (cpu=True/use_cpu)
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
               "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
               "--dynamo_backend", "no", "--main_process_port"]
    # The port stays reserved until the run has ended (fused_reducer.testing.launch).
    with reserved_port() as port:
        if launcher != "torchrun":
            cmd.append(str(port))
        proc = subprocess.Popen(cmd + [WORKER] + worker_args, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=worker_environment(),
                                cwd=outdir, start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)  # torchrun stops its workers on SIGTERM
            try:
                output, _ = proc.communicate(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                output, _ = proc.communicate()
            pytest.fail(f"{' '.join(worker_args)} did not finish in {LAUNCH_TIMEOUT_S} s:\n"
                        f"{output[-6000:]}")
    assert proc.returncode == 0, f"{' '.join(worker_args)} failed:\n{output[-8000:]}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    require_torchrun()
    return Runs(tmp_path_factory.mktemp("hf"))


def assert_same_parameters(ours, theirs, what):
    assert sorted(ours) == sorted(theirs), what
    different = {k: (ours[k] - theirs[k]).abs().max().item() for k in ours
                 if not torch.equal(ours[k], theirs[k])}
    assert not different, f"{what}: parameters differ (max abs difference per tensor): {different}"


def logged(run):
    """Every logged number of a Trainer run but timings."""
    return [{k: v for k, v in entry.items() if k in LOGGED} for entry in run["log"]]


def check_trainer_pair(fused, ddp, trainer_name, find_unused_parameters=True):
    for rank in range(2):
        assert fused[rank]["wrapped"] == "FusedReducer"  # trainer.model_wrapped
        assert fused[rank]["trainer"] == trainer_name
        assert fused[rank]["accelerator"] == "fused_reducer.accelerate"
        assert ddp[rank]["wrapped"] == "DistributedDataParallel"
        # The Trainer's default for a PreTrainedModel (False with gradient checkpointing),
        # passed on as to DDP.
        assert fused[rank]["find_unused_parameters"] is find_unused_parameters
        assert_same_parameters(fused[rank]["params"], ddp[rank]["params"], f"rank {rank}")
        assert logged(fused[rank]) == logged(ddp[rank])
        # save_model wrote a plain transformers checkpoint (no `module.` keys) of these weights.
        assert_same_parameters(fused[rank]["reloaded"], fused[rank]["params"], "save_model")
    assert_same_parameters(fused[0]["params"], fused[1]["params"], "rank 0 vs rank 1")
    steps = [e["step"] for e in fused[0]["log"] if "loss" in e]
    evals = [e["step"] for e in fused[0]["log"] if "eval_loss" in e]
    assert steps == [1, 2, 3, 4, 5, 6] and evals == [3, 6]
    # max_grad_norm=0.5 clipped (a norm above it was logged), so the clip path was exercised.
    assert any(e.get("grad_norm", 0) > 0.5 for e in fused[0]["log"]), fused[0]["log"]


@pytest.mark.timeout(300)
def test_trainer_gpt2_on_fused_reducer_equals_ddp_bit_for_bit(runs):
    ddp = runs.get("trainer_gpt2_ddp", "trainer", "--model", "gpt2", "--wrapper", "ddp")
    fused = runs.get("trainer_gpt2_fused", "trainer", "--model", "gpt2", "--wrapper", "fused")
    check_trainer_pair(fused, ddp, "FusedReducerTrainer")


@pytest.mark.timeout(300)
def test_trainer_resumed_from_a_mid_run_checkpoint_equals_the_uninterrupted_run(runs):
    full = runs.get("trainer_gpt2_fused", "trainer", "--model", "gpt2", "--wrapper", "fused")
    checkpoint = os.path.join(runs.outdir, "trainer_gpt2_fused_checkpoints", "checkpoint-3")
    resumed = runs.get("trainer_gpt2_resumed", "trainer", "--model", "gpt2", "--wrapper", "fused",
                       "--resume", checkpoint)
    for rank in range(2):
        assert resumed[rank]["wrapped"] == "FusedReducer"
        assert_same_parameters(resumed[rank]["params"], full[rank]["params"], f"rank {rank}")
        # Steps 4-6 were computed by the resumed run (1-3 come from the checkpoint's state);
        # the closing train_loss averages the steps of one run, so it differs by design.
        def per_step(run):
            return [e for e in logged(run) if "train_loss" not in e]
        assert per_step(resumed[rank]) == per_step(full[rank])


@pytest.mark.timeout(300)
def test_with_fused_reducer_trains_a_trainer_subclass_bert_equal_to_ddp(runs):
    # With gradient checkpointing: the Trainer's other DDP set-up (find_unused_parameters=False).
    checkpointing = ("--training-args", '{"gradient_checkpointing": true}')
    ddp = runs.get("trainer_bert_ddp", "trainer", "--model", "bert", "--wrapper", "ddp",
                   *checkpointing)
    fused = runs.get("trainer_bert_fused", "trainer", "--model", "bert", "--wrapper", "fused",
                     *checkpointing)
    check_trainer_pair(fused, ddp, "FusedReducerLoggingTrainer", find_unused_parameters=False)
    # The subclass's own compute_loss ran, on the FusedReducer (as the plain one's on DDP).
    assert fused[0]["model_types"] == ["BertForSequenceClassification", "FusedReducer"]
    assert ddp[0]["model_types"] == ["BertForSequenceClassification", "DistributedDataParallel"]


@pytest.mark.timeout(400)
def test_trainer_with_a_sharded_optimizer_equals_ddp_and_resumes(runs):
    # optimizer_cls_and_kwargs=(ShardedOptimizer, {"optimizer_class": AdamW, ...}) against DDP
    # with (AdamW, ...). Clipping inactive (max_grad_norm 1e9), see the module docstring.
    unclipped = ("--training-args", '{"max_grad_norm": 1e9}')
    ddp = runs.get("trainer_adamw_ddp", "trainer", "--wrapper", "ddp", "--optimizer", "adamw",
                   *unclipped)
    sharded = runs.get("trainer_sharded", "trainer", "--wrapper", "fused", "--optimizer",
                       "sharded", *unclipped)
    checkpoint = os.path.join(runs.outdir, "trainer_sharded_checkpoints", "checkpoint-3")
    resumed = runs.get("trainer_sharded_resumed", "trainer", "--wrapper", "fused", "--optimizer",
                       "sharded", *unclipped, "--resume", checkpoint)
    for rank in range(2):
        assert sharded[rank]["optimizer"] == "ShardedOptimizer"
        assert ddp[rank]["optimizer"] == "AdamW"
        assert sharded[rank]["wrapped"] == "FusedReducer"
        assert_same_parameters(sharded[rank]["params"], ddp[rank]["params"], f"rank {rank}")
        ours, theirs = logged(sharded[rank]), logged(ddp[rank])
        norms = [e["grad_norm"] for e in ours if "grad_norm" in e]
        assert len(norms) == 6 and norms == pytest.approx(
            [e["grad_norm"] for e in theirs if "grad_norm" in e], rel=1e-6, abs=0)  # all shards
        assert ([{k: v for k, v in e.items() if k != "grad_norm"} for e in ours]
                == [{k: v for k, v in e.items() if k != "grad_norm"} for e in theirs])
        # The checkpoint holds the optimizer state every rank contributed (saved by rank 0).
        assert_same_parameters(resumed[rank]["params"], sharded[rank]["params"], "resumed")


def check_accelerate_pair(ours, ddp, wrapped, norm_rtol=0.0):
    for rank in range(2):
        assert ours[rank]["wrapped"] == wrapped
        assert ddp[rank]["wrapped"] == "DistributedDataParallel"
        assert ours[rank]["distributed_type"] == "DistributedType.MULTI_CPU"
        assert ours[rank]["unwrapped"] == "GPT2LMHeadModel"  # accelerator.unwrap_model
        # get_state_dict: the unwrapped model's keys, bit-identical to DDP's run.
        assert_same_parameters(ours[rank]["params"], ddp[rank]["params"], f"rank {rank}")
        assert ours[rank]["losses"] == ddp[rank]["losses"]  # accelerator.gather, every micro-batch
        assert len(ours[rank]["norms"]) == 6
        assert ours[rank]["norms"] == pytest.approx(ddp[rank]["norms"], rel=norm_rtol, abs=0)


@pytest.mark.timeout(300)
def test_accelerate_custom_loop_on_fused_reducer_equals_ddp_bit_for_bit(runs):
    ddp = runs.get("accelerate_ddp", "accelerate", "--wrapper", "ddp")
    fused = runs.get("accelerate_fused", "accelerate", "--wrapper", "fused")
    check_accelerate_pair(fused, ddp, "FusedReducer")
    assert min(fused[0]["norms"]) > 0.5  # max_norm 0.5: every step was clipped
    # mixed_precision="bf16" reached the wrapped model: its head ran under bf16 autocast.
    assert fused[0]["logits_dtypes"] == ddp[0]["logits_dtypes"] == ["torch.bfloat16"], (
        fused[0]["logits_dtypes"], ddp[0]["logits_dtypes"])


@pytest.mark.timeout(300)
def test_accelerate_load_state_resumes_exactly_where_save_state_left(runs):
    full = runs.get("accelerate_fused", "accelerate", "--wrapper", "fused")
    state = os.path.join(runs.outdir, "accelerate_fused_state")
    resumed = runs.get("accelerate_fused_resumed", "accelerate", "--wrapper", "fused",
                       "--resume", state)
    for rank in range(2):
        assert_same_parameters(resumed[rank]["params"], full[rank]["params"], f"rank {rank}")
        assert resumed[rank]["norms"] == full[rank]["norms"][3:]
        assert resumed[rank]["losses"] == full[rank]["losses"][6:]


@pytest.mark.timeout(400)
def test_accelerate_with_a_sharded_optimizer_clips_by_the_global_norm_and_resumes(runs):
    unclipped = ("--max-norm", "1e9")
    ddp = runs.get("accelerate_ddp_unclipped", "accelerate", "--wrapper", "ddp", *unclipped)
    sharded = runs.get("accelerate_sharded", "accelerate", "--wrapper", "sharded", *unclipped)
    # The norm accelerator.clip_grad_norm_ returns is over all shards: a rank's own shard alone
    # would be ~1/sqrt(2) of it, far outside this bound.
    check_accelerate_pair(sharded, ddp, "FusedReducer", norm_rtol=1e-6)
    state = os.path.join(runs.outdir, "accelerate_sharded_state")
    resumed = runs.get("accelerate_sharded_resumed", "accelerate", "--wrapper", "sharded",
                       *unclipped, "--resume", state)
    for rank in range(2):  # save_state/load_state of the ShardedOptimizer's (collective) state
        assert_same_parameters(resumed[rank]["params"], sharded[rank]["params"], f"rank {rank}")


@pytest.mark.timeout(400)
def test_accelerate_launch_runs_trainer_and_custom_loop_on_fused_reducer(runs):
    loop = runs.get("accelerate_launch_loop", "accelerate", "--wrapper", "fused",
                    launcher="accelerate")
    check_accelerate_pair(loop, runs.get("accelerate_ddp", "accelerate", "--wrapper", "ddp"),
                          "FusedReducer")
    trainer = runs.get("accelerate_launch_trainer", "trainer", "--model", "gpt2", "--wrapper",
                       "fused", launcher="accelerate")
    check_trainer_pair(trainer, runs.get("trainer_gpt2_ddp", "trainer", "--model", "gpt2",
                                         "--wrapper", "ddp"), "FusedReducerTrainer")


@pytest.mark.timeout(300)
def test_accelerate_ddp_kwargs_comm_hook_and_trigger_sync_on_fused_reducer(runs):
    checks = runs.get("checks", "checks")
    for rank in range(2):
        out = checks[rank]
        # DistributedDataParallelKwargs reach FusedReducer; fused_reducer_kwargs win.
        assert out["from_ddp"] == {"bucket_cap_bytes": 10 << 20, "backend": "shm",
                                   "find_unused_parameters": True,
                                   "gradient_as_bucket_view": True, "forward_sync_buffers": False}
        assert out["ours_win"] == dict(out["from_ddp"], bucket_cap_bytes=20 << 20,
                                       backend="process_group")
        assert out["kept_users_reducer"] is True
        assert "static_graph=True is not supported" in out["static_graph"]
        assert "DistributedDataParallelKwargs" in out["static_graph"]
        # accelerate's comm_hook=FP16 registered on FusedReducer, reducing as on DDP.
        assert out["fused_hook"] is True
        assert_same_parameters(out["fused_hook_grads"], out["ddp_hook_grads"], "fp16 hook")
        # trigger_sync_in_backward after two forwards under no_sync: the second backward syncs.
        assert_same_parameters(out["fused_trigger_grads"], out["ddp_trigger_grads"], "trigger")
        assert out["fused_unwrapped"] == out["ddp_unwrapped"] == "GPT2LMHeadModel"
        assert out["fused_state_keys"] == out["ddp_state_keys"]
        assert not any(k.startswith("module.") for k in out["fused_state_keys"])
    assert_same_parameters(checks[0]["fused_trigger_grads"], checks[1]["fused_trigger_grads"],
                           "rank 0 vs rank 1")


@pytest.mark.timeout(300)
def test_the_hugging_face_example_runs_on_fused_reducer(tmp_path):
    require_torchrun()
    example = os.path.join(os.path.dirname(HERE), "examples", "hf_example.py")
    proc = subprocess.run([sys.executable, example], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, env=worker_environment(),
                          cwd=tmp_path, timeout=LAUNCH_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-6000:]
    assert "Trainer: model_wrapped is FusedReducer (shm)" in proc.stdout
    assert "accelerate: the prepared model is FusedReducer" in proc.stdout


def optimizer_checkpoint(runs, name, step):
    return torch.load(os.path.join(runs.outdir, f"{name}_checkpoints", f"checkpoint-{step}",
                                   "optimizer.pt"), weights_only=False)


@pytest.mark.timeout(400)
def test_trainer_checkpoints_of_a_sharded_optimizer_hold_ddps_full_adamw_state_at_that_step(runs):
    # The same runs as test_trainer_with_a_sharded_optimizer_equals_ddp_and_resumes (cached).
    unclipped = ("--training-args", '{"max_grad_norm": 1e9}')
    runs.get("trainer_adamw_ddp", "trainer", "--wrapper", "ddp", "--optimizer", "adamw",
             *unclipped)
    sharded = runs.get("trainer_sharded", "trainer", "--wrapper", "fused", "--optimizer",
                       "sharded", *unclipped)
    assert sharded[0]["optimizer"] == "ShardedOptimizer"
    for step in (3, 6):  # each checkpoint: the state of its own step, not an earlier one
        ours = optimizer_checkpoint(runs, "trainer_sharded", step)
        theirs = optimizer_checkpoint(runs, "trainer_adamw_ddp", step)
        # The plain AdamW format of every parameter (all ranks' shards), DDP's to the bit.
        assert ours["param_groups"] == theirs["param_groups"], step
        indices = sorted(i for g in theirs["param_groups"] for i in g["params"])
        assert sorted(ours["state"]) == sorted(theirs["state"]) == indices, step
        assert len(indices) == 28  # GPT-2's parameters (its head is tied to the embedding)
        for index, state in theirs["state"].items():
            assert sorted(ours["state"][index]) == sorted(state), (step, index)
            for key, value in state.items():
                assert torch.equal(ours["state"][index][key], value), (step, index, key)
                assert ours["state"][index][key].shape == value.shape
        assert all(s["step"].item() == step for s in ours["state"].values()), step
    # Resumed from checkpoint-3: steps 4-6 log what the uninterrupted run logged, and the
    # checkpoint it writes at step 6 holds the uninterrupted run's state.
    checkpoint = os.path.join(runs.outdir, "trainer_sharded_checkpoints", "checkpoint-3")
    resumed = runs.get("trainer_sharded_resumed", "trainer", "--wrapper", "fused", "--optimizer",
                       "sharded", *unclipped, "--resume", checkpoint)
    for rank in range(2):
        def per_step(run):
            return [e for e in logged(run) if "train_loss" not in e]
        assert per_step(resumed[rank]) == per_step(sharded[rank])
    again = optimizer_checkpoint(runs, "trainer_sharded_resumed", 6)
    final = optimizer_checkpoint(runs, "trainer_sharded", 6)
    assert sorted(again["state"]) == sorted(final["state"])
    for index, state in final["state"].items():
        for key, value in state.items():
            assert torch.equal(again["state"][index][key], value), (index, key)
