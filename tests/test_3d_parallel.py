"""3-D parallel training: tensor x pipeline x data parallel on a 2 x 2 x 2
DeviceMesh ("pp", "dp", "tp") of 8 gloo ranks. Each pipeline stage is a small transformer block
(LayerNorm, causal self-attention with q/k/v ColwiseParallel and the output projection
RowwiseParallel, LayerNorm, MLP ColwiseParallel + RowwiseParallel), wrapped with
FusedReducer(block, device_mesh=mesh["dp"]) and driven by fused_reducer.pipelining.PipelineStage
under Schedule1F1B (4 microbatches). The parameters after each step match a float64
single-process model (the two blocks in sequence) trained on the global batch, with one reduction
of each bucket per step; the profile a stage exports records its local (TP) shard sizes and the
DP group's size, which the planner then plans for; autotune runs on such a stage.
"""
import json
import os

import torch
from torch import nn

from fused_reducer import FusedReducer
from dist_utils import SelectedChecks, per_rank

WORLD = 8
DIM = 8
HEADS = 2          # one per TP rank
TOKENS = 3
ROWS = 4           # sequences per DP rank and step
MICRO = 4
STEPS = 2
LR = 0.1
TOL = 2e-6

checks = SelectedChecks()


class Attention(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.head_dim = dim // HEADS
        self.q, self.k, self.v = (nn.Linear(dim, dim) for _ in range(3))
        self.o = nn.Linear(dim, dim)

    def forward(self, x):
        b, t, _ = x.shape
        # Under TP q/k/v hold this rank's heads: the head count follows from the local width.
        q, k, v = (f(x).view(b, t, -1, self.head_dim).transpose(1, 2)
                   for f in (self.q, self.k, self.v))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, dim=DIM):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim)
        self.norm2 = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.down(torch.relu(self.up(self.norm2(x))))


def _blocks(dtype=torch.float32, dim=DIM, n=2):
    torch.manual_seed(0)
    return [Block(dim).to(dtype) for _ in range(n)]


def _tp_plan():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    return {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "attn.o": RowwiseParallel(), "up": ColwiseParallel(), "down": RowwiseParallel()}


def _data(dp, step, dtype=torch.float32, dim=DIM):
    g = torch.Generator().manual_seed(100 * step + dp)
    return (torch.randn(ROWS, TOKENS, dim, generator=g).to(dtype),
            torch.randn(ROWS, TOKENS, dim, generator=g).to(dtype))


def _loss(out, target):
    return (out - target).pow(2).mean()


def _reference(steps, blocks=2, dp_size=2, dim=DIM):
    """float64, one process, the global batch (every DP rank's rows): parameters after each
    step, per block."""
    blocks = _blocks(torch.float64, dim, max(blocks, 2))[:blocks]
    model = nn.Sequential(*blocks)
    after = []
    for step in range(steps):
        xs, ys = zip(*(_data(d, step, torch.float64, dim) for d in range(dp_size)))
        model.zero_grad()
        _loss(model(torch.cat(xs)), torch.cat(ys)).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
        after.append([{n: p.detach().clone() for n, p in b.named_parameters()} for b in blocks])
    return after


def _full(t):
    from torch.distributed.tensor import DTensor
    return t.full_tensor() if isinstance(t, DTensor) else t


