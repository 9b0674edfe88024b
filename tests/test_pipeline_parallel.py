"""Pipeline parallel x data parallel: torch.distributed.pipelining's schedules
driving stages whose modules are FusedReducers over the DP group, through
fused_reducer.pipelining.PipelineStage (torch's constructor arguments), on a 2 x 2 DeviceMesh
("pp", "dp") of 4 gloo ranks. GPipe, 1F1B and Interleaved1F1B (two stages per rank) train exactly as
a float64 single-process model on the global batch, with one reduction of each bucket per
schedule step (and ScheduleLoopedBFS); so do the schedules that split the backward (ScheduleInterleavedZeroBubble,
ScheduleZBVZeroBubble, ScheduleDualPipeV; Note [Split backward]), whose reduction overlaps the
last weight half (with tensor-parallel stages: tests/test_3d_parallel.py).
"""
import pytest
import torch
from torch import nn

from fused_reducer import FusedReducer, FusedReducerError
from dist_utils import SelectedChecks, per_rank

WORLD = 4
MICRO = 4
ROWS = 8      # rows per DP rank and step
STEPS = 2
LR = 0.1
TOL = 2e-6
# From the float64 reference: gradients reduced in bf16 (measured 8e-5; not dividing by the
# microbatches: 2e-2); bf16 parameters (two bf16 ulps below 0.5; measured 1.7e-3, not dividing:
# 2e-2)
TOL_BF16_REDUCTION = 5e-4
TOL_BF16_PARAMS = 2 * 2.0 ** -9
WIDTH = 8

checks = SelectedChecks()


def _layers(dtype=torch.float32, n=4):
    torch.manual_seed(0)
    return nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(n)).to(dtype)


def _data(dp, step, dtype=torch.float32):
    g = torch.Generator().manual_seed(100 * step + dp)
    return torch.randn(ROWS, WIDTH, generator=g).to(dtype), torch.randn(ROWS, WIDTH, generator=g).to(dtype)


def _loss(out, target):
    return (out - target).pow(2).mean()


class _Twice(nn.Module):
    """Its layers applied twice (one weight used at two places of the graph: a split backward's
    parameter group with two intermediates)."""

    def __init__(self, *layers):
        super().__init__()
        self.layers = nn.Sequential(*layers)

    def forward(self, x):
        return self.layers(self.layers(x))


def _reference(steps, twice=False, n_layers=4):
    layers = _layers(torch.float64, n_layers)
    model = nn.Sequential(*(_Twice(layer) if twice else layer for layer in layers))
    for step in range(steps):
        xs, ys = zip(*(_data(d, step, torch.float64) for d in range(2)))
        model.zero_grad()
        _loss(model(torch.cat(xs)), torch.cat(ys)).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
    return [[p.detach().clone() for p in layer.parameters()] for layer in layers]


