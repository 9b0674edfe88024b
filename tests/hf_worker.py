"""Worker of tests/test_hf.py: one training run on 2 CPU ranks (gloo), launched by torchrun or
`accelerate launch`, writing what the test compares into OUTDIR/<name>_rank<r>.pt.

    torchrun --standalone --nproc-per-node 2 tests/hf_worker.py trainer OUTDIR NAME \\
        --model gpt2 --wrapper fused [--resume CHECKPOINT]
    torchrun ... tests/hf_worker.py accelerate OUTDIR NAME --wrapper ddp [--resume STATE_DIR]

trainer: transformers' Trainer (wrapper ddp) or FusedReducerTrainer / with_fused_reducer(a
Trainer subclass) (wrapper fused) on a tiny GPT-2 or BERT built from a config (no download),
gradient accumulation 2, max_grad_norm, evaluation and a checkpoint every 3 steps, 6 steps.
accelerate: accelerate's custom loop (prepare(model, optimizer, dataloader), accumulate,
clip_grad_norm_, gather, save_state after 3 optimizer steps / load_state), bf16 autocast on CPU,
with accelerate.Accelerator (ddp) or fused_reducer.accelerate.Accelerator (fused; sharded: with
a ShardedOptimizer, whose norm accelerator.clip_grad_norm_ must take over all shards).
"""
import argparse
import faulthandler
import json
import os
import sys

import torch

STEPS = 6          # optimizer steps
SAVE_EVERY = 3     # checkpoint (Trainer) / save_state (accelerate) after this many steps
ACCUMULATE = 2
BATCH = 4          # per rank and micro-batch
SEQ = 16
VOCAB = 64
LIFE_S = 200       # a worker ends itself after this (stacks on stderr): never outlives its test


def tiny_model(kind, dropout=0.1):
    import transformers
    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB,
                                         n_positions=SEQ, bos_token_id=0, eos_token_id=0,
                                         resid_pdrop=dropout, embd_pdrop=dropout,
                                         attn_pdrop=dropout)
        return transformers.GPT2LMHeadModel(config)
    config = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, vocab_size=VOCAB,
                                     max_position_embeddings=SEQ, num_labels=3)
    return transformers.BertForSequenceClassification(config)


def dataset(kind, n, seed):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=g)
        label = ids.clone() if kind == "gpt2" else torch.randint(0, 3, (), generator=g)
        rows.append({"input_ids": ids, "labels": label})
    return rows


def run_trainer(args, rank):
    import transformers
    from fused_reducer.transformers import FusedReducerTrainer, with_fused_reducer

    class LoggingTrainer(transformers.Trainer):
        """A Trainer subclass (as TRL's are), to be wrapped by with_fused_reducer."""

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            self.model_types = getattr(self, "model_types", set()) | {type(model).__name__}
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    if args.wrapper == "ddp":
        trainer_class, extra = LoggingTrainer, {}
    elif args.model == "gpt2":
        trainer_class, extra = FusedReducerTrainer, {"fused_reducer_kwargs": {"first_bucket_mb": 1}}
    else:
        trainer_class, extra = with_fused_reducer(LoggingTrainer), {}
    settings = dict(
        output_dir=os.path.join(args.outdir, f"{args.name}_checkpoints"), use_cpu=True,
        ddp_backend="gloo", per_device_train_batch_size=BATCH, per_device_eval_batch_size=BATCH,
        gradient_accumulation_steps=ACCUMULATE, max_grad_norm=0.5, learning_rate=3e-3,
        max_steps=STEPS, logging_steps=1, eval_strategy="steps", eval_steps=SAVE_EVERY,
        save_strategy="steps", save_steps=SAVE_EVERY, seed=7, report_to=[],
        disable_tqdm=True, dataloader_num_workers=0, label_smoothing_factor=0.1)
    training = transformers.TrainingArguments(**{**settings, **json.loads(args.training_args)})
    if args.optimizer == "adamw":
        extra["optimizer_cls_and_kwargs"] = (torch.optim.AdamW, {"lr": 3e-3})
    elif args.optimizer == "sharded":
        import fused_reducer
        extra["optimizer_cls_and_kwargs"] = (fused_reducer.ShardedOptimizer,
                                             {"optimizer_class": torch.optim.AdamW, "lr": 3e-3})
    trainer = trainer_class(model=tiny_model(args.model), args=training,
                            train_dataset=dataset(args.model, 64, 1),
                            eval_dataset=dataset(args.model, 16, 2), **extra)
    trainer.train(resume_from_checkpoint=args.resume)
    final = os.path.join(args.outdir, f"{args.name}_final")
    trainer.save_model(final)
    trainer.accelerator.wait_for_everyone()
    reloaded = type(trainer.model).from_pretrained(final)
    return {
        "params": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
        "reloaded": {k: v.detach().clone() for k, v in reloaded.state_dict().items()},
        "log": [entry for entry in trainer.state.log_history],
        "wrapped": type(trainer.model_wrapped).__name__,
        "trainer": type(trainer).__name__,
        "accelerator": type(trainer.accelerator).__module__,
        "model_types": sorted(getattr(trainer, "model_types", ())),
        "find_unused_parameters": getattr(trainer.model_wrapped, "find_unused_parameters", None),
        "optimizer": type(trainer.optimizer.optimizer).__name__,
    }


