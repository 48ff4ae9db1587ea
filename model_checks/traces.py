"""Trace validation: recorded runs replayed by TLC as behaviours of spec/ODB.tla.

A :class:`~model_checks.conformance.Trace` (the constants of one run, its abstract
states, the spec action and the recorded grouping of each step) comes from the
simulator (:func:`model_checks.conformance.record`) or from the per-rank event logs
of a real run (:func:`merge`). :func:`replay` writes one ``TraceData`` module per
batch of traces (one constant-level ``INSTANCE ODB`` per trace, since INSTANCE
arguments may not depend on a variable) and runs TLC on ``spec/TraceCheck.tla``,
which, for every trace and every state:

* replays the recorded step as the spec action it names (``Fetch``, ``Drain``, or the
  gather with the recorded emission order), from the recorded state to the next;
* at a gather, requires the recorded grouping of each ready rank to EQUAL the budget's
  rule (``Packing``: the B(l) walk, or best-fit decreasing under ``BudgetKind = "packed"``;
  with regroup, the full grouping held groups included, which is what
  ``RankProtocol.grouping`` records) and ``<<>>`` for the other ranks;
* evaluates every invariant of :data:`INVARIANTS` (through the trace's instance);
* on the last state of a complete trace, requires ``done`` (JoinCoverage and
  QuotaClosure are guarded by ``done``, so they bite there).

The first failure ends the trace's behaviour with a verdict naming it (:class:`Verdict`).
:func:`coverage` counts the kinds of steps a trace exercises; :func:`merge` turns
per-rank event logs (``odb_core.epoch.EpochDriver(trace=...)``) into a trace.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from model_checks.conformance import VARIABLES, Scenario, Trace, Value, to_tla
from model_checks.tla import SPEC_DIR, tlc
from odb_core.config import BUDGETS, OVERFLOW_POLICIES, TARGET_POLICIES

#: the invariants of spec/ODB.tla checked on every replayed state (TypeOK first: if it
#: fails the others are not reported). JoinCoverage and QuotaClosure hold trivially
#: until ``done``; with the last state required ``done`` they check the end of the run.
#: BRuleAdmissible is a property of the spec's own rule (checked by model checking),
#: and the grouping check below compares the recorded grouping with that rule.
INVARIANTS = ("TypeOK", "NoLeak", "DepthBound", "HeldOK", "Lockstep", "BudgetOK", "WithinCapacity",
              "RoundBound", "JoinCoverage", "QuotaClosure")
#: spec actions a trace step can name
ACTIONS = ("Init", "Fetch", "Drain", "Gather")
#: verdict reasons besides the invariant names
REASONS = {
    "Init": "the first state is not ODB's Init",
    "Step": "no ODB step leads from the previous state to this one",
    "BRule": "a ready rank's recorded grouping is not the budget's rule, B(l) or packing (or a rank not ready "
             "recorded one)",
    "Done": "the last state of a complete run is not done",
    "Shape": "the trace is malformed (not replayed)",
}
#: traces per TLC run (amortises the JVM start and SANY)
TRACE_BATCH = 260

_IX = {v: k for k, v in enumerate(VARIABLES)}


# ---- verdicts ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Verdict:
    """What the replay of one trace found."""

    index: int
    """The trace's index in the list given to :func:`replay`."""
    accepted: bool
    reasons: tuple[str, ...] = ()
    """Why it was rejected: invariant names and/or ``Init``, ``Step``, ``BRule``, ``Done``,
    ``Shape`` (see :data:`REASONS`); empty when accepted."""
    state: int = 0
    """0-based index into ``trace.states`` of the state where the replay stopped: the state
    that violates the invariants, is not an ODB step from the previous one, is reached by a
    gather whose grouping is not the budget's rule, or is the last state and not done."""
    detail: str = ""

    def describe(self) -> str:
        if self.accepted:
            return f"trace {self.index}: accepted"
        why = ", ".join(self.reasons)
        detail = f" ({self.detail})" if self.detail else ""
        return f"trace {self.index}: rejected at state {self.state} by {why}{detail}"


def actions_of(trace: Trace) -> list[str]:
    """The spec action of each state of ``trace``: the recorded ones, else inferred from the
    states (a Fetch only raises one rank's ``next`` and adds to its Q; a Drain moves one
    position from Q to the end of B; anything else, a stutter included, is a gather)."""
    if trace.actions:
        return list(trace.actions)
    out = ["Init"]
    for a, b in zip(trace.states, trace.states[1:]):
        out.append(_infer(a, b))
    return out


