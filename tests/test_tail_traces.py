"""Trace validation of the shared tail (``ODBConfig.shared_tail``): pooled runs' event logs
merge into spec traces (the claims applied by the gather that makes them, spec ``ClaimWith``),
TLC replays them against spec/TraceCheck.tla with every invariant, and three seeded claim bugs
are rejected at the gather that breaks them."""

from __future__ import annotations

import copy
import dataclasses
import random

import pytest

from model_checks import conformance, traces
from model_checks.conformance import VARIABLES, Trace
from odb_core.config import ODBConfig
from odb_core.simulator import simulate

pytestmark = pytest.mark.timeout(300)

IX = {v: k for k, v in enumerate(VARIABLES)}


def _pooled(k: int, mutant: str | None = None) -> tuple[conformance.Scenario, list[int], str]:
    return conformance.pooled_scenario(random.Random(f"tail-traces:{k}"), k, mutant)


def _claims_after_skip(logs: list[list[dict]]) -> bool:
    """Some rank logged a claim right after a skip round's gather (applied at that gather)."""
    return any(ev["ev"] == "claim" and log[i - 1]["ev"] == "gather" and log[i - 1]["target"] == 0
               for log in logs for i, ev in enumerate(log))


def test_merged_pooled_logs_are_the_recorded_traces():
    """Merging recovers the simulator's own trace, pc and claimed included, and the pool's lengths."""
    seen = {"claims after a skip round": False, "two ranks claim at one gather": False}
    for k in range(40):
        s, data, schedule = _pooled(k)
        logs = traces.simulator_logs(s, data, schedule)
        recorded, merged = conformance.record(s, data, schedule), traces.merge(logs, f"pooled{k}")
        assert merged.complete and merged.states == recorded.states, (k, s, schedule)
        assert merged.packs == recorded.packs and merged.actions == traces.actions_of(recorded), (k, s)
        assert merged.scenario.pool == s.pool and merged.scenario.lengths == s.lengths, (k, s)
        assert merged.states[-1][IX["pc"]] == len(s.pool), "a clean run claims the whole pool"
        claim_rounds = {ev["round"] for log in logs for ev in log if ev["ev"] == "claim"}
        assert traces.coverage(merged)["claim"] == len(claim_rounds) > 0, "coverage counts the gathers that claim"
        seen["claims after a skip round"] |= _claims_after_skip(logs)
        seen["two ranks claim at one gather"] |= any(
            sum(x != y for x, y in zip(a[IX["claimed"]], b[IX["claimed"]])) > 1
            for a, b in zip(merged.states, merged.states[1:]))
    assert all(seen.values()), seen


def test_merge_rejects_claims_that_are_not_one_pooled_run():
    s, data, schedule = _pooled(3)
    logs = traces.simulator_logs(s, data, schedule)
    r, i = next((r, i) for r, log in enumerate(logs) for i, ev in enumerate(log) if ev["ev"] == "claim")

    bad = copy.deepcopy(logs)
    bad[r][i]["first"] = len(s.pool)
    with pytest.raises(traces.MergeError, match=f"rank {r}: a claim of .* outside the pool's {len(s.pool)} views"):
        traces.merge(bad)

    bad = copy.deepcopy(logs)
    bad[r][i]["round"] += 7
    with pytest.raises(traces.MergeError, match=f"rank {r}: event .*: a claim of round"):
        traces.merge(bad)

    merged = traces.merge(logs)
    last = list(merged.states[-1])
    last[IX["claimed"]] = ((len(s.pool) + 1,), *last[IX["claimed"]][1:])
    outside = dataclasses.replace(merged, states=[*merged.states[:-1], tuple(last)])
    assert "rank 1: claimed must be a sequence of pool indices" in (traces.shape_errors(outside) or "")

    bad = copy.deepcopy(logs)
    start = next(ev for ev in bad[1] if ev["ev"] == "iteration")
    start["pool"] += 1
    with pytest.raises(traces.MergeError, match="rank 1: shared-tail pools of"):
        traces.merge(bad)


def test_a_pooled_log_from_before_reserve_divisor_replays_with_one_rank_a_round():
    """A log whose configuration has no ``reserve_divisor`` (written before it existed, when the
    reserve went to one rank a round at every W) merges with ReserveDiv = W, so k = 1."""
    s, data, schedule = _pooled(1)
    logs = traces.simulator_logs(dataclasses.replace(s, reserve_divisor=len(s.lengths)), data, schedule)
    for log in logs:
        for ev in log:
            if "config" in ev:
                del ev["config"]["reserve_divisor"]
    merged = traces.merge(logs)
    assert merged.scenario.reserve_divisor == len(s.lengths)
    assert all(v.accepted for v in traces.replay([merged]))


def _mutant_run(mutant: str) -> tuple[Trace, int]:
    """The merged logs of a pooled run the mutation changed, and the first state that differs
    from the clean run's on the same inputs (where the bug shows)."""
    for k in range(200):
        s, data, schedule = _pooled(k, mutant)
        bad = traces.merge(traces.simulator_logs(s, data, schedule), mutant)
        good = traces.merge(traces.simulator_logs(dataclasses.replace(s, mutant=None), data, schedule))
        differs = [j for j, (a, b) in enumerate(zip(bad.states, good.states)) if a != b]
        if differs:
            return bad, differs[0]
    raise AssertionError(f"{mutant} never changed a pooled run")


def test_tlc_replays_pooled_runs_and_rejects_claim_bugs():
    clean = [traces.merge(traces.simulator_logs(*_pooled(k)), f"pooled{k}") for k in range(5)]
    logs: list[list[dict]] = []  # the configuration of the brief: a quarter of the order pooled, W = 3
    simulate([5, 9, 2, 7, 3, 8, 1, 6], 3, ODBConfig(mode="join", shared_tail=0.25, token_budget=12, buffer_size=2,
                                                     depth=3), "uneven", shuffle=False, events=logs)
    clean.append(traces.merge(logs, "quarter"))
    assert all(t.states[-1][IX["pc"]] == len(t.scenario.pool) > 0 for t in clean)
    double, double_at = _mutant_run("double-deal")
    dropped, dropped_at = _mutant_run("drop-last-claim")
    least, least_at = _mutant_run("fill-least-room")
    one, one_at = _mutant_run("fill-one-rank")
    verdicts = traces.replay([*clean, one, least, double, dropped])
    assert all(v.accepted for v in verdicts[:-4]), [v.describe() for v in verdicts if not v.accepted]
    # the reserve dealt to one rank where reserve_divisor gives more: the same kind of Step break
    assert one.scenario.reserve_divisor == 1
    v = verdicts[-4]
    assert not v.accepted and v.reasons == ("Step",) and v.state == one_at, v.describe()
    # the packed reserve's view dealt to the rank with the least room: every view is still dealt
    # once, but the gather's claims are not the spec's (Claims), so no spec step matches it
    v = verdicts[-3]
    assert not v.accepted and v.reasons == ("Step",) and v.state == least_at, v.describe()
    # a pool view dealt twice: the gather deals other views (no ODB step), and PoolOnce breaks
    v = verdicts[-2]
    assert not v.accepted and {"Step", "PoolOnce"} <= set(v.reasons) and v.state == double_at, v.describe()
    assert traces.actions_of(double)[double_at] == "Gather"
    # the last claim dropped: the spec's gather deals the pool's last views, the run's did not
    v = verdicts[-1]
    assert not v.accepted and v.reasons == ("Step",) and v.state == dropped_at, v.describe()
    assert dropped.states[dropped_at][IX["pc"]] < len(dropped.scenario.pool) and dropped.states[-1][IX["done"]]
