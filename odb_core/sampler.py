"""Sampler views: a seeded permutation and DistributedSampler-compatible sharding.

Sharding follows ``torch.utils.data.DistributedSampler(drop_last=False)``: the
order is padded by repeating its head up to W x ceil(N / W) views and rank r takes
every W-th view from r. The permutation itself is the core's own (seeded
:mod:`random`); the torch adapter uses torch's, the sharding rule is the same.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from odb_core.errors import UnsupportedSettingError


def permutation(n: int, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """The sampler order of ``range(n)`` for (seed, epoch); identity order if not shuffled."""
    order = list(range(n))
    if shuffle:
        random.Random(f"odb-sampler:{seed}:{epoch}").shuffle(order)
    return order


def padded_order(order: Sequence[int], world: int) -> list[int]:
    """``order`` padded by repetition to W x ceil(N / W) views (empty stays empty)."""
    n = len(order)
    total = world * -(-n // world)
    out = list(order)
    while len(out) < total:
        out.extend(order[: total - len(out)])
    return out


def shard_all(order: Sequence[int], world: int) -> list[list[int]]:
    """Every rank's views, ``[shard_views(order, world, r) for r in range(world)]``, padding
    the order once (O(N), not O(N x W))."""
    padded = padded_order(order, world)
    return [padded[rank::world] for rank in range(world)]


def shard_views(order: Sequence[int], world: int, rank: int) -> list[int]:
    """Rank ``rank``'s views: ``padded_order(order, world)[rank::world]``."""
    if not 0 <= rank < world:
        raise UnsupportedSettingError(f"rank {rank} outside world of size {world}", field="rank", rank=rank)
    return padded_order(order, world)[rank::world]


def pool_size(n: int, fraction: float) -> int:
    """The shared tail's pool of an epoch of ``n`` views: floor(fraction x n) (``ODBConfig.shared_tail``),
    the product taken in floating point (``int(n * fraction)``: 28, not 29, for 100 x 0.29), the
    same on every rank and in every checkpoint (it is part of the epoch's layout, P8)."""
    return int(n * fraction)


def split_tail(order: Sequence[int], fraction: float) -> tuple[list[int], list[int]]:
    """``order`` split into the views to shard and the shared tail's pool: its last
    :func:`pool_size` views (none for fraction 0)."""
    k = pool_size(len(order), fraction)
    cut = len(order) - k
    return list(order[:cut]), list(order[cut:])


def tail_views(order: Sequence[int], world: int, rank: int, fraction: float) -> tuple[list[int], list[int]]:
    """Rank ``rank``'s own views and the shared tail's pool of the epoch's (unpadded) global
    ``order``: the pool is its last floor(fraction x N) views, the rest is sharded like
    ``DistributedSampler(drop_last=False)`` (:func:`shard_views`). Every rank gets the same pool."""
    own, pool = split_tail(order, fraction)
    return shard_views(own, world, rank), pool


def epoch_views(n: int, world: int, fraction: float = 0.0) -> int:
    """Views an epoch of ``n`` samples serves over ``world`` ranks: the pool's floor(fraction x n)
    once each, the rest padded as ``DistributedSampler(drop_last=False)`` pads it."""
    k = pool_size(n, fraction)
    return k + world * -(-(n - k) // world)
