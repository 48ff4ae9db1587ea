"""Seeded bugs: subclasses of the core's state machines that override one hook each.

Each core mutant is the twin of a spec mutant (spec/cfg/mutant_*.cfg) and must be
caught by TLC, by the hypothesis suite (:mod:`model_checks.mutation`) and by trace
validation. They live here, with the checks, so no training run can configure one:
``odb_core`` has hooks, not bugs. :func:`driver` gives the epoch driver of a mutant,
which the simulator, the conformance harness and the collate process accept.
"""

from __future__ import annotations

import random
from bisect import insort
from collections.abc import Sequence
from dataclasses import replace
from fractions import Fraction
from itertools import accumulate, count
from typing import Any

from odb_core.epoch import ClaimRule, EpochDriver
from odb_core.packing import size_of
from odb_core.protocol import Plan, RankProtocol, Step
from odb_core.tail import in_reserve
from odb_core.wire import Header, Status


class NoCminProtocol(RankProtocol):
    """M1: the configured target policy without C_min+ (breaks the output capacity bound)."""

    def _target(self, headers: Sequence[Header]) -> int:
        return self._target_policy([Header(h.iteration, h.round, h.status, h.groups, 0, h.samples, h.tokens)
                                    for h in headers])


class MaxGroupsProtocol(RankProtocol):
    """M2: T = max G over active ranks, ignoring C_min+ and S_min+ (splits fall short: P2)."""

    def _target(self, headers: Sequence[Header]) -> int:
        return max((h.groups for h in headers if h.status is Status.READY), default=0)


class DropOverflowProtocol(RankProtocol):
    """M3: overflow groups are dropped instead of recirculated (breaks P1)."""

    def _settle_overflow(self, emitted: list[list[int]],
                         recirculated: list[list[int]]) -> tuple[list[list[int]], list[int]]:
        return emitted, [p for g in recirculated for p in g]


class EarlyFinishProtocol(RankProtocol):
    """M4: finished is announced once R and Q are empty, although B holds samples (breaks P4)."""

    def _reports_finished(self, drained: bool) -> bool:
        return drained


class MergeOverflowProtocol(RankProtocol):
    """M5: overflow is merged into the last kept group (breaks the budget, P3)."""

    def _settle_overflow(self, emitted: list[list[int]],
                         recirculated: list[list[int]]) -> tuple[list[list[int]], list[int]]:
        if recirculated:
            emitted = [*emitted[:-1], emitted[-1] + [p for g in recirculated for p in g]]
        return emitted, []


class PackOverfillProtocol(RankProtocol):
    """M7: the packed budget's best fit ignores the sample's own size: a sample goes into the
    fullest group with any room left, fit or not (breaks the packed budget, P3). The padded
    budget is unchanged. Spec twin: ``FitOp <- MutFitsOverfill``."""

    def _group(self) -> list[list[int]]:
        if self.config.budget != "packed":
            return super()._group()
        length = self._length
        groups: list[list[int]] = []
        open_: list[tuple[int, int]] = []  # (room left > 0, opening number), the fullest first
        for key in reversed(sorted(sorted(length), key=length.__getitem__)):
            size = size_of(length[key])
            if open_:
                room, number = open_.pop(0)
                groups[number].append(key)
            else:
                room, number = self.config.token_budget, len(groups)
                groups.append([key])
            if room - size > 0:
                insort(open_, (room - size, number))
        return [list(reversed(g)) for g in reversed(groups)]


class _RepeatsProtocol(RankProtocol):
    """Lets a seeded bug emit a position twice: a round's emitted groups leave the buffer at the
    round's end (their lengths and tokens are read first), a position already gone is recorded
    as emitted again."""

    _leaving: tuple[list[int], ...] = ()

    def _remove(self, group: list[int]) -> None:
        self._leaving = (*self._leaving, group)

    def _end_round(self) -> None:
        gone: set[int] = set()
        for group in self._leaving:
            fresh = [p for p in dict.fromkeys(group) if p in self._length and p not in gone]
            gone.update(group)
            super()._remove(fresh)
            again = list(group)
            for p in fresh:
                again.remove(p)
            self._emitted.extend(again)
        self._leaving = ()
        super()._end_round()


