"""The packed budget (ODBConfig.budget="packed"): the best-fit-decreasing rule, P3 under it,
its configuration and handshake, and the protocol running it."""

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from odb_core import InvalidSampleError, ODBConfig, audit, simulate
from odb_core.budgets import BUFFER_RULES, form, group_cost, within_budget
from odb_core.epoch import EpochDriver
from odb_core.errors import ConfigMismatchError
from odb_core.packing import pack_buffer, pack_groups


def reference_best_fit(lengths: list[int], budget: int, held: frozenset[int] = frozenset()) -> list[list[int]]:
    """The rule's prose, literally: the held indices longest first, then the others longest
    first (ties: the larger index first), each sample into the fullest group it fits in (ties:
    the group opened first), else a new group; each group short to long, the groups ordered
    by their longest index (short to long)."""
    groups: list[list[int]] = []
    key = lambda i: (lengths[i], i)  # noqa: E731
    walk = sorted(held, key=key, reverse=True) + sorted(set(range(len(lengths))) - held, key=key, reverse=True)
    for i in walk:
        size = max(lengths[i], 1)
        loads = [sum(max(lengths[k], 1) for k in g) for g in groups]
        fits = [j for j, load in enumerate(loads) if load + size <= budget]
        if fits:
            best = max(fits, key=lambda j: (loads[j], -j))
            groups[best].append(i)
        else:
            groups.append([i])
    return sorted((sorted(g, key=key) for g in groups), key=lambda g: key(g[-1]))


lengths_st = st.lists(st.integers(0, 5000), max_size=300)
budget_st = st.integers(1, 4096)


@given(lengths_st, budget_st)
def test_matches_the_rules_prose(lengths, budget):
    assert pack_groups(lengths, budget) == reference_best_fit(lengths, budget)


@st.composite
def held_buffers(draw):
    """A buffer (key -> length) and the keys regroup held back at the last round (any subset)."""
    lengths = draw(st.lists(st.integers(0, 600), max_size=120))
    held = draw(st.sets(st.sampled_from(range(len(lengths))))) if lengths else set()
    return lengths, frozenset(held), draw(st.integers(1, 1200))


@given(held_buffers())
def test_held_samples_walked_first_matches_the_prose(case):
    lengths, held, budget = case
    assert pack_buffer(dict(enumerate(lengths)), budget, held) == reference_best_fit(lengths, budget, held)


@given(held_buffers())
def test_held_first_keeps_p3_the_partition_and_the_layout(case):
    """Walking the held samples first changes which samples share a group, never P3, the
    partition or the layout the alignment relies on (each group short to long, groups by
    their longest sample)."""
    lengths, held, budget = case
    groups = pack_buffer(dict(enumerate(lengths)), budget, held)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        assert within_budget("packed", [lengths[i] for i in g], budget)
        assert [(lengths[i], i) for i in g] == sorted((lengths[i], i) for i in g)
    tops = [(lengths[g[-1]], g[-1]) for g in groups]
    assert tops == sorted(tops)


def test_held_samples_first_choose_their_partners():
    """The round after regroup held {3, 4} (7 of 10 tokens), 5 arrives: walked first, the held
    pair stays together and 5 opens a group; walked last (the old rule), 5 takes 4 and 3 is
    left alone, part-full again (the second buffer of conformance's join_1_held_first)."""
    lengths = {0: 3, 2: 4, 3: 5}
    assert pack_buffer(lengths, 10, frozenset({0, 2})) == [[0, 2], [3]]
    assert pack_buffer(lengths, 10) == [[0], [2, 3]]


@given(lengths_st, budget_st)
def test_every_index_in_exactly_one_group(lengths, budget):
    groups = pack_groups(lengths, budget)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert all(groups)


@given(lengths_st, budget_st)
def test_p3_packed_budget_and_over_budget_samples_alone(lengths, budget):
    for g in pack_groups(lengths, budget):
        if len(g) >= 2:
            assert sum(max(lengths[i], 1) for i in g) <= budget
            assert all(lengths[i] <= budget for i in g)
        assert within_budget("packed", [lengths[i] for i in g], budget)


