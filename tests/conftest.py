"""Suite-wide settings: reproducible hypothesis runs, and the per-test deadline the harness needs.

Hypothesis profiles (choose with HYPOTHESIS_PROFILE=<name>; default "ci"):
    ci    derandomized (the same examples on every run, so a CI failure reproduces locally),
          no example database (nothing written into the working tree), no deadline (a shared
          2-core machine makes timing-based deadlines flaky).
    deep  for local bug hunting: random examples, 10x the examples where a test does not pin
          max_examples itself, failures remembered in ~/.cache/fused_reducer/hypothesis and
          replayed first next time. e.g. HYPOTHESIS_PROFILE=deep pytest tests/test_bucket_assignment.py
"""
import os
import time

import pytest
from hypothesis import settings
from hypothesis.database import DirectoryBasedExampleDatabase

import dist_utils

settings.register_profile("ci", derandomize=True, database=None, deadline=None, print_blob=True)
settings.register_profile(
    "deep", derandomize=False, deadline=None, print_blob=True,
    max_examples=10 * settings.default.max_examples,
    database=DirectoryBasedExampleDatabase(
        os.path.join(os.path.expanduser("~"), ".cache", "fused_reducer", "hypothesis")))
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def _pytest_timeout(item):
    """The test's pytest-timeout in seconds (marker, --timeout, PYTEST_TIMEOUT or ini), or None."""
    try:
        from pytest_timeout import _get_item_settings
        return _get_item_settings(item).timeout or None
    except Exception:  # noqa: BLE001 - plugin absent or its internals changed: no deadline
        return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    # pytest-timeout counts setup (module fixtures that spawn ranks) + call + teardown from here;
    # the harness ends its waits before that, so a hang is reported with the ranks' stacks.
    seconds = _pytest_timeout(item)
    dist_utils.set_test_deadline(time.monotonic() + seconds if seconds else None)
    try:
        yield
    finally:
        dist_utils.set_test_deadline(None)
