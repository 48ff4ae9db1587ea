"""The shared tail: pool views claimed by the ranks with the least work left (join mode).

With ``shared_tail`` = f > 0 the last floor(f x N) views of an epoch's sampler order are not
sharded: they form a pool every rank knows. At each round's header gather, every rank computes
the same claims from the gathered headers (P8), so each pool view goes to exactly one rank
(P4), and the ranks that drew light shards take more of the pool: the ranks end the epoch
with about equal work and the join-mode tail (the alignment overhead at large W) shrinks.

The rule, in integers (so every rank computes it bit for bit):

* a rank's remaining work is w_r = load_r x S + pending_r x L, where load_r is the sum of the
  lengths in its buffer, pending_r its views not yet arrived, and L / S the gather's mean
  length (L = sum of loads, S = sum of buffered samples; 1 / 1 when every buffer is empty);
* the pool's work is P = left x L; the level is the least integer h with
  sum_r max(0, h - w_r) >= P;
* in rank order from the pool cursor, each rank with nothing pending takes
  min(cap, floor((h - w_r) / L)) views (0 if h <= w_r); if that gives nobody a view while
  some rank has nothing pending, the least-loaded such rank (lowest rank on ties) takes one,
  so the pool always drains.

The packed budget (with ``regroup_padding``) keeps a reserve for last and fills part-full
groups with it: a rank whose views have all arrived holds its part-full groups open while the
pool is open (:func:`~odb_core.grouping.hold_sparse` with ``pool``) and reports the most room
one leaves unused (the header's ``room``). The reserve is about one budget's worth of views per
rank, reserve = floor(W x L_max x S / L) views (W x L_max over the mean length); the rule above
deals only the pool beyond it. Once at most the reserve is left, a round deals one view each
to the k = min(left, ceil(W / ``reserve_divisor``)) ranks with nothing pending and the most
room (lowest rank on ties), or, if none has room, to the k least-loaded ranks with nothing
pending. A view's length is unknown when it is dealt; its rank packs it with its open groups
by best-fit decreasing, and the next round's rooms know it, so the part-full groups fill
before new ones open. On the chat data at W=8 (L_max 8,192, buffer 1,024, pool 2%, k = 1):
438 batches on seeds 0-4, offline first-fit decreasing over every length 437, each rank's
own first-fit decreasing 441-442, the work rule alone 440-442
(``benchmarks/bench_tail_fill.py``). The reserve holds about W budgets' worth of views, so
with k = 1 at every W its rounds would grow with W (ultrachat, 3,000 samples per rank, W=64:
420 rounds, 407 of them without a step); k = ceil(W / 8) deals it in 72 with the same rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from odb_core.errors import ResumeStateError


def tail_claims(pending: Sequence[int], load: Sequence[int], samples: Sequence[int], left: int, cap: int,
                room: Sequence[int] = (), budget: int = 0, spread: int = 1) -> list[int]:
    """How many pool views each rank claims this round (see the module); they sum to at most
    ``left`` and only ranks with ``pending`` 0 claim. ``budget``: L_max if the packed budget's
    reserve applies (the packed budget with ``regroup_padding``), else 0; ``room``: each rank's
    header room (empty: all 0); ``spread``: the most ranks a reserve round deals to
    (ceil(W / ``ODBConfig.reserve_divisor``))."""
    if left <= 0 or cap <= 0:
        return [0] * len(pending)
    reserve = reserve_views(load, samples, left, budget)
    if left <= reserve:  # in_reserve, the reserve computed once
        return _fill_claim(pending, load, room, min(spread, left))
    return _work_claims(pending, load, samples, left - reserve, cap)


def reserve_views(load: Sequence[int], samples: Sequence[int], left: int, budget: int) -> int:
    """The packed budget's reserve: floor(W x ``budget`` x S / L) pool views (W ranks, L and S the
    gathered loads and buffered samples), all ``left`` while L = 0; 0 where ``budget`` is 0."""
    if not budget:
        return 0
    total_load = sum(load)
    return len(load) * budget * sum(samples) // total_load if total_load else left


def in_reserve(load: Sequence[int], samples: Sequence[int], left: int, budget: int) -> bool:
    """This round deals the packed budget's reserve (one view a rank, by room): ``left`` > 0 views are
    left and at most :func:`reserve_views` of them."""
    reserve = reserve_views(load, samples, left, budget)
    return 0 < left <= reserve


def _fill_claim(pending: Sequence[int], load: Sequence[int], room: Sequence[int], k: int) -> list[int]:
    """The reserve's claims: one view to each of the ``k`` ranks with nothing pending and the most
    room (room > 0; lowest rank on ties), or, if none has room, to each of the ``k`` least-loaded
    ranks with nothing pending; none if every rank has views pending."""
    claims = [0] * len(pending)
    free = [r for r, p in enumerate(pending) if p == 0]
    roomy = [r for r in free if r < len(room) and room[r] > 0]
    picks = sorted(roomy, key=lambda r: (-room[r], r)) if roomy else sorted(free, key=lambda r: (load[r], r))
    for r in picks[:k]:
        claims[r] = 1
    return claims


def _work_claims(pending: Sequence[int], load: Sequence[int], samples: Sequence[int], left: int,
                 cap: int) -> list[int]:
    """The work rule (see the module): levels the ranks' remaining work with ``left`` views."""
    total_load, total_samples = sum(load), sum(samples)
    mean_num, mean_den = (total_load, total_samples) if total_samples and total_load else (1, 1)
    work = [ld * mean_den + p * mean_num for ld, p in zip(load, pending)]
    level = _level(work, left * mean_num)
    claims, unclaimed = [0] * len(pending), left
    for r, (p, w) in enumerate(zip(pending, work)):
        if p == 0 and unclaimed and level > w:
            claims[r] = min(cap, (level - w) // mean_num, unclaimed)
            unclaimed -= claims[r]
    free = [r for r, p in enumerate(pending) if p == 0]
    if not any(claims) and free:
        claims[min(free, key=lambda r: (work[r], r))] = 1
    return claims


def _level(work: Sequence[int], pool: int) -> int:
    """The least integer h with sum(max(0, h - w)) >= pool (binary search)."""
    lo, hi = min(work), max(work) + pool
    while lo < hi:
        mid = (lo + hi) // 2
        if sum(mid - w for w in work if mid > w) >= pool:
            hi = mid
        else:
            lo = mid + 1
    return lo


@dataclass(frozen=True, slots=True)
class TailPosition:
    """Where a pooled epoch stood at one step boundary, for its resume: ``cursor`` pool views
    claimed by every rank so far (the same on every rank at one step), ``claimed`` this rank's
    claims (pool indices, in claim order). Claims are deterministic per round (P8) and every
    rank reports those of the rounds it yielded from, so the ranks' positions agree."""

    cursor: int
    claimed: tuple[int, ...]


def resumed_positions(own: int, pool: int, skip: frozenset[int], tail: TailPosition, rank: int) -> list[int]:
    """The sampler positions a rank serves when a pooled epoch resumes (P4 across the resume): its
    own views (positions 0..own-1) and the pool views it had claimed (position ``own + j`` for
    pool index j), less the consumed ``skip``; pool views from ``tail.cursor`` on stay in the
    pool. :class:`ResumeStateError` if the position does not fit the epoch (a cursor outside the
    pool, a claim at or past it or twice, a consumed pool view this rank never claimed)."""
    claimed = set(tail.claimed)
    if not 0 <= tail.cursor <= pool or len(claimed) != len(tail.claimed) or any(
            not 0 <= j < tail.cursor for j in claimed):
        raise ResumeStateError(f"rank {rank}: the checkpoint's pool position (cursor {tail.cursor}, claims "
                               f"{list(tail.claimed)[:8]}) does not fit this epoch's pool of {pool} views",
                               field="claimed", rank=rank, ranks=[rank])
    stray = sorted(p for p in skip if p < 0 or p >= own and p - own not in claimed)
    if stray:
        raise ResumeStateError(f"rank {rank}: consumed positions {stray[:8]} are negative or pool views this rank "
                               "never claimed",
                               field="consumed", rank=rank, ranks=[rank], indices=stray)
    kept = [p for p in range(own) if p not in skip]  # (a negative one is above, with the strays)
    return kept + [own + j for j in tail.claimed if own + j not in skip]
