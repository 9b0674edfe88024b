"""The health checks' keyword arguments (docs/HEALTH.md): each option C++ binds on HealthOptions
(for_each_health_option in ext/health_checks.h) is a FusedReducer keyword argument with C++'s
default (None for an automatic float, which C++ spells 0), and a wrong value is refused at
construction, before any collective or process group, naming the option and what it takes."""
import inspect

import pytest
from torch import nn

from fused_reducer import FusedReducer, FusedReducerError
from fused_reducer import _C


def _cpp_options():
    defaults = _C.HealthOptions()
    return {name: getattr(defaults, name) for name in dir(_C.HealthOptions)
            if not name.startswith("_")}


def test_every_cpp_health_option_is_a_keyword_argument_with_cpps_default():
    signature = inspect.signature(FusedReducer.__init__).parameters
    options = _cpp_options()
    assert set(options) == {"check_finite", "straggler_interval", "straggler_window",
                            "straggler_threshold_ms", "straggler_warn_steps"}
    for name, default in options.items():
        assert name in signature, name
        expected = None if isinstance(default, float) and default == 0.0 else default
        assert signature[name].default == expected, (name, signature[name].default, default)


@pytest.mark.parametrize("name, value, says", [
    ("check_finite", 1, "must be True or False"),
    ("straggler_interval", 1.5, "must be an int number of steps"),
    ("straggler_interval", True, "must be an int number of steps"),
    ("straggler_interval", -1, "must be >= 0 steps (0: off)"),
    ("straggler_window", 0, "must be a positive number of steps"),
    ("straggler_warn_steps", 2**62, "must be an int number of steps (below 2**62)"),
    ("straggler_threshold_ms", 0, "must be a positive number of milliseconds, or None"),
    ("straggler_threshold_ms", -5.0, "must be a positive number of milliseconds, or None"),
    ("straggler_threshold_ms", "3", "must be a positive number of milliseconds, or None"),
])
def test_a_wrong_health_option_is_refused_naming_it(name, value, says):
    with pytest.raises(FusedReducerError) as raised:
        FusedReducer(nn.Linear(2, 2), **{name: value})
    assert f"{name} {says}" in str(raised.value), str(raised.value)