def _run(schedule_name, stages_per_rank=1, v_shape=False, twice=False, sharded=False,
         n_layers=4, dtype=torch.float32, master_dtype=None, **fr_kwargs):
    """`sharded`: each stage's parameters stepped by a ShardedOptimizer (SGD, `master_dtype`) over
    the DP group, else one plain SGD. `dtype`: the parameters' and the data's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed import pipelining
    from fused_reducer.pipelining import PipelineStage
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    n_stages = 2 * stages_per_rank
    layers = _layers(dtype, n=n_layers)
    per_stage = n_layers // n_stages
    # stage s on pp rank s % 2; V-shaped (ZBV): rank 0 holds stages 0 and 3, rank 1 1 and 2
    indices = ([pp, 3 - pp] if v_shape else [pp + 2 * i for i in range(stages_per_rank)])
    models, stages = [], []
    for s in indices:
        module = nn.Sequential(*((_Twice(layer) if twice else layer)
                                 for layer in layers[s * per_stage:(s + 1) * per_stage]))
        model = FusedReducer(module, device_mesh=mesh["dp"], **fr_kwargs)
        models.append((s, model))
        stages.append(PipelineStage(model, s, n_stages, torch.device("cpu"),
                                    group=mesh["pp"].get_group()))
    schedule_cls = getattr(pipelining, schedule_name)
    schedule = schedule_cls(stages if stages_per_rank > 1 else stages[0], n_microbatches=MICRO,
                            loss_fn=_loss)
    if sharded:
        from fused_reducer import ShardedOptimizer
        opts = [ShardedOptimizer(m, torch.optim.SGD, lr=LR, master_dtype=master_dtype)
                for _, m in models]
    else:
        opts = [torch.optim.SGD([p for _, m in models for p in m.parameters()], lr=LR)]
    out = {"reductions": [], "allreduces": [], "buckets": [len(m.bucket_sizes()) for _, m in models]}
    for step in range(STEPS):
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        before = [m.stats()["step"] for _, m in models]
        x, y = _data(dp, step, dtype)
        first, last = 0 in indices, n_stages - 1 in indices
        kwargs = {}
        if last:
            kwargs["target"] = y
        schedule.step(x, **kwargs) if first else schedule.step(**kwargs)
        out["reductions"].append([m.stats()["step"] - b for (_, m), b in zip(models, before)])
        out["allreduces"].append([m.stats()["allreduces"] for _, m in models])
        for opt in opts:
            opt.step()
    reference = _reference(STEPS, twice, n_layers)
    out["params"] = max(
        float((p.detach().double() - r).abs().max())
        for s, m in models
        for layer, ref_layer in zip(m.module, reference[s * per_stage:(s + 1) * per_stage])
        for p, r in zip(layer.parameters(), ref_layer))
    return out


def check_gpipe(rank, world):
    return _run("ScheduleGPipe", bucket_cap_mb=0.0002, first_bucket_mb=0.0002)


def check_1f1b(rank, world):
    return _run("Schedule1F1B")


def check_interleaved_1f1b(rank, world):
    return _run("ScheduleInterleaved1F1B", stages_per_rank=2)


def check_looped_bfs(rank, world):
    return _run("ScheduleLoopedBFS", stages_per_rank=2)


def check_reduction_overlaps_the_last_backward(rank, world):
    """One 1F1B step under torch.profiler, 2 buckets per stage: where the all-reduces start
    (ALLREDUCE_EVENTS, not FusedReducer's stats) against the moments each microbatch's backward
    accumulates the stage's first layer's weight gradient (its last gradient, a marker recorded
    by a plain post-accumulate-grad hook)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import Schedule1F1B
    from fused_reducer.pipelining import PipelineStage
    from dist_utils import ALLREDUCE_EVENTS
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    module = nn.Sequential(*_layers()[2 * pp:2 * pp + 2])
    model = FusedReducer(module, device_mesh=mesh["dp"], bucket_cap_mb=0.0002,
                         first_bucket_mb=0.0002)
    stage = PipelineStage(model, pp, 2, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = Schedule1F1B(stage, n_microbatches=MICRO, loss_fn=_loss)

    def marker(_):
        with torch.profiler.record_function("first_layer_weight_grad"):
            pass
    module[0][0].weight.register_post_accumulate_grad_hook(marker)

    def step(k):
        x, y = _data(dp, k)
        model.zero_grad(set_to_none=True)
        schedule.step(x) if pp == 0 else schedule.step(target=y)
    step(0)  # shape inference and the first layout
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step(1)
    events = prof.events()
    starts = sorted(e.time_range.start for e in events if e.name in ALLREDUCE_EVENTS)
    marks = sorted(e.time_range.start for e in events if e.name == "first_layer_weight_grad")
    last = model.step_history()[-1]
    return {"allreduces": len(starts), "buckets": len(model.bucket_sizes()), "marks": len(marks),
            "after_the_previous_backward": bool(starts) and starts[0] > marks[-2],
            "before_the_last_gradient": bool(starts) and starts[0] < marks[-1],
            # the reducer's own telemetry says the same: the first bucket launched in backward
            "telemetry": last["buckets"][0]["launch_us"] < last["backward_end_us"]}


def check_interleaved_zero_bubble(rank, world):
    return _run("ScheduleInterleavedZeroBubble", stages_per_rank=2, bucket_cap_mb=0.00002,
                first_bucket_mb=0.00002)  # 2 buckets per one-layer stage


def check_zbv_zero_bubble(rank, world):
    return _run("ScheduleZBVZeroBubble", stages_per_rank=2, v_shape=True, bucket_cap_mb=0.00002,
                first_bucket_mb=0.00002)


def check_zero_bubble_reduction_overlaps_the_last_weight_half(rank, world):
    """One ScheduleInterleavedZeroBubble step under torch.profiler, two layers per stage (two
    parameter groups in each weight half), 4 buckets per stage. Each stage marks when its layers' weight-gradient nodes run (a
    node pre-hook on the Linear's backward, which runs in the input half and again in the weight
    half); the step's last weight half of a stage is the window from the last run of its last
    layer's node to the last run of its first layer's. Some all-reduce (ALLREDUCE_EVENTS, not
    FusedReducer's stats) must start inside that window: after the last layer's weight gradients
    are in, while the first layer's are still to be computed (stage 0, on pp rank 0, runs full
    backwards, where the window holds too). Torch's own path (gradients added by hand, the groups
    in forward order) leaves every reduction for after the last weight half."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import ScheduleInterleavedZeroBubble
    from fused_reducer.pipelining import PipelineStage
    from dist_utils import ALLREDUCE_EVENTS
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(8)]
    models, stages = {}, []
    for s in (pp, pp + 2):
        module = nn.Sequential(*layers[2 * s:2 * s + 2])
        for name, layer in (("last", module[1][0]), ("first", module[0][0])):
            def mark_node(_, args, out, name=f"stage{s}_{name}_layer_backward"):
                def marker(grad_outputs):
                    with torch.profiler.record_function(name):
                        pass
                if out.grad_fn is not None:  # shape inference runs without grad
                    out.grad_fn.register_prehook(marker)
            layer.register_forward_hook(mark_node)
        models[s] = FusedReducer(module, device_mesh=mesh["dp"], bucket_cap_mb=0.00002,
                                 first_bucket_mb=0.00002)  # one parameter per bucket
        stages.append(PipelineStage(models[s], s, 4, torch.device("cpu"),
                                    group=mesh["pp"].get_group()))
    schedule = ScheduleInterleavedZeroBubble(stages, n_microbatches=MICRO, loss_fn=_loss)

    def step(k):
        x, y = _data(dp, k)
        for model in models.values():
            model.zero_grad(set_to_none=True)
        schedule.step(x) if pp == 0 else schedule.step(target=y)
    step(0)  # shape inference and the first layout
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step(1)
    events = prof.events()
    starts = sorted(e.time_range.start for e in events if e.name in ALLREDUCE_EVENTS)

    def last(name):
        return max(e.time_range.start for e in events if e.name == name)
    windows = {s: (last(f"stage{s}_last_layer_backward"), last(f"stage{s}_first_layer_backward"))
               for s in models}
    return {"stages": sorted(models), "allreduces": len(starts),
            "buckets": sum(len(m.bucket_sizes()) for m in models.values()),
            "inside": {s: sum(1 for t in starts if lo < t < hi) for s, (lo, hi) in windows.items()},
            "ordered": {s: lo < hi for s, (lo, hi) in windows.items()}}


def check_zero_bubble_with_find_unused_parameters(rank, world):
    """Two layers per stage: two parameter groups in each weight half."""
    return _run("ScheduleInterleavedZeroBubble", stages_per_rank=2, n_layers=8,
                bucket_cap_mb=0.00002, first_bucket_mb=0.00002, find_unused_parameters=True)


def check_zero_bubble_with_each_weight_used_twice(rank, world):
    return _run("ScheduleInterleavedZeroBubble", stages_per_rank=2, twice=True,
                bucket_cap_mb=0.00002, first_bucket_mb=0.00002)


def check_sharded_optimizer_under_1f1b(rank, world):
    return _run("Schedule1F1B", sharded=True, bucket_cap_mb=0.0002, first_bucket_mb=0.0002)


def check_sharded_optimizer_under_zero_bubble(rank, world):
    return _run("ScheduleInterleavedZeroBubble", stages_per_rank=2, sharded=True,
                bucket_cap_mb=0.00002, first_bucket_mb=0.00002)


def check_sharded_optimizer_under_1f1b_with_bf16_reduction(rank, world):
    """bf16 shards, updated in fp32: each fragment's gradient is an fp32 copy of its bf16 bucket
    slot, not a view of it (the division by the number of microbatches must reach the copy)."""
    return _run("Schedule1F1B", sharded=True, bucket_cap_mb=0.0001, first_bucket_mb=0.0001,
                reduce_dtype=torch.bfloat16)


def check_sharded_optimizer_under_1f1b_with_fp32_master_weights(rank, world):
    """bf16 parameters with fp32 master weights: the gradients are fp32 copies of the shards."""
    return _run("Schedule1F1B", sharded=True, dtype=torch.bfloat16, master_dtype=torch.float32,
                bucket_cap_mb=0.0001, first_bucket_mb=0.0001)


def check_zero_bubble_with_gradients_as_bucket_views(rank, world):
    """The weight halves accumulate into param.grad that views its bucket slot."""
    return _run("ScheduleInterleavedZeroBubble", stages_per_rank=2, n_layers=8,
                bucket_cap_mb=0.00002, first_bucket_mb=0.00002, gradient_as_bucket_view=True)


def check_dualpipev(rank, world):
    return _run("ScheduleDualPipeV", stages_per_rank=2, v_shape=True, bucket_cap_mb=0.00002,
                first_bucket_mb=0.00002)


@pytest.fixture(scope="module")
def outcomes(request):
    return checks.run(request, world_size=WORLD, timeout=240)


def _assert_exact_once_per_step(results, extra=0, tol=TOL):
    """`extra`: all-reduces per step besides the buckets' (find_unused_parameters' used map);
    `tol`: the largest difference from the float64 reference."""
    for r in results:
        assert r["params"] < tol, r
        assert r["reductions"] == [[1] * len(r["buckets"])] * STEPS, r
        assert r["allreduces"] == [[n + extra for n in r["buckets"]]] * STEPS, r


@checks.uses(check_gpipe)
def test_gpipe_is_exact_with_one_reduction_per_bucket(outcomes):
    results = per_rank(outcomes, "check_gpipe")
    assert all(n > 1 for r in results for n in r["buckets"]), results
    _assert_exact_once_per_step(results)


@checks.uses(check_1f1b)
def test_1f1b_is_exact_with_one_reduction_per_bucket(outcomes):
    _assert_exact_once_per_step(per_rank(outcomes, "check_1f1b"))


@checks.uses(check_interleaved_1f1b)
def test_interleaved_1f1b_is_exact_with_one_reduction_per_bucket(outcomes):
    _assert_exact_once_per_step(per_rank(outcomes, "check_interleaved_1f1b"))


@checks.uses(check_looped_bfs)
def test_looped_bfs_is_exact_with_one_reduction_per_bucket(outcomes):
    _assert_exact_once_per_step(per_rank(outcomes, "check_looped_bfs"))


@checks.uses(check_reduction_overlaps_the_last_backward)
def test_1f1b_reduction_starts_while_the_last_microbatchs_backward_runs(outcomes):
    for r in per_rank(outcomes, "check_reduction_overlaps_the_last_backward"):
        assert r["buckets"] > 1 and r["allreduces"] == r["buckets"] and r["marks"] == MICRO, r
        assert r["after_the_previous_backward"] and r["before_the_last_gradient"], r
        assert r["telemetry"], r


@checks.uses(check_interleaved_zero_bubble)
def test_interleaved_zero_bubble_split_backward_is_exact_with_one_reduction_per_bucket(outcomes):
    _assert_exact_once_per_step(per_rank(outcomes, "check_interleaved_zero_bubble"))


@checks.uses(check_zbv_zero_bubble)
def test_zbv_zero_bubble_split_backward_is_exact_with_one_reduction_per_bucket(outcomes):
    _assert_exact_once_per_step(per_rank(outcomes, "check_zbv_zero_bubble"))


@checks.uses(check_zero_bubble_reduction_overlaps_the_last_weight_half)
def test_zero_bubble_reduction_starts_while_the_last_weight_half_runs(outcomes):
    results = per_rank(outcomes, "check_zero_bubble_reduction_overlaps_the_last_weight_half")
    for r in results:
        assert r["allreduces"] == r["buckets"] and r["buckets"] >= 8, r
        for stage in r["stages"]:
            if stage != 0:  # a first stage runs full backwards, not split ones
                assert r["ordered"][stage] and r["inside"][stage] >= 1, r


@checks.uses(check_zero_bubble_with_find_unused_parameters)
def test_zero_bubble_with_find_unused_parameters_is_exact_with_one_reduction_per_bucket(outcomes):
    _assert_exact_once_per_step(per_rank(outcomes, "check_zero_bubble_with_find_unused_parameters"),
                                extra=1)


@checks.uses(check_zero_bubble_with_each_weight_used_twice)
def test_zero_bubble_with_each_weight_used_twice_is_exact(outcomes):
    """A weight used twice in a stage's forward: its split backward's parameter group has two
    intermediates, one reached through the other (Note [Split backward]: counted once)."""
    _assert_exact_once_per_step(per_rank(outcomes, "check_zero_bubble_with_each_weight_used_twice"))


@checks.uses(check_sharded_optimizer_under_1f1b)
def test_sharded_optimizer_under_1f1b_is_exact_with_one_reduction_per_bucket(outcomes):
    _assert_exact_once_per_step(per_rank(outcomes, "check_sharded_optimizer_under_1f1b"))


@checks.uses(check_sharded_optimizer_under_zero_bubble)
def test_sharded_optimizer_under_zero_bubble_is_exact_with_one_reduction_per_bucket(outcomes):
    _assert_exact_once_per_step(per_rank(outcomes, "check_sharded_optimizer_under_zero_bubble"))


@checks.uses(check_sharded_optimizer_under_1f1b_with_bf16_reduction)
def test_sharded_optimizer_under_1f1b_with_bf16_reduction_divides_by_the_microbatches(outcomes):
    """The stage divides the fp32 copies of the bf16 shards by the number of microbatches, as
    torch's scale_grads divides param.grad: the float64 model on the global batch within bf16's
    rounding of the gradients (not dividing them moves each parameter 4 times as far)."""
    _assert_exact_once_per_step(
        per_rank(outcomes, "check_sharded_optimizer_under_1f1b_with_bf16_reduction"),
        tol=TOL_BF16_REDUCTION)


@checks.uses(check_sharded_optimizer_under_1f1b_with_fp32_master_weights)
def test_sharded_optimizer_under_1f1b_with_master_weights_divides_by_the_microbatches(outcomes):
    """bf16 parameters, fp32 master weights: the float64 model within bf16's rounding of the
    forward and of the parameters."""
    _assert_exact_once_per_step(
        per_rank(outcomes, "check_sharded_optimizer_under_1f1b_with_fp32_master_weights"),
        tol=TOL_BF16_PARAMS)


@checks.uses(check_zero_bubble_with_gradients_as_bucket_views)
def test_zero_bubble_with_gradients_as_bucket_views_is_exact(outcomes):
    _assert_exact_once_per_step(per_rank(outcomes, "check_zero_bubble_with_gradients_as_bucket_views"))


@checks.uses(check_dualpipev)
def test_dualpipev_is_exact_with_one_reduction_per_bucket(outcomes):
    _assert_exact_once_per_step(per_rank(outcomes, "check_dualpipev"))


def tp_and_split_pipeline_world_of_one(device, steps=2):
    """Tensor parallel x a split-backward pipeline on one rank, on the device path:
    mesh (pp, dp, tp) = (1, 1, 1), two stages on the rank under ScheduleInterleavedZeroBubble,
    each an MLP with ColwiseParallel + RowwiseParallel Linears in a FusedReducer over mesh['dp'].
    Returns the parameters' largest difference from a float64 copy trained on the same batches,
    the reductions per stage and step, and whether every param.grad kept its placements. Also
    run on the CPU over gloo, so that the logic is checked where no GPU is; on a GPU by
    tests/test_gpu.py, over NCCL."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import ScheduleInterleavedZeroBubble
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    from fused_reducer.pipelining import PipelineStage
    mesh = init_device_mesh(device, (1, 1, 1), mesh_dim_names=("pp", "dp", "tp"))
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)) for _ in range(2)]
    reference = nn.Sequential(*(nn.Sequential(*(m.double() for m in (
        nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)))) for _ in range(2)))
    reference.load_state_dict({k: v.double() for k, v in
                               nn.Sequential(*blocks).state_dict().items()})
    models, stages = [], []
    for index, block in enumerate(blocks):
        block.to(device)
        parallelize_module(block, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        model = FusedReducer(block, device_mesh=mesh["dp"], bucket_cap_mb=0.001,
                                           first_bucket_mb=0.001)
        models.append(model)
        stages.append(PipelineStage(model, index, 2, torch.device(device),
                                    group=mesh["pp"].get_group()))
    loss_fn = lambda out, target: (out - target).pow(2).mean()  # noqa: E731
    schedule = ScheduleInterleavedZeroBubble(stages, n_microbatches=4, loss_fn=loss_fn)
    opt = torch.optim.SGD([p for m in models for p in m.parameters()], lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    out = {"reductions": [], "placements": True}
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)
        before = [m.stats()["step"] for m in models]
        opt.zero_grad(set_to_none=True)
        schedule.step(x.to(device), target=y.to(device))
        out["reductions"].append([m.stats()["step"] - b for m, b in zip(models, before)])
        out["placements"] &= all(isinstance(p.grad, DTensor) and p.grad.placements == p.placements
                                 for m in models for p in m.module.parameters())
        opt.step()
        ref_opt.zero_grad()
        loss_fn(reference(x.double()), y.double()).backward()
        ref_opt.step()
    out["params"] = max(float((p.detach().full_tensor().double().cpu() - r.detach()).abs().max())
                        for p, r in zip((p for m in models for p in m.module.parameters()),
                                        reference.parameters()))
    return out



def test_tensor_parallel_split_backward_pipeline_on_one_rank():
    from dist_utils import run_ranks
    out, = run_ranks(_tp_and_split_pipeline_on_the_cpu, 1)
    assert out["params"] < 1e-6, out
    assert out["reductions"] == [[1, 1]] * 2 and out["placements"], out


def _tp_and_split_pipeline_on_the_cpu(rank, world):
    return tp_and_split_pipeline_world_of_one("cpu")
