r"""Documented behaviours of odb_core that P1-P8's property tests do not pin, each found by a
mutation audit (57 hand-made mutants; these 10 survived the fast core suite): the balanced
target's ceiling and Alg. 1's split of the longest sample (the spec's BalancedTarget and
SplitTo), readiness counting |B \ H| only, zero weights for idle ranks under every scaling
(P7), the work rule's least-loaded fallback claim, and typed refusals of malformed resume
states (a rank outside the world, a claim past the pool, a repeated position: P4), of a header
gather of another length and of a truncated hello. Each test fails on its mutant (named
beside it) and passes on the code."""

from __future__ import annotations

from fractions import Fraction

import pytest

from odb_core import ODBConfig, simulate
from odb_core.alignment import balanced_target, split_to
from odb_core.elastic import global_state_from, merge_states
from odb_core.epoch import EpochDriver
from odb_core.errors import ConfigMismatchError, ResumeStateError
from odb_core.loss import rank_weight, step_weights
from odb_core.protocol import RankProtocol
from odb_core.tail import tail_claims
from odb_core.wire import HEADER_LEN, TAIL_HEADER_LEN, Header, HeaderGather, Status


def _ready(groups: int, samples: int = 100) -> Header:
    return Header(0, 0, Status.READY, groups, 0, samples, samples)


# A4 (alignment.py:66, ceil -> floor)
def test_balanced_target_is_the_ceiling_of_the_mean_group_count():
    """balanced: T = max(min(ceil(mean_A G_r), C_min+, S_min+), 1); spec BalancedTarget."""
    assert balanced_target([_ready(1), _ready(2)]) == 2
    assert balanced_target([_ready(3), _ready(4), _ready(4)]) == 4  # ceil(11/3)
    assert balanced_target([_ready(2), _ready(4)]) == 3


def test_each_target_policy_follows_its_formula_and_its_bounds():
    """Eq. 3 (paper: the max of the ready ranks' group counts), min and balanced, each bounded by
    the smallest positive capacity and sample count and at least 1; the all-ready policies give 0
    while a rank is WAITING (A1, capacity 0 counted as a bound, and A3, paper as min, passed every
    property test: only a packing-quality test and trace replay caught them)."""
    from odb_core.alignment import all_ready_target, min_target, paper_target

    def header(groups: int, capacity: int = 0, samples: int = 100, status: Status = Status.READY) -> Header:
        return Header(0, 0, status, groups, capacity, samples, samples)

    ready = [header(2), header(5), header(3)]
    assert (paper_target(ready), min_target(ready), balanced_target(ready)) == (5, 2, 4)
    assert paper_target([header(5, capacity=0), header(2, capacity=4)]) == 4  # capacity 0: no bound
    assert paper_target([header(5, samples=3), header(2)]) == 3 and paper_target([header(0)]) == 1
    waiting = [header(4), header(0, status=Status.WAITING)]
    assert (paper_target(waiting), all_ready_target(waiting), min_target(waiting)) == (4, 0, 0)


# A8 (alignment.py:103, pop() -> pop(0))
def test_split_takes_the_longest_sample_of_the_last_splittable_group():
    """Alg. 1: the last sample (the longest: groups run short to long) of the last group with
    >= 2 samples becomes a singleton right after it (spec SplitTo)."""
    assert split_to([[0, 1, 2]], 2) == [[0, 1], [2]]
    assert split_to([[0, 1], [2, 3, 4], [5]], 4) == [[0, 1], [2, 3], [4], [5]]
    assert split_to([[0, 1], [2, 3, 4], [5]], 5) == [[0, 1], [2], [3], [4], [5]]


def _round(p: RankProtocol):
    header = p.begin_round()
    plan = p.on_headers([header])
    steps = p.on_steps([plan.step_vector]) if plan.step_vector is not None else []
    return plan, steps


# R1 (protocol.py:321, held samples counted toward buffer_size)
def test_held_samples_do_not_make_the_rank_ready():
    """buffer_fill is |B \\ H|: held-back samples count toward neither buffer_size nor the depth;
    the rank is ready once |B \\ H| reaches buffer_size."""
    config = ODBConfig(token_budget=20, buffer_size=4, depth=4, regroup_padding=0.02)
    p = RankProtocol(config, 0, 1, list(range(10)))
    for pos, n in zip(p.fetch(), (3, 5, 10, 10)):
        p.arrive(pos, n)
    plan, steps = _round(p)
    assert sorted(s.lengths for s in steps) == [(3,), (10,)] and p.held == {1, 2}  # [5, 10] held: 25% padding
    fetched = p.fetch()
    assert len(fetched) == 4  # held samples leave the depth
    for pos in fetched[:2]:
        p.arrive(pos, 7)
    assert p.buffer_fill == 2
    p.begin_round()
    assert p.status is Status.WAITING  # 4 buffered, 2 of them held: not full


