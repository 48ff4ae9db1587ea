"""Trace validation (model_checks.traces): the strict replay, coverage, and the merger
of per-rank event logs.

* The merger turns the per-rank event logs of a simulator run (the epoch driver's
  ``trace`` events) into exactly the trace ``conformance.record`` records for that run.
* One TLC run replays clean traces, merged traces, a run cut by a fault, and seeded
  bugs; each seeded bug is rejected by the invariant (or check) it breaks.
"""

from __future__ import annotations

import copy
import dataclasses
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from model_checks import conformance, traces
from model_checks.conformance import VARIABLES, Trace
from odb_core.budgets import BUFFER_RULES, within_budget

pytestmark = pytest.mark.timeout(900)

IX = {v: k for k, v in enumerate(VARIABLES)}


def _normal_constants(t: Trace, arrived: set[tuple[int, int]]) -> dict:
    """The constants that a run's events determine: lengths of views that arrived (others
    are never read by the spec), the quota in non-join mode only."""
    k = dict(t.scenario.constants())
    if k["JoinMode"]:
        k.pop("Quota")
    k["Length"] = tuple(tuple(n if (r, p) in arrived else None for p, n in enumerate(ls))
                        for r, ls in enumerate(k["Length"]))
    return k


def _arrived(logs: list[list[dict]]) -> set[tuple[int, int]]:
    return {(r, ev["pos"]) for r, log in enumerate(logs) for ev in log if ev["ev"] == "arrive"}


# ---- the merger -----------------------------------------------------------------------------
def test_merged_event_logs_are_the_recorded_traces(tmp_path):
    rng = random.Random("merge-vs-record")
    for k in range(200):
        s, data, schedule = conformance.random_scenario(rng, k)
        recorded = conformance.record(s, data, schedule)
        logs = traces.simulator_logs(s, data, schedule)
        if k % 20 == 0:  # through the files real runs write
            traces.write_logs(tmp_path, f"run{k}", logs)
            ((name, logs),) = [r for r in traces.read_logs(tmp_path) if r[0] == f"run{k}"]
        merged = traces.merge(logs, name=f"run{k}")
        assert merged.complete
        assert merged.states == recorded.states, (k, s, schedule)
        assert merged.packs == recorded.packs, (k, s, schedule)
        assert merged.actions == traces.actions_of(recorded), (k, s, schedule)
        assert _normal_constants(merged, _arrived(logs)) == _normal_constants(recorded, _arrived(logs))
    assert len(traces.merge_directory(tmp_path)) == 10


def test_merged_mutant_runs_are_the_recorded_traces():
    """Also for seeded bugs, but drop-overflow: a dropped sample leaves B without an event, so
    the merged run keeps it in B (and is rejected when the next grouping leaves it out)."""
    rng = random.Random("merge-vs-record-mutants")
    for mutant in set(conformance.TRACEABLE_MUTANTS) - {"drop-overflow"}:
        for k in range(20):
            s, data, schedule = conformance.random_scenario(rng, k, mutant)
            merged = traces.merge(traces.simulator_logs(s, data, schedule), statuses=False)
            assert merged.states == conformance.record(s, data, schedule).states, (mutant, k)


def _join_logs() -> tuple[conformance.Scenario, list[list[dict]]]:
    s = conformance.Scenario("j", ((3, 1, 7, 2, 5, 1), (4, 4, 1, 2, 6, 8)), budget=8, buffer_size=2, depth=3,
                             capacity=1)
    data = [3, 4, 1, 4, 7, 1, 2, 2, 5, 6, 1, 8]  # DistributedSampler order: rank 0 gets 0, 2, 4, ...
    logs = traces.simulator_logs(s, data, "in_order")
    return s, logs


def test_merge_rejects_logs_the_ranks_disagree_on():
    _, logs = _join_logs()
    gathers = [i for i, ev in enumerate(logs[1]) if ev["ev"] == "gather"]

    bad = copy.deepcopy(logs)
    bad[1][gathers[2]]["target"] += 1
    with pytest.raises(traces.MergeError, match="gather 2: rank 1 reports target"):
        traces.merge(bad)

    bad = copy.deepcopy(logs)
    del bad[1][gathers[-1]]
    with pytest.raises(traces.MergeError, match="rank 1 has .* gathers, rank 0 has"):
        traces.merge(bad)

    bad = copy.deepcopy(logs)
    bad[1][0]["config"] = {**bad[1][0]["config"], "token_budget": 99}
    with pytest.raises(traces.MergeError, match="rank 1 begins with config"):
        traces.merge(bad)

    bad = copy.deepcopy(logs)
    bad[0].append({"ev": "fetch", "positions": []})
    with pytest.raises(traces.MergeError, match="after 'end'"):
        traces.merge(bad)

    with pytest.raises(traces.MergeError, match="rank 0 is not a new rank"):
        traces.merge([logs[0], logs[0]])


