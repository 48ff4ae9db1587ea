"""Checks that reach past the toy models (CI slice, about a minute on 2 cores).

* TLC simulation of models up to W = 8 with 20-50 views per rank: every invariant and
  the progress invariants on every state, every behaviour reaches done, every monitored
  branch (split, overflow, hold, skip, chain, ...) exercised; seeded bugs only a larger
  model reaches are caught.
* The progress invariants (spec/Progress.tla) hold on quick configurations and catch
  stuck protocols that TLC's deadlock check cannot see.
* The invariants with their strengthening are inductive on bounded domains, and the
  counterexamples to induction that motivate the strengthening are found.

``odb check --deep`` runs the longer slice (:func:`model_checks.reach.check_reach`).
"""

import json
import subprocess
import sys

import pytest

from model_checks import inductive, progress, reach
from model_checks.generated import parallel
from odb_core.config import TARGET_POLICIES

pytestmark = pytest.mark.timeout(600)


def test_simulation_at_scale_checks_every_invariant_and_reaches_done():
    results = parallel(lambda m: reach.simulate(m, reach.CI_BEHAVIOURS), reach.CI_MODELS)
    for r in results:
        assert r.outcome == "ok", f"{r.model.name}: {r.outcome}\n{r.output[-3000:]}"
        assert r.behaviours == r.requested, f"{r.model.name}: only {r.behaviours} behaviours reached done"
        assert r.states > 0 and r.longest > r.model.views  # every view fetched, drained and emitted at least
    largest = max(results, key=lambda r: r.model.world)
    assert largest.model.world == 8 and min(map(len, largest.model.lengths)) >= 20
    models = [r.model for r in results]
    assert {m.policy for m in models} == set(TARGET_POLICIES)
    assert {m.join for m in models} == {True, False} and {m.regroup[1] > 0 for m in models} == {True, False}
    assert {m.capacity for m in models} >= {1, 2, 3, 4}
    assert {(m.budget_kind, m.join) for m in models} >= {("packed", True), ("packed", False), ("padded", True)}
    # the shared tail at W=6, its packed reserve dealt to 3 ranks a round ("claims" counts its gathers)
    assert any(m.pool and m.budget_kind == "packed" and -(-m.world // m.reserve_divisor) > 1 for m in models)
    coverage = {k: sum(r.coverage[k] for r in results) for k in reach.COVERAGE}
    assert all(coverage.values()), f"a branch never simulated: {coverage}"


def test_every_check_lists_every_invariant_the_configurations_check():
    """Every ODB.tla invariant some TLC configuration checks is in ``ODB_INVARIANTS``, the list the
    simulation, the progress checks and the state-space comparison use (PoolOnce was missing until
    2026-11-27: the pooled reach models never checked that each pool view goes to one rank), and the
    inductiveness checks' candidates; the trace replay leaves out one, for the reason given."""
    import re
    from pathlib import Path

    from model_checks import traces
    from model_checks.tla import ODB_INVARIANTS

    spec = Path(__file__).resolve().parent.parent / "spec"
    defined = set(re.findall(r"^(\w+) ==", (spec / "ODB.tla").read_text(), re.M))
    checked: set[str] = set()
    for cfg in spec.glob("cfg/**/*.cfg"):
        listing = False
        for line in cfg.read_text().splitlines():
            if re.match(r"[A-Z_]+\b", line):  # a cfg keyword starts a section
                listing = line.startswith("INVARIANT")
                line = line.split(None, 1)[1] if listing and len(line.split()) > 1 else ""
            if listing:
                checked |= set(line.split())
    assert set(ODB_INVARIANTS) <= defined, set(ODB_INVARIANTS) - defined
    assert "PoolOnce" in checked and checked & defined <= set(ODB_INVARIANTS), sorted(checked & defined - set(ODB_INVARIANTS))
    # the trace replay checks the recorded grouping against the rule itself instead of BRuleAdmissible
    assert set(traces.INVARIANTS) == set(ODB_INVARIANTS) - {"BRuleAdmissible"}
    assert set(inductive.ODB) == set(ODB_INVARIANTS)


@pytest.mark.parametrize("bug", reach.SIM_BUGS, ids=lambda b: b.name)
def test_simulation_catches_seeded_bug(bug):
    result = reach.run_bug(bug)
    assert result.outcome == bug.expected, f"{bug.name}: TLC said {result.outcome}"


def test_progress_invariants_hold_on_quick_configurations():
    for r in parallel(progress.run_progress, progress.quick_checks(progress.CI_QUICK)):
        assert r.outcome == "ok", f"{r.check.name}: {r.outcome}\n{r.output[-3000:]}"
        assert r.distinct_states > 100


def test_progress_invariants_catch_stuck_protocols_the_deadlock_check_misses():
    results = {r.check.name: r for r in parallel(progress.run_progress, progress.BUGS)}
    for name, r in results.items():
        assert r.outcome == r.check.expected, f"{name}: expected {r.check.expected}, TLC said {r.outcome}"
    # the same seeded bug, checked with ODB's invariants and TLC's deadlock check only: silent
    blind = results["deadlock_check_blind"]
    assert blind.outcome == "ok" and "Deadlock" not in blind.output and blind.distinct_states > 100


def test_invariants_are_inductive_and_the_strengthening_is_needed():
    results = parallel(inductive.run_check, inductive.CI_CHECKS)
    for r in results:
        assert r.passed, f"{r.check.name}: expected {r.check.expected}, TLC said {r.outcome}\n{r.output[-3000:]}"
        assert r.initial_states > 50, f"{r.check.name}: the domain is nearly empty"
    positive = [r for r in results if r.check.expected == "ok"]
    assert {r.check.model.world for r in positive} == {1, 2}
    assert {r.check.model.join for r in positive} == {True, False}
    assert any(r.check.model.pool for r in positive), "a domain with a shared tail's pool (PoolOnce, the claims)"
    assert any(r.check.model.stream for r in positive), "a domain of streams (next up to NV + 2: the end known)"
    # a counterexample to induction is one step from the domain (depth 2)
    for r in results:
        if r.check.expected != "ok":
            assert "State 2:" in r.output and "State 3:" not in r.output, r.check.name


def test_odb_check_json_has_the_reach_object():
    out = subprocess.run(
        [sys.executable, "-m", "odb_tools.cli", "check", "--json", "--select", "reach_inductive_old_depth_bound",
         "--traces", "0", "--mutant-traces", "0", "--hunt-examples", "0", "--scenarios", "none"],
        capture_output=True, text=True, timeout=600,
    )
    report = json.loads(out.stdout)
    assert out.returncode == 0 and report["ok"], out.stderr[-2000:]
    assert report["configs"] == []
    reach_obj = report["reach"]
    assert reach_obj["ok"] and [c["name"] for c in reach_obj["inductive"]] == ["old_depth_bound"]
    assert reach_obj["inductive"][0]["result"] == "invariant:OldDepthBound"
    assert {"models", "behaviours", "states", "largest", "coverage", "bugs"} <= set(reach_obj["simulation"])