# L1 (loss.py:68, "none" weights idle ranks too)
def test_none_scaling_gives_an_idle_rank_weight_zero():
    """loss_scaling='none': w_r = 1/W for ranks with samples; an idle rank's batch has weight 0
    (loader docs: idle ranks get zero-weight batches, loss_scale == 0)."""
    assert step_weights("none", [0, 3, 2], [0, 30, 9], []) == [0, Fraction(1, 3), Fraction(1, 3)]
    assert rank_weight("none", [0, 3], [0, 30], [], 0) == 0


def test_idle_items_have_zero_weight_under_every_scaling():
    for mode in ("none", "exact", "sample", "approx"):
        config = ODBConfig(token_budget=64, buffer_size=2, loss_scaling=mode)
        result = simulate([5, 60, 7, 3, 9, 40, 2, 8, 30, 1], 3, config, schedule="uneven", shuffle=False)
        idle = [s for rank in result.steps for s in rank if s.is_idle]
        assert idle, "the case has idle items"
        assert all(s.weight == 0 and s.loss_scale == 0 for s in idle), mode


# T3 (tail.py:105, fallback to the most-loaded free rank)
def test_the_work_rules_fallback_claim_goes_to_the_least_loaded_free_rank():
    """No rank's level share reaches one view: the least-loaded free rank (lowest on ties) takes one."""
    assert tail_claims([0, 0], [10, 12], [1, 1], left=1, cap=5) == [1, 0]
    assert tail_claims([0, 0], [12, 10], [1, 1], left=1, cap=5) == [0, 1]
    assert tail_claims([0, 0], [10, 10], [1, 1], left=1, cap=5) == [1, 0]


def _pooled_state(rank: int, consumed: list[int], claimed: list[int]) -> dict:
    return {"rank": rank, "world_size": 2, "epoch": 0, "steps": 1, "seed": 0, "total": 10, "shared_tail": 0.2,
            "pool_size": 2, "claimed": claimed, "consumed": consumed}


# X3 (elastic.py:210, a claimed pool index past the pool accepted)
def test_a_pooled_state_claiming_past_the_pool_is_refused():
    """own = (10 - 2) // 2 = 4 views a rank; pool indices 0..1. A claim of pool index 2 would be
    global position 10, outside the order of 10."""
    states = [_pooled_state(0, [0, 6], [2]), _pooled_state(1, [0], [])]
    with pytest.raises(ResumeStateError) as err:
        merge_states(states)
    assert err.value.field == "consumed"


# X4 (elastic.py:144, a rank outside the world accepted)
def test_a_state_of_a_rank_outside_the_world_is_refused_pooled_too():
    """A third state claiming rank 2 of a world of 2: its positions (rank + p x W) would mark
    views of rank 0 consumed, and they would never be trained (P4)."""
    states = [_pooled_state(0, [0], []), _pooled_state(1, [0], []), _pooled_state(2, [0], [])]
    with pytest.raises(ResumeStateError) as err:
        merge_states(states)
    assert err.value.field == "rank"


# X5 (elastic.py:273, a repeated consumed position in a merged state accepted)
def test_a_merged_state_with_a_repeated_position_is_refused():
    state = {"kind": "odb-global", "epoch": 0, "steps": 1, "seed": 0, "total": 10, "order_world": 2,
             "consumed": [3, 3]}
    with pytest.raises(ResumeStateError) as err:
        global_state_from(state)
    assert err.value.field == "consumed"


# W12 (wire.py:179, HeaderGather.belongs_to ignores the header length)
def test_a_header_gather_of_another_length_does_not_belong():
    gather = HeaderGather.decode([Header(0, 0, Status.WAITING, 0, 0, 0, 0).encode(HEADER_LEN)], 1, 0, 0, HEADER_LEN)
    assert gather.belongs_to(1, 0, 0, HEADER_LEN)
    assert not gather.belongs_to(1, 0, 0, TAIL_HEADER_LEN)


# E6 (epoch.py:203, a hello vector of another length)
def test_a_truncated_hello_is_a_config_mismatch_not_an_index_error():
    config = ODBConfig(token_budget=64)
    drivers = [EpochDriver(config, r, 2) for r in range(2)]
    hellos = [d.hello({"n": 5}) for d in drivers]
    hellos[1] = hellos[1][:-3]
    with pytest.raises(ConfigMismatchError):
        drivers[0].check_hello(hellos)