def test_merge_rejects_lengths_that_change_between_chained_iterations():
    rng = random.Random("chained")
    for k in range(500):  # a non-join run that chains and fetches again in its second iteration
        s, data, schedule = conformance.random_scenario(rng, k)
        logs = traces.simulator_logs(s, data, schedule)
        starts = [i for i, ev in enumerate(logs[0]) if ev["ev"] == "iteration"]
        if len(starts) >= 2 and any(ev["ev"] == "arrive" for ev in logs[0][starts[1]:]):
            break
    else:
        raise AssertionError("no run chains")
    bad = copy.deepcopy(logs)
    arrive = next(ev for ev in bad[0][starts[1]:] if ev["ev"] == "arrive")
    arrive["length"] += 1
    with pytest.raises(traces.MergeError, match=f"rank 0 position {arrive['pos']}: length .* fixed across"):
        traces.merge(bad)


def _cut(logs: list[list[dict]], gathers: int) -> list[list[dict]]:
    """Every rank's log up to its ``gathers``-th gather: a run cut by a fault (no ``end``)."""
    return [log[: [i for i, ev in enumerate(log) if ev["ev"] == "gather"][gathers - 1] + 1] for log in logs]


def test_a_run_cut_by_a_fault_is_incomplete():
    _, logs = _join_logs()
    assert sum(ev["ev"] == "gather" for ev in logs[0]) > 3
    merged = traces.merge(_cut(logs, 3))
    assert not merged.complete and not merged.states[-1][IX["done"]]
    assert traces.merge(logs).complete


def test_a_rank_missing_more_than_the_last_gather_is_not_a_fault_cut():
    """A gather needs every rank, so a rank cut by a fault misses at most the last gather a peer
    logged; missing two, the logs cannot be one run (merged before as a cut run, and accepted)."""
    _, logs = _join_logs()
    gathers = [i for i, ev in enumerate(logs[1]) if ev["ev"] == "gather"]
    one = [logs[0], logs[1][: gathers[-1]]]  # rank 1 cut in its last gather
    assert not traces.merge(one).complete
    two = [logs[0], logs[1][: gathers[-2]]]
    with pytest.raises(traces.MergeError, match="rank 0 has .* gathers, rank 1 only .* can miss only the last"):
        traces.merge(two)


def _round_logs(want: str) -> list[list[dict]]:
    """A padded run's logs with a gather that emits nothing (``skip``: T = 0 mid-run) or chains."""
    rng = random.Random(f"rounds:{want}")
    for k in range(3000):
        s, data, schedule = conformance.random_scenario(rng, k)
        if s.pool or s.stream:
            continue
        logs = traces.simulator_logs(s, data, schedule)
        kinds = [(ev["target"], ev["ended"], ev["done"]) for ev in logs[0] if ev["ev"] == "gather"]
        if want == "skip" and any(t == 0 and not e for t, e, _ in kinds):
            return logs
        if want == "chain" and any(e and not d for _, e, d in kinds):
            return logs
    raise AssertionError(f"no run has a {want} round")


def _gather_where(logs: list[list[dict]], r: int, pick: Any) -> dict:
    return next(ev for ev in logs[r] if ev["ev"] == "gather" and pick(ev))


def test_a_round_that_emits_nothing_must_yield_nothing_and_a_chain_keeps_its_h():
    """Seeded log bugs the merge ignored before (their traces were accepted, the same as the
    clean run's): a step yielded at a skip round or at the gather that ends an iteration
    (lockstep, P2), and a changed held-back set at a chain."""
    for want, pick in (("skip", lambda ev: ev["target"] == 0 and not ev["ended"]),
                       ("chain", lambda ev: ev["ended"] and not ev["done"])):
        logs = _round_logs(want)
        traces.merge(logs)  # clean
        bad = copy.deepcopy(logs)
        _gather_where(bad, 1, pick)["out"] = [[0]]
        with pytest.raises(traces.MergeError, match=r"rank 1 yields \[\[0\]\] at a round that emits nothing"):
            traces.merge(bad)
    bad = copy.deepcopy(_round_logs("chain"))
    ev = _gather_where(bad, 0, lambda ev: ev["ended"] and not ev["done"])
    ev["held"] = sorted(set(ev["held"]) ^ {0})
    with pytest.raises(traces.MergeError, match="held back as its iteration ends, the spec's H"):
        traces.merge(bad)


