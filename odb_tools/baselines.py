"""Offline and fixed-size batchers ODB is compared with (paper Sec. 3.1 and App. F).

Each takes every sample's length and returns the global list of batches (lists of
sample indices) in step order, with ``world`` consecutive batches forming one update
(the list is padded to a multiple of ``world`` by repeating its leading batches, as
DistributedSampler pads views and the paper's oracles do). Pure Python; no torch.

* ``standard``: random fixed-size batches.
* ``sorted``: online length grouping: each rank sorts windows of ``buffer_size`` loaded
  samples by length and cuts them into fixed-size batches.
* ``hfg``: HF ``group_by_length`` oracle: mega-batches of ``50 x batch_size`` from a
  random order, each sorted by length (from a length cache), cut into fixed-size batches.
* ``gmt``: fairseq-style global max-token oracle: ascending sort of the whole epoch,
  greedy packing while ``max_len x size <= budget`` (an over-budget sample goes alone),
  batches shuffled.
* ``bmt``: bucketed max-token oracle: random order, buckets of ``bucket`` samples,
  each sorted and greedily packed, all batches shuffled.

The fixed batch size is the survival one: the largest that never exceeds the token
budget at the longest sample (``max(1, budget // max(lengths))``).
"""

from __future__ import annotations

import random
from collections.abc import Sequence


def survival_batch_size(lengths: Sequence[int], token_budget: int) -> int:
    """The largest fixed batch size whose padded area never exceeds the budget."""
    return max(1, token_budget // max(max(lengths), 1))


def _deal(batches: list[list[int]], world: int) -> list[list[int]]:
    return batches + batches[: (-len(batches)) % world]


def _pack(order: list[int], lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Greedy max-token packing of ``order`` (ascending lengths): add while the padded area fits."""
    batches: list[list[int]] = []
    cur: list[int] = []
    longest = 0
    for i in order:
        new_longest = max(longest, lengths[i])
        if cur and new_longest * (len(cur) + 1) > budget:
            batches.append(cur)
            cur, new_longest = [], lengths[i]
        cur.append(i)
        longest = new_longest
    if cur:
        batches.append(cur)
    return batches


def standard(lengths: Sequence[int], batch_size: int, world: int, seed: int = 0) -> list[list[int]]:
    order = list(range(len(lengths)))
    random.Random(seed).shuffle(order)
    return _deal([order[k:k + batch_size] for k in range(0, len(order), batch_size)], world)


def sorted_online(lengths: Sequence[int], batch_size: int, world: int, buffer_size: int = 1024,
                  seed: int = 0) -> list[list[int]]:
    order = list(range(len(lengths)))
    random.Random(seed).shuffle(order)
    per_rank = [order[r::world] for r in range(world)]
    rank_batches: list[list[list[int]]] = []
    for views in per_rank:
        mine: list[list[int]] = []
        for k in range(0, len(views), buffer_size):
            window = sorted(views[k:k + buffer_size], key=lambda i: lengths[i])
            mine += [window[j:j + batch_size] for j in range(0, len(window), batch_size)]
        rank_batches.append(mine)
    steps = max(len(b) for b in rank_batches)
    out: list[list[int]] = []
    for s in range(steps):  # ranks with fewer batches repeat their first ones (as padding)
        out += [b[s] if s < len(b) else b[s % len(b)] for b in rank_batches]
    return out


def hfg(lengths: Sequence[int], batch_size: int, world: int, seed: int = 0, mega: int = 50) -> list[list[int]]:
    rng = random.Random(seed)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    size = mega * batch_size
    batches: list[list[int]] = []
    for k in range(0, len(order), size):
        chunk = sorted(order[k:k + size], key=lambda i: -lengths[i])
        batches += [chunk[j:j + batch_size] for j in range(0, len(chunk), batch_size)]
    return _deal(batches, world)


def gmt(lengths: Sequence[int], token_budget: int, world: int, seed: int = 0) -> list[list[int]]:
    batches = _pack(sorted(range(len(lengths)), key=lambda i: lengths[i]), lengths, token_budget)
    random.Random(seed).shuffle(batches)
    return _deal(batches, world)


def bmt(lengths: Sequence[int], token_budget: int, world: int, seed: int = 0, bucket: int = 8192) -> list[list[int]]:
    rng = random.Random(seed)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    batches: list[list[int]] = []
    for k in range(0, len(order), bucket):
        batches += _pack(sorted(order[k:k + bucket], key=lambda i: lengths[i]), lengths, token_budget)
    rng.shuffle(batches)
    return _deal(batches, world)
