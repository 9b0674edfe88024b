"""The Lightning strategy's settings reach the reducer (its timeout, the transport's).

Each test checks a behaviour against an independent reference (DDP on the same model and data,
a float64 average of locally computed gradients, the profiler's record of the collectives, or the
test's own count). The checks of the selected tests run in ONE spawn of 2 gloo ranks
(SelectedChecks, the module fixture).
"""
from datetime import timedelta

import pytest

from dist_utils import SelectedChecks, per_rank
from ddp_comparison import Net, build


def check_lightning_timeout_reaches_the_reducer(rank, world):
    """Record what the strategy's wrapping passes to the C++ reducer and to the transport."""
    from fused_reducer.core import attachment as reducer_module
    from fused_reducer.lightning import FusedReducerStrategy
    real_c, real_make = reducer_module._C, reducer_module.make_transport
    seen = {}

    class RecordingC:
        def __getattr__(self, name):
            return getattr(real_c, name)

        def Reducer(self, *args, **kwargs):  # noqa: N802 - stands in for the class
            options = kwargs["options"] if "options" in kwargs else args[5]
            seen.setdefault("reducer", []).append(options.timeout_seconds)
            return real_c.Reducer(*args, **kwargs)

    def make_transport(group, device, backend, timeout_s, **kwargs):
        seen.setdefault("transport", []).append(timeout_s)
        return real_make(group, device, backend, timeout_s, **kwargs)

    reducer_module._C, reducer_module.make_transport = RecordingC(), make_transport
    try:
        out = {}
        for given in (timedelta(seconds=37), 41):
            strategy = FusedReducerStrategy(timeout=given, first_bucket_mb=1)
            model = strategy._setup_model(build(Net))
            out[str(given)] = {"reducer": seen["reducer"][-1], "transport": seen["transport"][-1],
                               "strategy": strategy._timeout.total_seconds()}
            model.close()
        return out
    finally:
        reducer_module._C, reducer_module.make_transport = real_c, real_make


CHECKS = SelectedChecks()
outcomes = CHECKS.fixture(timeout=240)  # the selected tests' checks, in one spawn


@CHECKS.uses(check_lightning_timeout_reaches_the_reducer)
def test_lightning_strategy_timeout_reaches_the_reducer_and_its_transport(outcomes):
    """Slip: FusedReducerStrategy keeping `timeout` for the process group only (the reducer
    then waits its default 10 minutes on a dead peer)."""
    pytest.importorskip("pytorch_lightning", reason="Lightning is not installed")
    for r in per_rank(outcomes, "check_lightning_timeout_reaches_the_reducer"):
        assert r["0:00:37"] == {"reducer": 37.0, "transport": 37.0, "strategy": 37.0}, r
        assert r["41"] == {"reducer": 41.0, "transport": 41.0, "strategy": 41.0}, r
