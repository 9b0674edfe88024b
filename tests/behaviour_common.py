"""Models and helpers shared by the behaviour test files (test_gradient_route.py,
test_bucket_rebuilds.py, test_no_sync.py, ...): stand-in models, the float64 reference of
averaged gradients, the profiler's count of collectives."""
import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import ProfilerActivity, profile

from dist_utils import ALLREDUCE_EVENTS, SHAPED_ALLREDUCE_EVENTS
from ddp_comparison import ddp, loss_of


def fused(module, **kwargs):
    """FusedReducer with DDP's 1 MiB first bucket unless kwargs say otherwise."""
    from fused_reducer import FusedReducer
    kwargs.setdefault("first_bucket_mb", 1)
    return FusedReducer(module, **kwargs)


def reference_grads(model_state, module_factory, inputs, rank, **fwd):
    """The average over ranks of locally computed gradients, in float64 with plain all_reduce
    (None where no rank produced a gradient)."""
    ref = module_factory()
    ref.load_state_dict(model_state)
    x, y = inputs
    loss_of(ref(x, **fwd), y, rank).backward()
    out = {}
    for name, p in ref.named_parameters():
        g = torch.zeros_like(p, dtype=torch.float64) if p.grad is None else p.grad.double()
        used = torch.tensor([0.0 if p.grad is None else 1.0], dtype=torch.float64)
        dist.all_reduce(g)
        dist.all_reduce(used)
        out[name] = None if used.item() == 0 else (g / dist.get_world_size()).to(p.dtype)
    return out


class SwappedBranches(nn.Module):
    """Two bias-free branches of the same size computed in a rank-dependent order: autograd makes
    their gradients ready in a different order on each rank, and with one parameter per bucket
    their two buckets have the same size (a swap cannot show up as a size mismatch)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.a = nn.Linear(8, 8, bias=False)
        self.b = nn.Linear(8, 8, bias=False)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        if dist.get_rank() % 2 == 0:
            ya, yb = self.a(h), self.b(h)
        else:
            yb, ya = self.b(h), self.a(h)
        return self.head(torch.tanh(ya) * torch.sigmoid(yb))


def wrap(kind, module, **kwargs):
    """DDP, or FusedReducer with DDP's 1 MiB first bucket (always FusedReducer: these checks use
    its own API, so FUSED_TESTS_AGAINST_DDP, which checks the side-by-side files, does not apply)."""
    if kind == "ddp":
        return ddp(module, **kwargs)
    from fused_reducer import FusedReducer
    kwargs.setdefault("first_bucket_mb", 1)
    return FusedReducer(module, **kwargs)


ELEMENT = {"float": 4, "double": 8, "int": 4, "long int": 8, "c10::BFloat16": 2, "c10::Half": 2}


ENV = "FUSED_REDUCER_FIRST_BUCKET_BYTES"


MiB = 1 << 20


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3)
        self.conv2 = nn.Conv2d(8, 8, 3)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        y = torch.relu(self.conv2(torch.relu(self.conv1(x))))
        return self.head(y.mean(dim=(2, 3)))


def fused_with_its_defaults(module, **kwargs):
    """FusedReducer with its own defaults (first bucket included)."""
    from fused_reducer import FusedReducer
    return FusedReducer(module, **kwargs)


def collectives(fn):
    """What fn ran, from the profiler: (number of all-reduces, sorted (bytes, dtype) of each);
    see dist_utils.ALLREDUCE_EVENTS."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    count, moved = 0, []
    for e in prof.events():
        count += e.name in ALLREDUCE_EVENTS
        if e.name in SHAPED_ALLREDUCE_EVENTS:
            numel = 1
            for d in e.input_shapes[0]:
                numel *= d
            moved.append((numel * ELEMENT[e.input_dtypes[0]], e.input_dtypes[0]))
    return count, sorted(moved)
