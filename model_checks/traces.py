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

from model_checks.conformance import VARIABLES, Scenario, Trace, Value, to_tla, wrap_tla
from model_checks.tla import SPEC_DIR, tlc
from odb_core.config import BUDGETS, OVERFLOW_POLICIES, TARGET_POLICIES

#: the invariants of spec/ODB.tla checked on every replayed state (TypeOK first: if it
#: fails the others are not reported). JoinCoverage and QuotaClosure hold trivially
#: until ``done``; with the last state required ``done`` they check the end of the run.
#: BRuleAdmissible is a property of the spec's own rule (checked by model checking),
#: and the grouping check below compares the recorded grouping with that rule.
INVARIANTS = ("TypeOK", "NoLeak", "DepthBound", "HeldOK", "Lockstep", "BudgetOK", "WithinCapacity",
              "RoundBound", "JoinCoverage", "QuotaClosure", "PoolOnce", "NoDupInRound")
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


def _constant_errors(s: Scenario) -> str | None:
    """Why the constants of ``s`` are no values TLC can evaluate the spec on, or None."""
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
    pool = consts.get("Pool", ())
    if not (isinstance(pool, tuple) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in pool)):
        return "Pool must hold the pool views' lengths >= 0"
    if pool and s.stream:
        return "a stream has no shared tail (Pool with streams)"
    return None


def shape_errors(trace: Trace) -> str | None:
    """Why ``trace`` cannot be given to TLC (a value TLC could not evaluate the spec on:
    a position outside a rank's views, a per-rank tuple of the wrong length, ...), or None."""
    s = trace.scenario
    err = _constant_errors(s)
    if err:
        return err
    consts = s.constants()
    world, nv, pool = consts["W"], consts["NV"], consts.get("Pool", ())
    if not trace.states:
        return "no states"
    if len(trace.packs) != len(trace.states):
        return f"{len(trace.packs)} packs for {len(trace.states)} states"
    acts = actions_of(trace)
    if len(acts) != len(trace.states) or acts[0] != "Init" or not set(acts[1:]) <= set(ACTIONS[1:]):
        return f"actions must be Init then Fetch/Drain/Gather, one per state (got {len(acts)} for {len(trace.states)})"

    views = list(nv)  # a rank's views in the current state: its own and the pool views it claimed

    def positions(r: int, xs: Iterable[Value]) -> bool:
        return all(isinstance(p, int) and not isinstance(p, bool) and 1 <= p <= views[r] for p in xs)

    for j, st in enumerate(trace.states):
        where = f"state {j}"
        if len(st) != len(VARIABLES):
            return f"{where}: {len(st)} variables"
        nxt, q, b, e, h, consumed, last_step, last_out, rounds, done, pc, claimed = st
        per_rank = (nxt, q, b, e, h, last_out, claimed)
        if not all(isinstance(x, tuple) and len(x) == world for x in per_rank):
            return f"{where}: next/Q/B/E/H/lastOut/claimed need one entry per rank"
        err = _pool_state_errors(pc, claimed, len(pool))
        if err:
            return f"{where}: {err}"
        views = [n + len(c) for n, c in zip(nv, claimed)]
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in (*nxt, consumed, last_step, rounds)):
            return f"{where}: next/consumed/lastStep/rounds must be integers"
        if not isinstance(done, bool):
            return f"{where}: done must be a boolean"
        for r in range(world):
            if not (isinstance(q[r], frozenset) and isinstance(e[r], frozenset) and isinstance(h[r], frozenset)
                    and isinstance(b[r], tuple) and isinstance(last_out[r], tuple)):
                return f"{where}: rank {r + 1}: Q, E, H are sets, B and lastOut sequences"
            if not (positions(r, q[r]) and positions(r, b[r]) and positions(r, e[r]) and positions(r, h[r])):
                return f"{where}: rank {r + 1}: a position outside 1..{views[r]}"
            if not all(isinstance(item, tuple) and positions(r, item) for item in last_out[r]):
                return f"{where}: rank {r + 1}: lastOut holds a position outside 1..{views[r]}"
        pack = trace.packs[j]
        if not (isinstance(pack, tuple) and len(pack) == world):
            return f"{where}: the grouping needs one entry per rank"
        for r in range(world):
            if not (isinstance(pack[r], tuple)
                    and all(isinstance(g, tuple) and positions(r, g) for g in pack[r])):
                return f"{where}: rank {r + 1}: the grouping holds a position outside 1..{views[r]}"
    return None