def _infer(a: tuple[Value, ...], b: tuple[Value, ...]) -> str:
    same = [x for x in VARIABLES if a[_IX[x]] == b[_IX[x]]]
    if set(VARIABLES) - set(same) == {"next", "Q"}:
        return "Fetch"
    if set(VARIABLES) - set(same) == {"Q", "B"}:
        return "Drain"
    return "Gather"


def shape_errors(trace: Trace) -> str | None:
    """Why ``trace`` cannot be given to TLC (a value TLC could not evaluate the spec on:
    a position outside a rank's views, a per-rank tuple of the wrong length, ...), or None."""
    s = trace.scenario
    try:
        consts = s.constants()
    except Exception as exc:  # noqa: BLE001 - a malformed scenario is reported, not raised
        return f"constants: {exc}"
    world, nv = consts["W"], consts["NV"]
    if not (isinstance(world, int) and world >= 1 and len(nv) == world and len(consts["Length"]) == world):
        return f"W = {world}, NV = {nv}: one entry per rank needed"
    if any(len(ls) != n or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in ls)
           for ls, n in zip(consts["Length"], nv)):
        return "Length must hold NV[r] lengths >= 0 per rank"
    for key in ("Budget", "BufSize"):
        if not (isinstance(consts[key], int) and consts[key] >= 1):
            return f"{key} = {consts[key]!r} must be >= 1"
    for key in ("Depth", "Capacity", "Quota", "RegroupNum", "RegroupDen"):
        if not (isinstance(consts[key], int) and consts[key] >= 0):
            return f"{key} = {consts[key]!r} must be >= 0"
    if consts["Overflow"] not in OVERFLOW_POLICIES or consts["Policy"] not in TARGET_POLICIES:
        return f"unknown overflow or target policy ({consts['Overflow']!r}, {consts['Policy']!r})"
    if consts["BudgetKind"] not in BUDGETS:
        return f"unknown budget {consts['BudgetKind']!r}"
    if not trace.states:
        return "no states"
    if len(trace.packs) != len(trace.states):
        return f"{len(trace.packs)} packs for {len(trace.states)} states"
    acts = actions_of(trace)
    if len(acts) != len(trace.states) or acts[0] != "Init" or not set(acts[1:]) <= set(ACTIONS[1:]):
        return f"actions must be Init then Fetch/Drain/Gather, one per state (got {len(acts)} for {len(trace.states)})"

    def positions(r: int, xs: Iterable[Value]) -> bool:
        return all(isinstance(p, int) and not isinstance(p, bool) and 1 <= p <= nv[r] for p in xs)

    for j, st in enumerate(trace.states):
        where = f"state {j}"
        if len(st) != len(VARIABLES):
            return f"{where}: {len(st)} variables"
        nxt, q, b, e, h, consumed, last_step, last_out, rounds, done, _pc, _claimed = st
        per_rank = (nxt, q, b, e, h, last_out)
        if not all(isinstance(x, tuple) and len(x) == world for x in per_rank):
            return f"{where}: next/Q/B/E/H/lastOut need one entry per rank"
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in (*nxt, consumed, last_step, rounds)):
            return f"{where}: next/consumed/lastStep/rounds must be integers"
        if not isinstance(done, bool):
            return f"{where}: done must be a boolean"
        for r in range(world):
            if not (isinstance(q[r], frozenset) and isinstance(e[r], frozenset) and isinstance(h[r], frozenset)
                    and isinstance(b[r], tuple) and isinstance(last_out[r], tuple)):
                return f"{where}: rank {r + 1}: Q, E, H are sets, B and lastOut sequences"
            if not (positions(r, q[r]) and positions(r, b[r]) and positions(r, e[r]) and positions(r, h[r])):
                return f"{where}: rank {r + 1}: a position outside 1..{nv[r]}"
            if not all(isinstance(item, tuple) and positions(r, item) for item in last_out[r]):
                return f"{where}: rank {r + 1}: lastOut holds a position outside 1..{nv[r]}"
        pack = trace.packs[j]
        if not (isinstance(pack, tuple) and len(pack) == world):
            return f"{where}: the grouping needs one entry per rank"
        for r in range(world):
            if not (isinstance(pack[r], tuple)
                    and all(isinstance(g, tuple) and positions(r, g) for g in pack[r])):
                return f"{where}: rank {r + 1}: the grouping holds a position outside 1..{nv[r]}"
    return None


