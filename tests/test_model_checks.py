"""TLC on the spec, seeded bugs, and conformance between odb_core and the spec (CI).

Every quick configuration must pass all invariants and Termination; every sanity
configuration must FAIL Termination (the restated fairness is not vacuous); every
mutant configuration must FAIL the invariant it targets; the core's reachable
abstract states and transitions must equal TLC's (in aligned order; with shuffled
steps they must lie inside TLC's, which admits every order); simulator traces must replay as
spec behaviours and mutated-core traces must not.
"""

import dataclasses
import json
import subprocess
import sys

import pytest

from model_checks import conformance
from model_checks import traces as trace_validation
from model_checks.mutants import MUTANTS
from model_checks.report import SPEC_MUTANT, TRACE_BATCH
from model_checks.suites import configs, run_config
from model_checks.tla import sany
from odb_core.alignment import TARGET_FUNCTIONS, balanced_target
from odb_core.budgets import BUFFER_RULES
from odb_core.packing import pack_buffer

pytestmark = pytest.mark.timeout(900)


def test_spec_parses():
    assert "Semantic processing of module MC" in sany("MC")


@pytest.mark.parametrize("path", configs(("quick", "sanity", "mutant")), ids=lambda p: p.stem)
def test_tlc_configuration_gives_expected_outcome(path):
    result = run_config(path)
    assert result.run.distinct_states > 0, result.run.output[-2000:]
    assert result.passed, f"{path.stem}: expected {result.expected}, TLC said {result.run.outcome}\n{result.run.output[-3000:]}"


def test_brule_admissible_catches_the_overfilling_packing_rule():
    """BRuleAdmissible is left out of mutant_pack_overfill so that BudgetOK is shown to catch the bug;
    with every invariant, BRuleAdmissible (the rule's packing is a partition within the budget) fails
    first, on the state the rule packs before anything is emitted."""
    from model_checks import progress
    from model_checks.generated import outcome, run_tlc
    from model_checks.tla import ODB_INVARIANTS

    cfg = progress.derived_cfg(progress.CFG_DIR / "mutant_pack_overfill.cfg", (), ODB_INVARIANTS)
    text, _ = run_tlc("Progress", cfg, {}, ())
    assert outcome(text) == "invariant:BRuleAdmissible", text[-2000:]


def test_every_core_mutant_has_a_spec_mutant():
    names = {p.stem for p in configs(("mutant",))}
    assert {SPEC_MUTANT[m] for m in MUTANTS} == names


@pytest.mark.parametrize("scenario", conformance.STATE_SPACE_SCENARIOS, ids=lambda s: s.name)
def test_core_and_spec_state_spaces_are_equal(scenario):
    result = conformance.compare_state_spaces(scenario)
    assert result.python_states > 100 or scenario.name.endswith(("cap1", "best_fit"))
    assert result.states_equal, (result.only_python, result.only_tlc)
    assert result.transitions_equal
    if scenario.name.endswith(("regroup", "2x4_packed")):  # these scenarios really hold groups back
        assert result.holds_back


@pytest.mark.parametrize("scenario", conformance.SHUFFLED_SCENARIOS, ids=lambda s: s.name)
def test_shuffled_core_stays_inside_the_specs_every_order(scenario):
    result = conformance.compare_state_spaces(scenario)
    assert result.states_included, result.only_python
    assert result.transitions_included
    in_order, _ = conformance.enumerate_core(dataclasses.replace(scenario, shuffle=False))
    shuffled, _ = conformance.enumerate_core(scenario)
    assert shuffled - in_order, "the shuffle never changed an emission order: the check would be vacuous"


def test_state_space_comparison_detects_a_mutated_core():
    mutated = conformance.Scenario("m", ((2, 3, 6), (1, 5, 12)), capacity=1, mutant="drop-overflow")
    result = conformance.compare_state_spaces(mutated)
    assert not result.states_equal


def _first_fit(lengths, budget, held):
    """First-fit decreasing in the core's layout: the packing rule the spec must tell apart."""
    groups, loads = [], []
    for k in reversed(sorted(sorted(lengths), key=lengths.__getitem__)):
        size = max(lengths[k], 1)
        fit = next((j for j, load in enumerate(loads) if load + size <= budget), None)
        if fit is None:
            groups.append([k])
            loads.append(size)
        else:
            groups[fit].append(k)
            loads[fit] += size
    return [list(reversed(g)) for g in reversed(groups)]


def test_state_space_comparison_tells_best_fit_from_first_fit(monkeypatch):
    """A core packing by first fit instead of best fit leaves the spec's state space."""
    (scenario,) = [s for s in conformance.STATE_SPACE_SCENARIOS if s.name == "join_1_best_fit"]
    monkeypatch.setitem(BUFFER_RULES, "packed", _first_fit)
    result = conformance.compare_state_spaces(scenario)
    assert not result.states_equal and not result.states_included


def _packed_ignoring_held(lengths, budget, held):
    """Best fit that walks held samples with the others (the rule before held-first)."""
    return pack_buffer(lengths, budget)


