"""The demo's evidence of fewer all-reduces: what examples/train_demo.py prints under torchrun
(`bash scripts/demo.sh`) equals an independent count, on both CPU transports.

The demo counts each step's all-reduces with torch.profiler. Here the same schedule (the demo's
own model and train loop) is counted without the profiler: DDP's by a communication hook that
counts the buckets it all-reduces, FusedReducer's by stats()["allreduces"] (the C++ reducer's
count of the last step). Both must equal the lists the demo prints, and those must show the
seed's evidence: DDP's default 2 all-reduces per step after its rebuild, FusedReducer 1 once the
first bucket is 16 MiB, kept after a forced rebuild. Before the fix the demo counted only the
c10d dispatcher op and printed [0, 0, 0, 0, 0, 0] for FusedReducer on shared memory.
"""
import ast
import os
import re
import subprocess
import sys

import pytest
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from dist_utils import run_ranks
from test_torchrun_restart import require_torchrun, worker_environment

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "examples", "train_demo.py")
LAUNCH_TIMEOUT_S = 180  # the demo takes ~13 s here
MiB = 1 << 20


def _demo():
    sys.path.insert(0, os.path.dirname(DEMO))
    try:
        import train_demo
    finally:
        sys.path.pop(0)
    return train_demo


def _counting_hook(state, bucket):
    state["allreduces"] += 1
    return default_hooks.allreduce_hook(None, bucket)


def independent_counts(rank, world_size, backend):
    """The demo's schedule, with each step's all-reduces counted by the reducers themselves."""
    import fused_reducer
    demo = _demo()
    ddp = DDP(demo.make_model())
    hooked = {"allreduces": 0}
    ddp.register_comm_hook(hooked, _counting_hook)

    def by_hook(step_fn):
        before = hooked["allreduces"]
        step_fn()
        return hooked["allreduces"] - before

    ddp_counts = demo.train(ddp, 4, count=by_hook)
    model = fused_reducer.FusedReducer(demo.make_model(), backend=backend)

    def by_stats(step_fn):
        step_fn()
        return model.stats()["allreduces"]

    def change(step):
        if step == 3:
            model.first_bucket_bytes = 16 * MiB

    changed = demo.train(model, 6, change, count=by_stats)
    model.rebuild_buckets()
    rebuilt = demo.train(model, 2, count=by_stats)
    transport = model.backend
    model.close()
    dist.barrier()
    return {"ddp": ddp_counts, "changed": changed, "rebuilt": rebuilt, "transport": transport}


def printed_counts(output):
    """The lists after 'all-reduces per step' in the demo's output, and its transport line."""
    found = re.findall(r"all-reduces per step (\[[0-9, ]*\])", output)
    lists = [ast.literal_eval(m) for m in found]
    transport = re.search(r"FusedReducer transport: (\w+)", output)
    assert len(lists) == 3 and transport, f"unexpected demo output:\n{output}"
    return {"ddp": lists[0], "changed": lists[1], "rebuilt": lists[2],
            "transport": transport.group(1)}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend,transport", [("auto", "shm"), ("process_group", "process_group")])
def test_demo_prints_the_all_reduce_counts_the_reducers_count(backend, transport, tmp_path):
    require_torchrun()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           DEMO, "--backend", backend]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=worker_environment(), cwd=tmp_path, timeout=LAUNCH_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-6000:]
    printed = printed_counts(proc.stdout)
    counted = run_ranks(independent_counts, 2, backend, timeout=240)
    assert counted[0] == counted[1]
    assert counted[0]["transport"] == transport
    assert printed == counted[0], f"demo printed {printed}, the reducers counted {counted[0]}"
    # The seed's evidence, as the reducers count it: DDP's default 1 MiB first bucket costs a
    # second all-reduce after its rebuild; FusedReducer's 16 MiB first bucket, set at step 3
    # (applied at step 3's forward), gives 1 from then on, also after a forced rebuild.
    assert counted[0]["ddp"] == [1, 2, 2, 2]
    assert counted[0]["changed"] == [2, 2, 2, 1, 1, 1]
    assert counted[0]["rebuilt"] == [1, 1]