class SplitDupProtocol(_RepeatsProtocol):
    """M9: a split leaves the split-off sample in its group as well: that view is emitted twice in
    one round (breaks P4, exactly once). Spec twin: ``AlignOp <- MutAlignDup``."""

    def _align(self, groups: list[list[int]], target: int) -> tuple[list[list[int]], list[list[int]]]:
        if len(groups) >= target:
            return super()._align(groups, target)
        out = [list(g) for g in groups]
        while len(out) < target:
            big = [i for i, g in enumerate(out) if len(g) >= 2]
            if not big:
                break
            out.insert(big[-1] + 1, [out[big[-1]][-1]])
        return out, []


class ReemitProtocol(_RepeatsProtocol):
    """M10: the last item of a round of two or more is this rank's first non-idle item of the
    previous round again; the group it displaces stays in the buffer. Views emitted before are
    emitted again (breaks P4, exactly once). Spec twin: ``AlignOp <- MutAlignReemit``."""

    _previous: tuple[tuple[int, int, int, int, int], ...] = ()  # (position, length, tokens, arrival, round)

    def on_headers(self, gathered: Any) -> Plan:
        plan = super().on_headers(gathered)
        if plan.target == 0:  # a round without items (spec: lastOut' idle)
            self._previous = ()
        return plan

    def on_steps(self, gathered: Any) -> list[Step]:
        real = [g for g in self._pending if g]
        saved = tuple((p, self._length[p], self._tokens[p], self._arrival[p], self._arrival_round[p])
                      for p in (real[0] if real else ()))
        steps = super().on_steps(gathered)
        self._previous = saved
        return steps

    def _align(self, groups: list[list[int]], target: int) -> tuple[list[list[int]], list[list[int]]]:
        emitted, back = super()._align(groups, target)
        if not self._previous or target < 2:
            return emitted, back
        for p, length, tokens, arrival, arrival_round in self._previous:  # in the buffer's books again
            self._length[p], self._tokens[p], self._arrival[p], self._arrival_round[p] = (
                length, tokens, arrival, arrival_round)
            self._buffer_tokens += tokens
        return [*emitted[:-1], [p for p, *_ in self._previous]], [*back, emitted[-1]]


class NoChainDriver(EpochDriver):
    """M6: non-join without chaining: the epoch ends with the first logical iteration (breaks P5)."""

    def _chains(self) -> bool:
        return False


class LocalQuotaDriver(EpochDriver):
    """A7 (adapter): the quota counts this rank's samples instead of the step's global ones
    (ranks stop at different steps; breaks P5 and, across ranks, P2)."""

    def _quota_count(self, step: Step) -> int:
        return step.local_samples


class RoundQuotaDriver(EpochDriver):
    """A8 (adapter): the quota is checked once per round, so every step of the round that
    reaches N is consumed (breaks P5's bound N + S_max and the spec's consumed count)."""

    def _stops_at_quota(self) -> bool:
        return False


class DoubleDealDriver(EpochDriver):
    """T1 (shared tail): a rank's claim starts at the round's pool cursor, leaving out the views
    the ranks before it claim in the same round: two ranks that claim in one round get the same
    pool views, and as many are never dealt (breaks P4: each pool view to one rank, spec PoolOnce)."""

    def _plan_claims(self, proto: RankProtocol) -> None:
        cursor = self.pool_cursor
        super()._plan_claims(proto)
        self._claim = (cursor, self._claim[1])


class DropLastClaimDriver(EpochDriver):
    """T2 (shared tail): the claim that takes the pool's last view is never applied (the rank
    closes the pool without it), so its views are never trained (breaks P4: JoinCoverage)."""

    def _apply_claims(self, proto: RankProtocol) -> None:
        start, count = self._claim
        if count and start + count == len(self.pool):
            self._claim = (0, 0)
        super()._apply_claims(proto)


