"""The memory bound (spec: ``DepthBound``, ``HeldOK``) on every state of random simulations.

A rank fetches while |Q| + |B \\ H| < D and holds back (regroup) at most D samples per
round, so at every state |Q| + |B| <= 2D and |H| <= D; with regroup off (H empty)
|Q| + |B| <= D. The liveness side of the fetch rule is checked too: after every round,
a rank that will not be ready with Q empty and R non-empty has fetch room.
"""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from odb_core import ODBConfig
from odb_core.config import TARGET_POLICIES
from odb_core.protocol import RankProtocol
from odb_core.schedules import SCHEDULES
from odb_core.simulator import simulate


@st.composite
def depth_cases(draw: st.DrawFn) -> tuple[list[int], int, ODBConfig, str]:
    """Small worlds (1-4), capacities 1-4 or none, buffer = depth or depth > buffer,
    both modes, both budgets, a shared tail's pool or none (join), every target and overflow
    policy, regroup off or at several thresholds."""
    world = draw(st.integers(1, 4))
    budget = draw(st.sampled_from([10, 64]))
    # short lengths make multi-sample groups, most of them padded: holds, and big ones
    longest = draw(st.sampled_from([budget // 4, budget // 2, 2 * budget]))
    n = draw(st.integers(0, 200))  # a drawn size: st.lists alone keeps most lists short
    lengths = draw(st.lists(st.integers(0, longest), min_size=n, max_size=n))
    buffer_size = draw(st.integers(1, 16))
    depth = buffer_size + draw(st.one_of(st.just(0), st.integers(1, buffer_size)))
    mode = draw(st.sampled_from(["join", "non-join"]))
    config = ODBConfig(
        token_budget=budget,
        budget=draw(st.sampled_from(["padded", "packed"])),
        shared_tail=draw(st.sampled_from([0.0, 0.1, 0.3])) if mode == "join" else 0.0,
        buffer_size=buffer_size,
        depth=depth,
        mode=mode,
        target_policy=draw(st.sampled_from(TARGET_POLICIES)),
        overflow_policy=draw(st.sampled_from(["largest", "oldest"])),
        output_capacity=draw(st.one_of(st.integers(1, 4), st.none())),
        regroup_padding=draw(st.sampled_from([None, 0.0, 0.02, 0.2])),
        seed=draw(st.integers(0, 2**16)),
    )
    schedule = draw(st.sampled_from(SCHEDULES))
    if config.mode == "non-join" and schedule == "empty_rank" and world > 1:
        schedule = "uneven"  # an empty rank stalls non-join by design
    return lengths, world, config, schedule


def check_bound(protos: list[RankProtocol], config: ODBConfig) -> None:
    d = config.outstanding_depth
    for p in protos:
        load = len(p.in_flight) + len(p.buffered)
        assert load <= 2 * d, f"rank {p.rank}: |Q| + |B| = {load} > 2D = {2 * d}"
        assert len(p.held) <= d, f"rank {p.rank}: |H| = {len(p.held)} > D = {d}"
        assert p.held <= p.buffered.keys(), f"rank {p.rank}: H is not a subset of B"
        if config.regroup_padding is None:
            assert load <= d, f"rank {p.rank}: |Q| + |B| = {load} > D = {d} with regroup off"


# found by this test with the hold cap removed (hold_sparse limit unbounded): |H| = 7 > D = 6
NO_CAP_COUNTEREXAMPLE = (
    [0] * 15 + [4] + [0] * 19 + [5] + [0] * 6 + [5] + [0] * 7 + [4, 0, 4] + [0] * 7
    + [2, 0, 1, 3, 3, 0, 5, 2, 2, 2, 2, 0, 4, 4, 4, 5, 4, 5, 5, 5, 0, 3, 0, 0, 0, 0, 1],
    1,
    ODBConfig(token_budget=10, buffer_size=6, depth=6, mode="join", seed=298, target_policy="paper",
              overflow_policy="largest", output_capacity=1, regroup_padding=0.0),
    "in_order",
)


@settings(max_examples=max(300, settings().max_examples), deadline=None)
@given(depth_cases())
@example(NO_CAP_COUNTEREXAMPLE)
def test_q_plus_b_within_2d_held_within_d_and_d_without_regroup(case: tuple[list[int], int, ODBConfig, str]) -> None:
    lengths, world, config, schedule = case

    def tracer(label: str, protos: list[RankProtocol], *_: object) -> None:
        check_bound(protos, config)  # every state: after each fetch, arrival and gather

    def observer(protos: list[RankProtocol]) -> None:
        check_bound(protos, config)
        for p in protos:  # liveness: a rank that will wait with nothing in flight can fetch
            if p.remaining and not p.in_flight and p.buffer_fill < config.buffer_size:
                assert p.fetch_room() >= 1, f"rank {p.rank} waits with Q empty and no fetch room"

    simulate(lengths, world, config, schedule, observer=observer, tracer=tracer)


def test_the_bound_needs_the_hold_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the cap (hold_sparse's limit unbounded) the counterexample holds more than D
    samples and then fetches past 2D: the property above is not vacuous."""
    import odb_core.protocol as protocol
    from odb_core.grouping import hold_sparse

    monkeypatch.setattr(protocol, "hold_sparse", lambda g, lengths, f, exempt, limit, area=None, pool=False: hold_sparse(
        g, lengths, f, exempt, limit=1 << 30, area=area, pool=pool))
    lengths, world, config, schedule = NO_CAP_COUNTEREXAMPLE
    d = config.outstanding_depth
    worst = [0, 0]

    def tracer(label: str, protos: list[RankProtocol], *_: object) -> None:
        for p in protos:
            worst[0] = max(worst[0], len(p.held))
            worst[1] = max(worst[1], len(p.in_flight) + len(p.buffered))

    simulate(lengths, world, config, schedule, tracer=tracer)
    assert worst[0] > d and worst[1] > 2 * d, worst