def test_state_space_comparison_tells_held_first_from_held_last(monkeypatch):
    """A core packing its held samples in length order with the rest, instead of first,
    leaves the spec's state space: it misses spec states, and takes a transition the spec
    does not (its own states differ from the right core's, so the scenario exercises the rule)."""
    (scenario,) = [s for s in conformance.STATE_SPACE_SCENARIOS if s.name == "join_1_held_first"]
    right, _ = conformance.enumerate_core(scenario)
    monkeypatch.setitem(BUFFER_RULES, "packed", _packed_ignoring_held)
    result = conformance.compare_state_spaces(scenario)
    assert not result.states_equal and not result.transitions_included
    wrong, _ = conformance.enumerate_core(scenario)
    assert right != wrong


def test_state_space_comparison_tells_min_from_balanced(monkeypatch):
    """A core whose "min" target aims at the mean (balanced) instead leaves the spec's state
    space on the min scenario (the spec's MinTarget is what the core's min_target computes)."""
    (scenario,) = [s for s in conformance.STATE_SPACE_SCENARIOS if s.name == "join_2x4_min"]
    monkeypatch.setitem(TARGET_FUNCTIONS, "min", balanced_target)
    result = conformance.compare_state_spaces(scenario)
    assert not result.states_equal and not result.transitions_included


def test_state_space_comparison_catches_a_core_that_deals_the_pool_otherwise(monkeypatch):
    """The shared tail: the core's claims equal the spec's (join_2_pool: 548 states), and a core
    that hands the pool to the first rank with nothing pending instead of filling the least
    loaded ones leaves the spec's state space."""
    import odb_core.epoch as epoch

    (scenario,) = [s for s in conformance.STATE_SPACE_SCENARIOS if s.name == "join_2_pool"]
    assert conformance.compare_state_spaces(scenario).states_equal

    def first_takes_all(pending, load, samples, left, cap, room=(), budget=0, spread=1):
        out = [0] * len(pending)
        free = [r for r, p in enumerate(pending) if p == 0]
        if free:
            out[free[0]] = min(cap, left)
        return out

    monkeypatch.setattr(epoch, "tail_claims", first_takes_all)
    result = conformance.compare_state_spaces(scenario)
    assert not result.states_equal and not result.transitions_included


def test_state_space_comparison_catches_a_core_that_fills_the_packed_tail_otherwise():
    """The packed budget's pool (join_2_pool_packed: 1,127 states, part-full groups held open):
    the core's holds and reserve claims equal the spec's, and a core whose reserve goes to the
    rank with the least room instead of the most (mutant fill-least-room) leaves them."""
    (scenario,) = [s for s in conformance.STATE_SPACE_SCENARIOS if s.name == "join_2_pool_packed"]
    assert conformance.compare_state_spaces(scenario).states_equal
    result = conformance.compare_state_spaces(dataclasses.replace(scenario, mutant="fill-least-room"))
    assert not result.states_equal and not result.transitions_included


def test_state_space_comparison_catches_a_reserve_dealt_to_one_rank_a_round():
    """The reserve dealt to every free rank with room at once (join_2_pool_packed_spread,
    ``reserve_divisor`` 1: k = W = 2; 1,150 states): the core's claims equal the spec's, and a
    core that deals to one rank a round whatever the divisor (mutant fill-one-rank) leaves them,
    while at the default divisor (k = 1 at W = 2) it is the same protocol."""
    (spread,) = [s for s in conformance.STATE_SPACE_SCENARIOS if s.name == "join_2_pool_packed_spread"]
    assert conformance.compare_state_spaces(spread).states_equal
    result = conformance.compare_state_spaces(dataclasses.replace(spread, mutant="fill-one-rank"))
    assert not result.states_equal and not result.transitions_included
    (default,) = [s for s in conformance.STATE_SPACE_SCENARIOS if s.name == "join_2_pool_packed"]
    assert conformance.compare_state_spaces(dataclasses.replace(default, mutant="fill-one-rank")).states_equal


def test_simulator_traces_replay_as_spec_behaviours():
    traces = conformance.clean_traces(200)  # `odb check` replays more; 200 already cover every kind of step
    schedules = {t.schedule for t in traces}
    modes = {t.scenario.join for t in traces}
    assert len(schedules) == 5 and modes == {True, False}
    assert {t.scenario.budget_kind for t in traces} == {"padded", "packed"}
    held = conformance.VARIABLES.index("H")
    assert any(any(st[held]) for t in traces for st in t.states), "no trace holds a group back to regroup"
    # every kind of step occurs: fetch, drain, gather, split, overflow, hold, skip, chain, end, claim
    trace_validation.require_coverage(traces)
    # every invariant on every state, the B(l) grouping at every gather, done at the end
    rejected = [v for v in trace_validation.replay(traces, batch=TRACE_BATCH) if not v.accepted]
    assert not rejected, [(v.describe(), traces[v.index].scenario, traces[v.index].schedule) for v in rejected[:3]]