def _pool_state_errors(pc: Value, claimed: tuple[Value, ...], size: int) -> str | None:
    """Why ``pc`` and ``claimed`` (the shared tail's variables) are no values TLC can evaluate
    the spec on with a pool of ``size`` views, or None (pool indices 1..size; a pc past the
    pool is left to TypeOK, a view claimed twice to PoolOnce)."""
    if not (isinstance(pc, int) and not isinstance(pc, bool) and pc >= 0):
        return f"pc = {pc!r} must be an integer >= 0"
    for r, c in enumerate(claimed):
        if not (isinstance(c, tuple) and all(isinstance(j, int) and not isinstance(j, bool) and 1 <= j <= size
                                             for j in c)):
            return f"rank {r + 1}: claimed must be a sequence of pool indices in 1..{size}"
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
        cfg = wrap_tla(to_tla(tr.scenario.constants()))
        states = ",\n  ".join(wrap_tla(to_tla(dict(zip(VARIABLES, st)))) for st in tr.states)
        packs = ",\n  ".join(wrap_tla(to_tla(p)) for p in tr.packs)
        acts = wrap_tla(to_tla(tuple(actions_of(tr))))
        rows.append(f"[cfg |-> {cfg}, complete |-> {to_tla(tr.complete)}, acts |-> {acts},\n"
                    f" states |-> <<{states}>>,\n packs |-> <<{packs}>>]")
        pooled = bool(tr.scenario.pool)
        subst = ", ".join(f"{c} <- Traces[{k}].cfg.{c}" for c in (*names, *(("Pool", "ReserveDiv") if pooled else ())))
        o = f"O_{k}"
        fails = " \\o ".join(f'Fails({o}!{inv}, "{inv}")' for inv in INVARIANTS[1:])
        module = "ODBStream" if tr.scenario.stream else "ODBPool" if pooled else "ODB"
        defs.append(
            f"{o} == INSTANCE {module} WITH {subst}\n"
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


def pool_module() -> str:
    """ODB with the shared tail's ``Pool`` and ``ReserveDiv`` constants, as module ODBPool: trace
    instances of pooled runs substitute each trace's (spec/ODB.tla defines ``Pool == <<>>`` and
    ``ReserveDiv == 8``, which a .cfg overrides, but INSTANCE substitutes constants only)."""
    text = (SPEC_DIR / "ODB.tla").read_text()
    for definition in ("\nPool == <<>>\n", "\nReserveDiv == 8\n"):
        if text.count(definition) != 1:
            raise RuntimeError(f"spec/ODB.tla: expected one '{definition.strip()}' definition")
    return (text.replace("MODULE ODB ", "MODULE ODBPool ", 1).replace("\nPool == <<>>\n", "\nCONSTANT Pool\n")
            .replace("\nReserveDiv == 8\n", "\nCONSTANT ReserveDiv\n"))


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
        (tmp / "ODBPool.tla").write_text(pool_module())
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
    kind = trace.scenario.budget_kind
    parts = []
    for r, groups in enumerate(pack):
        buf, held = before[_IX["B"]][r], {p - 1 for p in before[_IX["H"]][r]}
        lengths = {p - 1: _length_of(trace.scenario, before, r, p) for p in buf}
        rule = tuple(tuple(p + 1 for p in g) for g in BUFFER_RULES[kind](lengths,
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
#: began), end (the epoch is over after it) and claim (ranks claimed shared-tail pool views).
COVERAGE_KINDS = ("fetch", "drain", "gather", "split", "overflow", "hold", "skip", "chain", "end", "claim")


def _length_of(s: Scenario, st: tuple[Value, ...], r: int, p: int) -> int:
    """The spec's LenOf(r, p) in state ``st`` (0-based rank, 1-based position): the length of
    one of the rank's own views, or of the pool view it claimed at that position."""
    own = s.lengths[r]
    return own[p - 1] if p <= len(own) else s.pool[st[_IX["claimed"]][r][p - len(own) - 1] - 1]


def _status(s: Scenario, st: tuple[Value, ...], r: int) -> str:
    """The spec's Status(r) in state ``st`` (0-based rank)."""
    nxt, q, b, h = st[_IX["next"]][r], st[_IX["Q"]][r], st[_IX["B"]][r], st[_IX["H"]][r]
    views = len(s.lengths[r]) + len(st[_IX["claimed"]][r])
    pool_open = st[_IX["pc"]] < len(s.pool)
    drained = nxt > views and not q and not pool_open
    dry = pool_open and nxt > views and not q  # spec: PoolDry
    if drained and not b:
        return "finished"
    if not b and dry:
        return "idle"
    if b and (len(b) - len(h) >= s.buffer_size or drained or dry):
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
        if after[_IX["pc"]] > before[_IX["pc"]]:
            out["claim"] += 1
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


Events = list[Mapping[str, Any]]


@dataclass
class _RankLog:
    """A rank's events after ``begin``, split at its gathers."""

    segments: list[Events]
    """The local events before each gather (one more list than gathers: those after the last)."""
    gathers: Events
    claims: list[Events]
    """Per gather, the shared tail's claims applied at it (after its emission: odb_core's
    ``_apply_claims``): logged just before the gather event of an emitting round, just after
    that of a skip round; each names its gather by ``round``."""
    ended: bool


def _split_rank(r: int, log: Sequence[Mapping[str, Any]]) -> _RankLog:
    """A rank's events after ``begin``: local events, gathers, claims per gather, whether it ended."""
    out = _RankLog([[]], [], [], False)
    pending: Events = []  # claims of the gather to come (an emitting round's)
    for n, ev in enumerate(log[1:], start=1):
        kind = ev.get("ev")
        if out.ended:
            raise MergeError(f"rank {r}: event {n} ({kind!r}) after 'end'")
        if kind == "gather":
            late = [c.get("round") for c in pending if c.get("round") != ev.get("round")]
            if late:
                raise MergeError(f"rank {r}: event {n}: a claim of round {late[0]!r} before the gather of round "
                                 f"{ev.get('round')!r}")
            out.gathers.append(ev)
            out.claims.append(pending)
            out.segments.append([])
            pending = []
        elif kind == "claim":
            last = out.gathers[-1] if out.gathers else None
            if last is not None and not out.segments[-1] and last.get("round") == ev.get("round"):
                out.claims[-1].append(ev)  # a skip round's claim, logged after its gather
            else:
                pending.append(ev)
        elif kind in _LOCAL:
            out.segments[-1].append(ev)
        elif kind == "end":
            out.ended = True
        else:
            raise MergeError(f"rank {r}: event {n} has unknown kind {kind!r}")
    return out  # claims still pending belong to a gather the run was cut before


def _claim_range(r: int, ev: Mapping[str, Any], pool: int) -> range:
    """The 0-based pool indices a claim event names (a :class:`MergeError` if outside the pool)."""
    first, count = ev.get("first"), ev.get("count")
    if not (isinstance(first, int) and isinstance(count, int) and first >= 0 and count >= 1 and first + count <= pool):
        raise MergeError(f"rank {r}: a claim of {count!r} pool views from {first!r}, outside the pool's "
                         f"{pool} views")
    return range(first, first + count)


@dataclass
class _Lengths:
    """What the events say about lengths: per position of each rank's own views and per pool
    view, the length and the logical iteration it arrived in."""

    own: list[dict[int, tuple[int, int]]]
    pool: dict[int, tuple[int, int]]

    def add(self, r: int, key: int, length: int, iteration: int, pool_view: bool) -> None:
        table = self.pool if pool_view else self.own[r]
        seen = table.get(key)
        if seen is not None and seen[0] != length and pool_view:
            raise MergeError(f"rank {r} pool view {key}: length {length}, where it arrived earlier with {seen[0]}")
        if seen is not None and seen[0] != length:
            raise MergeError(
                f"rank {r} position {key}: length {seen[0]} in iteration {seen[1]}, {length} in iteration "
                f"{iteration}; the spec's Length is fixed across iterations (trace non-join runs "
                "with an unshuffled sampler)")
        table.setdefault(key, (length, iteration))


def _scan_rank(r: int, log: _RankLog, n_gathers: int, nv: int, stream: bool, pool: int, lengths: _Lengths) -> None:
    """Check rank r's fetched and arrived positions (its own views, then the pool views it
    claimed, in claim order) and note their lengths."""
    claimed: list[int] = []
    iteration = 0
    for g, seg in enumerate(log.segments[: n_gathers + 1]):
        views = nv + len(claimed)
        for ev in seg:
            if ev["ev"] == "iteration":
                iteration = int(ev["iteration"])
            elif ev["ev"] == "fetch":
                bad = [p for p in ev["positions"] if not 0 <= p < views and not stream]
                if bad:
                    raise MergeError(f"rank {r}: fetched positions {bad} outside 0..{views - 1}")
            elif ev["ev"] == "arrive":
                p, length = int(ev["pos"]), int(ev["length"])
                if not 0 <= p < views:
                    raise MergeError(f"rank {r}: position {p} arrived, outside 0..{views - 1}")
                pooled = p >= nv
                lengths.add(r, claimed[p - nv] if pooled else p, length, iteration, pooled)
        if g < n_gathers:
            for ev in log.claims[g]:
                claimed.extend(_claim_range(r, ev, pool))


def merge(logs: Sequence[Sequence[Mapping[str, Any]]], name: str = "run", statuses: bool = True) -> Trace:
    """One run's per-rank event logs (``EpochDriver(trace=...)``, see :mod:`odb_core.epoch`)
    as a spec trace: Init, then for each gather the local events (fetch, arrive) of every
    rank since the previous gather, rank by rank, each one spec step, then the gather step
    (which, with a shared tail, also applies the round's claims: spec ``ClaimWith``).

    Raises :class:`MergeError` if the ranks disagree (world, configuration, quota, the
    number of gathers, a gather's shared fields, the pool's size), an event is malformed
    (a position outside the rank's views, a claim outside the pool), or a position's
    length differs between chained non-join iterations (the spec's Length is fixed: trace
    non-join runs with an unshuffled sampler). The trace is incomplete (``complete`` False:
    its last state need not be done) when some rank has no ``end`` event, unless the epoch
    was over before it began (quota 0); such a run is cut at the fewest gathers any rank
    reached; a rank may miss only the last gather another rank logged (a gather is collective).
    Each rank's record of a gather must agree with the spec's state before it: its status is
    the spec's Status (without a stream or a shared tail's pool; unless ``statuses`` is False:
    a seeded bug's logs, to show TLC rejects their states without it), a round that emits
    nothing yields nothing, and a chain reports the H the rank had."""
    first, split = _split_logs(logs)
    world = len(split)
    complete = all(x.ended for x in split)
    counts = [len(x.gathers) for x in split]
    if complete and len(set(counts)) > 1:
        r = next(r for r in range(world) if counts[r] != counts[0])
        raise MergeError(f"rank {r} has {counts[r]} gathers, rank 0 has {counts[0]}")
    if max(counts) - min(counts) > 1:  # a gather is collective: a rank cut by a fault misses at most the last one
        lo, hi = counts.index(min(counts)), counts.index(max(counts))
        raise MergeError(f"rank {hi} has {counts[hi]} gathers, rank {lo} only {counts[lo]}: every gather needs "
                         "every rank, so a rank cut by a fault can miss only the last")
    n_gathers = min(counts)
    for g in range(n_gathers):
        for r in range(1, world):
            for key in SHARED_GATHER_FIELDS:
                if split[r].gathers[g].get(key) != split[0].gathers[g].get(key):
                    raise MergeError(f"gather {g}: rank {r} reports {key} = {split[r].gathers[g].get(key)!r}, "
                                     f"rank 0 {split[0].gathers[g].get(key)!r}")
    scenario, stream_ranks = _merged_scenario(first, split, n_gathers, name)
    quota = int(first.get("quota") or 0)
    run = _Behaviour(scenario, stream_ranks, done=not scenario.join and quota == 0, statuses=statuses)
    if run.done and all(c == 0 for c in counts):
        complete = True  # the epoch was over before it began: nothing to end
    for g in range(n_gathers + 1):
        for r in range(world):
            for ev in split[r].segments[g]:
                run.local(r, ev)
        if g < n_gathers:
            run.gather(g, [x.gathers[g] for x in split], [x.claims[g] for x in split])
    return Trace(scenario, name, run.states, run.packs, run.actions, complete)


def _split_logs(logs: Sequence[Sequence[Mapping[str, Any]]]) -> tuple[Mapping[str, Any], list[_RankLog]]:
    """Rank 0's ``begin`` event and every rank's split log, in rank order (a :class:`MergeError`
    if the logs are not one world's, or the ranks begin differently)."""
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
    return first, [_split_rank(r, by_rank[r]) for r in range(world)]


def _merged_scenario(first: Mapping[str, Any], split: list[_RankLog], n_gathers: int,
                     name: str) -> tuple[Scenario, set[int]]:
    """The run's constants (views per rank, fixed across iterations; lengths from arrivals,
    1 for views that never arrived, which the spec never reads; the pool's size from the
    ``iteration`` events) and its stream ranks."""
    world = len(split)
    nv: list[int] = []
    stream_ranks: set[int] = set()
    lengths = _Lengths([{} for _ in range(world)], {})
    pools: list[set[int]] = []  # per rank, the pool sizes its iterations name
    for r in range(world):
        segments = split[r].segments[: n_gathers + 1]
        starts = [ev for seg in segments for ev in seg if ev["ev"] == "iteration"]
        views = {int(ev["views"]) for ev in starts}
        if len(views) > 1:
            raise MergeError(f"rank {r}: logical iterations over {sorted(views)} views; the spec's NV is fixed")
        pools.append({int(ev.get("pool") or 0) for ev in starts})
        nv.append(views.pop() if views else 0)
        if nv[r] < 0:  # a stream: NV is where it ended (or what was fetched, in a run cut before)
            ends = [int(ev["pos"]) for seg in segments for ev in seg if ev["ev"] == "stream_end"]
            fetched = [p for seg in segments for ev in seg if ev["ev"] == "fetch" for p in ev["positions"]]
            nv[r] = ends[0] if ends else max(fetched, default=-1) + 1
            stream_ranks.add(r)
    for r in range(world):
        if len(pools[r]) > 1 or pools[r] != pools[0]:
            raise MergeError(f"rank {r}: shared-tail pools of {sorted(pools[r])} views, rank 0: {sorted(pools[0])}")
    pool = max(pools[0], default=0)
    for r in range(world):
        _scan_rank(r, split[r], n_gathers, nv[r], r in stream_ranks, pool, lengths)
    cfg = first["config"]
    join = cfg["mode"] == "join"
    regroup = cfg.get("regroup") or [0, 0]
    scenario = Scenario(
        name=name, lengths=tuple(tuple(lengths.own[r].get(p, (1, 0))[0] for p in range(nv[r])) for r in range(world)),
        budget=int(cfg["token_budget"]), buffer_size=int(cfg["buffer_size"]), depth=int(cfg["depth"]),
        capacity=int(cfg.get("output_capacity") or 0), join=join, overflow=str(cfg["overflow_policy"]),
        policy=str(cfg["target_policy"]), dataset_size=None if join else int(first.get("quota") or 0),
        regroup=(int(regroup[0]), int(regroup[1])), budget_kind=str(cfg.get("budget", "padded")),
        pool=tuple(lengths.pool.get(j, (1, 0))[0] for j in range(pool)), stream=bool(stream_ranks),
        # a log from before reserve_divisor was dealt one view a round: k = ceil(W / W) = 1
        reserve_divisor=int(cfg.get("reserve_divisor", world)),
    )
    return scenario, stream_ranks


class _Behaviour:
    """The spec's variables along a merged run, and the states, groupings and actions so far."""

    def __init__(self, s: Scenario, stream_ranks: set[int], done: bool, statuses: bool = True) -> None:
        world = len(s.lengths)
        self.nv, self.stream_ranks, self.world = [len(ls) for ls in s.lengths], stream_ranks, world
        self.next = [1] * world
        self.q: list[set[int]] = [set() for _ in range(world)]
        self.b: list[list[int]] = [[] for _ in range(world)]
        self.e: list[set[int]] = [set() for _ in range(world)]
        self.h: list[set[int]] = [set() for _ in range(world)]
        self.last_out: list[tuple[tuple[int, ...], ...]] = [() for _ in range(world)]
        self.consumed = self.last_step = self.rounds = 0
        self.done = done
        self.pc = 0
        self.claimed: list[list[int]] = [[] for _ in range(world)]
        self.pool = len(s.pool)
        self.states: list[tuple[Value, ...]] = []
        self.packs: list[tuple[Value, ...]] = []
        self.actions: list[str] = []
        self.scenario, self.statuses = s, statuses
        self.push("Init")

    def push(self, action: str, pack: tuple[Value, ...] | None = None) -> None:
        self.states.append((
            tuple(self.next), tuple(frozenset(x) for x in self.q), tuple(tuple(x) for x in self.b),
            tuple(frozenset(x) for x in self.e), tuple(frozenset(x) for x in self.h), self.consumed,
            self.last_step, tuple(self.last_out), self.rounds, self.done, self.pc,
            tuple(tuple(c) for c in self.claimed)))
        self.packs.append(tuple(() for _ in range(self.world)) if pack is None else pack)
        self.actions.append(action)

    def local(self, r: int, ev: Mapping[str, Any]) -> None:
        """A fetch or an arrival of rank r: one spec step (Fetch, Drain); other events none."""
        if ev["ev"] == "fetch":
            if not ev["positions"]:
                return
            stream = r in self.stream_ranks
            self.q[r].update(p + 1 for p in ev["positions"] if p < self.nv[r] or not stream)
            self.next[r] = max(self.next[r], max(ev["positions"]) + 2)
            if stream and max(ev["positions"]) >= self.nv[r]:
                self.next[r] = self.nv[r] + 2  # the fetch reached past the stream's end (spec: the end is known)
            self.push("Fetch")
        elif ev["ev"] == "arrive":
            self.q[r].discard(int(ev["pos"]) + 1)
            self.b[r].append(int(ev["pos"]) + 1)
            self.push("Drain")

    def gather(self, g: int, recs: Sequence[Mapping[str, Any]], claims: Sequence[Events]) -> None:
        """One gather (every rank's record of it) and the claims applied at it: one spec step."""
        world = self.world
        target, ended, done_after = int(recs[0]["target"]), bool(recs[0]["ended"]), bool(recs[0]["done"])
        pack = tuple(tuple(tuple(p + 1 for p in grp) for grp in rec.get("grouping") or []) for rec in recs)
        emitting = target > 0 and not (ended and not any(rec.get("out") for rec in recs))
        self._check_records(g, recs, emitting, ended and not done_after)
        if emitting:
            for r, rec in enumerate(recs):
                items = tuple(tuple(p + 1 for p in item) for item in rec.get("out") or [])
                gone = {p for item in items for p in item}
                self.last_out[r] = items
                self.b[r] = [p for p in self.b[r] if p not in gone]
                self.e[r] |= gone
                self.h[r] = {p + 1 for p in rec.get("held") or []}
            self.rounds += 1
        elif ended and not done_after:  # non-join: the trainer chains the next logical iteration
            self.next, self.rounds = [1] * world, 0
            self.q, self.b = [set() for _ in range(world)], [[] for _ in range(world)]
            self.e, self.h = [set() for _ in range(world)], [set() for _ in range(world)]
            self.last_out = [() for _ in range(world)]
        else:  # a skip round, or the end of the epoch
            self.last_out = [() for _ in range(world)]
            for r, rec in enumerate(recs):
                self.h[r] = {p + 1 for p in rec.get("held") or []}
        for r, evs in enumerate(claims):  # the shared tail: claimed pool views join R (spec: ClaimWith)
            for ev in evs:
                got = _claim_range(r, ev, self.pool)
                self.claimed[r].extend(j + 1 for j in got)
                self.pc += len(got)
        self.consumed, self.last_step, self.done = int(recs[0]["consumed"]), int(recs[0]["last_step"]), done_after
        self.push("Gather", pack)


    def _check_records(self, g: int, recs: Sequence[Mapping[str, Any]], emitting: bool, chaining: bool) -> None:
        """A :class:`MergeError` unless each rank's record of this gather agrees with the spec's
        state before it: its status is the spec's Status(r), and a round that emits nothing (a
        skip round, a chain, the end) yields nothing and, when it chains, reports the H it had."""
        before = self.states[-1]
        # the header's status is Status(r) but for a stream (its end is learned) and a pool (a
        # pool hold reports a ready rank waiting: the spec's HeldStatus): there it is not compared
        exact_status = not self.scenario.stream and not self.scenario.pool
        for r, rec in enumerate(recs):
            where = f"gather {g} (round {rec.get('round')!r}): rank {r}"
            if self.statuses and exact_status and "status" in rec:
                want = _status(self.scenario, before, r)
                if rec["status"] != want:
                    raise MergeError(f"{where} reports status {rec['status']!r}, the spec's Status is {want!r}")
            if not emitting and any(rec.get("out") or []):
                raise MergeError(f"{where} yields {rec.get('out')!r} at a round that emits nothing")
            if chaining and {p + 1 for p in rec.get("held") or []} != set(before[_IX["H"]][r]):
                raise MergeError(f"{where} reports {rec.get('held')!r} held back as its iteration ends, the "
                                 f"spec's H {sorted(p - 1 for p in before[_IX['H']][r])}")


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


def merge_directory(directory: str | Path, statuses: bool = True) -> list[Trace]:
    """Every run of ``directory`` (:func:`read_logs`) merged into a trace named after it (``statuses``: :func:`merge`)."""
    return [merge(logs, run, statuses) for run, logs in read_logs(directory)]


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
