"""ShardedOptimizer: each rank keeps the state of, and updates, its shard of every
bucket; the parameters are all-gathered after the step (Note [Sharded optimizer]).

Against DDP + the same torch optimizer on the same data, at 2, 3 and 4 ranks, on both CPU
transports:
- every supported optimizer (foreach and not), through a limit change mid-training (the shards
  move and the state moves with them), with an LR scheduler: the same parameters, bit-identical
  at 2 ranks (the same sums in the same order), within 1e-6 at 3 and 1e-5 at 4 (see _bound);
- overlap_param_gather: the all-gathers left in flight by step() are finished by the next
  forward (module pre-hooks) and by model.state_dict(); parameters still DDP's;
- clip_grad_norm_: DDP's norm (torch.nn.utils.clip_grad_norm_) and DDP's parameters after it;
  torch.nn.utils.clip_grad_norm_ over model.parameters() raises ShardedGradientError naming a
  parameter (param.grad holds a released-gradient placeholder until zero_grad() or the next
  forward, through step(); reading it after step() raises too);
- collectives counted by torch's profiler: one reduce-scatter and one all-gather per bucket, the
  first reduce-scatter started while backward still runs;
- autotune started while training (every trial moves the shards and the state);
- gradient_as_bucket_view=True, and torch.compile (aot_eager) around the model or inside it with
  overlapped all-gathers, train like DDP wrapped the same way;
- no_sync accumulation and find_unused_parameters (a parameter no rank uses is not updated);
- reduce_dtype=bf16 (bf16 shards, fp32 update) equals the unsharded FusedReducer's arithmetic,
  and CPU autocast (bf16) trains like DDP under it;
- the optimizer state per rank is 1/world of the plain optimizer's (padding aside);
- bf16 parameters with fp32 master weights (master_dtype) train like a single process with an
  fp32 master on the whole batch, closer than bf16 AdamW without masters;
- checkpoints in the plain format: a DDP + AdamW checkpoint resumes here, and back;
- refusals: optimizers whose update is not elementwise, and what sharded mode cannot combine with
  yet (fp16 GradScaler, join, comm hooks), each naming what to do.
"""
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fused_reducer
from fused_reducer import (FusedReducer, FusedReducerError, ShardedGradientError, ShardedOptimizer,
                           ShardedOptimizerError)
from dist_utils import per_rank, run_checks

BACKENDS = ("shm", "process_group")
KB = 1024

OPTIMIZERS = [
    ("SGD", dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)),
    ("SGD", dict(lr=0.05, momentum=0.9, dampening=0.1, foreach=True)),
    ("Adam", dict(lr=1e-2, foreach=False)),
    ("Adam", dict(lr=1e-2, amsgrad=True, foreach=True)),
    ("AdamW", dict(lr=1e-2, weight_decay=0.1, foreach=False)),
    ("AdamW", dict(lr=1e-2, weight_decay=0.1, foreach=True)),
    ("Adamax", dict(lr=1e-2)),
    ("NAdam", dict(lr=1e-2)),
    ("RAdam", dict(lr=1e-2)),
    ("Adagrad", dict(lr=1e-2)),
    ("RMSprop", dict(lr=1e-3, momentum=0.9, centered=True)),
    ("Adadelta", dict(lr=0.5)),
    ("Rprop", dict(lr=1e-3)),
]


def _net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 40), nn.Tanh(), nn.Linear(40, 33), nn.Tanh(),
                         nn.Linear(33, 7))


def _batch(rank, step, rows=8):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(rows, 12, generator=g), torch.randn(rows, 7, generator=g)


def _loss(model, x, y):
    return ((model(x) - y) ** 2).mean()


def _step_each(pairs, x, y):
    """One training step of each (model, optimizer) pair on the same batch."""
    for model, o in pairs:
        o.zero_grad()
        _loss(model, x, y).backward()
        o.step()


def _max_diff(a_params, b_params):
    return max((a - b).abs().max().item() for a, b in zip(a_params, b_params))


def _pair(backend, cls, kwargs, **options):
    """FusedReducer + ShardedOptimizer and DDP + the plain optimizer, same start."""
    ours = FusedReducer(_net(), backend=backend, bucket_cap_mb=2 * KB / 2**20,
                        first_bucket_mb=KB / 2**20, **options)
    opt = ShardedOptimizer(ours, cls, **kwargs)
    ddp = DDP(_net(), **options)
    ref = cls(ddp.parameters(), **kwargs)
    return ours, opt, ddp, ref


# -- checks (each rank) ----------------------------------------------------------------------------