def run_accelerate(args, rank):
    from torch.utils.data import DataLoader
    if args.wrapper == "ddp":
        from accelerate import Accelerator
        extra = {}
    else:
        from fused_reducer.accelerate import Accelerator
        extra = {"fused_reducer_kwargs": {"first_bucket_mb": 1}}
    from accelerate.utils import set_seed
    accelerator = Accelerator(cpu=True, mixed_precision="bf16",
                              gradient_accumulation_steps=ACCUMULATE, **extra)
    set_seed(7)
    # No dropout here: a DataLoader iterator draws its base seed from the global RNG, so after
    # load_state (which restores that RNG) the resumed loop's first iterator shifts the dropout
    # masks: a resumed run differs from the uninterrupted one by 1e-2 under DDP too (measured).
    # The Trainer restores its RNG after creating the iterator, so it keeps dropout.
    model = tiny_model("gpt2", dropout=0.0)
    loader = DataLoader(dataset("gpt2", 96, 1), batch_size=BATCH, shuffle=False)
    if args.wrapper == "sharded":  # the optimizer needs the prepared model (the FusedReducer)
        import fused_reducer
        model = accelerator.prepare(model)
        optimizer = fused_reducer.ShardedOptimizer(model, torch.optim.AdamW, lr=3e-3)
        optimizer, loader = accelerator.prepare(optimizer, loader)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses, norms, steps, logits_dtypes = [], [], 0, set()
    # The head's own output (transformers then upcasts the logits to float32): bf16 when
    # accelerate's CPU autocast reached the wrapped model's forward.
    head = accelerator.unwrap_model(model).lm_head
    head.register_forward_hook(lambda module, inputs, out: logits_dtypes.add(str(out.dtype)))
    if args.resume:
        accelerator.load_state(args.resume)
        steps = SAVE_EVERY
        loader = accelerator.skip_first_batches(loader, SAVE_EVERY * ACCUMULATE)
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norms.append(accelerator.clip_grad_norm_(model.parameters(), args.max_norm).item())
            optimizer.step()
            optimizer.zero_grad()
        losses.append(accelerator.gather(loss.detach().reshape(1)).tolist())
        if accelerator.sync_gradients:
            steps += 1
            if steps == SAVE_EVERY and not args.resume:
                accelerator.save_state(os.path.join(args.outdir, f"{args.name}_state"))
            if steps == STEPS:
                break
    unwrapped = accelerator.unwrap_model(model)
    return {
        "params": {k: v.detach().clone() for k, v in accelerator.get_state_dict(model).items()},
        "losses": losses, "norms": norms, "logits_dtypes": sorted(logits_dtypes),
        "wrapped": type(model).__name__, "unwrapped": type(unwrapped).__name__,
        "distributed_type": str(accelerator.distributed_type),
    }