def _in_reserve(rule: ClaimRule, hs: Sequence[Header]) -> bool:
    """The round deals the packed budget's reserve (one view a rank, by room; :mod:`odb_core.tail`)."""
    return in_reserve([h.load for h in hs], [h.samples for h in hs], rule.left, rule.budget)


def _counts(counts: list[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A claim rule's result for these counts: the counts and their prefix sums."""
    return tuple(counts), tuple(accumulate(counts, initial=0))


class NoFallbackRule(ClaimRule):
    """The reserve's view goes only to a rank with room: with none, nobody claims."""

    def __call__(self, hs: Sequence[Header]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        if _in_reserve(self, hs) and not any(h.pending == 0 and h.room > 0 for h in hs):
            return _counts([0] * len(hs))
        return super().__call__(hs)


class LeastRoomRule(ClaimRule):
    """The reserve's view goes to the rank with the least room instead of the most."""

    def __call__(self, hs: Sequence[Header]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        roomy = [r for r, h in enumerate(hs) if h.pending == 0 and h.room > 0]
        if _in_reserve(self, hs) and roomy:
            counts = [0] * len(hs)
            counts[min(roomy, key=lambda r: (hs[r].room, r))] = 1
            return _counts(counts)
        return super().__call__(hs)


class OneRankRule(ClaimRule):
    """The reserve goes to one rank a round whatever ``reserve_divisor`` says."""

    def __call__(self, hs: Sequence[Header]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        if _in_reserve(self, hs):
            return ClaimRule(self.left, self.cap, self.budget, 1)(hs)
        return super().__call__(hs)


class FillNoFallbackDriver(EpochDriver):
    """F1 (the packed budget's pool): the reserve's view goes only to a rank with room, so
    once every rank with nothing pending has no part-full group (all emitted full, or an empty
    buffer) the pool is never claimed again and the epoch never ends (breaks P6: Termination).
    Spec twin: ``FillOp <- MutFillNoFallback``."""

    claim_rule_cls = NoFallbackRule


class FillLeastRoomDriver(EpochDriver):
    """F2 (the packed budget's pool): the reserve's view goes to the rank with the least room
    (every view still dealt once: only trace replay, which checks each gather's claims, sees it)."""

    claim_rule_cls = LeastRoomRule


class FillOneRankDriver(EpochDriver):
    """F3 (the packed budget's pool): a reserve round deals to one rank, not to
    ceil(W / ``reserve_divisor``) (every view still dealt once: only state-space comparison and
    trace replay, which check each gather's claims, see it)."""

    claim_rule_cls = OneRankRule


class SlowTargetProtocol(RankProtocol):
    """P6 (a hypothesis hunt only: no spec twin): two rounds in three skip (target 0) whatever the
    headers say, so an epoch takes about three times its rounds; every view is still emitted once
    in lockstep, so only the round bound catches it."""

    def _target(self, headers: Any) -> int:
        return 0 if self.round % 3 else super()._target(headers)


class LocalMeanProtocol(RankProtocol):
    """P7 (a hypothesis hunt only): every rank weighs its step 1/W, the mean of the ranks' local
    means, whatever its tokens (the weights still sum to 1 when no rank is idle; the per-token
    mean is lost when the ranks' token counts differ)."""

    def on_steps(self, gathered: Any) -> list[Step]:
        return [replace(s, weight=Fraction(1, self.world)) for s in super().on_steps(gathered)]


_RUNS = count()


class RunSeededOrderProtocol(RankProtocol):
    """P8 (a hypothesis hunt only): a round's items in an order seeded by how many protocols this
    process has built so far, run-dependent state (as a seed from the clock or ``hash()`` would be),
    not by the configured seed; within a run every rank keeps its own order, so P1-P7 hold."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._run = next(_RUNS)

    def _align(self, groups: list[list[int]], target: int) -> tuple[list[list[int]], list[list[int]]]:
        emitted, recirculated = super()._align(groups, target)
        emitted = list(emitted)
        random.Random(f"{self._run}:{self.round}").shuffle(emitted)
        return emitted, recirculated


def _with(name: str, protocol: type[RankProtocol]) -> type[EpochDriver]:
    """An epoch driver running ``protocol`` (named ``name`` in this module, so it pickles)."""
    return type(name, (EpochDriver,), {"protocol_cls": protocol, "__module__": __name__, "__doc__": protocol.__doc__})


NoCminDriver = _with("NoCminDriver", NoCminProtocol)
MaxGroupsDriver = _with("MaxGroupsDriver", MaxGroupsProtocol)
DropOverflowDriver = _with("DropOverflowDriver", DropOverflowProtocol)
EarlyFinishDriver = _with("EarlyFinishDriver", EarlyFinishProtocol)
MergeOverflowDriver = _with("MergeOverflowDriver", MergeOverflowProtocol)
PackOverfillDriver = _with("PackOverfillDriver", PackOverfillProtocol)
SplitDupDriver = _with("SplitDupDriver", SplitDupProtocol)
ReemitDriver = _with("ReemitDriver", ReemitProtocol)

SlowTargetDriver = _with("SlowTargetDriver", SlowTargetProtocol)
LocalMeanDriver = _with("LocalMeanDriver", LocalMeanProtocol)
RunSeededOrderDriver = _with("RunSeededOrderDriver", RunSeededOrderProtocol)

#: the core mutants, each the twin of spec/cfg/mutant_<name>.cfg
MUTANTS: dict[str, type[EpochDriver]] = {
    "no-cmin": NoCminDriver,
    "max-groups": MaxGroupsDriver,
    "drop-overflow": DropOverflowDriver,
    "early-finish": EarlyFinishDriver,
    "merge-overflow": MergeOverflowDriver,
    "no-chain": NoChainDriver,
    "pack-overfill": PackOverfillDriver,
    "fill-no-fallback": FillNoFallbackDriver,
    "split-dup": SplitDupDriver,
    "reemit": ReemitDriver,
}
#: the mutants that only change the packed budget's behaviour (their hunts and traces draw it)
PACKED_MUTANTS = ("pack-overfill", "fill-no-fallback")
#: the mutants that only change a pooled epoch's behaviour (their hunts draw a shared tail)
POOLED_MUTANTS = ("fill-no-fallback",)
#: mutants of the adapter's epoch loop, caught by replaying real-run traces
ADAPTER_MUTANTS: dict[str, type[EpochDriver]] = {"local-quota": LocalQuotaDriver, "round-quota": RoundQuotaDriver}
#: mutants of the shared tail's claims (join mode with a pool), caught by replaying pooled traces
POOL_MUTANTS: dict[str, type[EpochDriver]] = {"double-deal": DoubleDealDriver, "drop-last-claim": DropLastClaimDriver,
                                               "fill-least-room": FillLeastRoomDriver, "fill-one-rank": FillOneRankDriver}
#: mutants of the properties the spec does not model or bounds loosely (P6's round bound, P7's
#: weights, P8's determinism): the hypothesis properties of tests/test_properties.py catch them
PROPERTY_MUTANTS: dict[str, type[EpochDriver]] = {"slow-target": SlowTargetDriver, "local-mean": LocalMeanDriver,
                                                   "run-seeded-order": RunSeededOrderDriver}


def driver(mutant: str | None) -> type[EpochDriver]:
    """The epoch driver class of ``mutant`` (the real one for None)."""
    if mutant is None:
        return EpochDriver
    table = {**MUTANTS, **ADAPTER_MUTANTS, **POOL_MUTANTS, **PROPERTY_MUTANTS}
    if mutant not in table:
        raise ValueError(f"unknown mutant {mutant!r}; known: {sorted(table)}")
    return table[mutant]