def _stage(mesh, **fr_kwargs):
    """This rank's stage: block `pp`, its attention and MLP split over mesh['tp'], in a
    FusedReducer over mesh['dp'], driven by fused_reducer.pipelining.PipelineStage."""
    from torch.distributed.tensor.parallel import parallelize_module
    from fused_reducer.pipelining import PipelineStage
    pp = mesh["pp"].get_local_rank()
    block = _blocks()[pp]
    parallelize_module(block, mesh["tp"], _tp_plan())
    model = FusedReducer(block, device_mesh=mesh["dp"], **fr_kwargs)
    # A microbatch's shape, given: torch's shape inference would run the TP forward on meta
    # tensors. requires_grad says which gradients cross the stages: the first stage's output's,
    # which the second stage sends back as the gradient of its input.
    example = torch.zeros(ROWS // MICRO, TOKENS, DIM)
    stage = PipelineStage(model, pp, 2, torch.device("cpu"),
                          input_args=(example.clone().requires_grad_(pp > 0),),
                          output_args=(example.clone().requires_grad_(),), group=mesh["pp"].get_group())
    return model, stage


def _train(mesh, model, stage, steps, on_step=None):
    from torch.distributed.pipelining import Schedule1F1B
    pp, dp = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    schedule = Schedule1F1B(stage, n_microbatches=MICRO, loss_fn=_loss)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    reference = _reference(steps)
    out = {"params": [], "reductions": [], "allreduces": []}
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        before = model.stats()
        x, y = _data(dp, step)
        schedule.step(x) if pp == 0 else schedule.step(target=y)
        after = model.stats()
        out["reductions"].append(after["step"] - before["step"])
        out["allreduces"].append(after["allreduces"])  # the last step's collectives
        opt.step()
        out["params"].append(max(
            float((_full(p).detach().double() - reference[step][pp][n]).abs().max())
            for n, p in model.module.named_parameters()))
        if on_step is not None:
            on_step(step)
    out["buckets"] = len(model.bucket_sizes())
    return out


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))


def check_1f1b_exact_and_profile(rank, world):
    import tempfile
    mesh = _mesh()
    model, stage = _stage(mesh, bucket_cap_mb=0.001, first_bucket_mb=0.001)
    out = _train(mesh, model, stage, STEPS + 1)
    # The profile of this stage (collective over its DP group): rank 0 of each DP group writes.
    os.environ["LOCAL_WORLD_SIZE"] = "8"  # as torchrun on one node: the DP group holds 2 of them
    with tempfile.TemporaryDirectory() as tmp:
        path = model.export_profile(os.path.join(tmp, "profile_{rank}.json"))  # every rank
        out["profile"] = json.load(open(path))
    out["local_bytes"] = {n: (p.to_local() if hasattr(p, "to_local") else p).numel() * 4
                          for n, p in model.module.named_parameters()}
    out["dp_size"] = mesh["dp"].size()
    return out


