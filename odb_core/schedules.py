"""Seeded delivery schedules and shardings for the in-process simulator.

A schedule decides (a) how the sampler order is sharded across ranks and (b) which
in-flight views arrive at each rank in each round. Every schedule is fair: a rank
whose worker queue is non-empty receives at least one sample per round, which is
the fairness P6 relies on.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from odb_core.sampler import shard_all

SCHEDULES = ("in_order", "random", "straggler", "empty_rank", "uneven")


def shard(order: Sequence[int], world: int, schedule: str, seed: int) -> list[list[int]]:
    """Split the sampler order into per-rank views.

    ``empty_rank`` gives the last rank nothing (DistributedSampler sharding over the
    others); ``uneven`` cuts the order at random points into non-empty shards of
    unequal sizes (when N >= W); the rest shard exactly like
    DistributedSampler(drop_last=False). The uneven cut points depend only on
    (seed, N, W), so chained iterations over the same order get the same shards.
    """
    check_schedule(schedule)
    if schedule == "empty_rank" and world > 1:
        return [*shard_all(order, world - 1), []]
    if schedule == "uneven" and 1 < world <= len(order):
        rng = random.Random(f"odb-uneven:{seed}:{len(order)}:{world}")
        cuts = sorted(rng.sample(range(1, len(order)), world - 1))
        bounds = [0, *cuts, len(order)]
        return [list(order[bounds[r] : bounds[r + 1]]) for r in range(world)]
    return shard_all(order, world)


def deliver(schedule: str, rank: int, world: int, pipeline: list[int], rng: random.Random) -> list[int]:
    """Remove and return the views of ``pipeline`` (fetch order) that arrive now, in arrival order."""
    if not pipeline:
        return []
    if schedule == "random":
        arrived = [p for p in pipeline if rng.random() < 0.5] or [pipeline[rng.randrange(len(pipeline))]]
        rng.shuffle(arrived)
    elif schedule == "straggler" and rank == world - 1:
        arrived = [pipeline[0]]
    else:
        arrived = list(pipeline)
    gone = set(arrived)
    pipeline[:] = [p for p in pipeline if p not in gone]
    return arrived


def check_schedule(schedule: str) -> None:
    """Raise ValueError naming the choices if ``schedule`` is unknown."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
