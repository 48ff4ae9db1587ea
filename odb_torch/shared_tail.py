"""The shared tail on the torch side: each epoch's own views and pool from the global order.

With ``ODBConfig.shared_tail`` = f > 0 the core (:func:`odb_core.sampler.tail_views`) keeps the
last floor(f x N) views of the epoch's global order as a pool the ranks claim from
(:mod:`odb_core.tail`). This module knows the one thing the core cannot: that global order, the
permutation of a plain ``DistributedSampler`` (rebuilt from its seed and shuffle flag with torch's
own sampler, :func:`odb_torch.elastic.global_order`). Any other sampler is refused, typed.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import DistributedSampler

from odb_core.errors import UnsupportedSettingError
from odb_core.sampler import shard_views, tail_views
from odb_torch.elastic import global_order


def check_tail_sampler(sampler: Any, rank: int, world: int) -> DistributedSampler[Any]:
    """``sampler`` if the shared tail can rebuild its global order: a plain ``DistributedSampler``
    of this rank and world, without ``drop_last``; else :class:`UnsupportedSettingError`."""
    if (type(sampler) is not DistributedSampler or (sampler.num_replicas, sampler.rank) != (world, rank)
            or sampler.drop_last):
        raise UnsupportedSettingError(
            f"rank {rank}: shared_tail needs the epoch's global order, known only for a plain "
            f"DistributedSampler(drop_last=False) of this rank and world (got {type(sampler).__name__}); "
            "use the loader's default sampler, or shared_tail=0", field="shared_tail", rank=rank)
    return sampler


def tail_shares(sampler: Any, rank: int, world: int, epoch: int, fraction: float) -> tuple[list[int], list[int]]:
    """This rank's own views (dataset indices, in order) and the epoch's pool. With no pool the
    own views are exactly the sampler's: checked, so a rebuilt order that differs is caught."""
    ds = check_tail_sampler(sampler, rank, world)
    order = global_order(ds, epoch, 1)  # the unpadded permutation of the whole dataset
    views, pool = tail_views(order, world, rank, fraction)
    ds.set_epoch(epoch)
    if shard_views(order, world, rank) != [int(i) for i in ds]:
        raise UnsupportedSettingError(
            f"rank {rank}: the rebuilt global order of epoch {epoch} does not shard into this rank's "
            "DistributedSampler views (a torch sampler that permutes otherwise?); use shared_tail=0",
            field="shared_tail", rank=rank)
    return views, pool
