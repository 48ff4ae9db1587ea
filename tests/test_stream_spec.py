"""The spec over streams (spec/ODB.tla with ``StreamOn <- StreamsOn``): a rank's view count is
unknown until a fetch reaches past its end. TLC checks the quick stream configurations
(spec/cfg/streams/: uneven streams of 3, 2 and 0 views; every invariant and Termination), catches
the seeded bug M8 (the end mapped one position early: NoLeak), and the core's stream state
space equals the spec's on a stream scenario (every state and transition).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from model_checks import conformance
from model_checks.suites import CFG_DIR, run_config

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