# ---- the TraceData module and the TLC run ------------------------------------------------
def _dispatch(head: str, arms: Sequence[str]) -> str:
    """``head == <arm k>`` for k = 1..len(arms), as a balanced IF tree on ``k`` (a CASE over
    hundreds of arms costs TLC a comparison per arm on every evaluation)."""
    def tree(lo: int, hi: int, indent: str) -> str:
        if lo == hi:
            return arms[lo - 1]
        mid = (lo + hi) // 2
        deeper = indent + "  "
        return (f"IF k <= {mid}\n{indent}THEN {tree(lo, mid, deeper)}\n"
                f"{indent}ELSE {tree(mid + 1, hi, deeper)}")
    return f"{head} == {tree(1, len(arms), '    ')}\n"


def trace_module(traces: Sequence[Trace]) -> str:
    """The TraceData module: ODB's variables, the traces (flat tuples, no @@ chains), one
    constant-level ODB instance per trace, and the dispatch on the trace number ``k``:
    ``InitAt(k)``, ``ReplayAt(k, a, P)`` (the recorded step is ODB action ``a``, a gather with
    grouping ``P`` and the recorded emission order), ``GroupingAt(k, P)`` (``P`` is the budget's
    rule, ``Packing``, on every ready rank and empty on the others), ``ViolatedAt(k)`` (the sequence of
    the names of the :data:`INVARIANTS` the current state violates)."""
    if not traces:
        raise ValueError("no traces")
    rows, defs = [], []
    names = tuple(Scenario("x", ()).constants())
    for k, tr in enumerate(traces, start=1):
        cfg = to_tla(tr.scenario.constants())
        states = ", ".join(to_tla(dict(zip(VARIABLES, st))) for st in tr.states)
        packs = ", ".join(to_tla(p) for p in tr.packs)
        acts = to_tla(tuple(actions_of(tr)))
        rows.append(f"[cfg |-> {cfg}, complete |-> {to_tla(tr.complete)}, acts |-> {acts},\n"
                    f" states |-> <<{states}>>,\n packs |-> <<{packs}>>]")
        subst = ", ".join(f"{c} <- Traces[{k}].cfg.{c}" for c in names)
        o = f"O_{k}"
        fails = " \\o ".join(f'Fails({o}!{inv}, "{inv}")' for inv in INVARIANTS[1:])
        defs.append(
            f"{o} == INSTANCE {'ODBStream' if tr.scenario.stream else 'ODB'} WITH {subst}\n"
            f"Replay_{k}(a, P) ==\n"
            f"    CASE a = \"Fetch\" -> \\E r \\in {o}!Ranks : {o}!Fetch(r)\n"
            f"      [] a = \"Drain\" -> \\E r \\in {o}!Ranks : \\E p \\in Q[r] : {o}!Drain(r, p)\n"
            f"      [] OTHER -> {o}!GatherWith(LAMBDA r : P[r], LAMBDA al, T : {o}!RecordedOrder(al, T))\n"
            f"Grouping_{k}(P) ==\n"
            f"    \\A r \\in {o}!Ranks : P[r] = IF {o}!Status(r) = \"ready\" THEN {o}!Packing(r) ELSE <<>>\n"
            f"Violated_{k} == IF ~{o}!TypeOK THEN <<\"TypeOK\">> ELSE {fails}\n"
        )
    n = len(traces)
    return (
        "---- MODULE TraceData ----\nEXTENDS Naturals, Sequences\n"
        f"VARIABLES {', '.join(VARIABLES)}\n"
        "Fails(ok, name) == IF ok THEN <<>> ELSE <<name>>\n"
        "Traces == <<\n" + ",\n".join(rows) + "\n>>\n" + "".join(defs)
        + _dispatch("InitAt(k)", [f"O_{k}!Init" for k in range(1, n + 1)])
        + _dispatch("ReplayAt(k, a, P)", [f"Replay_{k}(a, P)" for k in range(1, n + 1)])
        + _dispatch("GroupingAt(k, P)", [f"Grouping_{k}(P)" for k in range(1, n + 1)])
        + _dispatch("ViolatedAt(k)", [f"Violated_{k}" for k in range(1, n + 1)])
        + "====\n"
    )


