"""The benchmarks compare against DDP's best settings for the run, as the
installed torch's DDP takes them, with DDP(model) as a second row; and the report tables say so.
In-process and fast (the end-to-end runs are tests/test_bench.py's step_bench smoke tests)."""
import os
import sys

import pytest
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import common  # noqa: E402
import report  # noqa: E402
import step_bench  # noqa: E402
from step import configs, measure  # noqa: E402


class DDPWithEverything:
    def __init__(self, module, bucket_cap_mb=None, bucket_cap_mb_list=None,
                 batched_grad_copy=False):
        pass


class DDPBefore214:
    def __init__(self, module, bucket_cap_mb=None, gradient_as_bucket_view=False):
        pass


def test_best_settings_follow_the_installed_signature():
    kwargs, why = common.ddp_best_kwargs(1.0, 25.0, DDPWithEverything)
    assert why is None and kwargs == {"batched_grad_copy": True, "bucket_cap_mb_list": [1.0, 25.0]}
    # equal limits: an explicit cap is DDP's first bucket too
    assert common.ddp_best_kwargs(25.0, 25.0, DDPWithEverything) == (
        {"batched_grad_copy": True, "bucket_cap_mb": 25.0}, None)
    # an older DDP: nothing it does not take; the limits then go through its module defaults
    kwargs, why = common.ddp_best_kwargs(1.0, 25.0, DDPBefore214)
    assert kwargs == {} and "bucket_cap_mb_list" in why
    assert common.ddp_best_kwargs(8.0, 8.0, DDPBefore214) == ({"bucket_cap_mb": 8.0}, None)


def test_the_installed_ddp_gets_batched_copies_and_the_bucket_list_where_it_has_them():
    import inspect
    params = inspect.signature(nn.parallel.DistributedDataParallel.__init__).parameters
    kwargs, why = common.ddp_best_kwargs(1.0, 25.0)
    assert kwargs.get("batched_grad_copy") is (True if "batched_grad_copy" in params else None)
    if "bucket_cap_mb_list" in params:
        assert why is None and kwargs["bucket_cap_mb_list"] == [1.0, 25.0]
    assert configs.ddp_settings(1.0, 25.0)["ddp_default"] == "DDP(model)"
    assert "batched_grad_copy=True" in configs.ddp_settings(1.0, 25.0)["ddp"] or (
        "batched_grad_copy" not in params)


def test_no_ddp_default_flag_is_documented():
    text = step_bench.build_parser().format_help()
    assert "--no-ddp-default" in text and "DDP(model)" in text


def _row(impl, median, **extra):
    row = {"model": "m", "first_bucket_mb": 1.0, "bucket_cap_mb": 25.0, "impl": impl,
           "median_ms": median, "p90_ms": median * 1.1, "collectives_per_step": 2,
           "bytes_per_step": 4e6, "exposed_comm_ms": 1.0, "bucket_sizes": [1, 2], "params": 1e6,
           "tensors": 4, "steps": 5}
    row.update(extra)
    return row


META = {"command": "python bench/step_bench.py", "date": "2026-12-04T00:00:00", "cpu_count": 2,
        "world_size": 2, "backend": "gloo", "torch_version": "2.14.1", "device_type": "cpu",
        "benchmark": "step_bench"}


def test_step_table_names_ddp_best_and_default_and_how_they_were_built():
    data = {"meta": META, "rows": [
        _row("ddp", 10.0, ratio_to_ddp=1.0, ratio_to_ddp_default=0.8,
             constructed_as="DDP(batched_grad_copy=True, bucket_cap_mb_list=[1.0, 25.0])"),
        _row("ddp_default", 12.5, ratio_to_ddp=1.25, ratio_to_ddp_default=1.0,
             constructed_as="DDP(model)"),
        _row("fused", 9.0, ratio_to_ddp=0.9, ratio_to_ddp_default=0.72)]}
    table = report.step_table(data)
    assert "median / DDP best" in table and "median / DDP default" in table
    assert "| m | 1 / 25 | DDP best | 10.0 |" in table
    assert "| DDP default | 12.5 |" in table and "| **0.900** | 0.720 |" in table
    assert "bucket_cap_mb_list=[1.0, 25.0]" in table and "`DDP(model)`" in table
    summary = report.summary_table([data])
    assert "DDP best ms" in summary and "| 12.5 |" in summary and "to DDP default: 0.720" in summary


def test_step_table_of_an_older_run_keeps_calling_its_row_ddp():
    data = {"meta": META, "rows": [_row("ddp", 10.0, ratio_to_ddp=1.0),
                                   _row("fused", 9.0, ratio_to_ddp=0.9)]}
    table = report.step_table(data)
    assert "median / DDP |" in table and "DDP best" not in table and "DDP default" not in table
    assert "| m | 1 / 25 | DDP | 10.0 |" in table


def test_memory_table():
    rows = [{"impl": "ddp", "gv": False, "added": 200.0, "added_raw": 230.0, "added_shmem": 0.0,
             "train_peak": 230.0},
            {"impl": "ddp-best", "gv": False, "added": 198.0, "added_raw": 200.0,
             "added_shmem": 0.0, "train_peak": 215.0},
            {"impl": "fused-shm", "gv": False, "added": 195.0, "added_raw": 196.0,
             "added_shmem": 1.4, "train_peak": 212.0, "retained_raw": 0.1, "retained": 0.0,
             "rebuild_peak": 0.5}]
    data = {"meta": {"benchmark": "memory_bench", "command": "python bench/memory_bench.py",
                     "date": "2026-12-04T00:00:00", "cpu_count": 2, "torch_version": "2.14.1"},
            "settings": {"changes": 3}, "rows": rows}
    table = report.memory_table(data)
    assert "3 limit changes" in table
    assert "| FusedReducer, shm | off | **195.0** | 1.4 | 196.0 | 212.0 | **0.975** | 0.985 | " \
           "0.1 / 0.0 | 0.5 |" in table
    assert "| DDP default | off | **200.0** |" in table


@pytest.mark.parametrize("impls", [("ddp", "ddp_default", "fused"),
                                   ("ddp", "ddp_default", "fused", "ddp_aa")])
def test_ddp_default_is_interleaved_like_the_others(impls):
    variants = [(name, None) for name in impls]
    cycle = measure._order_cycle(len(variants))
    firsts = [measure.round_order(variants, r)[0][0] for r in range(len(cycle))]
    assert set(firsts) == set(impls)
