"""The B(l) grouping rule (paper Sec. 2.2, App. C) and P3 Budget."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from odb_core import InvalidSampleError, form_groups
from odb_core.grouping import batch_size_for


def reference_groups(lengths: list[int], budget: int) -> list[list[int]]:
    """The paper's prose, literally: walk longest to shortest, close at threshold t, t <- B(l_last)."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    groups, current, t = [], [], 1
    for i in reversed(order):
        current.append(i)
        if len(current) >= t:
            groups.append(list(reversed(current)))
            t = max(budget // max(lengths[i], 1), 1)
            current = []
    if current:
        groups.append(list(reversed(current)))
    return list(reversed(groups))


def test_worked_example_from_paper_appendix_c():
    assert form_groups([100, 200, 500, 800], 1000) == [[0, 1], [2], [3]]


def test_threshold_carry_over_makes_first_group_a_singleton():
    # t starts at 1, so the longest sample closes the first group alone; then t = B(100) = 10.
    assert [len(g) for g in form_groups([100] * 25, 1000)] == [4, 10, 10, 1]


lengths_st = st.lists(st.integers(0, 5000), max_size=300)
budget_st = st.integers(1, 4096)


@given(lengths_st, budget_st)
def test_matches_the_papers_walk(lengths, budget):
    assert form_groups(lengths, budget) == reference_groups(lengths, budget)


@given(lengths_st, budget_st)
def test_every_index_in_exactly_one_group(lengths, budget):
    groups = form_groups(lengths, budget)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert all(groups)


@given(lengths_st, budget_st)
def test_p3_budget_holds_for_every_multi_sample_group(lengths, budget):
    for g in form_groups(lengths, budget):
        if len(g) >= 2:
            assert max(lengths[i] for i in g) * len(g) <= budget


@given(lengths_st, budget_st)
def test_over_budget_samples_travel_alone(lengths, budget):
    for g in form_groups(lengths, budget):
        if any(lengths[i] > budget for i in g):
            assert len(g) == 1


@given(lengths_st, budget_st)
def test_order_short_to_long_ties_by_index(lengths, budget):
    flat = [i for g in form_groups(lengths, budget) for i in g]
    assert flat == sorted(range(len(lengths)), key=lambda i: (lengths[i], i))


def test_batch_size_rule():
    assert batch_size_for(800, 1000) == 1
    assert batch_size_for(100, 1000) == 10
    assert batch_size_for(5000, 1000) == 1
    assert batch_size_for(0, 1000) == 1000  # zero-length sized as length 1


@pytest.mark.parametrize(
    ("lengths", "budget", "needle"),
    [([1, -3], 10, "sample 1"), ([1, 2.5], 10, "sample 1"), ([True], 10, "sample 0"), ([1], 0, "token_budget")],
)
def test_bad_input_names_the_sample_or_field(lengths, budget, needle):
    with pytest.raises(InvalidSampleError, match=needle):
        form_groups(lengths, budget)


def test_hold_sparse_holds_padded_groups_only_and_never_all():
    """Regroup: a group of >= 2 padded above the fraction is held; singletons, tight groups
    and groups touching the exempt set (held last round) are kept; all held -> none held."""
    from fractions import Fraction

    from odb_core.grouping import hold_sparse

    lengths = {0: 10, 1: 10, 2: 5, 3: 10, 4: 100, 5: 6, 6: 12}
    groups = [[0, 1], [2, 3], [4], [5, 6]]  # padding 0, 25%, 0 (singleton), 25%
    kept, held = hold_sparse(groups, lengths, Fraction(1, 50), set(), limit=8)
    assert (kept, held) == ([[0, 1], [4]], [[2, 3], [5, 6]])
    kept, held = hold_sparse(groups, lengths, Fraction(1, 50), {6}, limit=8)
    assert (kept, held) == ([[0, 1], [4], [5, 6]], [[2, 3]])
    assert hold_sparse(groups, lengths, Fraction(1, 4), set(), limit=8) == (groups, [])  # 25% is not above 25%
    assert hold_sparse([[2, 3], [5, 6]], lengths, Fraction(1, 50), set(), limit=8) == ([[2, 3], [5, 6]], [])


def test_hold_sparse_holds_at_most_limit_samples_a_prefix_in_walk_order():
    """The held groups are the longest prefix of the holdable ones (walk order) of at most
    ``limit`` samples; holdable groups past it are kept, even a smaller one that would fit."""
    from fractions import Fraction

    from odb_core.grouping import hold_sparse

    lengths = {0: 1, 1: 2, 2: 1, 3: 1, 4: 3, 5: 3, 6: 4, 7: 9, 8: 9}
    groups = [[0, 1], [2, 3, 4], [5, 6], [7, 8]]  # padding 25%, 44%, 12.5%, 0
    frac = Fraction(1, 50)
    assert hold_sparse(groups, lengths, frac, set(), limit=7) == ([[7, 8]], [[0, 1], [2, 3, 4], [5, 6]])
    assert hold_sparse(groups, lengths, frac, set(), limit=6) == ([[5, 6], [7, 8]], [[0, 1], [2, 3, 4]])
    # [2, 3, 4] does not fit in 4: the prefix ends there, so [5, 6] is kept although it would fit
    assert hold_sparse(groups, lengths, frac, set(), limit=4) == ([[2, 3, 4], [5, 6], [7, 8]], [[0, 1]])
    assert hold_sparse(groups, lengths, frac, set(), limit=1) == (groups, [])
    assert hold_sparse(groups, lengths, frac, set(), limit=0) == (groups, [])
    # exempt groups are not holdable, so they neither count toward the limit nor end the prefix
    assert hold_sparse(groups, lengths, frac, {3}, limit=4) == ([[2, 3, 4], [7, 8]], [[0, 1], [5, 6]])
    # a capped hold that would hold every group holds none
    assert hold_sparse(groups[:3], lengths, frac, set(), limit=7) == (groups[:3], [])
    assert hold_sparse(groups[:3], lengths, frac, set(), limit=6) == ([[5, 6]], [[0, 1], [2, 3, 4]])


def test_a_pool_hold_keeps_every_part_full_group_open_singletons_and_held_ones_too():
    """The packed budget's pool hold (``pool=True``): every group that leaves more than the
    fraction of L_max unused is held, a single sample's included, whether held last round or
    not, and all of them if all are; still at most ``limit`` samples, a prefix."""
    from fractions import Fraction

    from odb_core.grouping import hold_sparse

    lengths = {0: 3, 1: 4, 2: 9, 3: 10, 4: 2}
    groups = [[0, 1], [2], [3], [4]]  # L_max 10: 30% unused, 10%, 0 (full), 80%
    frac = Fraction(1, 50)
    assert hold_sparse(groups, lengths, frac, {0, 2}, limit=8, area=10, pool=True) == ([[3]], [[0, 1], [2], [4]])
    assert hold_sparse(groups, lengths, frac, {0, 2}, limit=8, area=10) == (groups, [])  # no pool: exempt, singletons
    assert hold_sparse([[0, 1], [4]], lengths, frac, set(), limit=8, area=10, pool=True) == ([], [[0, 1], [4]])
    assert hold_sparse(groups, lengths, frac, set(), limit=2, area=10, pool=True) == ([[2], [3], [4]], [[0, 1]])


@pytest.mark.parametrize("lengths", [(x for x in [3, 2]), {3, 2}, "32"], ids=["generator", "set", "str"])
@pytest.mark.parametrize("fn", ["form_groups", "pack_groups"])
def test_lengths_that_are_not_a_sequence_are_a_type_error_naming_the_type(fn, lengths):
    """Group members are indices into ``lengths``: an iterator (which the checks would use up,
    leaving an empty walk and a misleading error), a set or a string is refused by name."""
    import odb_core

    with pytest.raises(TypeError, match=f"got {type(lengths).__name__}"):
        getattr(odb_core, fn)(lengths, 10)