def stream_module() -> str:
    """ODB with streams on (``StreamOn == TRUE``), as module ODBStream: trace instances of
    streamed runs (INSTANCE substitutes constants only, not definitions)."""
    text = (SPEC_DIR / "ODB.tla").read_text()
    if text.count("StreamOn == FALSE") != 1:
        raise RuntimeError("spec/ODB.tla: expected one 'StreamOn == FALSE' definition")
    return text.replace("MODULE ODB ", "MODULE ODBStream ", 1).replace("StreamOn == FALSE", "StreamOn == TRUE")


_FIELD = re.compile(r"^/\\ (t|i|fail) = (.*)$", re.M)


def _run_batch(traces: Sequence[Trace]) -> dict[int, tuple[int, tuple[str, ...]]]:
    """TLC on one batch; per trace (0-based), the last state reached (1-based ``i``) and its
    ``fail`` (empty if the replay reached the end without failure)."""
    with tempfile.TemporaryDirectory(prefix="odb-trace-") as tmpname:
        tmp = Path(tmpname)
        shutil.copy(SPEC_DIR / "ODB.tla", tmp / "ODB.tla")
        shutil.copy(SPEC_DIR / "TraceCheck.tla", tmp / "TraceCheck.tla")
        (tmp / "ODBStream.tla").write_text(stream_module())
        (tmp / "TraceData.tla").write_text(trace_module(traces))
        (tmp / "TraceCheck.cfg").write_text("INIT Init\nNEXT Next\n")
        # no separate SANY run: TLC parses the modules itself (about half of a batch's time
        # is parsing the generated module) and reports a parse error as outcome "error"
        run = tlc("TraceCheck", tmp / "TraceCheck.cfg", cwd=tmp, extra=("-dump", str(tmp / "states")))
        if run.outcome != "ok":
            raise RuntimeError(f"TLC trace check: {run.outcome}\n{run.output[-3000:]}")
        dump = (tmp / "states.dump").read_text()
    ends: dict[int, tuple[int, tuple[str, ...]]] = {}
    for block in re.split(r"^State \d+:$", dump, flags=re.M)[1:]:
        fields = dict(_FIELD.findall(block))
        k, i = int(fields["t"]) - 1, int(fields["i"])
        fail = tuple(re.findall(r'"(\w+)"', fields["fail"]))
        best = ends.get(k)
        if best is None or (fail and not best[1]) or (bool(fail) == bool(best[1]) and i > best[0]):
            ends[k] = (i, fail)
    return ends


def _brule_detail(trace: Trace, j: int) -> str:
    """Which rank's grouping differs from the budget's rule at the gather into state ``j``."""
    from odb_core.budgets import BUFFER_RULES

    before, pack = trace.states[j - 1], trace.packs[j]
    lengths, kind = trace.scenario.lengths, trace.scenario.budget_kind
    parts = []
    for r, groups in enumerate(pack):
        buf, held = before[_IX["B"]][r], {p - 1 for p in before[_IX["H"]][r]}
        rule = tuple(tuple(p + 1 for p in g) for g in BUFFER_RULES[kind]({p - 1: lengths[r][p - 1] for p in buf},
                                                                         trace.scenario.budget, held)) if buf else ()
        if groups and groups != rule:
            name = "the packing" if kind == "packed" else "B(l)"
            parts.append(f"rank {r + 1} recorded {groups}, {name} gives {rule}")
        elif not groups and buf:
            parts.append(f"rank {r + 1} recorded no grouping over B = {buf}")
    return "; ".join(parts)


def replay(traces: Sequence[Trace], batch: int = TRACE_BATCH) -> list[Verdict]:
    """Replay every trace with TLC (``batch`` traces per TLC run); one verdict per trace."""
    verdicts: dict[int, Verdict] = {}
    good: list[int] = []
    for k, tr in enumerate(traces):
        err = shape_errors(tr)
        if err is None:
            good.append(k)
        else:
            verdicts[k] = Verdict(k, False, ("Shape",), 0, err)
    for lo in range(0, len(good), batch):
        chunk = good[lo: lo + batch]
        ends = _run_batch([traces[k] for k in chunk])
        for local, k in enumerate(chunk):
            tr = traces[k]
            i, fail = ends.get(local, (0, ("Step",)))
            if not fail and i == len(tr.states):
                verdicts[k] = Verdict(k, True)
                continue
            fail = fail or ("Step",)
            detail = "; ".join(REASONS.get(f, f"invariant {f} is violated")
                               + (f" ({_brule_detail(tr, i - 1)})" if f == "BRule" else "") for f in fail)
            verdicts[k] = Verdict(k, False, fail, i - 1, detail)
    return [verdicts[k] for k in range(len(traces))]


