"""Inductiveness of ODB's invariants on bounded domains (spec/Inductive.tla).

Each :class:`Check` names a domain (the constants and how the per-rank states are
enumerated), a candidate invariant (a conjunction of named predicates of
Inductive.tla, Progress.tla or ODB.tla) and what TLC must find: ``ok`` (the candidate
is inductive on that domain: every successor of every state satisfying it satisfies
it) or ``invariant:<Name>`` (a one-step counterexample). The negative checks are the
seeded bugs of this check: an invariant without the strengthening it needs, the old
depth bound, and a protocol bug, each must produce a counterexample.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from model_checks.generated import Model, constants_cfg, model_module, outcome, run_tlc

#: the invariants of ODB (Inductive.tla: ODBInvariants) and the strengthening they need
ODB = ("TypeOK", "NoLeak", "DepthBound", "HeldOK", "Lockstep", "BudgetOK", "WithinCapacity", "JoinCoverage",
       "QuotaClosure", "RoundBound", "BRuleAdmissible", "PoolOnce", "NoDupInRound")
STRENGTHENING = ("RoundsEmitted", "QuotaOpen", "HeldOnlyWithRegroup")
PROGRESS = ("QuiescentProgress", "IterationProgress")


@dataclass(frozen=True)
class Check:
    """One inductiveness check: ``candidate`` on ``model``'s domain must give ``expected``."""

    name: str
    model: Model
    domain: str
    """Inductive.tla's DomainMode: "free", "partition" or "held"."""
    candidate: tuple[str, ...]
    expected: str = "ok"
    substitute: tuple[str, ...] = ()
    why: str = ""


@dataclass
class InductiveResult:
    check: Check
    outcome: str
    initial_states: int
    distinct_states: int
    seconds: float
    output: str

    @property
    def passed(self) -> bool:
        return self.outcome == self.check.expected

    def to_json(self) -> dict[str, Any]:
        c = self.check
        return {
            "name": c.name, "domain": c.domain, "world": c.model.world,
            "views_per_rank": [len(x) for x in c.model.lengths], "mode": "join" if c.model.join else "non-join",
            "regroup": f"{c.model.regroup[0]}/{c.model.regroup[1]}" if c.model.regroup[1] else "off",
            "stream": c.model.stream,
            "candidate": list(c.candidate), "substitute": list(c.substitute), "expected": c.expected,
            "result": self.outcome, "passed": self.passed, "initial_states": self.initial_states,
            "distinct_states": self.distinct_states, "seconds": round(self.seconds, 2), "why": c.why,
        }


def run_check(c: Check, workers: int = 1, timeout: float = 1800) -> InductiveResult:
    """Run TLC from every domain state satisfying the candidate, checking each conjunct."""
    extra = "Candidate == " + " /\\ ".join(c.candidate) + "\nIndInit == Domain /\\ Candidate\n"
    extra += f'Ind_DomainMode == "{c.domain}"\n'
    module = model_module("InductiveModel", "Inductive", c.model, extra)
    cfg = constants_cfg("InductiveModel", c.model) + "    DomainMode <- Ind_DomainMode\n"
    if c.model.join:
        cfg += "    Orders <- InOrder\n"
    cfg += "".join(f"    {s}\n" for s in c.substitute)
    cfg += "INIT IndInit\nNEXT Next\nINVARIANTS " + " ".join(c.candidate) + "\n"
    text, seconds = run_tlc("InductiveModel", cfg, {"InductiveModel.tla": module}, (), workers=workers,
                            timeout=timeout)

    def last_int(pattern: str) -> int:
        found = re.findall(pattern, text)
        return int(found[-1].replace(",", "")) if found else 0

    return InductiveResult(c, outcome(text), last_int(r"Finished computing initial states: ([\d,]+) distinct"),
                           last_int(r"([\d,]+) distinct states found"), seconds, text)