def run_checks(args, rank):
    """What accelerate does around DDP, on FusedReducer and on DDP side by side (one process)."""
    import accelerate
    from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    import fused_reducer
    from fused_reducer.accelerate import Accelerator

    def handler(**kwargs):
        return [DistributedDataParallelKwargs(**kwargs)]

    def batch(seed):
        row = dataset("gpt2", 1, 10 * seed + rank)[0]
        return {k: v.unsqueeze(0).repeat(2, 1) for k, v in row.items()}

    out = {}
    # DistributedDataParallelKwargs become FusedReducer's arguments; fused_reducer_kwargs win.
    given = dict(bucket_cap_mb=10, find_unused_parameters=True, gradient_as_bucket_view=True,
                 broadcast_buffers=False)
    ours_win = {"bucket_cap_mb": 20, "backend": "process_group"}
    for name, ours in (("from_ddp", {}), ("ours_win", ours_win)):
        model = Accelerator(cpu=True, kwargs_handlers=handler(**given),
                            fused_reducer_kwargs=ours).prepare(tiny_model("gpt2"))
        out[name] = {"bucket_cap_bytes": model.bucket_cap_bytes, "backend": model.backend,
                     "find_unused_parameters": model.find_unused_parameters,
                     "gradient_as_bucket_view": model.gradient_as_bucket_view,
                     "forward_sync_buffers": model.forward_sync_buffers}
        model.close()
    # A model the user wrapped already is kept as it is, not wrapped twice.
    mine = fused_reducer.FusedReducer(tiny_model("gpt2"), first_bucket_mb=2)
    out["kept_users_reducer"] = Accelerator(cpu=True).prepare(mine) is mine
    mine.close()
    # A DDP argument FusedReducer refuses raises at prepare(), naming it.
    try:
        refusing = Accelerator(cpu=True, kwargs_handlers=handler(static_graph=True))
        refusing.prepare(tiny_model("gpt2"))
        out["static_graph"] = "accepted"
    except fused_reducer.FusedReducerError as e:
        out["static_graph"] = str(e)

    def grads(acc, model):
        return {n: p.grad.clone() for n, p in acc.unwrap_model(model).named_parameters()
                if p.grad is not None}

    # accelerate's comm hook (fp16 compression) on FusedReducer, against DDP with the same hook;
    # trigger_sync_in_backward after two forwards under no_sync, against DDP.
    for wrapper, cls in (("ddp", accelerate.Accelerator), ("fused", Accelerator)):
        acc = cls(cpu=True, kwargs_handlers=handler(comm_hook=DDPCommunicationHookType.FP16))
        model = acc.prepare(tiny_model("gpt2", dropout=0.0))
        if wrapper == "fused":
            out["fused_hook"] = model._comm_hook[1] is default_hooks.fp16_compress_hook
        acc.backward(model(**batch(1)).loss)
        out[f"{wrapper}_hook_grads"] = grads(acc, model)
        model.zero_grad(set_to_none=True)
        with acc.no_sync(model):
            loss_a = model(**batch(2)).loss
            loss_b = model(**batch(3)).loss
        acc.backward(loss_a)
        with acc.trigger_sync_in_backward(model):
            acc.backward(loss_b)
        out[f"{wrapper}_trigger_grads"] = grads(acc, model)
        out[f"{wrapper}_unwrapped"] = type(acc.unwrap_model(model)).__name__
        out[f"{wrapper}_state_keys"] = sorted(acc.get_state_dict(model))
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("trainer", "accelerate", "checks"))
    parser.add_argument("outdir")
    parser.add_argument("name")
    parser.add_argument("--model", default="gpt2", choices=("gpt2", "bert"))
    parser.add_argument("--wrapper", default="fused", choices=("ddp", "fused", "sharded"))
    parser.add_argument("--resume", default=None)
    parser.add_argument("--max-norm", type=float, default=0.5)
    parser.add_argument("--training-args", default="{}", help="more TrainingArguments (JSON)")
    parser.add_argument("--optimizer", default="trainer", choices=("trainer", "adamw", "sharded"),
                        help="trainer: the Trainer's own (args.optim); adamw / sharded: "
                             "optimizer_cls_and_kwargs with torch.optim.AdamW / ShardedOptimizer")
    args = parser.parse_args()
    faulthandler.dump_traceback_later(LIFE_S, exit=True)
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    run = {"trainer": run_trainer, "accelerate": run_accelerate, "checks": run_checks}[args.mode]
    result = run(args, rank)
    torch.save(result, os.path.join(args.outdir, f"{args.name}_rank{rank}.pt"))
    torch.distributed.barrier()  # both results written before either rank ends its group
    torch.distributed.destroy_process_group()
    if args.wrapper == "ddp":
        # The DDP reference's exit is not under test, and upstream it can abort: a gloo work of
        # DDP's last backward released on gloo's thread while Python shuts down (Note
        # [Releasing process-group work]; FusedReducer's own exits are, in tests/test_lifecycle.py).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