def check_traces(traces: Sequence[Trace]) -> tuple[set[int], set[int]]:
    """Replay ``traces``; return (accepted, rejected) indices into ``traces``."""
    verdicts = replay(traces)
    return {v.index for v in verdicts if v.accepted}, {v.index for v in verdicts if not v.accepted}


# ---- coverage ----------------------------------------------------------------------------
#: the kinds of steps :func:`coverage` counts: every fetch, drain and gather; gathers that
#: split (a ready rank had fewer groups, held ones included, than T), overflow (a ready
#: rank kept more groups than T), hold (a ready rank's H is non-empty after), skip
#: (T = 0, the iteration not ended), chain (a non-join iteration ended and the next
#: began) and end (the epoch is over after it).
COVERAGE_KINDS = ("fetch", "drain", "gather", "split", "overflow", "hold", "skip", "chain", "end")


def _status(s: Scenario, st: tuple[Value, ...], r: int) -> str:
    """The spec's Status(r) in state ``st`` (0-based rank)."""
    nxt, q, b, h = st[_IX["next"]][r], st[_IX["Q"]][r], st[_IX["B"]][r], st[_IX["H"]][r]
    drained = nxt > len(s.lengths[r]) and not q
    if drained and not b:
        return "finished"
    if b and (len(b) - len(h) >= s.buffer_size or drained):
        return "ready"
    return "waiting"


def coverage(trace: Trace) -> Counter[str]:
    """How often each kind of :data:`COVERAGE_KINDS` occurs in ``trace`` (from its states,
    actions and groupings; a kind that never occurs counts 0)."""
    s = trace.scenario
    world = len(s.lengths)
    out: Counter[str] = Counter({k: 0 for k in COVERAGE_KINDS})
    acts = actions_of(trace)
    for j in range(1, len(trace.states)):
        act, before, after, pack = acts[j], trace.states[j - 1], trace.states[j], trace.packs[j]
        if act != "Gather":
            out[act.lower()] += 1
            continue
        out["gather"] += 1
        st = [_status(s, before, r) for r in range(world)]
        ended = all(x == "finished" for x in st) if s.join else any(x == "finished" for x in st)
        if after[_IX["done"]] and not before[_IX["done"]]:
            out["end"] += 1
        if ended:
            out["chain"] += 0 if after[_IX["done"]] else 1
            continue
        target = max((len(o) for o in after[_IX["lastOut"]]), default=0)
        if target == 0:
            out["skip"] += 1
            continue
        held_after = after[_IX["H"]]
        ready = [r for r in range(world) if st[r] == "ready"]
        if any(len(pack[r]) < target for r in ready):
            out["split"] += 1
        if any(sum(1 for g in pack[r] if not set(g) <= held_after[r]) > target for r in ready):
            out["overflow"] += 1
        if any(held_after[r] for r in ready):
            out["hold"] += 1
    return out


def coverage_report(traces: Sequence[Trace]) -> dict[str, Any]:
    """Per trace and in total, the counts of :func:`coverage`."""
    per = [dict(coverage(t)) for t in traces]
    total: Counter[str] = Counter({k: 0 for k in COVERAGE_KINDS})
    for c in per:
        total.update(c)
    return {"per_trace": per, "total": dict(total)}


def missing_coverage(traces: Sequence[Trace], expected: Iterable[str] = COVERAGE_KINDS) -> list[str]:
    """The kinds of ``expected`` that no trace of ``traces`` exercises."""
    total = coverage_report(traces)["total"]
    return [k for k in expected if not total.get(k)]


class CoverageError(AssertionError):
    """A set of traces never exercised a kind of step it should."""


def require_coverage(traces: Sequence[Trace], expected: Iterable[str] = COVERAGE_KINDS) -> dict[str, int]:
    """The total counts; raise :class:`CoverageError` naming the kinds of ``expected`` never seen."""
    expected = list(expected)
    unknown = set(expected) - set(COVERAGE_KINDS)
    if unknown:
        raise ValueError(f"unknown coverage kinds {sorted(unknown)}; choose from {COVERAGE_KINDS}")
    total: dict[str, int] = coverage_report(traces)["total"]
    missing = [k for k in expected if not total.get(k)]
    if missing:
        raise CoverageError(f"{len(traces)} traces never exercise {missing} (counts: {total})")
    return total