def _model(name: str, lengths: Sequence[Sequence[int]], join: bool = True, regroup: tuple[int, int] = (1, 5),
           buffer_size: int = 2, depth: int = 2, capacity: int = 1, policy: str = "paper",
           quota: int | None = None, budget_kind: str = "padded") -> Model:
    return Model(name, tuple(map(tuple, lengths)), budget=10, buffer_size=buffer_size, depth=depth,
                 capacity=capacity, join=join, quota=quota, policy=policy, regroup=regroup, budget_kind=budget_kind)


# Lengths: 1 and 3 pair with padding 1/3 > 1/5 (held under regroup 1/5); 11 is over the budget.
W1 = _model("w1x3", [[1, 3, 11]])
W1_NONJOIN = _model("w1x3_nonjoin", [[1, 3, 11]], join=False, quota=2)
W1X4 = _model("w1x4", [[1, 3, 1, 3]], depth=3)
W2_JOIN = _model("w2x2", [[1, 3], [2, 11]], policy="balanced")
W2_NONJOIN = _model("w2x2_nonjoin", [[1, 3], [2, 2]], join=False, quota=3, policy="all-ready", capacity=0)
W1_OFF = _model("w1x3_regroup_off", [[1, 3, 11]], regroup=(0, 0))
#: singletons only (B(10) = 1 at budget 10): with capacity 1 the oldest sample is emitted alone
W1_SINGLES = _model("w1x4_singles", [[1, 1, 10, 10]])
#: the packed budget: 1 + 3 leaves 60% of the budget unused (held under regroup 1/5); 11 is alone
W1_PACKED = _model("w1x3_packed", [[1, 3, 11]], budget_kind="packed")
#: the shared tail: one own view per rank and a pool of two (1 fits beside either; 11 is over the budget)
W2_POOL = dataclasses.replace(_model("w2x1_pool", [[3], [2]], policy="balanced"), pool=(1, 11))
#: streams: each rank's count unknown until a fetch passes its end (next up to NV + 2)
W2_STREAM = dataclasses.replace(_model("w2x2_stream", [[1, 3], [2, 11]], policy="balanced"), stream=True)
W2_POOL_PACKED = dataclasses.replace(_model("w2x1_pool_packed", [[3], [2]], policy="min", budget_kind="packed"),
                                     pool=(1, 11))

FULL = ODB + STRENGTHENING
#: the CI slice: every invariant with its strengthening inductive on W=1 (every duplicate-free
#: state) and W=2 (partitions), and the counterexamples that show what the strengthening is for
CI_CHECKS = (
    Check("full_w1_free", W1, "free", FULL,
          why="all invariants with the strengthening, over every duplicate-free state of W=1"),
    Check("full_w1_packed_free", W1_PACKED, "free", FULL,
          why="the same under the packed budget (BudgetOK and the rule's admissibility per budget)"),
    Check("full_w2_join", W2_JOIN, "partition", FULL + PROGRESS,
          why="W=2, balanced, regroup 1/5; the progress invariants hold on every such state"),
    Check("full_w2_nonjoin", W2_NONJOIN, "held", FULL + PROGRESS,
          why="W=2, non-join, all-ready, every emission order"),
    Check("roundbound_alone", W1, "partition", ("TypeOK", "NoLeak", "RoundBound"), "invariant:RoundBound",
          why="rounds <= views is not inductive: rounds <= |E| (RoundsEmitted) is"),
    Check("quota_alone", W1_NONJOIN, "partition", ("TypeOK", "NoLeak", "QuotaClosure"), "invariant:QuotaClosure",
          why="a run past its quota that is not done: QuotaOpen excludes it"),
    Check("depth_without_held_off", W1_OFF, "held", tuple(x for x in FULL if x != "HeldOnlyWithRegroup"),
          "invariant:DepthBound", why="with regroup off, a held sample (from nowhere) lets a fetch pass D"),
    Check("old_depth_bound", W1_SINGLES, "held", FULL[:2] + ("OldDepthBound",) + FULL[3:],
          "invariant:OldDepthBound",
          why="|Q| + |B \\ H| <= D: a sample released from H but not emitted counts toward D again"),
    Check("drop_overflow_bug", W1, "held", FULL, "invariant:NoLeak", ("Rest <- MutRestDrop",),
          why="seeded bug: overflow dropped"),
    Check("full_w2_pool_join", W2_POOL, "partition", FULL + PROGRESS,
          why="W=2 with a pool of 2 views: every way of having claimed 0, 1 or 2 of them, every state of the "
              "views each rank then has; the claims stay a partition of the claimed views (PoolOnce)"),
    Check("full_w2_stream_join", W2_STREAM, "partition", FULL + PROGRESS,
          why="W=2 streams: every state of a rank that has or has not found its stream's end"),
    Check("stream_end_early_bug", W2_STREAM, "partition", FULL, "invariant:NoLeak",
          ("StreamFetched <- MutStreamEndEarly",),
          why="seeded bug (M8): the fetch that finds the end leaves the stream's last view out"),
    Check("claim_drop_bug", W2_POOL, "partition", FULL, "invariant:PoolOnce", ("ClaimWith <- MutClaimWithDrop",),
          why="seeded bug: a claim advances the pool's cursor and deals its views to nobody"),
)


