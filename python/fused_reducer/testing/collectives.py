"""Internal: all-reduces counted by torch's profiler, independently of FusedReducer.stats() (the
demo, the benchmarks and the tests count the same way).

Each all-reduce shows in torch.profiler as exactly one of ALLREDUCE_EVENTS: a collective of a
c10d process group (DDP's, and FusedReducer's backend="process_group") passes through the
dispatcher op 'c10d::allreduce_' (gloo adds its own 'gloo:all_reduce' inside it: not counted, or
it would count twice); FusedReducer's shared-memory transport bypasses c10d and records one
'shm:all_reduce' (ext/shm_transport.cpp).
"""
import os

ALLREDUCE_EVENTS = ("c10d::allreduce_", "shm:all_reduce")


def count_allreduces(step_fn):
    """All-reduces in one call of `step_fn`, as torch.profiler sees them."""
    import torch
    saved = os.dup(2)  # the profiler prints a start/stop line per use on stderr: hide them
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            step_fn()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
    return sum(1 for e in prof.events() if e.name in ALLREDUCE_EVENTS)