# ---- merging per-rank event logs -----------------------------------------------------------
class MergeError(ValueError):
    """Per-rank event logs that cannot be one run (ranks disagree, an event is malformed)."""


#: the gather fields every rank must report alike (the round's shared decisions)
SHARED_GATHER_FIELDS = ("round", "target", "ended", "consumed", "last_step", "done")
_LOCAL = ("iteration", "fetch", "arrive", "stream_end")


def _split_rank(r: int, log: Sequence[Mapping[str, Any]]) -> tuple[list[list[Mapping[str, Any]]],
                                                                   list[Mapping[str, Any]], bool]:
    """A rank's events after ``begin``: the local events before each gather (one more list
    than gathers: the events after the last one), the gathers, and whether it ended."""
    segments: list[list[Mapping[str, Any]]] = [[]]
    gathers: list[Mapping[str, Any]] = []
    ended = False
    for n, ev in enumerate(log[1:], start=1):
        kind = ev.get("ev")
        if ended:
            raise MergeError(f"rank {r}: event {n} ({kind!r}) after 'end'")
        if kind == "gather":
            gathers.append(ev)
            segments.append([])
        elif kind in _LOCAL:
            segments[-1].append(ev)
        elif kind == "end":
            ended = True
        else:
            raise MergeError(f"rank {r}: event {n} has unknown kind {kind!r}")
    return segments, gathers, ended


