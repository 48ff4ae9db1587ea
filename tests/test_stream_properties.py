"""P1-P6 on the core over streams: each rank's view count unknown until its stream ends.

Random W in 1..6, uneven stream lengths per rank (empty streams included), budgets, buffers,
depths, policies and seeded read orders (odb_core.stream_sim). Seeded bugs: the end mapped one
position early breaks coverage; fetching as if the count were known breaks termination.
"""

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from model_checks.strategies import lengths_from_seed
from odb_core import ODBConfig, RankProtocol
from odb_core.config import BUDGETS, OVERFLOW_POLICIES, TARGET_POLICIES
from odb_core.epoch import EpochDriver
from odb_core.errors import ProtocolStateError, ResumeStateError, UnsupportedSettingError
from odb_core.stream_sim import simulate_streams


@st.composite
def stream_cases(draw: st.DrawFn) -> tuple[list[list[int]], ODBConfig, int]:
    world = draw(st.integers(1, 6))
    budget = draw(st.sampled_from([1, 7, 64, 1000]))
    sizes = [draw(st.one_of(st.integers(0, 3), st.integers(0, 300))) for _ in range(world)]
    streams = [lengths_from_seed(n, budget, draw(st.integers(0, 2**32)), 0.02) for n in sizes]
    buffer_size = draw(st.integers(1, 40))
    config = ODBConfig(token_budget=budget, budget=draw(st.sampled_from(BUDGETS)), buffer_size=buffer_size,
                       depth=buffer_size + draw(st.integers(0, 16)), mode="join",
                       loss_scaling=draw(st.sampled_from(["none", "sample", "exact"])), seed=draw(st.integers(0, 99)),
                       target_policy=draw(st.sampled_from(TARGET_POLICIES)),
                       overflow_policy=draw(st.sampled_from(OVERFLOW_POLICIES)),
                       regroup_padding=draw(st.sampled_from([None, 0.02])))
    return streams, config, draw(st.integers(0, 2**16))


def check_coverage(streams: list[list[int]], steps: list[list], skips: list[list[int]] | None = None) -> None:
    for r, stream in enumerate(streams):
        got = Counter(i for s in steps[r] for i in s.identities) + Counter(skips[r] if skips else [])
        assert got == Counter(range(len(stream))), f"rank {r}: its stream was not yielded exactly once"
        assert all(s.lengths == tuple(stream[i] for i in s.identities) for s in steps[r])


def check_partition(protos: list[RankProtocol]) -> None:
    for p in protos:
        r, q, b, e = p.remaining, p.in_flight, set(p.buffered), p.emitted
        assert len(r) + len(q) + len(b) + len(e) == len(p.views), f"rank {p.rank}: a view leaked or doubled"
        assert set(r) | q | b | set(e) == set(range(len(p.views)))


@settings(max_examples=60, deadline=None)
@given(stream_cases())
def test_streams_every_element_once_lockstep_budget_and_termination(case):
    """P1 (partition every round), P2 (same items per round on every rank), P3 (budget),
    P4 (every element of every stream exactly once, empty streams included), P6 (round bound)."""
    streams, config, seed = case
    result = simulate_streams(streams, config, seed, observer=check_partition)
    check_coverage(streams, result.steps)
    per_round = [Counter((s.iteration, s.round) for s in steps) for steps in result.steps]
    assert all(c == per_round[0] for c in per_round), "ranks emitted different item counts in a round"
    for steps in result.steps:
        for s in steps:
            if len(s.lengths) >= 2:
                cost = sum(max(n, 1) for n in s.lengths) if config.budget == "packed" else \
                    max(s.lengths) * len(s.lengths)
                assert cost <= config.token_budget
    assert all(p.finished and p.ended for p in result.final_states)


@settings(max_examples=40, deadline=None)
@given(stream_cases(), st.integers(0, 200))
def test_streams_resumed_at_a_step_boundary_yield_the_rest_once(case, stop):
    """A checkpoint after ``stop`` steps (consumed stream positions per rank) resumed over the
    same streams: the two runs together yield every element exactly once, in lockstep."""
    streams, config, seed = case
    first = simulate_streams(streams, config, seed, stop_after=stop)
    skips = [[p for d in ds for p in d.sampler_positions] for ds in first.deliveries]
    steps = len(first.steps[0])
    second = simulate_streams(streams, config, seed + 1, skips=skips, first_step=steps)
    check_coverage(streams, second.steps, skips)
    assert len({len(s) for s in second.steps}) == 1
    assert all(d.number == steps + k for ds in second.deliveries for k, d in enumerate(ds))


class EndsOneEarlyDriver(EpochDriver):
    """Seeded bug: the stream's end is mapped one position early (its last element is lost)."""

    def end_stream(self, count: int) -> None:
        super().end_stream(max(0, count - 1))


class FetchesAsIfKnownProtocol(RankProtocol):
    """Seeded bug: fetch is bounded by the views named so far, as if the count were known."""

    def fetch(self) -> list[int]:
        self.ended = True
        fetched = super().fetch()
        self.ended = False
        return fetched


def test_seeded_bugs_in_the_stream_end_are_caught_by_coverage_and_termination():
    config = ODBConfig(token_budget=64, buffer_size=4, depth=4)
    streams = [[5] * 30, [9] * 3, []]
    check_coverage(streams, simulate_streams(streams, config, 1).steps)
    with pytest.raises(AssertionError, match="exactly once"):
        check_coverage(streams, simulate_streams(streams, config, 1, driver_cls=EndsOneEarlyDriver).steps)
    stuck = type("StuckDriver", (EpochDriver,), {"protocol_cls": FetchesAsIfKnownProtocol})
    with pytest.raises(ProtocolStateError, match="P6"):
        simulate_streams(streams, config, 1, driver_cls=stuck)


def test_non_join_over_a_stream_is_refused_naming_the_mode():
    config = ODBConfig(token_budget=64, mode="non-join")
    with pytest.raises(UnsupportedSettingError, match="quota") as info:
        EpochDriver(config, 0, 2, quota=0, stream=True)
    assert info.value.field == "mode" and info.value.rank == 0


def test_stream_end_contracts_are_typed():
    """end() past the fetched positions, twice, or after a position past it arrived is refused;
    a resumed stream shorter than its checkpoint's consumed positions is a ResumeStateError."""
    d = EpochDriver(ODBConfig(token_budget=64, buffer_size=2, depth=4), 0, 1, stream=True)
    d.start_iteration(())
    assert d.fetch() == [0, 1, 2, 3]
    d.arrive(2, 5)
    with pytest.raises(ProtocolStateError):
        d.end_stream(1)  # position 2 already arrived
    with pytest.raises(ProtocolStateError):
        d.end_stream(9)  # the end is found reading a fetched position: 3 is the last
    d.end_stream(3)
    assert d.protocol is not None and d.protocol.in_flight == {0, 1} and d.protocol.ended
    with pytest.raises(ProtocolStateError):
        d.end_stream(3)
    r = EpochDriver(ODBConfig(token_budget=64, buffer_size=2, depth=4), 1, 2, skip=[0, 7], stream=True)
    r.start_iteration(())
    assert r.stream_positions(r.fetch()) == [1, 2, 3, 4]
    with pytest.raises(ResumeStateError) as info:
        r.end_stream(3)
    assert info.value.indices == (7,) and info.value.rank == 1
