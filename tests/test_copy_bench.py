"""bench/copy_bench.py lays the bucket out as the reducer does (CPU; the benchmark itself needs a
GPU and runs in bench/gpu_check.sh)."""
import os
import sys

import pytest
import torch

BENCH = os.path.join(os.path.dirname(__file__), os.pardir, "bench")
sys.path.insert(0, BENCH)

import copy_bench  # noqa: E402

NUMELS = [1, 3, 7, 8, 31, 1000, 4097, 65537]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_slots_start_on_16_bytes_in_order_with_minimal_padding(dtype):
    flat, slots = copy_bench.slot_layout(NUMELS, dtype, device="cpu")
    itemsize = flat.element_size()
    align = max(1, 16 // itemsize)
    assert [s.numel() for s in slots] == NUMELS
    offsets = [s.storage_offset() for s in slots]
    assert all(s.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() for s in slots)
    assert all(offset * itemsize % 16 == 0 for offset in offsets), "Note [Slot layout]"
    for offset, n, following in zip(offsets, NUMELS, offsets[1:] + [flat.numel()]):
        assert 0 <= following - (offset + n) < align, "slots in order, padding only to 16 bytes"
    # The plain split the benchmark used before puts most slots off 16 bytes: the scalar path.
    plain = torch.empty(sum(NUMELS), dtype=dtype).split(NUMELS)
    assert sum((p.storage_offset() * itemsize) % 16 != 0 for p in plain) >= len(NUMELS) // 2


def test_the_benchmark_offers_the_widening_unpack():
    assert "--unpack" in copy_bench.__doc__