def merge(logs: Sequence[Sequence[Mapping[str, Any]]], name: str = "run") -> Trace:
    """One run's per-rank event logs (``EpochDriver(trace=...)``, see :mod:`odb_core.epoch`)
    as a spec trace: Init, then for each gather the local events (fetch, arrive) of every
    rank since the previous gather, rank by rank, each one spec step, then the gather step.

    Raises :class:`MergeError` if the ranks disagree (world, configuration, quota, the
    number of gathers, a gather's shared fields), an event is malformed, or a position's
    length differs between chained non-join iterations (the spec's Length is fixed: trace
    non-join runs with an unshuffled sampler). The trace is incomplete (``complete`` False:
    its last state need not be done) when some rank has no ``end`` event, unless the epoch
    was over before it began (quota 0); such a run is cut at the fewest gathers any rank
    reached."""
    if not logs:
        raise MergeError("no rank logs")
    by_rank: dict[int, Sequence[Mapping[str, Any]]] = {}
    for n, log in enumerate(logs):
        if not log or log[0].get("ev") != "begin":
            raise MergeError(f"log {n} does not start with a 'begin' event")
        r = log[0].get("rank")
        if not isinstance(r, int) or r in by_rank:
            raise MergeError(f"log {n}: rank {r!r} is not a new rank number")
        by_rank[r] = log
    world = len(by_rank)
    if sorted(by_rank) != list(range(world)):
        raise MergeError(f"ranks {sorted(by_rank)} are not 0..{world - 1}")
    first = by_rank[0][0]
    for r in range(world):
        begin = by_rank[r][0]
        for key in ("world", "epoch", "config", "quota"):
            if begin.get(key) != first.get(key):
                raise MergeError(f"rank {r} begins with {key} = {begin.get(key)!r}, rank 0 with {first.get(key)!r}")
    if first.get("world") != world:
        raise MergeError(f"{world} rank logs for a world of {first.get('world')}")
    cfg = first["config"]
    join = cfg["mode"] == "join"
    quota = int(first.get("quota") or 0)

    split = [_split_rank(r, by_rank[r]) for r in range(world)]
    complete = all(ended for _, _, ended in split)
    counts = [len(g) for _, g, _ in split]
    if complete and len(set(counts)) > 1:
        r = next(r for r in range(world) if counts[r] != counts[0])
        raise MergeError(f"rank {r} has {counts[r]} gathers, rank 0 has {counts[0]}")
    n_gathers = min(counts)
    for g in range(n_gathers):
        for r in range(1, world):
            for key in SHARED_GATHER_FIELDS:
                if split[r][1][g].get(key) != split[0][1][g].get(key):
                    raise MergeError(f"gather {g}: rank {r} reports {key} = {split[r][1][g].get(key)!r}, "
                                     f"rank 0 {split[0][1][g].get(key)!r}")

    # the constants: views per rank (fixed across iterations) and lengths (from arrivals)
    nv: list[int] = []
    stream_ranks: set[int] = set()
    lengths: list[dict[int, tuple[int, int]]] = [{} for _ in range(world)]
    for r in range(world):
        segments = split[r][0][: n_gathers + 1]
        views = {int(ev["views"]) for seg in segments for ev in seg if ev["ev"] == "iteration"}
        if len(views) > 1:
            raise MergeError(f"rank {r}: logical iterations over {sorted(views)} views; the spec's NV is fixed")
        nv.append(views.pop() if views else 0)
        if nv[r] < 0:  # a stream: NV is where it ended (or what was fetched, in a run cut before)
            ends = [int(ev["pos"]) for seg in segments for ev in seg if ev["ev"] == "stream_end"]
            fetched = [p for seg in segments for ev in seg if ev["ev"] == "fetch" for p in ev["positions"]]
            nv[r] = ends[0] if ends else max(fetched, default=-1) + 1
            stream_ranks.add(r)
        iteration = 0
        for seg in segments:
            for ev in seg:
                if ev["ev"] == "iteration":
                    iteration = int(ev["iteration"])
                elif ev["ev"] == "claim":
                    raise MergeError(f"rank {r}: a shared-tail claim; merging pooled runs is not supported yet")
                elif ev["ev"] == "fetch":
                    bad = [p for p in ev["positions"] if not 0 <= p < nv[r] and r not in stream_ranks]
                    if bad:
                        raise MergeError(f"rank {r}: fetched positions {bad} outside 0..{nv[r] - 1}")
                elif ev["ev"] == "arrive":
                    p, length = int(ev["pos"]), int(ev["length"])
                    if not 0 <= p < nv[r]:
                        raise MergeError(f"rank {r}: position {p} arrived, outside 0..{nv[r] - 1}")
                    seen = lengths[r].get(p)
                    if seen is not None and seen[0] != length:
                        raise MergeError(
                            f"rank {r} position {p}: length {seen[0]} in iteration {seen[1]}, {length} in iteration "
                            f"{iteration}; the spec's Length is fixed across iterations (trace non-join runs "
                            "with an unshuffled sampler)")
                    lengths[r].setdefault(p, (length, iteration))
    regroup = cfg.get("regroup") or [0, 0]
    scenario = Scenario(
        name=name, lengths=tuple(tuple(lengths[r].get(p, (1, 0))[0] for p in range(nv[r])) for r in range(world)),
        budget=int(cfg["token_budget"]), buffer_size=int(cfg["buffer_size"]), depth=int(cfg["depth"]),
        capacity=int(cfg.get("output_capacity") or 0), join=join, overflow=str(cfg["overflow_policy"]),
        policy=str(cfg["target_policy"]), dataset_size=None if join else quota,
        regroup=(int(regroup[0]), int(regroup[1])), budget_kind=str(cfg.get("budget", "padded")),
        stream=bool(stream_ranks),
    )

    # the behaviour
    nxt = [1] * world
    q: list[set[int]] = [set() for _ in range(world)]
    b: list[list[int]] = [[] for _ in range(world)]
    e: list[set[int]] = [set() for _ in range(world)]
    h: list[set[int]] = [set() for _ in range(world)]
    last_out: list[tuple[tuple[int, ...], ...]] = [() for _ in range(world)]
    consumed = last_step = rounds = 0
    done = not join and quota == 0
    if done and all(c == 0 for c in counts):
        complete = True  # the epoch was over before it began: nothing to end
    states: list[tuple[Value, ...]] = []
    packs: list[tuple[Value, ...]] = []
    actions: list[str] = []
    empty: tuple[Value, ...] = tuple(() for _ in range(world))

    def push(action: str, pack: tuple[Value, ...] = empty) -> None:
        states.append((tuple(nxt), tuple(frozenset(x) for x in q), tuple(tuple(x) for x in b),
                       tuple(frozenset(x) for x in e), tuple(frozenset(x) for x in h), consumed, last_step,
                       tuple(last_out), rounds, done, 0, tuple(() for _ in range(world))))
        packs.append(pack)
        actions.append(action)

    push("Init")
    for g in range(n_gathers + 1):
        for r in range(world):
            for ev in split[r][0][g]:
                if ev["ev"] == "fetch":
                    if not ev["positions"]:
                        continue
                    q[r].update(p + 1 for p in ev["positions"] if p < nv[r])
                    nxt[r] = max(nxt[r], max(ev["positions"]) + 2)
                    if r in stream_ranks and max(ev["positions"]) >= nv[r]:
                        nxt[r] = nv[r] + 2  # the fetch reached past the stream's end (spec: the end is known)
                    push("Fetch")
                elif ev["ev"] == "arrive":
                    q[r].discard(int(ev["pos"]) + 1)
                    b[r].append(int(ev["pos"]) + 1)
                    push("Drain")
        if g == n_gathers:
            break
        recs = [split[r][1][g] for r in range(world)]
        target, ended, done_after = int(recs[0]["target"]), bool(recs[0]["ended"]), bool(recs[0]["done"])
        pack = tuple(tuple(tuple(p + 1 for p in grp) for grp in rec.get("grouping") or []) for rec in recs)
        emitting = target > 0 and not (ended and not any(rec.get("out") for rec in recs))
        if emitting:
            for r, rec in enumerate(recs):
                items = tuple(tuple(p + 1 for p in item) for item in rec.get("out") or [])
                gone = {p for item in items for p in item}
                last_out[r] = items
                b[r] = [p for p in b[r] if p not in gone]
                e[r] |= gone
                h[r] = {p + 1 for p in rec.get("held") or []}
            rounds += 1
        elif ended and not done_after:  # non-join: the trainer chains the next logical iteration
            nxt, rounds = [1] * world, 0
            q, b, e, h = ([set() for _ in range(world)], [[] for _ in range(world)], [set() for _ in range(world)],
                          [set() for _ in range(world)])
            last_out = [() for _ in range(world)]
        else:  # a skip round, or the end of the epoch
            last_out = [() for _ in range(world)]
            for r, rec in enumerate(recs):
                h[r] = {p + 1 for p in rec.get("held") or []}
        consumed, last_step, done = int(recs[0]["consumed"]), int(recs[0]["last_step"]), done_after
        push("Gather", pack)
    return Trace(scenario, name, states, packs, actions, complete)


