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
"""

from __future__ import annotations

from collections.abc import Sequence


def tail_claims(pending: Sequence[int], load: Sequence[int], samples: Sequence[int], left: int, cap: int) -> list[int]:
    """How many pool views each rank claims this round (see the module); they sum to at most
    ``left`` and only ranks with ``pending`` 0 claim."""
    if left <= 0 or cap <= 0:
        return [0] * len(pending)
    total_load, total_samples = sum(load), sum(samples)
    mean_num, mean_den = (total_load, total_samples) if total_samples and total_load else (1, 1)
    work = [ld * mean_den + p * mean_num for ld, p in zip(load, pending)]
    level = _level(work, left * mean_num)
    claims, room = [0] * len(pending), left
    for r, (p, w) in enumerate(zip(pending, work)):
        if p == 0 and room and level > w:
            claims[r] = min(cap, (level - w) // mean_num, room)
            room -= claims[r]
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