def check_zero_bubble_split_backward_of_tp_stages(rank, world):
    """ScheduleInterleavedZeroBubble (input and weight halves split) over 4 tensor-parallel
    blocks, two stages per pp rank (stages pp and pp + 2): every stage's DTensor parameters get
    their weight halves' gradients, reduced over the DP group once per step (Note [Split
    backward]); the parameters match the float64 model of the 4 blocks on the global batch and
    each param.grad is a DTensor with its parameter's placements."""
    from torch.distributed.pipelining import ScheduleInterleavedZeroBubble
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module
    from fused_reducer.pipelining import PipelineStage
    mesh = _mesh()
    pp, dp = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    blocks = _blocks(n=4)
    example = torch.zeros(ROWS // MICRO, TOKENS, DIM)
    models, stages = {}, []
    for s in (pp, pp + 2):
        parallelize_module(blocks[s], mesh["tp"], _tp_plan())
        models[s] = FusedReducer(blocks[s], device_mesh=mesh["dp"], bucket_cap_mb=0.001,
                                 first_bucket_mb=0.001)
        stages.append(PipelineStage(models[s], s, 4, torch.device("cpu"),
                                    input_args=(example.clone().requires_grad_(s > 0),),
                                    output_args=(example.clone().requires_grad_(),),
                                    group=mesh["pp"].get_group()))
    schedule = ScheduleInterleavedZeroBubble(stages, n_microbatches=MICRO, loss_fn=_loss)
    opt = torch.optim.SGD([p for m in models.values() for p in m.parameters()], lr=LR)
    reference = _reference(STEPS, blocks=4)
    out = {"params": [], "reductions": [], "allreduces": [], "grad_placements": True}
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        before = {s: m.stats()["step"] for s, m in models.items()}
        x, y = _data(dp, step)
        schedule.step(x) if pp == 0 else schedule.step(target=y)
        out["reductions"].append([m.stats()["step"] - before[s] for s, m in models.items()])
        out["allreduces"].append([m.stats()["allreduces"] for m in models.values()])
        out["grad_placements"] &= all(
            p.grad is not None and isinstance(p.grad, DTensor) == isinstance(p, DTensor) and
            (not isinstance(p, DTensor) or p.grad.placements == p.placements)
            for m in models.values() for p in m.module.parameters())
        opt.step()
        out["params"].append(max(
            float((_full(p).detach().double() - reference[step][s][n]).abs().max())
            for s, m in models.items() for n, p in m.module.named_parameters()))
    out["buckets"] = [len(m.bucket_sizes()) for m in models.values()]
    return out


AUTOTUNE_MIN_STEPS = 4
AUTOTUNE_ROUND_STEPS = 3
# Planning after AUTOTUNE_MIN_STEPS steps, then per trial one warm-up step and the measured ones;
# the step whose forward ends the last trial is the last.
AUTOTUNE_STEPS = AUTOTUNE_MIN_STEPS + 2 * (1 + AUTOTUNE_ROUND_STEPS) + 1


def check_autotune_on_a_stage(rank, world):
    """autotune() on a pipeline stage of the 3-D job: trials are measured per schedule step (the
    stage's forwards all run inside no_sync) and training stays exact. Medians on both sides of
    the predicted-vs-measured comparison, so that one slow step on a loaded machine moves
    neither: the prediction is anchored on the median of 3 step periods (4 steps before
    planning; the first, with the job's warm-up, is the slowest), each trial's step_ms is the
    median of 3 steps."""
    mesh = _mesh()
    model, stage = _stage(mesh)
    model.autotune(candidates=[(256, 256, 0), (1 << 20, 1 << 20, 0)],
                   round_steps=(AUTOTUNE_ROUND_STEPS,), min_steps=AUTOTUNE_MIN_STEPS)
    out = _train(mesh, model, stage, AUTOTUNE_STEPS)
    out["report"] = model.autotune_report()
    return out


def check_tp_dp_autotune_true(rank, world):
    """TP=2 x DP=4 (no pipeline), blocks of width 128 (0.38 MB of local gradients per rank, so
    that the tuner's grid has several layouts): FusedReducer(..., autotune=True) tunes on the DP
    group (its probe and trials over 4 ranks, the layouts of the local shards) while training
    stays exact; the profile then records the local shards and world size 4."""
    import tempfile
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"].get_local_rank()
    dim = 128
    block = _blocks(dim=dim)[0]
    parallelize_module(block, mesh["tp"], _tp_plan())
    model = FusedReducer(block, device_mesh=mesh["dp"], autotune=True)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    steps = 40
    reference = _reference(steps, blocks=1, dp_size=4, dim=dim)
    out = {"params": []}
    for step in range(steps):
        x, y = _data(dp, step, dim=dim)
        opt.zero_grad(set_to_none=True)
        _loss(model(x), y).backward()
        opt.step()
        out["params"].append(max(
            float((_full(p).detach().double() - reference[step][0][n]).abs().max())
            for n, p in block.named_parameters()))
    out["report"] = model.autotune_report()
    with tempfile.TemporaryDirectory() as tmp:
        out["profile"] = json.load(open(model.export_profile(os.path.join(tmp, "p{rank}.json"))))
    out["local_bytes"] = {n: (p.to_local() if hasattr(p, "to_local") else p).numel() * 4
                          for n, p in block.named_parameters()}
    return out


def check_example_runs(rank, world):
    """examples/train_3d.py's train() on these 8 ranks (its defaults: TP=2 x PP=2 x DP=2), tiny,
    under Schedule1F1B and (two stages per rank) ScheduleInterleavedZeroBubble."""
    import math
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                    "examples"))
    import train_3d
    runs = {}
    for schedule in ("1f1b", "zero-bubble"):
        out = train_3d.train(train_3d.parse_args(["--dim", "16", "--heads", "2", "--tokens", "4",
                                                  "--batch", "4", "--steps", "2",
                                                  "--schedule", schedule]))
        out["finite"] = all(math.isfinite(l) for l in out["losses"])
        runs[schedule] = out
    return runs


outcomes = checks.fixture(world_size=WORLD, timeout=240)