def check_optimizers_match_ddp(rank, world):
    diffs = {}
    for backend in BACKENDS:
        for name, kwargs in OPTIMIZERS:
            cls = getattr(torch.optim, name)
            ours, opt, ddp, ref = _pair(backend, cls, kwargs)
            schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5)
                          for o in (opt, ref)]
            for step in range(8):
                if step == 4:
                    ours.first_bucket_bytes = 3 * KB  # the shards move; the state moves with them
                x, y = _batch(rank, step)
                for model, o, s in ((ours, opt, schedulers[0]), (ddp, ref, schedulers[1])):
                    o.zero_grad()
                    _loss(model, x, y).backward()
                    o.step()
                    s.step()
            diffs[(backend, name, tuple(sorted(kwargs.items())))] = (
                _max_diff(ours.module.parameters(), ddp.module.parameters()),
                ours.backend, ours.stats()["rebuilds"])
            ours.close()
    return diffs


def check_overlapped_param_gather(rank, world):
    """overlap_param_gather=True: step() leaves the all-gathers in flight, the next forward's
    module pre-hooks finish them; parameters still DDP's, and model.state_dict() right after
    step() already holds the updated values."""
    out = {}
    for backend in BACKENDS:
        ours = FusedReducer(_net(), backend=backend, bucket_cap_mb=2 * KB / 2**20,
                            first_bucket_mb=KB / 2**20)
        opt = ShardedOptimizer(ours, torch.optim.AdamW, lr=1e-2, overlap_param_gather=True)
        ddp = DDP(_net())
        ref = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
        in_flight, saved_diff = [], 0.0
        for step in range(6):
            if step == 3:
                ours.first_bucket_bytes = 3 * KB
            x, y = _batch(rank, step)
            _step_each(((ours, opt), (ddp, ref)), x, y)
            in_flight.append(len(opt._gathers))
            if step == 4:
                saved = ours.state_dict()
                saved_diff = max((saved["module." + k] - v).abs().max().item()
                                 for k, v in ddp.module.state_dict().items())
        out[backend] = (_max_diff(ours.module.parameters(), ddp.module.parameters())
                        if not opt.finish_param_gather() else None, in_flight, saved_diff)
        ours.close()
    return out


def check_clip_grad_norm(rank, world):
    out = {}
    for backend in BACKENDS:
        ours, opt, ddp, ref = _pair(backend, torch.optim.AdamW, dict(lr=1e-2))
        norms = []
        for step in range(4):
            x, y = _batch(rank, step)
            opt.zero_grad()
            ref.zero_grad()
            (_loss(ours, x, y) * 50).backward()
            (_loss(ddp, x, y) * 50).backward()
            try:  # the torch utility over model.parameters() must not compute something else
                torch.nn.utils.clip_grad_norm_(ours.parameters(), 0.5)
                loud = None
            except ShardedGradientError as e:
                loud = str(e)
            mine = opt.clip_grad_norm_(0.5)
            theirs = torch.nn.utils.clip_grad_norm_(ddp.parameters(), 0.5)
            opt.step()
            ref.step()
            try:  # a gradient norm logged after step(), as under DDP
                torch.linalg.vector_norm(next(ours.parameters()).grad)
                after_step = None
            except ShardedGradientError as e:
                after_step = str(e)
            opt.zero_grad()
            cleared = all(p.grad is None for p in ours.parameters())
            norms.append((mine.item(), theirs.item(), loud, after_step, cleared))
        out[backend] = (norms, _max_diff(ours.module.parameters(), ddp.module.parameters()))
        ours.close()
    return out


def check_gradient_as_bucket_view(rank, world):
    """gradient_as_bucket_view=True (autograd's gradient replaced by its bucket slot when packed)
    against DDP(gradient_as_bucket_view=True) + AdamW, through no_sync accumulation and a limit
    change; param.grad of the synchronised step is released (a placeholder), not a bucket view
    whose other shards hold unreduced sums."""
    out = {}
    for backend in BACKENDS:
        ours, opt, ddp, ref = _pair(backend, torch.optim.AdamW, dict(lr=1e-2),
                                    gradient_as_bucket_view=True)
        released = []
        for step in range(6):
            if step == 3:
                ours.first_bucket_bytes = 3 * KB
            for model, o in ((ours, opt), (ddp, ref)):
                o.zero_grad()
                if step % 2:
                    with model.no_sync():
                        x, y = _batch(rank, 10 * step + 1)
                        _loss(model, x, y).backward()
                x, y = _batch(rank, 10 * step)
                _loss(model, x, y).backward()
                if model is ours:
                    released.append(all("released gradient" in repr(p.grad)
                                        for p in ours.parameters()))
                o.step()
        out[backend] = (_max_diff(ours.module.parameters(), ddp.module.parameters()),
                        ours.stats()["rebuilds"], released)
        ours.close()
    return out


