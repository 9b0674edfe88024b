"""fused_reducer._C.assign_buckets against an independent pure-Python reading of
Note [Bucket assignment] (ext/bucket_assignment.h):

* parameters are visited in `order`; each group (dtype, device) fills one open bucket at a time;
* a bucket closes as soon as its byte size reaches its limit (size >= limit), so a parameter is
  never split and a bucket may exceed its limit;
* the k-th bucket of a group has limit `first` for k == 0 and `cap` after;
* buckets come back in launch order: by the position in `order` of their first parameter, each
  listing its parameter indices in `order` order.
"""
import pytest
from hypothesis import given, settings, strategies as st

from fused_reducer import _C


def reference_assign(sizes, groups, order, first, cap):
    """Straightforward re-statement of the rule; shares no code with the C++ version."""
    position = {index: pos for pos, index in enumerate(order)}
    open_buckets = {}  # group -> [indices, bytes, buckets already closed in this group]
    finished = []
    for index in order:
        g = groups[index]
        state = open_buckets.setdefault(g, [[], 0, 0])
        state[0].append(index)
        state[1] += sizes[index]
        limit = first if state[2] == 0 else cap
        if state[1] >= limit:
            finished.append(state[0])
            open_buckets[g] = [[], 0, state[2] + 1]
    finished.extend(state[0] for state in open_buckets.values() if state[0])
    return sorted(finished, key=lambda bucket: position[bucket[0]])


def assign(sizes, groups, order, first, cap):
    return [list(b) for b in _C.assign_buckets(list(sizes), list(groups), list(order), first, cap)]


# -- property-based ----------------------------------------------------------------------------

@st.composite
def bucketing_problems(draw):
    n = draw(st.integers(min_value=0, max_value=40))
    # Mostly small sizes so that several parameters share buckets, sometimes huge ones, some 0.
    size = st.one_of(st.integers(0, 64), st.integers(0, 4096), st.integers(1, 1 << 40))
    sizes = draw(st.lists(size, min_size=n, max_size=n))
    # Group labels are arbitrary integers (the reducer numbers (dtype, device) pairs).
    labels = draw(st.lists(st.integers(-(1 << 62), 1 << 62), min_size=1, max_size=4, unique=True))
    groups = draw(st.lists(st.sampled_from(labels), min_size=n, max_size=n))
    order = draw(st.permutations(list(range(n))))
    limit = st.one_of(st.integers(1, 128), st.integers(1, 10_000), st.integers(1, 1 << 50))
    first = draw(limit)
    cap = draw(limit)
    return sizes, groups, order, first, cap


@settings(max_examples=400, deadline=None)
@given(bucketing_problems())
def test_assignment_matches_python_reference(problem):
    sizes, groups, order, first, cap = problem
    assert assign(sizes, groups, order, first, cap) == reference_assign(sizes, groups, order,
                                                                        first, cap)


@settings(max_examples=300, deadline=None)
@given(bucketing_problems())
def test_assignment_invariants_hold(problem):
    """Rule-level invariants checked without the reference: a partition of all parameters, one
    group per bucket, order preserved, closed buckets reached their limit and would not have
    reached it one parameter earlier, launch order by first position."""
    sizes, groups, order, first, cap = problem
    buckets = assign(sizes, groups, order, first, cap)
    position = {index: pos for pos, index in enumerate(order)}

    flat = [i for b in buckets for i in b]
    assert sorted(flat) == list(range(len(sizes)))
    assert all(b for b in buckets)
    for b in buckets:
        assert len({groups[i] for i in b}) == 1
        assert [position[i] for i in b] == sorted(position[i] for i in b)
    assert [position[b[0]] for b in buckets] == sorted(position[b[0]] for b in buckets)

    by_group = {}
    for b in buckets:
        by_group.setdefault(groups[b[0]], []).append(b)
    for group_buckets in by_group.values():
        for k, b in enumerate(group_buckets):
            limit = first if k == 0 else cap
            total = sum(sizes[i] for i in b)
            assert total - sizes[b[-1]] < limit  # never closed later than needed
            if k < len(group_buckets) - 1:
                assert total >= limit  # only the group's last bucket may stay under its limit


# -- hand-written cases ------------------------------------------------------------------------

def test_param_larger_than_cap_gets_its_own_bucket():
    sizes = [10, 1000, 10, 10]
    # order 3, 2, 1, 0: first bucket (limit 15) = [3, 2]; then 1 alone exceeds the cap 50.
    assert assign(sizes, [0] * 4, [3, 2, 1, 0], 15, 50) == [[3, 2], [1], [0]]
    # A huge parameter first: it fills the first bucket on its own and is not split.
    assert assign([1 << 30, 4, 4], [0, 0, 0], [0, 1, 2], 8, 8) == [[0], [1, 2]]


def test_first_limit_applies_to_first_bucket_only_then_cap():
    sizes = [4] * 6
    assert assign(sizes, [0] * 6, list(range(6)), 4, 8) == [[0], [1, 2], [3, 4], [5]]
    assert assign(sizes, [0] * 6, list(range(6)), 12, 4) == [[0, 1, 2], [3], [4], [5]]


def test_mixed_groups_never_share_a_bucket():
    sizes = [4, 4, 4, 4]
    groups = [0, 1, 0, 1]
    buckets = assign(sizes, groups, [0, 1, 2, 3], 100, 100)
    assert buckets == [[0, 2], [1, 3]]
    # Each group has its own [first, cap, ...] sequence.
    buckets = assign([4] * 6, [0, 1, 0, 1, 0, 1], list(range(6)), 4, 8)
    assert buckets == [[0], [1], [2, 4], [3, 5]]


def test_buckets_are_in_launch_order_by_first_position():
    # Group 1's bucket starts at position 0, so it launches first even though it closes last.
    buckets = assign([1, 8, 8], [1, 0, 0], [0, 1, 2], 8, 8)
    assert buckets == [[0], [1], [2]]
    buckets = assign([1, 8, 8, 1], [1, 0, 0, 1], [1, 0, 2, 3], 8, 8)
    assert buckets == [[1], [0, 3], [2]]


def test_empty_input_gives_no_buckets():
    assert assign([], [], [], 1, 1) == []


@pytest.mark.parametrize("first, cap, setting", [
    (0, 10, "first_bucket_bytes"), (-1, 10, "first_bucket_bytes"),
    (10, 0, "bucket_cap_bytes"), (10, -5, "bucket_cap_bytes"),
])
def test_non_positive_limits_raise_value_error_naming_the_setting(first, cap, setting):
    with pytest.raises(ValueError, match=setting):
        assign([4, 4], [0, 0], [1, 0], first, cap)


@pytest.mark.parametrize("order", [[0, 0, 1], [0, 1, 3], [0, 1, -1], [0, 1], [0, 1, 2, 0]])
def test_order_that_is_not_a_permutation_raises(order):
    with pytest.raises(ValueError, match="order"):
        assign([4, 4, 4], [0, 0, 0], order, 8, 8)


def test_one_group_per_tensor_is_required():
    with pytest.raises((ValueError, RuntimeError), match="group"):
        assign([4, 4], [0], [0, 1], 8, 8)