def read_logs(directory: str | Path) -> list[tuple[str, list[list[dict[str, Any]]]]]:
    """The runs in ``directory``: files ``<run>-rank<r>.jsonl`` (one JSON event per line),
    as ``(run, logs)`` pairs sorted by run name, ``logs[r]`` rank r's events."""
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {}
    for path in sorted(Path(directory).glob("*-rank*.jsonl")):
        m = re.fullmatch(r"(.+)-rank(\d+)\.jsonl", path.name)
        if m is None:
            continue
        events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        runs.setdefault(m.group(1), {})[int(m.group(2))] = events
    out = []
    for run, ranks in sorted(runs.items()):
        if sorted(ranks) != list(range(len(ranks))):
            raise MergeError(f"run {run}: rank files {sorted(ranks)} are not 0..{len(ranks) - 1}")
        out.append((run, [ranks[r] for r in range(len(ranks))]))
    return out


def write_logs(directory: str | Path, run: str, logs: Sequence[Sequence[Mapping[str, Any]]]) -> list[Path]:
    """Write ``logs`` as ``<run>-rank<r>.jsonl`` files in ``directory`` (the :func:`read_logs` layout)."""
    paths = []
    for r, log in enumerate(logs):
        path = Path(directory) / f"{run}-rank{r}.jsonl"
        path.write_text("".join(json.dumps(ev) + "\n" for ev in log))
        paths.append(path)
    return paths


def merge_directory(directory: str | Path) -> list[Trace]:
    """Every run of ``directory`` (:func:`read_logs`) merged into a trace named after it."""
    return [merge(logs, run) for run, logs in read_logs(directory)]


def simulator_logs(s: Scenario, dataset: Sequence[int], schedule: str) -> list[list[dict[str, Any]]]:
    """The per-rank event logs of the simulator run :func:`~model_checks.conformance.record`
    records (unshuffled, so chained iterations see the same shards; ``s.mutant``'s driver):
    what :func:`merge` turns back into that run's trace."""
    from model_checks.mutants import driver
    from odb_core.simulator import simulate

    logs: list[list[dict[str, Any]]] = []
    simulate(list(dataset), len(s.lengths), s.config(), schedule, shuffle=False, events=logs,
             driver_cls=driver(s.mutant))
    return logs
