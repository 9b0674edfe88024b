"""3-D parallel training with FusedReducer as the data-parallel dimension: tensor parallel
(DTensor, parallelize_module) x pipeline parallel (torch.distributed.pipelining: Schedule1F1B, or
ScheduleInterleavedZeroBubble with two stages per rank) x data parallel (FusedReducer over
mesh["dp"]). Each pipeline stage is a small transformer block
(causal self-attention with q/k/v ColwiseParallel and the output RowwiseParallel, an MLP
ColwiseParallel + RowwiseParallel, two LayerNorms).

    torchrun --nproc-per-node 8 examples/train_3d.py                  # CPU, gloo: TP=2 x PP=2 x DP=2
    torchrun --nproc-per-node 8 examples/train_3d.py --device cuda    # one GPU per rank, NCCL
    torchrun --nproc-per-node 4 examples/train_3d.py --tp 2 --pp 2    # DP=1: no data parallelism
    torchrun --nproc-per-node 8 examples/train_3d.py --schedule zero-bubble  # split backward

World size = tp x pp x dp. Prints, on rank 0, the loss of each step, the bucket layout of its
stages and the reductions per step (one per bucket and step: each stage is driven by
fused_reducer.pipelining.PipelineStage). tests/test_3d_parallel.py checks this set-up against a
float64 single-process model.
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import Schedule1F1B, ScheduleInterleavedZeroBubble
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from fused_reducer import FusedReducer
from fused_reducer.pipelining import PipelineStage


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.head_dim = dim // heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.shape
        # Under TP q/k/v output this rank's heads only: -1 is the local head count.
        q, k, v = (f(x).view(b, t, -1, self.head_dim).transpose(1, 2)
                   for f in (self.q, self.k, self.v))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.down(torch.relu(self.up(self.norm2(x))))


TP_PLAN = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
           "attn.o": RowwiseParallel(), "up": ColwiseParallel(), "down": RowwiseParallel()}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8, help="sequences per DP rank and step")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--schedule", choices=("1f1b", "zero-bubble"), default="1f1b",
                        help="zero-bubble: ScheduleInterleavedZeroBubble, two stages (blocks) per "
                             "pp rank, each backward split into an input and a weight half")
    return parser.parse_args(argv)


def train(args):
    """The job, on every rank (the default process group, if not yet there, from torchrun's
    environment). Returns this rank's all-reduces per step and bucket count (its stages'
    together) and, on the rank of the last stage, the mean loss of each step."""
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ["WORLD_SIZE"])
    if world % (args.tp * args.pp):
        raise SystemExit(f"train_3d: world size {world} is not a multiple of tp x pp = "
                         f"{args.tp * args.pp}")
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    device = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" \
        else torch.device("cpu")
    dp = world // (args.tp * args.pp)

    # The mesh: TP innermost (fastest links), then DP, then PP.
    mesh = init_device_mesh(args.device, (args.pp, dp, args.tp), mesh_dim_names=("pp", "dp", "tp"))
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    per_rank = 2 if args.schedule == "zero-bubble" else 1
    n_stages = args.pp * per_rank
    micro = torch.zeros(args.batch // args.microbatches, args.tokens, args.dim, device=device)
    models, stages = [], []
    for stage_index in range(pp_rank, n_stages, args.pp):  # interleaved: pp_rank, pp_rank + pp
        torch.manual_seed(stage_index)  # the same initial block on every TP and DP rank
        block = Block(args.dim, args.heads).to(device)
        parallelize_module(block, mesh["tp"], TP_PLAN)
        models.append(FusedReducer(block, device_mesh=mesh["dp"]))
        stages.append(PipelineStage(models[-1], stage_index, n_stages, device,
                                    group=mesh["pp"].get_group(),
                                    input_args=(micro.clone().requires_grad_(stage_index > 0),),
                                    output_args=(micro.clone().requires_grad_(),)))
    losses = []
    loss_fn = lambda out, y: (out - y).pow(2).mean()  # noqa: E731
    schedule = (Schedule1F1B(stages[0], n_microbatches=args.microbatches, loss_fn=loss_fn)
                if per_rank == 1 else
                ScheduleInterleavedZeroBubble(stages, n_microbatches=args.microbatches,
                                              loss_fn=loss_fn))
    opt = torch.optim.AdamW([p for m in models for p in m.parameters()], lr=1e-3)  # DTensors

    out = {"allreduces": [], "losses": []}
    for step in range(args.steps):
        g = torch.Generator().manual_seed(1000 * step + dp_rank)  # this DP rank's rows
        x = torch.randn(args.batch, args.tokens, args.dim, generator=g).to(device)
        y = torch.randn(args.batch, args.tokens, args.dim, generator=g).to(device)
        opt.zero_grad(set_to_none=True)
        start = time.perf_counter()
        if pp_rank == 0:
            schedule.step(x)
        elif pp_rank == args.pp - 1:
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
        opt.step()
        ms = 1e3 * (time.perf_counter() - start)
        out["allreduces"].append(sum(m.stats()["allreduces"] for m in models))
        if pp_rank == args.pp - 1:
            out["losses"].append(sum(l.item() for l in losses[-args.microbatches:])
                                 / args.microbatches)
            if dp_rank == 0 and mesh["tp"].get_local_rank() == 0:
                print(f"step {step}: loss {out['losses'][-1]:.4f} (DP rank 0's rows), {ms:.1f} "
                      f"ms; this rank's {len(models)} stage(s): {out['allreduces'][-1]} "
                      f"all-reduces for {sum(len(m.bucket_sizes()) for m in models)} buckets",
                      flush=True)
    if dist.get_rank() == 0:
        print(f"mesh pp={args.pp} x dp={dp} x tp={args.tp}, {args.schedule}; stage 0 buckets "
              f"(bytes, local shards): {models[0].bucket_sizes()}", flush=True)
    out["buckets"] = sum(len(m.bucket_sizes()) for m in models)
    for model in models:
        model.close()
    return out


def main():
    train(parse_args())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