def deep_checks() -> tuple[Check, ...]:
    """``odb check --deep``: larger domains."""
    return (
        Check("full_w1_nonjoin_free", W1_NONJOIN, "free", FULL, why="W=1 non-join (quota 2, chaining), every state"),
        Check("noleak_alone_w1", W1, "free", ("TypeOK", "NoLeak"), why="P1 needs nothing else"),
        Check("depth_alone_w1", W1, "free", ("TypeOK", "DepthBound"), "invariant:DepthBound",
              why="H not inside B lets a fetch pass 2D: DepthBound needs HeldOK"),
        Check("heldok_alone_w1", W1, "free", ("TypeOK", "HeldOK"), "invariant:HeldOK",
              why="a drain of a view already in B: HeldOK needs NoLeak"),
        Check("joincoverage_alone_w1", W1, "free", ("TypeOK", "JoinCoverage"), "invariant:JoinCoverage",
              why="done with views never emitted: JoinCoverage needs NoLeak"),
        Check("roundsemitted_alone_w1", W1, "free", ("TypeOK", "RoundsEmitted"), "invariant:RoundsEmitted",
              why="an emission of views already in E: RoundsEmitted needs NoLeak"),
        Check("full_w2x3_join", _model("w2x3", [[1, 3, 11], [2, 2, 5]], depth=3, buffer_size=2),
              "held", FULL + PROGRESS, why="W=2, 3 views per rank"),
        Check("full_w2x3_nonjoin", _model("w2x3_nonjoin", [[1, 3, 11], [2, 2, 5]], join=False, quota=5,
                                          depth=2, policy="balanced"),
              "held", FULL + PROGRESS, why="W=2, 3 views per rank, non-join"),
        Check("full_w3_join", _model("w3", [[1, 3], [2, 11], [4]], policy="all-ready"), "held", FULL + PROGRESS,
              why="W=3, uneven"),
        Check("full_w2x3_packed_join", _model("w2x3_packed", [[1, 3, 11], [2, 2, 5]], depth=3, buffer_size=2,
                                              budget_kind="packed"),
              "held", FULL + PROGRESS, why="W=2, 3 views per rank, the packed budget"),
        Check("full_w1x4", W1X4, "partition", FULL + PROGRESS, why="W=1, 4 views (the free domain of 4 views "
              "has over 10^6 states per rank, past TLC's set limit)"),
        Check("memory_w1x4", W1X4, "partition", ("TypeOK", "NoLeak", "DepthBound", "HeldOK"),
              why="the memory bound (DepthBound, HeldOK) needs only NoLeak with regroup on"),
        Check("full_w2_pool_packed_join", W2_POOL_PACKED, "partition", FULL + PROGRESS,
              why="the pool under the packed budget: its reserve and the hold of part-full groups for it"),
    )
