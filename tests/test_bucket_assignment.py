"""fused_reducer._C.assign_buckets against an independent pure-Python reading of
Note [Bucket assignment] (ext/bucket_assignment.h):

* parameters are visited in `order`; each group (dtype, device) fills one open bucket at a time;
* a bucket closes as soon as its byte size reaches its limit (size >= limit), so a parameter is
  never split and a bucket may exceed its limit;
* the k-th bucket of a group has limit caps[k], the last entry repeating (`[first, cap]`: `first`
  for k == 0 and `cap` after; a longer list is DDP's bucket_cap_mb_list);
* buckets come back in launch order: by the position in `order` of their first parameter, each
  listing its parameter indices in `order` order;
* with a last bucket (last > 0), each group's shortest suffix (in `order`) reaching `last` bytes
  is a bucket of its own, unless it is the whole group; the rest is bucketed as above.
"""
import pytest
from hypothesis import given, settings, strategies as st

from fused_reducer import _C


def reference_assign(sizes, groups, order, first, cap, last=0):
    return reference_assign_caps(sizes, groups, order, [first, cap], last)


def reference_assign_caps(sizes, groups, order, caps, last=0):
    """Straightforward re-statement of the rule; shares no code with the C++ version."""
    position = {index: pos for pos, index in enumerate(order)}
    finished = []
    tail = set()
    if last > 0:
        for g in {groups[i] for i in order}:
            members = [i for i in order if groups[i] == g]
            k, total = len(members), 0
            while k > 0 and total < last:  # grow the suffix until it reaches `last`
                k -= 1
                total += sizes[members[k]]
            if k > 0:  # a suffix that is the whole group is not split off
                finished.append(members[k:])
                tail.update(members[k:])
    open_buckets = {}  # group -> [indices, bytes, buckets already closed in this group]
    for index in (i for i in order if i not in tail):
        g = groups[index]
        state = open_buckets.setdefault(g, [[], 0, 0])
        state[0].append(index)
        state[1] += sizes[index]
        limit = caps[min(state[2], len(caps) - 1)]
        if state[1] >= limit:
            finished.append(state[0])
            open_buckets[g] = [[], 0, state[2] + 1]
    finished.extend(state[0] for state in open_buckets.values() if state[0])
    return sorted(finished, key=lambda bucket: position[bucket[0]])


def assign(sizes, groups, order, first, cap, last=0):
    return assign_caps(sizes, groups, order, [first, cap], last)


def assign_caps(sizes, groups, order, caps, last=0):
    return [list(b) for b in _C.assign_buckets(list(sizes), list(groups), list(order), list(caps),
                                               last)]


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


@st.composite
def bucketing_problems_with_last(draw):
    sizes, groups, order, first, cap = draw(bucketing_problems())
    last = draw(st.one_of(st.just(0), st.integers(1, 128), st.integers(1, 10_000),
                          st.integers(1, 1 << 50)))
    return sizes, groups, order, first, cap, last


@settings(max_examples=400, deadline=None)
@given(bucketing_problems())
def test_assignment_matches_python_reference(problem):
    sizes, groups, order, first, cap = problem
    assert assign(sizes, groups, order, first, cap) == reference_assign(sizes, groups, order,
                                                                        first, cap)


@settings(max_examples=400, deadline=None)
@given(bucketing_problems_with_last())
def test_assignment_with_last_bucket_matches_python_reference(problem):
    sizes, groups, order, first, cap, last = problem
    assert (assign(sizes, groups, order, first, cap, last)
            == reference_assign(sizes, groups, order, first, cap, last))


@settings(max_examples=300, deadline=None)
@given(bucketing_problems_with_last(), st.lists(st.one_of(st.integers(1, 128),
                                                          st.integers(1, 10_000)),
                                                min_size=1, max_size=6))
def test_a_list_of_limits_matches_python_reference(problem, caps):
    """DDP's bucket_cap_mb_list: the k-th bucket of each group closes at caps[k], the last
    entry repeating."""
    sizes, groups, order, _, _, last = problem
    assert (assign_caps(sizes, groups, order, caps, last)
            == reference_assign_caps(sizes, groups, order, caps, last))


@settings(max_examples=300, deadline=None)
@given(bucketing_problems_with_last())
def test_last_bucket_is_the_shortest_tail_reaching_last_bytes(problem):
    """Without the reference: each group's last bucket is a suffix of the group that reaches
    `last` and would not without its first parameter, or else the group was left whole to the
    [first, cap] rule; last=0 changes nothing."""
    sizes, groups, order, first, cap, last = problem
    buckets = assign(sizes, groups, order, first, cap, last)
    assert sorted(i for b in buckets for i in b) == list(range(len(sizes)))
    if last == 0:
        assert buckets == assign(sizes, groups, order, first, cap)
        return

    def plain(members):  # the [first, cap] rule alone on these parameters, in this order
        got = assign([sizes[i] for i in members], [0] * len(members), list(range(len(members))),
                     first, cap)
        return [[members[j] for j in b] for b in got]

    for g in set(groups):
        members = [i for i in order if groups[i] == g]
        mine = [b for b in buckets if groups[b[0]] == g]
        if sum(sizes[i] for i in members[1:]) < last:
            # the shortest suffix reaching `last` would be the whole group: nothing split off
            assert mine == plain(members)
            continue
        tail = mine[-1]
        assert tail == members[len(members) - len(tail):]  # a suffix, in order
        total = sum(sizes[i] for i in tail)
        assert total >= last and total - sizes[tail[0]] < last
        rest = members[: len(members) - len(tail)]
        assert mine[:-1] == plain(rest)


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


def test_last_bucket_splits_off_the_shortest_tail_then_first_and_cap_apply():
    sizes = [4] * 6
    assert assign(sizes, [0] * 6, list(range(6)), 8, 8, 5) == [[0, 1], [2, 3], [4, 5]]
    assert assign(sizes, [0] * 6, list(range(6)), 8, 8, 4) == [[0, 1], [2, 3], [4], [5]]
    # A first bucket big enough for everything still leaves the last bucket separate.
    assert assign(sizes, [0] * 6, list(range(5, -1, -1)), 1 << 30, 8, 4) == [[5, 4, 3, 2, 1], [0]]
    # A last bucket that would hold the whole group is not split off.
    assert assign([4, 4], [0, 0], [0, 1], 4, 4, 100) == [[0], [1]]
    # Each group gets its own last bucket.
    assert assign([4] * 4, [0, 1, 0, 1], [0, 1, 2, 3], 100, 100, 4) == [[0], [1], [2], [3]]


def test_negative_last_bucket_raises_value_error_naming_it():
    with pytest.raises(ValueError, match="last_bucket_bytes"):
        assign([4, 4], [0, 0], [1, 0], 8, 8, -1)


def test_empty_input_gives_no_buckets():
    assert assign([], [], [], 1, 1) == []


@pytest.mark.parametrize("first, cap, setting", [
    (0, 10, r"bucket_caps_bytes\[0\]"), (-1, 10, r"bucket_caps_bytes\[0\]"),
    (10, 0, r"bucket_caps_bytes\[1\]"), (10, -5, r"bucket_caps_bytes\[1\]"),
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