def test_a_status_the_spec_would_not_report_is_refused():
    """The header's status drives the target (P2); a log whose rank reports another status than
    the spec's Status in the merged state is not the run (accepted before: nothing read it)."""
    _, logs = _join_logs()
    traces.merge(logs)
    for flip in range(len([ev for ev in logs[1] if ev["ev"] == "gather"])):
        bad = copy.deepcopy(logs)
        ev = [ev for ev in bad[1] if ev["ev"] == "gather"][flip]
        ev["status"] = "waiting" if ev["status"] != "waiting" else "ready"
        with pytest.raises(traces.MergeError, match=f"gather {flip} .*: rank 1 reports status"):
            traces.merge(bad)


def test_real_traces_report_their_cut_runs(tmp_path, capsys):
    """A run with a rank that never logged ``end`` is replayed only up to the cut, where the
    end-of-run checks (Done, JoinCoverage, QuotaClosure) do not apply: ``odb check
    --real-traces`` names it (it counted it accepted as any other before)."""
    from model_checks.report import replay_real_traces

    _, logs = _join_logs()
    traces.write_logs(tmp_path, "whole", logs)
    assert replay_real_traces(str(tmp_path))["incomplete"] == []
    gathers = [i for i, ev in enumerate(logs[1]) if ev["ev"] == "gather"]
    traces.write_logs(tmp_path, "cut", [logs[0], logs[1][: gathers[-1]]])
    got = replay_real_traces(str(tmp_path))
    assert got["accepted"] == got["checked"] == 2 and got["incomplete"] == ["./cut"]
    from odb_tools.cli import main

    assert main(["check", "--select", "none", "--scenarios", "none", "--traces", "0", "--mutant-traces", "0",
                 "--hunt-examples", "0", "--real-traces", str(tmp_path)]) == 0
    assert "1 real runs stopped before every rank's end" in capsys.readouterr().err


# ---- coverage -------------------------------------------------------------------------------
def test_coverage_agrees_with_the_events():
    rng = random.Random("coverage")
    for k in range(150):
        s, data, schedule = conformance.random_scenario(rng, k)
        logs = traces.simulator_logs(s, data, schedule)
        got = traces.coverage(traces.merge(logs))
        gathers = [ev for ev in logs[0] if ev["ev"] == "gather"]
        assert got["fetch"] == sum(ev["ev"] == "fetch" and bool(ev["positions"]) for log in logs for ev in log)
        assert got["drain"] == sum(ev["ev"] == "arrive" for log in logs for ev in log)
        assert got["gather"] == len(gathers)
        assert got["skip"] == sum(not ev["ended"] and ev["target"] == 0 for ev in gathers)
        assert got["chain"] == sum(ev["ended"] and not ev["done"] for ev in gathers)
        assert got["end"] == (1 if gathers and gathers[-1]["done"] else 0)
        per_rank = [[ev for ev in log if ev["ev"] == "gather"] for log in logs]
        rounds = list(zip(*per_rank))
        ready = [[ev for ev in rnd if ev["status"] == "ready"] for rnd in rounds]
        emitting = [not rnd[0]["ended"] and rnd[0]["target"] > 0 for rnd in rounds]
        assert got["split"] == sum(e and any(len(ev["grouping"]) < ev["target"] for ev in rd)
                                   for e, rd in zip(emitting, ready))
        assert got["hold"] == sum(e and any(ev["held"] for ev in rd) for e, rd in zip(emitting, ready))