@given(lengths_st, budget_st)
def test_groups_run_short_to_long(lengths, budget):
    """The layout the alignment relies on: keys ascending inside a group, so a split takes
    the longest sample off, and groups ordered by their longest sample."""
    groups = pack_groups(lengths, budget)
    for g in groups:
        assert [(lengths[i], i) for i in g] == sorted((lengths[i], i) for i in g)
    tops = [(lengths[g[-1]], g[-1]) for g in groups]
    assert tops == sorted(tops)


@given(st.lists(st.integers(0, 500), max_size=100), st.integers(1, 1000), st.randoms(use_true_random=False))
def test_buffer_order_does_not_matter(lengths, budget, rnd):
    """P8: the grouping depends on the buffer's contents, not on its insertion order."""
    keys = list(range(len(lengths)))
    rnd.shuffle(keys)
    assert pack_buffer({k: lengths[k] for k in keys}, budget) == pack_groups(lengths, budget)


def test_best_fit_not_first_fit():
    # 12 and 10 open groups with room 8 and 10; 9 goes to the second (room 1); 1 goes to the
    # fullest group it fits in, the second: first fit would put it with 12
    assert pack_groups([1, 9, 12, 10], 20) == [[0, 1, 3], [2]]


def test_worked_example_and_zero_lengths():
    assert pack_groups([100, 200, 500, 800], 1000) == [[0, 2], [1, 3]]
    assert [len(g) for g in pack_groups([0] * 7, 3)] == [1, 3, 3]  # a zero length counts as 1
    assert pack_groups([12, 3, 3], 10) == [[1, 2], [0]]  # 12 > L_max travels alone


def test_bad_input_is_a_typed_error():
    with pytest.raises(InvalidSampleError, match="sample 1"):
        pack_groups([3, -1], 10)
    with pytest.raises(InvalidSampleError, match="token_budget"):
        pack_groups([3], 0)


def test_group_cost_per_budget():
    assert group_cost("padded", [2, 5, 3]) == 15 and group_cost("packed", [2, 5, 3]) == 10
    assert group_cost("packed", [0, 0]) == 2 and group_cost("padded", []) == 0
    assert within_budget("packed", [2, 5, 3], 10) and not within_budget("padded", [2, 5, 3], 10)
    assert within_budget("padded", [99], 10)  # a lone sample always passes
    with pytest.raises(ValueError, match="unknown budget"):
        group_cost("sparse", [1])
    assert form("packed", [4, 6], 10) == [[0, 1]] and form("padded", [4, 6], 10) == [[0], [1]]
    assert BUFFER_RULES["packed"] is pack_buffer


def test_config_field():
    assert ODBConfig(token_budget=10).budget == "padded"
    assert ODBConfig(token_budget=10, budget="packed").budget == "packed"
    with pytest.raises(ValidationError, match="budget"):
        ODBConfig(token_budget=10, budget="sparse")


def test_ranks_that_disagree_on_the_budget_fail_the_handshake():
    drivers = [EpochDriver(ODBConfig(token_budget=10, budget=kind), r, 2) for r, kind in enumerate(("padded", "packed"))]
    gathered = [d.hello() for d in drivers]
    with pytest.raises(ConfigMismatchError) as info:
        drivers[0].check_hello(gathered)
    assert info.value.field == "budget" and info.value.ranks == (1,)


def test_packed_protocol_fills_the_budget():
    """The real protocol under the packed budget: groups the B(l) walk pads are packed, so it
    emits fewer, fuller groups; over-budget samples are counted, not dropped."""
    rng = random.Random(0)
    lengths = [rng.randint(1, 3000) for _ in range(3000)] + [9000, 12000]
    padded = audit(simulate(lengths, 2, ODBConfig(token_budget=8192, buffer_size=256), "in_order"))
    packed = audit(simulate(lengths, 2, ODBConfig(token_budget=8192, buffer_size=256, budget="packed"), "in_order"))
    assert packed.coverage_exact and packed.over_budget_singletons == 2
    assert packed.budget_fill > 0.97 > padded.budget_fill
    assert packed.steps_per_rank[0] < padded.steps_per_rank[0]