def test_mutated_core_traces_are_rejected():
    """Every mutant's traces are rejected, each by the invariant its spec twin breaks."""
    per_mutant = conformance.mutant_traces(10)
    assert set(per_mutant) == set(conformance.REJECTED_BY)
    assert all(len(v) == 10 for v in per_mutant.values()), {k: len(v) for k, v in per_mutant.items()}
    traces = [t for ts in per_mutant.values() for t in ts]
    verdicts = {v.index: v for v in trace_validation.replay(traces, batch=TRACE_BATCH)}
    assert sorted(verdicts) == list(range(len(traces)))
    for k, t in enumerate(traces):
        v = verdicts[k]
        assert not v.accepted and conformance.REJECTED_BY[t.scenario.mutant] in v.reasons, (t.scenario.mutant, v.reasons)


def test_odb_check_json_shape():
    out = subprocess.run(
        [sys.executable, "-m", "odb_tools.cli", "check", "--json", "--select", "mutant_no_chain", "--traces", "12",
         "--mutant-traces", "2", "--hunt-examples", "0", "--scenarios", "join_1_best_fit"],
        capture_output=True, text=True, timeout=600,
    )
    report = json.loads(out.stdout)
    assert out.returncode == 0 and report["ok"], out.stderr[-2000:]
    (cfg,) = report["configs"]
    assert {"name", "mode", "world", "distinct_states", "depth", "seconds", "result"} <= set(cfg)
    assert cfg["name"] == "mutant_no_chain" and cfg["result"] == "invariant:QuotaClosure"
    assert {m["name"] for m in report["mutants"]} == set(MUTANTS)
    assert all({"name", "caught_by_tlc", "caught_by_hypothesis"} <= set(m) for m in report["mutants"])
    # --hunt-examples 0 skips the hypothesis hunts (tests/test_mutants.py runs them); TLC's verdict stays
    assert all(m["caught_by_hypothesis"] is None for m in report["mutants"])
    assert [m["caught_by_tlc"] for m in report["mutants"] if m["name"] == "no-chain"] == [True]
    assert {"traces_checked", "traces_accepted", "mutant_traces_rejected", "state_space_equal"} <= set(report["conformance"])
    assert report["conformance"]["traces_accepted"] == 12 and report["conformance"]["state_space_equal"] is True
    assert [s["scenario"] for s in report["conformance"]["state_spaces"]] == ["join_1_best_fit"], "--scenarios picks"


def test_odb_check_fails_when_a_mutant_yields_fewer_traces_than_asked(monkeypatch):
    """``odb check`` counts a mutant's traces: one that changed no behaviour in all its tries gives
    none to reject, and the verdict must not pass on the others' rejections alone."""
    from model_checks import report

    real = conformance.mutant_traces

    def one_short(per_mutant, *args, **kwargs):
        found = real(per_mutant, *args, **kwargs)
        first = next(iter(found))
        return {**found, first: found[first][:-1]}

    monkeypatch.setattr(conformance, "mutant_traces", one_short)
    out = report.check(select="mutant_no_chain", traces=0, mutant_traces_each=2, hunt_examples=0,
                       scenarios="join_1_best_fit")
    conf = out["conformance"]
    assert conf["mutant_traces_rejected"] == conf["mutant_traces"] > 0, conf  # every trace it got is rejected
    assert sorted(conf["mutant_traces_found"].values())[0] == 1 and out["ok"] is False


def test_odb_check_fails_when_a_mutant_trace_is_rejected_for_another_reason(monkeypatch):
    """``odb check`` counts a mutant trace as caught only if the invariant its spec twin breaks rejects
    it (here every no-cmin trace is expected to break an invariant nothing checks)."""
    from model_checks import report

    monkeypatch.setitem(conformance.REJECTED_BY, "no-cmin", "NoSuchInvariant")
    out = report.check(select="mutant_no_chain", traces=0, mutant_traces_each=2, hunt_examples=0,
                       scenarios="join_1_best_fit")
    conf = out["conformance"]
    assert conf["mutant_traces_rejected"] == conf["mutant_traces"] and conf["mutant_traces_wrong_reason"] == 2
    assert out["ok"] is False


def test_progress_checks_reach_every_module_with_a_seeded_bug_in_each_resumed_one():
    """The progress invariants run on every quick configuration, the resumed runs' modules
    (TailResume, Elastic) included, each in CI, and each resumed module has a stuck protocol
    they must catch."""
    from model_checks import progress

    quick = progress.quick_checks()
    assert {c.name for c in quick} == {p.stem for p in configs(("quick",), subfolders=True)}
    ci = progress.quick_checks(progress.CI_QUICK)
    assert len(ci) == len(progress.CI_QUICK)
    modules = {"Progress", "ProgressTailResume", "ProgressElastic"}
    assert {c.module for c in ci} == modules
    assert {c.module for c in progress.BUGS if c.expected != "ok"} == modules
    for c in quick:
        assert ("ResumeExactlyOnce" in c.invariants) == (c.module != "Progress"), c.name