def test_coverage_report_and_requirement():
    rng = random.Random("coverage-report")
    joins = []
    while len(joins) < 8:
        s, data, schedule = conformance.random_scenario(rng, len(joins))
        if s.join:
            joins.append(conformance.record(s, data, schedule))
    report = traces.coverage_report(joins)
    assert len(report["per_trace"]) == 8 and set(report["total"]) == set(traces.COVERAGE_KINDS)
    assert report["total"]["gather"] == sum(c["gather"] for c in report["per_trace"]) > 0
    assert "chain" in traces.missing_coverage(joins)  # join mode never chains
    with pytest.raises(traces.CoverageError, match="chain"):
        traces.require_coverage(joins)
    assert traces.require_coverage(joins, ["fetch", "drain", "gather", "end"])["end"] == 8


# ---- seeded bugs: one TLC run -----------------------------------------------------------------
def _with_state(t: Trace, j: int, state: tuple, insert: bool = False) -> Trace:
    """``t`` with state ``j`` replaced (or a new state inserted before it), actions inferred."""
    states, packs = list(t.states), list(t.packs)
    if insert:
        states.insert(j, state)
        packs.insert(j, tuple(() for _ in t.scenario.lengths))
    else:
        states[j] = state
    return dataclasses.replace(t, states=states, packs=packs, actions=[])


def _extra_fetch(pool: list[Trace]) -> Trace:
    """A fetch beyond the depth: after a fetch that filled |Q| + |B| to D (regroup off, so
    DepthBound is |Q| + |B| <= D), one more view moves R -> Q."""
    for t in pool:
        if t.scenario.regroup[1]:
            continue
        acts = traces.actions_of(t)
        for j, st in enumerate(t.states):
            if acts[j] != "Fetch":
                continue
            for r, n in enumerate(t.scenario.lengths):
                nxt, q, b = st[IX["next"]][r], st[IX["Q"]][r], st[IX["B"]][r]
                if len(q) + len(b) == t.scenario.depth and nxt <= len(n):
                    new = list(st)
                    new[IX["next"]] = tuple(x + 1 if i == r else x for i, x in enumerate(st[IX["next"]]))
                    new[IX["Q"]] = tuple(x | {nxt} if i == r else x for i, x in enumerate(st[IX["Q"]]))
                    return _with_state(t, j + 1, tuple(new), insert=True)
    raise AssertionError("no fetch fills the depth with views left")


def _over_budget(pool: list[Trace]) -> Trace:
    """An emitted item over the budget: in some rank's last gather, a long lone sample
    trades places with the shortest sample of a group (same item count, same E)."""
    for t in pool:
        budget, lengths = t.scenario.budget, t.scenario.lengths
        for j, st in enumerate(t.states):
            for r, items in enumerate(st[IX["lastOut"]]):
                for a, group in enumerate(items):
                    for c, lone in enumerate(items):
                        if len(group) < 2 or len(lone) != 1:
                            continue
                        short = min(group, key=lambda p: lengths[r][p - 1])
                        swapped = tuple(sorted((set(group) - {short}) | set(lone)))
                        if not within_budget(t.scenario.budget_kind, [lengths[r][p - 1] for p in swapped], budget):
                            out = list(items)
                            out[a], out[c] = swapped, (short,)
                            new = list(st)
                            new[IX["lastOut"]] = tuple(tuple(out) if i == r else x
                                                       for i, x in enumerate(st[IX["lastOut"]]))
                            return _with_state(t, j, tuple(new))
    raise AssertionError("no gather emits a group beside a long lone sample")


def _singleton_run(monkeypatch) -> Trace:
    """A real run whose grouping is admissible (every sample alone) but not the B(l) rule."""
    s = conformance.Scenario("single", ((1, 2, 1, 3), (2, 1, 2, 1)), budget=8, buffer_size=4, depth=4,
                             regroup=(0, 0))
    data = [1, 2, 2, 1, 1, 2, 3, 1]
    with monkeypatch.context() as m:
        m.setitem(BUFFER_RULES, "padded",
                  lambda lengths, budget, held: [[p] for p in sorted(lengths, key=lambda p: (lengths[p], p))])
        logs = traces.simulator_logs(s, data, "in_order")
    merged = traces.merge(logs, "single")
    assert any(len(pack[r]) for pack in merged.packs for r in range(2)), "the run must group"
    return merged


def _mutant_run(mutant: str) -> Trace:
    """The merged event logs of a run the mutation changed."""
    rng = random.Random(f"mutant-run:{mutant}")
    for k in range(2000):
        s, data, schedule = conformance.random_scenario(rng, k, mutant)
        bad = traces.merge(traces.simulator_logs(s, data, schedule), mutant, statuses=False)
        good = traces.merge(traces.simulator_logs(dataclasses.replace(s, mutant=None), data, schedule))
        if bad.states != good.states:
            return bad
    raise AssertionError(f"{mutant} never changed a run")


