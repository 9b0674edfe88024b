"""Hugging Face on FusedReducer, 2 CPU ranks: transformers' Trainer, then accelerate's custom loop,
each with its one-line switch. A tiny GPT-2 built from a config (nothing downloaded); ~20 s.

    python examples/hf_example.py                          # launches itself under torchrun
    torchrun --nproc-per-node 2 examples/hf_example.py     # the same
    accelerate launch --multi_gpu --num_processes 2 examples/hf_example.py   # accelerate's launcher
"""
import os
import sys
import tempfile

import torch
import transformers

from fused_reducer.accelerate import Accelerator          # was: from accelerate import Accelerator
from fused_reducer.transformers import FusedReducerTrainer  # was: from transformers import Trainer


def tiny_gpt2():
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32, bos_token_id=0,
        eos_token_id=0))


def data(n=128):
    g = torch.Generator().manual_seed(1)
    rows = torch.randint(0, 128, (n, 32), generator=g)
    return [{"input_ids": ids, "labels": ids} for ids in rows]


def with_trainer(outdir):
    args = transformers.TrainingArguments(
        output_dir=outdir, use_cpu=True, ddp_backend="gloo", per_device_train_batch_size=8,
        gradient_accumulation_steps=2, max_grad_norm=1.0, learning_rate=1e-3, max_steps=8,
        logging_steps=2, save_steps=4, report_to=[], disable_tqdm=True)
    trainer = FusedReducerTrainer(model=tiny_gpt2(), args=args, train_dataset=data(),
                                  fused_reducer_kwargs={"first_bucket_mb": 16})
    trainer.train()
    trainer.save_model(os.path.join(outdir, "final"))  # a plain transformers checkpoint
    return trainer.model_wrapped  # the FusedReducer


def with_accelerate():
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2,
                              fused_reducer_kwargs={"first_bucket_mb": 16})
    model = tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(data(), batch_size=8)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for step, batch in enumerate(loader):
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
        mean = accelerator.gather(loss.detach().reshape(1)).mean().item()
        accelerator.print(f"accelerate micro-batch {step}: loss averaged over ranks {mean:.4f}")
    return model


def main():
    torch.set_num_threads(1)
    rank0 = int(os.environ["RANK"]) == 0
    with tempfile.TemporaryDirectory() as outdir:
        reducer = with_trainer(outdir)
        if rank0:
            stats = reducer.stats()
            # The Trainer passes find_unused_parameters=True for transformers models (as to
            # DDP): one more small all-reduce per step, of the map of parameters used.
            print(f"Trainer: model_wrapped is {type(reducer).__name__} ({stats['transport']}), "
                  f"buckets {reducer.bucket_sizes()}, all-reduces in the last step "
                  f"{stats['allreduces']} "
                  f"(find_unused_parameters={reducer.find_unused_parameters})")
    reducer = with_accelerate()
    if rank0:
        print(f"accelerate: the prepared model is {type(reducer).__name__}, "
              f"buckets {reducer.bucket_sizes()}")


if __name__ == "__main__":
    if "RANK" in os.environ:
        main()
    else:  # plain `python examples/hf_example.py`: run under torchrun with 2 CPU ranks
        from torch.distributed.run import main as torchrun
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        torchrun(["--standalone", "--nproc-per-node", "2", os.path.abspath(__file__)])
        sys.exit(0)
