"""The transport probe: a per-collective latency and a bandwidth, measured on the transport the
reducer uses. The tuner (autotune.py) feeds them to the cost model for its shortlist; the
profile (profile.py) records them for the planner. Runs when called, never per step."""
import math
import time

import torch
import torch.distributed as dist

from ..transports import transport as _transport
from .costmodel import KiB, MiB


def probe_transport(transport, device, group, small=4 * KiB, large=4 * MiB, repeats=3,
                    control_device="cpu"):
    """(latency_us, bytes_per_us) of `transport` from timed all-reduces of a small and a large
    float32 buffer: the fastest of `repeats` each (after one warm-up), slowest rank (agreed with
    a tensor on `control_device`: the rank's GPU for an NCCL group)."""
    timings = []
    for nbytes in (small, large):
        flat = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device)
        transport.allreduce_sum(flat).wait()
        best = math.inf
        for _ in range(repeats):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            transport.allreduce_sum(flat).wait()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best = min(best, (time.perf_counter() - start) * 1e6)
        timings.append(best)
    t_small, t_large = _transport.control_allreduce(timings, dist.ReduceOp.MAX, group,
                                                    control_device)
    bytes_per_us = (large - small) / max(t_large - t_small, 1e-3)
    latency_us = max(t_small - small / bytes_per_us, 1.0)
    return latency_us, bytes_per_us