#: what each seeded bug must be rejected by (all of these reasons, maybe more)
EXPECTED = {
    "grouping-not-BRule": {"BRule"},
    "extra-fetch": {"Step", "DepthBound"},
    "not-done": {"Done"},
    "over-budget": {"Step", "BudgetOK"},
    "cut-marked-complete": {"Done"},
    "mutant:no-cmin": {"WithinCapacity"},
    # the drop has no event: the merged run keeps the samples in B, and the next fetch of the
    # core (whose B is smaller) takes more than the spec's room (record()'s traces: NoLeak)
    "mutant:drop-overflow": {"Step"},
    "mutant:early-finish": {"BRule"},
    "mutant:merge-overflow": {"BudgetOK"},
    "mutant:no-chain": {"QuotaClosure"},
    "mutant:pack-overfill": {"BRule"},
}


def test_strict_replay_rejects_seeded_bugs_and_says_why(monkeypatch):
    rng = random.Random("seeded-bugs")
    pool = [conformance.record(*conformance.random_scenario(rng, k)) for k in range(60)]
    clean = pool[:6]
    merged = [traces.merge(traces.simulator_logs(*conformance.random_scenario(rng, 100 + k))) for k in range(6)]
    _, logs = _join_logs()
    cut = traces.merge(_cut(logs, 3), "cut")
    bugs = {
        "grouping-not-BRule": _singleton_run(monkeypatch),
        "extra-fetch": _extra_fetch(pool),
        "not-done": dataclasses.replace(pool[0], states=pool[0].states[:-1], packs=pool[0].packs[:-1],
                                        actions=pool[0].actions[:-1]),
        "over-budget": _over_budget(pool),
        "cut-marked-complete": dataclasses.replace(cut, complete=True),
        **{f"mutant:{m}": _mutant_run(m) for m in conformance.TRACEABLE_MUTANTS},
    }
    malformed = dataclasses.replace(pool[1], states=[pool[1].states[0][:-1]], packs=pool[1].packs[:1])
    batch = [*clean, *merged, cut, *bugs.values(), malformed]
    verdicts = traces.replay(batch)
    good = len(clean) + len(merged) + 1
    assert all(v.accepted for v in verdicts[:good]), [v.describe() for v in verdicts[:good] if not v.accepted]
    found = {}
    for name, v in zip(bugs, verdicts[good:]):
        assert not v.accepted, f"{name} was accepted"
        found[name] = v
        assert EXPECTED[name] <= set(v.reasons), v.describe()
    assert found["grouping-not-BRule"].reasons == ("BRule",), "the singleton grouping is an ODB step otherwise"
    assert "B(l) gives" in found["grouping-not-BRule"].detail
    assert found["not-done"].reasons == ("Done",) and found["not-done"].state == len(pool[0].states) - 2
    assert verdicts[-1].reasons == ("Shape",) and not verdicts[-1].accepted
    print("\n".join(f"{name}: {v.describe()}" for name, v in found.items()))


_values = hs.recursive(
    hs.integers(-5, 10**6) | hs.booleans() | hs.sampled_from(["Fetch", "Drain", "padded"]),
    lambda inner: hs.lists(inner, max_size=40).map(tuple)
    | hs.frozensets(hs.integers(0, 10**4), max_size=40)
    | hs.dictionaries(hs.sampled_from(["next", "Q", "cfg"]), inner, max_size=3),
    max_leaves=400)


@given(_values, hs.integers(8, 120))
@settings(max_examples=200, deadline=None)
def test_wrapped_tla_is_the_same_value_on_short_lines(value, width):
    """wrap_tla only breaks lines after commas (SANY's lexer is quadratic in a line's
    length): the text is the value's with line breaks, and no line passes ``width`` (its
    comma aside) unless it holds a single element."""
    text = conformance.wrap_tla(conformance.to_tla(value), width)
    assert text.replace(",\n ", ", ") == conformance.to_tla(value)
    for line in text.splitlines():
        assert len(line) <= width + 1 or ", " not in line.strip(), line


def test_wrap_tla_refuses_a_string_with_a_comma():
    with pytest.raises(ValueError, match="comma"):
        conformance.wrap_tla(conformance.to_tla(("a, b", 1)))