@checks.uses(check_1f1b_exact_and_profile)
def test_tp_pp_dp_1f1b_matches_float64_global_batch_with_one_reduction_per_bucket(outcomes):
    for r in per_rank(outcomes, "check_1f1b_exact_and_profile"):
        assert max(r["params"]) < TOL, r["params"]
        assert r["buckets"] > 1, r
        assert r["reductions"] == [1] * (STEPS + 1), r
        assert r["allreduces"] == [r["buckets"]] * (STEPS + 1), r


@checks.uses(check_1f1b_exact_and_profile)
def test_profile_of_a_stage_records_local_shards_and_the_dp_group_size(outcomes):
    from fused_reducer.tuning.plan import main as plan_main
    for r in per_rank(outcomes, "check_1f1b_exact_and_profile"):
        profile = r["profile"]
        assert profile["world_size"] == r["dp_size"] == 2, profile["world_size"]
        recorded = {p["name"]: p["bytes"] for p in profile["params"]}
        assert recorded == r["local_bytes"], (recorded, r["local_bytes"])
        # ColwiseParallel halves q's rows on each TP rank: 4 x 8 floats, not 8 x 8.
        assert recorded["attn.q.weight"] == DIM * DIM // 2 * 4
        assert profile["ranks_per_node"] == 2, profile["ranks_per_node"]
    import io
    import contextlib
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "p.json")
        json.dump(per_rank(outcomes, "check_1f1b_exact_and_profile")[0]["profile"], open(path, "w"))
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            assert plan_main([path, "--json", os.path.join(tmp, "plan.json")]) == 0
        plan = json.load(open(os.path.join(tmp, "plan.json")))
    assert [w["world_size"] for w in plan["worlds"]] == [2], printed.getvalue()


@checks.uses(check_zero_bubble_split_backward_of_tp_stages)
def test_tp_pp_dp_zero_bubble_split_backward_matches_float64_with_one_reduction_per_bucket(outcomes):
    for r in per_rank(outcomes, "check_zero_bubble_split_backward_of_tp_stages"):
        assert max(r["params"]) < TOL, r["params"]
        assert r["grad_placements"], r
        assert all(n > 1 for n in r["buckets"]), r
        assert r["reductions"] == [[1, 1]] * STEPS, r
        assert r["allreduces"] == [r["buckets"]] * STEPS, r


@checks.uses(check_autotune_on_a_stage)
def test_autotune_on_a_pipeline_stage_measures_and_stays_exact(outcomes):
    for r in per_rank(outcomes, "check_autotune_on_a_stage"):
        assert max(r["params"]) < TOL, r["params"]
        assert r["reductions"] == [1] * AUTOTUNE_STEPS, r
        assert r["report"]["done"], r["report"]
        assert len(r["report"]["trials"]) == 2, r["report"]
        # Predictions read like the measured schedule steps (the whole step, forward to
        # forward), not like the reduced last microbatch's backward alone (6x below them).
        for trial in r["report"]["trials"]:
            assert len(trial["samples_ms"]) == AUTOTUNE_ROUND_STEPS, trial
            assert 0.5 < trial["predicted_ms"] / trial["step_ms"] < 2, trial


@checks.uses(check_tp_dp_autotune_true)
def test_tp_dp_autotune_true_tunes_on_the_dp_group_and_stays_exact(outcomes):
    for r in per_rank(outcomes, "check_tp_dp_autotune_true"):
        assert max(r["params"]) < TOL, r["params"]
        assert r["report"]["done"] and r["report"]["choice"] is not None, r["report"]
        assert len(r["report"]["trials"]) > 1, r["report"]  # several layouts measured
        assert r["profile"]["world_size"] == 4, r["profile"]["world_size"]
        assert {p["name"]: p["bytes"] for p in r["profile"]["params"]} == r["local_bytes"]


@checks.uses(check_example_runs)
def test_the_3d_example_trains_with_one_all_reduce_per_bucket_and_step(outcomes):
    for schedule in ("1f1b", "zero-bubble"):
        results = [r[schedule] for r in per_rank(outcomes, "check_example_runs")]
        for r in results:
            assert r["allreduces"] == [r["buckets"]] * 2 and r["finite"], (schedule, r)
        # the ranks of the last stage (4), 2 steps
        assert sum(len(r["losses"]) for r in results) == 4 * 2, (schedule, results)
