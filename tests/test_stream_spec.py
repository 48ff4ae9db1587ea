"""The spec over streams (spec/ODB.tla with ``StreamOn <- StreamsOn``): a rank's view count is
unknown until a fetch reaches past its end. TLC checks the quick stream configurations
(spec/cfg/streams/: uneven streams of 3, 2 and 0 views; every invariant and Termination), catches
the seeded bug M8 (the end mapped one position early: NoLeak), and the core's stream state
space equals the spec's on a stream scenario (every state and transition); streamed runs'
trace events replay in TLC, and a seeded bug's are rejected.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from model_checks import conformance
from model_checks.suites import CFG_DIR, run_config
from model_checks.traces import merge, replay
from odb_core import ODBConfig, RankProtocol
from odb_core.epoch import EpochDriver
from odb_core.stream_sim import simulate_streams

pytestmark = pytest.mark.timeout(600)

STREAM_CFGS = sorted((CFG_DIR / "streams").glob("*.cfg"))


@pytest.mark.parametrize("path", STREAM_CFGS, ids=lambda p: p.stem)
def test_tlc_stream_configuration_gives_expected_outcome(path: Path) -> None:
    result = run_config(path)
    assert result.run.distinct_states > 0, result.run.output[-2000:]
    assert result.passed, f"{path.stem}: expected {result.expected}, TLC said {result.run.outcome}"


def test_stream_configurations_cover_uneven_and_empty_streams_and_the_mutant() -> None:
    names = {p.stem for p in STREAM_CFGS}
    assert {"quick_join_3_empty_stream", "mutant_stream_end_early"} <= names


def test_core_and_spec_stream_state_spaces_are_equal() -> None:
    """Uneven streams (3, 2 and 0 views), unknown to the ranks until a fetch reaches past each end."""
    scenario = conformance.Scenario("join_3_empty_stream", ((1, 4, 8), (2, 2), ()), shuffle=False, stream=True)
    result = conformance.compare_state_spaces(scenario)
    assert result.python_states > 500
    assert result.states_equal, (result.only_python, result.only_tlc)
    assert result.transitions_equal
    known = conformance.enumerate_core(conformance.Scenario("k", scenario.lengths, shuffle=False))[0]
    assert result.python_states != len(known), "the stream scenario is the known-length one: the check is vacuous"


def _traced(base: type[EpochDriver], logs: list[list[dict]]) -> type[EpochDriver]:
    """``base`` recording each rank's trace events into ``logs[rank]``."""

    class Traced(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: object, **kw: object) -> None:
            logs.append([])
            super().__init__(*args, trace=logs[-1], **kw)  # type: ignore[arg-type]

    return Traced


def test_streamed_traces_replay_in_tlc_and_a_seeded_bug_is_rejected() -> None:
    """Trace events of stream ranks (a fetch past the end, then ``stream_end``) merged into
    behaviours of the stream spec: the real driver's are accepted, those of a driver whose end
    forgets the last element still in flight (it is never yielded, as in M8) are rejected."""
    config = ODBConfig(token_budget=10, buffer_size=2, depth=3, shuffle_steps=False)
    streams = [[1, 4], [2, 2], []]
    good: list[list[dict]] = []
    simulate_streams(streams, config, 3, driver_cls=_traced(EpochDriver, good))
    bad: list[list[dict]] = []
    simulate_streams(streams, config, 3, driver_cls=_traced(EndForgetsLast, bad))
    traces = [merge(good, "good"), merge(bad, "bad")]
    assert traces[0].scenario.stream and traces[0].scenario.lengths[2] == ()
    verdicts = replay(traces)
    assert verdicts[0].accepted, verdicts[0].describe()
    assert not verdicts[1].accepted and "Shape" not in verdicts[1].reasons, verdicts[1].describe()


class EndForgetsLastProtocol(RankProtocol):
    """Seeded bug: the end also forgets the stream's last element if it is still in flight."""

    def end(self, n: int) -> None:
        super().end(n)
        self._inflight.discard(n - 1)


EndForgetsLast = type("EndForgetsLast", (EpochDriver,), {"protocol_cls": EndForgetsLastProtocol})