def check_collectives_and_overlap(rank, world):
    """One parameter per bucket (12 buckets), counted by torch's profiler, not by our stats: a
    synchronised step issues one reduce-scatter per bucket (on gloo: the in-place all-reduce
    that stands for it, Note [Process-group reduce-scatter and all-gather]) and one all-gather
    per bucket, nothing else; the first reduce-scatter starts before the last layer's backward
    does (it overlaps backward)."""
    from torch.profiler import ProfilerActivity, profile
    names = {"shm": ("shm:reduce_scatter", "shm:all_gather"),
             "process_group": ("c10d::allreduce_", "c10d::_allgather_base_")}
    out = {}
    for backend in BACKENDS:
        torch.manual_seed(0)
        model = FusedReducer(nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)]),
                             backend=backend, first_bucket_mb=1e-6, bucket_cap_mb=1e-6)
        opt = ShardedOptimizer(model, torch.optim.AdamW, lr=1e-3)
        x = torch.randn(16, 64)
        for _ in range(2):  # the sharded layout, then the rebuild in the observed order
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
        events = prof.events()
        scatter, gather = names[backend]
        collectives = sorted(e.name for e in events
                             if e.name.startswith(("c10d::", "shm:")))
        starts = sorted(e.time_range.start for e in events if e.name == scatter)
        backward = sorted(e.time_range.start for e in events
                          if e.name.startswith("autograd::engine::evaluate_function: Addmm"))
        out[backend] = (collectives.count(scatter), collectives.count(gather), len(collectives),
                        starts[0] < backward[-1], len(model.bucket_sizes()))
        model.close()
    return out


def check_autotune_while_training(rank, world):
    """model.autotune() started after the ShardedOptimizer: each trial's limits rebuild the
    buckets, the shards move and the AdamW state moves with them; parameters stay DDP's."""
    out = {}
    for backend in BACKENDS:
        ours, opt, ddp, ref = _pair(backend, torch.optim.AdamW, dict(lr=1e-2))
        candidates = [(1 * KB, 1 * KB, 0), (3 * KB, 8 * KB, 0), (1 << 30, 1 << 30, 0)]
        ours.autotune(candidates=candidates, round_steps=(1, 2))
        steps = 0
        while not ours.autotune_report()["done"] or steps < 3:
            x, y = _batch(rank, steps)
            _step_each(((ours, opt), (ddp, ref)), x, y)
            steps += 1
            assert steps < 60, "autotune did not finish"
        out[backend] = (_max_diff(ours.module.parameters(), ddp.module.parameters()),
                        ours.stats()["rebuilds"], len(ours.autotune_report()["trials"]))
        ours.close()
    return out


def check_torch_compile(rank, world):
    """torch.compile (dynamo + AOT autograd: backend aot_eager, no C++ compiler needed) around
    the model ("outer": torch.compile(FusedReducer(m))) and inside it ("inner":
    FusedReducer(torch.compile(m))), with a ShardedOptimizer, overlapped all-gathers and a limit
    change, against DDP wrapped and compiled the same way with the plain AdamW. The all-gathers'
    module pre-hooks are traced there, not run: finished before the forward instead."""
    import torch._dynamo
    out = {}
    for backend in BACKENDS:
        for order in ("outer", "inner"):
            torch._dynamo.reset()

            def wrap(wrapper, **options):
                if order == "inner":
                    return wrapper(torch.compile(_net(), backend="aot_eager"), **options)
                return torch.compile(wrapper(_net(), **options), backend="aot_eager")
            compiled_ours = wrap(FusedReducer, backend=backend, bucket_cap_mb=2 * KB / 2**20,
                                 first_bucket_mb=KB / 2**20)
            compiled_ddp = wrap(DDP)
            ours = getattr(compiled_ours, "_orig_mod", compiled_ours)
            ddp = getattr(compiled_ddp, "_orig_mod", compiled_ddp)
            opt = ShardedOptimizer(ours, torch.optim.AdamW, lr=1e-2, overlap_param_gather=True)
            ref = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
            for step in range(5):
                if step == 3:
                    ours.first_bucket_bytes = 3 * KB
                x, y = _batch(rank, step)
                _step_each(((compiled_ours, opt), (compiled_ddp, ref)), x, y)
            opt.finish_param_gather()
            out[(backend, order)] = (
                _max_diff(ours.module.parameters(), ddp.module.parameters()),
                ours.stats()["rebuilds"])
            ours.close()
    return out


class _WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.used, self.unused = nn.Linear(12, 7), nn.Linear(12, 7)

    def forward(self, x):
        return self.used(x)


