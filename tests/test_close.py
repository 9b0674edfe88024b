"""close(), garbage collection and interpreter exit: the hooks go, once, for good.

Each test checks a behaviour against an independent reference (DDP on the same model and data,
a float64 average of locally computed gradients, the profiler's record of the collectives, or the
test's own count). The checks of the selected tests run in ONE spawn of 2 gloo ranks
(SelectedChecks, the module fixture).
"""
import gc
import os
import subprocess
import sys
import weakref

from behaviour_common import ENV, collectives, fused, fused_with_its_defaults
from dist_utils import SelectedChecks, assert_small, results
from ddp_comparison import (Net, build, data, grads, loss_of, max_diff, outcome,
                                same_on_all_ranks, sgd, step)


AT_EXIT_SCRIPT = r"""
import gc, sys
import torch, torch.distributed as dist
from torch import nn
from fused_reducer import FusedReducer
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
original = FusedReducer.close
def close(self):  # is_finalizing(): False in atexit handlers, True in the teardown after them
    print("close", self.tag, "while finalizing" if sys.is_finalizing() else "", flush=True)
    original(self)
FusedReducer.close = close
kept = FusedReducer(nn.Linear(4, 4))
kept.tag = "kept"
dropped = FusedReducer(nn.Linear(4, 4))
dropped.tag = "dropped"
for model in (kept, dropped):
    model(torch.randn(2, 4)).sum().backward()
del model, dropped
gc.collect()
print("end of script", flush=True)
"""


def check_close(rank, world):
    """close() twice raises nothing; a forward after close() raises naming close()."""
    model = fused(build(Net))
    x, y = data(rank, 0)
    loss_of(model(x), y, rank).backward()
    out = {"first_close": outcome(model.close)[:3], "second_close": outcome(model.close)[:3]}
    out["forward_after_close"] = outcome(lambda: model(x))[:3]
    return out


def check_close_and_gc_remove_hooks(rank, world):
    """A graph built by the reducer's forward, then close() (or the model garbage collected),
    then its backward: no hook is left to reduce it (profiler: no collective), the gradients are
    this rank's own, as if the module had never been wrapped."""
    out = {}
    for how in ("close", "garbage collection"):
        m = fused_with_its_defaults(build(Net))
        opt = sgd(m)
        step(m, opt, rank, 0)
        module = m.module
        state = {k: v.clone() for k, v in module.state_dict().items()}
        x, y = data(rank, 1)
        module.zero_grad(set_to_none=True)
        output = m(x)  # armed: this graph's backward would be averaged
        r = {}
        if how == "close":
            m.close()
        else:
            ref = weakref.ref(m)
            del m, opt
            gc.collect()
            r["freed"] = ref() is None
        r["allreduces"], _ = collectives(lambda: loss_of(output, y, rank).backward())
        local = Net()
        local.load_state_dict(state)
        loss_of(local(x), y, rank).backward()
        r["vs_local"] = max_diff(grads(local), grads(module))
        r["ranks_differ"] = same_on_all_ranks([p.grad for p in module.parameters()])
        out[how] = r
    return out


CHECKS = SelectedChecks()
outcomes = CHECKS.fixture(timeout=240)  # the selected tests' checks, in one spawn


@CHECKS.uses(check_close)
def test_close_is_idempotent_and_final(outcomes):
    for r in results(outcomes, check_close):
        assert r["first_close"] == ("ok", None), r
        assert r["second_close"] == ("ok", None), r
        assert r["forward_after_close"][:2] == ("raised", "RuntimeError"), r
        assert "close" in r["forward_after_close"][2], r


@CHECKS.uses(check_close_and_gc_remove_hooks)
def test_close_and_garbage_collection_remove_the_hooks(outcomes):
    for rank, r in enumerate(results(outcomes, check_close_and_gc_remove_hooks)):
        assert r["garbage collection"]["freed"], "the model was not garbage collected"
        for how, s in r.items():
            assert s["allreduces"] == 0, f"{how}: a hook still reduced: {s}"
            assert_small([s["vs_local"]], f"{how}: grads vs this rank's local grads")
            if rank == 1:
                assert s["ranks_differ"] > 0, f"{how}: gradients were averaged"


def test_close_runs_on_garbage_collection_and_at_exit(tmp_path):
    """A 1-rank subprocess: close() runs when a model is garbage collected, and, for a model
    still alive when the interpreter exits, at exit (an atexit handler: before the interpreter's
    teardown, not from __del__ during it)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop(ENV, None)
    result = subprocess.run([sys.executable, "-c", AT_EXIT_SCRIPT, str(tmp_path / "store")],
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line.strip() for line in result.stdout.splitlines() if line.strip()]
    assert lines == ["close dropped", "end of script", "close kept"], (lines, result.stderr[-2000:])