def check_no_sync_and_unused(rank, world):
    out = {}
    for backend in BACKENDS:
        ours = FusedReducer(_WithUnused(), backend=backend, find_unused_parameters=True)
        opt = ShardedOptimizer(ours, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
        ddp = DDP(_WithUnused(), find_unused_parameters=True)
        ref = torch.optim.AdamW(ddp.parameters(), lr=1e-2, weight_decay=0.1)
        start = ours.module.unused.weight.detach().clone()
        for step in range(4):
            for model, o in ((ours, opt), (ddp, ref)):
                o.zero_grad()
                with model.no_sync():  # one accumulated micro-step, then the synchronised one
                    x, y = _batch(rank, 10 * step)
                    _loss(model, x, y).backward()
                x, y = _batch(rank, 10 * step + 1)
                _loss(model, x, y).backward()
                o.step()
        out[backend] = (_max_diff(ours.module.parameters(), ddp.module.parameters()),
                        torch.equal(ours.module.unused.weight, start))
        ours.close()
    return out


def check_reduce_dtype_and_autocast(rank, world):
    """reduce_dtype=bf16: the shard is reduce-scattered in bf16 and updated in fp32, exactly as
    the all-reduced bf16 bucket is cast back into param.grad by the plain FusedReducer; and CPU
    autocast (bf16) trains like DDP under the same autocast."""
    out = {}
    for backend in BACKENDS:
        plain = FusedReducer(_net(), backend=backend, reduce_dtype=torch.bfloat16)
        plain_opt = torch.optim.SGD(plain.parameters(), lr=0.05, momentum=0.9)
        ours = FusedReducer(_net(), backend=backend, reduce_dtype=torch.bfloat16)
        opt = ShardedOptimizer(ours, torch.optim.SGD, lr=0.05, momentum=0.9)
        amp = FusedReducer(_net(), backend=backend)
        amp_opt = ShardedOptimizer(amp, torch.optim.AdamW, lr=1e-2)
        ddp = DDP(_net())
        ddp_opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
        for step in range(5):
            x, y = _batch(rank, step)
            _step_each(((plain, plain_opt), (ours, opt)), x, y)
            for model, o in ((amp, amp_opt), (ddp, ddp_opt)):
                o.zero_grad()
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = _loss(model, x, y)
                loss.float().backward()
                o.step()
        out[backend] = (_max_diff(ours.module.parameters(), plain.module.parameters()),
                        _max_diff(amp.module.parameters(), ddp.module.parameters()))
        for m in (plain, ours, amp):
            m.close()
    return out


def check_master_weights(rank, world):
    """bf16 parameters, fp32 masters and state for the local shard: against a single process
    training an fp32 master with AdamW on every rank's batch (its bf16 copy runs forward and
    backward), and against the same sharded run without masters (bf16 AdamW)."""
    out = {}
    steps, kwargs = 6, dict(lr=1e-3, weight_decay=0.1)
    for backend in BACKENDS:
        runs = {}
        for master_dtype in (torch.float32, None):
            model = FusedReducer(_net().to(torch.bfloat16), backend=backend,
                                 reduce_dtype=torch.float32)
            opt = ShardedOptimizer(model, torch.optim.AdamW, master_dtype=master_dtype, **kwargs)
            for step in range(steps):
                x, y = _batch(rank, step)
                opt.zero_grad()
                _loss(model, x.bfloat16(), y.bfloat16()).float().backward()
                opt.step()
            runs[master_dtype] = model
        master = _net()
        ref = torch.optim.AdamW(master.parameters(), **kwargs)
        for step in range(steps):
            batches = [_batch(r, step) for r in range(world)]
            x = torch.cat([b[0] for b in batches])
            y = torch.cat([b[1] for b in batches])
            copy = _net().to(torch.bfloat16)
            copy.load_state_dict({k: v.to(torch.bfloat16) for k, v in master.state_dict().items()})
            _loss(copy, x.bfloat16(), y.bfloat16()).float().backward()
            for p, q in zip(master.parameters(), copy.parameters()):
                p.grad = q.grad.float()
            ref.step()
        expected = [p.detach().to(torch.bfloat16).float() for p in master.parameters()]

        def error(model):
            return max(((p.float() - e).abs().max() / e.abs().max()).item()
                       for p, e in zip(model.module.parameters(), expected))
        dtypes = {p.dtype for p in runs[torch.float32].module.parameters()}
        out[backend] = (error(runs[torch.float32]), error(runs[None]), dtypes)
        for model in runs.values():
            model.close()
    return out


class _UsedOnce(_WithUnused):
    """`unused` takes part in the first forward only."""
    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.used(x) + (self.unused(x) if self.calls == 1 else 0)


def check_edge_cases(rank, world):
    """What a review found (each failed before its fix): two synchronised backward passes
    before step() raise; add_param_group after construction updates the new group like DDP +
    the plain optimizer; frozen parameters are accepted; zero_grad(set_to_none=False) keeps zero
    gradients for a parameter no rank used (Adam moves it on momentum, as under DDP); a master
    checkpoint (master_dtype) resumes."""
    out = {}
    ours = FusedReducer(_net(), backend="process_group")
    opt = ShardedOptimizer(ours, torch.optim.SGD, lr=0.1)
    for micro in range(2):
        x, y = _batch(rank, micro)
        _loss(ours, x, y).backward()
    try:
        opt.step()
    except ShardedOptimizerError as e:
        out["two synced"] = str(e)
    ours.close()

    ours = FusedReducer(_net(), backend="process_group")
    ddp = DDP(_net())
    mine, theirs = list(ours.module.parameters()), list(ddp.module.parameters())
    opt = ShardedOptimizer(ours, torch.optim.SGD, params=mine[:2], lr=0.1, momentum=0.9)
    ref = torch.optim.SGD(theirs[:2], lr=0.1, momentum=0.9)
    for step in range(4):
        if step == 2:
            opt.add_param_group({"params": mine[2:], "lr": 0.05})
            ref.add_param_group({"params": theirs[2:], "lr": 0.05})
        x, y = _batch(rank, step)
        _step_each(((ours, opt), (ddp, ref)), x, y)
    out["add_param_group"] = _max_diff(mine, theirs)
    ours.close()

    frozen = _net()
    frozen[0].weight.requires_grad_(False)
    ours = FusedReducer(frozen, backend="process_group")
    ShardedOptimizer(ours, torch.optim.AdamW, lr=1e-2)
    out["frozen"] = True
    ours.close()

    ours = FusedReducer(_UsedOnce(), backend="process_group", find_unused_parameters=True)
    ddp = DDP(_UsedOnce(), find_unused_parameters=True)
    opt = ShardedOptimizer(ours, torch.optim.Adam, lr=1e-2)
    ref = torch.optim.Adam(ddp.parameters(), lr=1e-2)
    for step in range(3):
        for model, o in ((ours, opt), (ddp, ref)):
            o.zero_grad(set_to_none=False)
            x, y = _batch(rank, step)
            _loss(model, x, y).backward()
            o.step()
    out["zeros kept"] = _max_diff(ours.module.parameters(), ddp.module.parameters())
    ours.close()

    ours = FusedReducer(_net().to(torch.bfloat16), backend="process_group")
    opt = ShardedOptimizer(ours, torch.optim.AdamW, master_dtype=torch.float32, lr=1e-2)
    for step in range(5):
        if step == 3:
            opt.load_state_dict(opt.state_dict())  # a checkpoint round trip mid-training
            saved = opt.state_dict()
        x, y = _batch(rank, step)
        opt.zero_grad()
        _loss(ours, x.bfloat16(), y.bfloat16()).float().backward()
        opt.step()
    out["master dtypes"] = sorted({str(v.dtype) for s_ in saved["state"].values()
                                   for k, v in s_.items() if k != "step"})
    ours.close()
    return out


def check_state_bytes(rank, world):
    def state_bytes(states):
        return sum(v.numel() * v.element_size() for s in states for v in s.values()
                   if torch.is_tensor(v) and v.dim() > 0)
    ours, opt, ddp, ref = _pair("process_group", torch.optim.AdamW, dict(lr=1e-2))
    for step in range(2):
        x, y = _batch(rank, step)
        _step_each(((ours, opt), (ddp, ref)), x, y)
    mine = state_bytes(opt._inner.state.values())
    plain = state_bytes(ref.state.values())
    ours.close()
    return mine, plain


def check_checkpoints_in_the_plain_format(rank, world):
    kwargs = dict(lr=1e-2, weight_decay=0.1)
    # DDP + AdamW for 3 steps, its checkpoint resumed here; both go on for 3 steps.
    ddp = DDP(_net())
    ref = torch.optim.AdamW(ddp.parameters(), **kwargs)
    for step in range(3):
        x, y = _batch(rank, step)
        ref.zero_grad()
        _loss(ddp, x, y).backward()
        ref.step()
    saved = {"model": ddp.module.state_dict(), "opt": ref.state_dict()}
    net = _net(seed=1)
    net.load_state_dict(saved["model"])
    ours = FusedReducer(net, backend="process_group")
    opt = ShardedOptimizer(ours, torch.optim.AdamW, **kwargs)
    opt.load_state_dict(saved["opt"])
    for step in range(3, 6):
        x, y = _batch(rank, step)
        _step_each(((ours, opt), (ddp, ref)), x, y)
    resumed_here = _max_diff(ours.module.parameters(), ddp.module.parameters())
    # And back: this optimizer's state_dict() is the plain format a plain AdamW takes.
    back = opt.state_dict()
    plain = ref.state_dict()
    same_format = (sorted(back["state"]) == sorted(plain["state"])
                   and back["param_groups"] == plain["param_groups"]
                   and all(sorted(back["state"][i]) == sorted(plain["state"][i])
                           for i in plain["state"]))
    state_diff = max((back["state"][i][k] - plain["state"][i][k]).abs().max().item()
                     for i in plain["state"] for k in ("exp_avg", "exp_avg_sq"))
    again = torch.optim.AdamW(ddp.parameters(), **kwargs)
    again.load_state_dict(back)
    ours.close()
    return resumed_here, same_format, state_diff


class _WithScale(nn.Module):
    """A 0-dim parameter beside a layer (CLIP's logit_scale, a learnable temperature): its
    optimizer moments are 0-dim too, like a step count."""

    def __init__(self):
        super().__init__()
        self.net = _net()
        self.scale = nn.Parameter(torch.tensor(0.5))

    def forward(self, x):
        return self.net(x) * self.scale


def check_zero_dim_parameters_and_a_replaced_optimizer(rank, world):
    """Through the layout rebuild after the first step and a checkpoint resumed into a new
    ShardedOptimizer: equal to DDP + the plain optimizer. The optimizer the new one replaced
    refuses to step (it would read parameters as gradients)."""
    out = {}
    for name, cls, kwargs in (("Adam", torch.optim.Adam, dict(lr=1e-2)),
                              ("NAdam", torch.optim.NAdam, dict(lr=1e-2)),
                              ("SGD", torch.optim.SGD, dict(lr=1e-2, momentum=0.9))):
        torch.manual_seed(0)
        ours, ddp = FusedReducer(_WithScale(), backend="process_group"), DDP(_WithScale())
        opt, ref = ShardedOptimizer(ours, cls, **kwargs), cls(ddp.parameters(), **kwargs)
        for step in range(3):
            _step_each(((ours, opt), (ddp, ref)), *_batch(rank, step))
        resumed = ShardedOptimizer(ours, cls, **kwargs)
        resumed.load_state_dict(opt.state_dict())
        try:
            opt.step()
            replaced = "stepped"
        except ShardedOptimizerError as e:
            replaced = str(e)
        for step in range(3, 5):
            _step_each(((ours, resumed), (ddp, ref)), *_batch(rank, step))
        out[name] = (_max_diff(ours.module.parameters(), ddp.module.parameters()), replaced)
        ours.close()
    return out


def check_refusals(rank, world):
    ours = FusedReducer(_net(), backend="process_group")
    messages = {}
    for cls in (torch.optim.LBFGS, type("MyAdam", (torch.optim.Adam,), {})):
        try:
            ShardedOptimizer(ours, cls, lr=1e-2)
        except ShardedOptimizerError as e:
            messages[cls.__name__] = str(e)
    scaled = FusedReducer(_net(), backend="process_group")
    scaled_opt = ShardedOptimizer(scaled, torch.optim.AdamW, lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    x, y = _batch(rank, 0)
    scaler.scale(_loss(scaled, x, y)).backward()
    try:
        scaler.step(scaled_opt)
    except ShardedOptimizerError as e:
        messages["GradScaler"] = str(e)
    try:
        with scaled.join():
            pass
    except FusedReducerError as e:
        messages["join"] = str(e)
    try:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        scaled.register_comm_hook(None, default_hooks.allreduce_hook)
    except RuntimeError as e:
        messages["comm hook"] = str(e)
    scaled.close()
    ours.close()
    return messages


CHECKS = [check_optimizers_match_ddp, check_overlapped_param_gather, check_clip_grad_norm,
          check_gradient_as_bucket_view, check_collectives_and_overlap,
          check_autotune_while_training, check_torch_compile,
          check_no_sync_and_unused,
          check_reduce_dtype_and_autocast, check_master_weights, check_edge_cases,
          check_state_bytes, check_checkpoints_in_the_plain_format, check_refusals,
          check_zero_dim_parameters_and_a_replaced_optimizer]


@pytest.fixture(scope="module", params=[2, 3, 4], ids=["world2", "world3", "world4"])
def outcomes(request):
    return request.param, run_checks(CHECKS, request.param, timeout=600)


def _bound(world):
    """Parameters against DDP's: bit-identical at 2 ranks (a sum of two is the same in either
    order); otherwise up to the summation order of the reduce-scatter versus DDP's all-reduce
    (our padded slots put elements at other places of the collective). Measured after 8 steps:
    at most 1.6e-7 at 3 ranks, 3.6e-6 at 4 (centered RMSprop, whose denominator amplifies it)."""
    return {2: 0.0, 3: 1e-6}.get(world, 1e-5)


def test_a_zero_dim_parameter_trains_as_ddp_and_a_replaced_optimizer_refuses_to_step(outcomes):
    world, outcomes = outcomes
    for out in per_rank(outcomes, "check_zero_dim_parameters_and_a_replaced_optimizer"):
        for name, (diff, replaced) in out.items():
            assert diff <= max(_bound(world), 1e-7), (name, diff)
            assert "replaced this one" in replaced, (name, replaced)


def test_every_elementwise_optimizer_matches_ddp_through_a_layout_change(outcomes):
    world, outcomes = outcomes
    for diffs in per_rank(outcomes, "check_optimizers_match_ddp"):
        for (backend, name, kwargs), (diff, used, rebuilds) in diffs.items():
            assert used == backend, (backend, used)
            assert rebuilds >= 2, "the limit change must have moved the shards"
            assert diff <= _bound(world), (backend, name, kwargs, diff)


def test_overlapped_parameter_all_gather_is_finished_by_the_next_forward(outcomes):
    world, outcomes = outcomes
    for out in per_rank(outcomes, "check_overlapped_param_gather"):
        for backend, (diff, in_flight, saved_diff) in out.items():
            assert all(n > 0 for n in in_flight), ("step() left nothing in flight", in_flight)
            assert diff <= _bound(world), (backend, diff)
            assert saved_diff <= _bound(world), (backend, saved_diff)


def test_clip_grad_norm_is_ddps_global_norm_and_torch_utilities_reading_param_grad_raise(
        outcomes):
    world, outcomes = outcomes
    for out in per_rank(outcomes, "check_clip_grad_norm"):
        for backend, (norms, diff) in out.items():
            for mine, theirs, loud, after_step, cleared in norms:
                assert abs(mine - theirs) <= 1e-5 * theirs, (backend, mine, theirs)
                assert loud is not None, "clip_grad_norm_(model.parameters()) must not pass"
                assert "opt.clip_grad_norm_" in loud and "'0.weight'" in loud, loud
                assert after_step is not None and "'0.weight'" in after_step, after_step
                assert cleared, "zero_grad() leaves param.grad None"
            assert diff <= 1e-6, (backend, diff)


def test_gradient_as_bucket_view_matches_ddp_and_releases_param_grad(outcomes):
    world, outcomes = outcomes
    for out in per_rank(outcomes, "check_gradient_as_bucket_view"):
        for backend, (diff, rebuilds, released) in out.items():
            assert rebuilds >= 2, "the limit change must have moved the shards"
            assert all(released), released
            assert diff <= _bound(world), (backend, diff)


def test_one_reduce_scatter_and_one_all_gather_per_bucket_and_the_first_overlaps_backward(
        outcomes):
    world, outcomes = outcomes
    for out in per_rank(outcomes, "check_collectives_and_overlap"):
        for backend, (scatters, gathers, total, overlapped, buckets) in out.items():
            assert buckets == 12, buckets
            assert (scatters, gathers, total) == (12, 12, 24), (backend, scatters, gathers, total)
            assert overlapped, (backend, "the first reduce-scatter waited for backward's end")


def test_autotune_while_training_moves_shards_and_state_exactly(outcomes):
    world, outcomes = outcomes
    for out in per_rank(outcomes, "check_autotune_while_training"):
        for backend, (diff, rebuilds, trials) in out.items():
            assert trials >= 3 and rebuilds >= 4, ("each trial must have moved the shards",
                                                    trials, rebuilds)
            assert diff <= _bound(world), (backend, diff)


def test_torch_compile_with_a_sharded_optimizer_matches_compiled_ddp(outcomes):
    world, outcomes = outcomes
    for out in per_rank(outcomes, "check_torch_compile"):
        for (backend, order), (diff, rebuilds) in out.items():
            assert rebuilds >= 2, "the limit change must have moved the shards"
            assert diff <= _bound(world), (backend, order, diff)


def test_no_sync_and_find_unused_parameters_match_ddp(outcomes):
    world, outcomes = outcomes
    for out in per_rank(outcomes, "check_no_sync_and_unused"):
        for backend, (diff, unused_kept) in out.items():
            assert diff <= _bound(world), (backend, diff)
            assert unused_kept, "a parameter no rank used must not be updated (weight decay)"


def test_reduce_dtype_shards_and_autocast_match_the_unsharded_arithmetic(outcomes):
    world, outcomes = outcomes
    for out in per_rank(outcomes, "check_reduce_dtype_and_autocast"):
        for backend, (bf16_diff, amp_diff) in out.items():
            # Shared memory sums in rank order whatever the layout: bit-identical. Gloo's ring
            # order depends on an element's place in the bucket, which the shard padding moves:
            # at 3 ranks a bf16 sum may round differently (measured 1.3e-5 after 5 SGD steps).
            bf16_bound = 1e-4 if (backend == "process_group" and world > 2) else 0.0
            assert bf16_diff <= bf16_bound, (backend, bf16_diff)
            assert amp_diff <= _bound(world), (backend, amp_diff)


def test_fp32_master_weights_train_like_a_single_process_fp32_master(outcomes):
    """Measured at 2 and 3 ranks: 0.0068-0.0072 of the largest parameter (about one bf16 ulp of
    it: the gradients are bf16, computed per rank), where bf16 AdamW without masters is 0.0144."""
    world, outcomes = outcomes
    for out in per_rank(outcomes, "check_master_weights"):
        for backend, (with_master, without, dtypes) in out.items():
            assert dtypes == {torch.bfloat16}, "the parameters stay bf16"
            assert with_master <= 1e-2, (backend, with_master)
            assert with_master < without, (backend, with_master, without)


def test_accumulation_groups_frozen_parameters_kept_zeros_and_master_checkpoints(outcomes):
    world, outcomes = outcomes
    for out in per_rank(outcomes, "check_edge_cases"):
        assert "no_sync" in out["two synced"] and "2 synchronised" in out["two synced"]
        assert out["add_param_group"] <= _bound(world), out["add_param_group"]
        assert out["frozen"]
        assert out["zeros kept"] <= _bound(world), out["zeros kept"]
        assert out["master dtypes"] == ["torch.float32"], out["master dtypes"]


def test_state_per_rank_is_one_world_th_of_the_plain_optimizers(outcomes):
    world, outcomes = outcomes
    results = per_rank(outcomes, "check_state_bytes")
    plain = results[0][1]
    assert sum(mine for mine, _ in results) == plain, "the shards hold every element once"
    for mine, _ in results:
        assert mine <= plain / world + 2 * 16 * 4 * 8, (mine, plain, world)  # padding aside


def test_a_ddp_checkpoint_resumes_here_and_back(outcomes):
    world, outcomes = outcomes
    for resumed_here, same_format, state_diff in per_rank(outcomes,
                                                          "check_checkpoints_in_the_plain_format"):
        assert resumed_here <= _bound(world), resumed_here
        assert same_format
        assert state_diff <= _bound(world), state_diff


def test_non_elementwise_optimizers_fp16_scaling_join_and_comm_hooks_are_refused(outcomes):
    world, outcomes = outcomes
    for messages in per_rank(outcomes, "check_refusals"):
        assert "LBFGS" in messages["LBFGS"] and "elementwise" in messages["LBFGS"]
        assert "MyAdam" in messages["MyAdam"]
        assert "GradScaler" in messages["GradScaler"] and "bf16" in messages["GradScaler"]
        assert "ShardedOptimizer" in messages["join"]
        assert "reduce-scatter" in messages["comm hook"]


# -- a checkpoint taken at one world size, resumed at another ---------------------------------------

def check_save_at_this_world_size(rank, world):
    """ShardedOptimizer(AdamW) for 4 steps (a layout change included); rank 0 saves the model and
    the consolidated optimizer state (the plain format) to $FR_TEST_CHECKPOINT."""
    import os
    ours, opt, _, _ = _pair("shm", torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1))
    for step in range(4):
        if step == 2:
            ours.first_bucket_bytes = 3 * KB
        x, y = _batch(rank, step)
        opt.zero_grad()
        _loss(ours, x, y).backward()
        opt.step()
    saved = {"model": ours.module.state_dict(), "opt": opt.state_dict()}
    if rank == 0:
        torch.save(saved, os.environ["FR_TEST_CHECKPOINT"])
    ours.close()


def check_resume_at_this_world_size(rank, world):
    """The checkpoint resumed by a ShardedOptimizer and by DDP + AdamW at this world size: the
    round trip of the state, and 3 more steps of both."""
    import os
    saved = torch.load(os.environ["FR_TEST_CHECKPOINT"])
    models = []
    for wrapper in (FusedReducer, DDP):
        net = _net(seed=1)
        net.load_state_dict(saved["model"])
        models.append(wrapper(net, **({"backend": "shm"} if wrapper is FusedReducer else {})))
    ours, ddp = models
    opt = ShardedOptimizer(ours, torch.optim.AdamW, lr=0.5)  # the checkpoint's groups win
    ref = torch.optim.AdamW(ddp.parameters(), lr=0.5)
    opt.load_state_dict(saved["opt"])
    ref.load_state_dict(saved["opt"])
    for step in range(4, 7):
        x, y = _batch(rank, step)
        for model, o in ((ours, opt), (ddp, ref)):
            o.zero_grad()
            loss = _loss(model, x, y)
            if model is ours and step == 4:
                # The first forward applied this world size's sharded layout: the loaded state
                # is split into its fragments, and consolidated again by state_dict().
                split = ours.attachment.reducer.sharded_layout() and opt._inner is None
                again = opt.state_dict()["state"]
                split = split and len(opt._inner.state) > 0
                round_trip = max((again[i][k] - v).abs().max().item()
                                 for i, s in saved["opt"]["state"].items() for k, v in s.items())
            loss.backward()
            o.step()
    out = (round_trip, _max_diff(ours.module.parameters(), ddp.module.parameters()),
           opt.param_groups[0]["lr"], split)
    ours.close()
    return out


def test_a_sharded_checkpoint_resumes_at_another_world_size(tmp_path, monkeypatch):
    """Saved by ShardedOptimizer at 3 ranks, resumed at 2 (by a ShardedOptimizer and by DDP +
    AdamW from the same file): the state, split into the fragments of the new world size's
    layout and consolidated again, round-trips exactly, and the two then train bit-identically
    (2 ranks)."""
    monkeypatch.setenv("FR_TEST_CHECKPOINT", str(tmp_path / "sharded.pt"))
    per_rank(run_checks([check_save_at_this_world_size], 3, timeout=300),
             "check_save_at_this_world_size")
    for round_trip, diff, lr, split in per_rank(run_checks([check_resume_at_this_world_size], 2,
                                                     timeout=300),
                                         "check_resume_at_this_world_size"):
        assert split, "the loaded state must have been split into this world size's fragments"
        assert round_trip == 0.0, round_trip
        assert lr == 1e-2, lr
        assert diff == 0.0, diff
