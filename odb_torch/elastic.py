"""Elastic resume for ``ODBDataLoader`` (join mode): the torch side of :mod:`odb_core.elastic`.

The core merges states and deals the remaining global positions; this module knows the one
thing it cannot: the global order itself, the padded order of a plain ``DistributedSampler``
(rank r of W takes ``order[r::W]``), rebuilt from the sampler's own seed, shuffle flag and
``drop_last`` with torch's permutation. A rank resumed on W' ranks runs its epoch over an
:class:`ElasticOrder`: its dealt views for the resumed epoch, its ``DistributedSampler`` after.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch.utils.data import DistributedSampler

from odb_core.elastic import GlobalState, assign_views, global_state_from
from odb_core.elastic import check_order as core_check_order
from odb_core.errors import ResumeStateError, UnsupportedSettingError
from odb_core.sampler import epoch_views, padded_order, split_tail


@dataclass(frozen=True)
class ElasticEpoch:
    """This rank's share of an epoch resumed on another world size."""

    epoch: int
    views: tuple[int, ...]
    """Global positions this rank serves, in order (its sampler positions index this)."""
    pool: int
    """Positions dealt over every rank at the resume (a later merge checks none is lost)."""
    order_world: int
    total: int
    order_tail: float = 0.0
    """The shared-tail fraction of the global order's layout (0: the plain padded order)."""
    digest: str | None = None
    """:meth:`GlobalState.digest` of the merged state it was dealt from (None: a rank's own
    state carried the share); the epoch's handshake compares it over the ranks."""


def check_sampler(sampler: Any, rank: int, world: int) -> DistributedSampler[Any]:
    """The loader's sampler if its global order is known (a plain ``DistributedSampler`` of this
    rank and world), else :class:`UnsupportedSettingError` (``field="sampler"``)."""
    if type(sampler) is not DistributedSampler or (sampler.num_replicas, sampler.rank) != (world, rank):
        raise UnsupportedSettingError(
            f"rank {rank}: resuming on another number of ranks needs the epoch's global order, known only for "
            f"a plain DistributedSampler of this rank and world (got {type(sampler).__name__}); resume on the "
            "same world size, or at an epoch boundary", field="sampler", rank=rank)
    return sampler


def order_total(sampler: DistributedSampler[Any], world: int, tail: float = 0.0) -> int:
    """Positions in the padded (or, ``drop_last``, truncated) global order of ``world`` ranks; with
    a shared tail ``tail`` > 0, in its pooled order (:func:`odb_core.sampler.epoch_views`)."""
    n = len(sampler.dataset)  # type: ignore[arg-type]
    if tail:
        return epoch_views(n, world, tail)
    return world * (n // world if sampler.drop_last else -(-n // world))


def global_order(sampler: DistributedSampler[Any], epoch: int, world: int, tail: float = 0.0) -> list[int]:
    """Dataset indices of the global order: ``DistributedSampler(num_replicas=world)`` of rank r
    yields ``global_order(...)[r::world]`` (the same seed, shuffle, drop_last and epoch). With a
    shared tail ``tail`` > 0, the pooled order: the sharded part padded (rank r's own views at
    r, r + W, ...), then the pool (:func:`odb_core.sampler.tail_views`)."""
    whole: DistributedSampler[int] = DistributedSampler(sampler.dataset, num_replicas=1, rank=0, shuffle=sampler.shuffle,
                               seed=sampler.seed, drop_last=False)
    whole.set_epoch(epoch)
    order = [int(i) for i in whole]
    if tail:
        own, pool = split_tail(order, tail)
        return padded_order(own, world) + pool
    return order[: order_total(sampler, world)] if sampler.drop_last else padded_order(order, world)


def order_fields(sampler: DistributedSampler[Any]) -> dict[str, int]:
    """What fixes a ``DistributedSampler``'s global order besides the epoch
    (:data:`~odb_core.elastic.ORDER_FIELDS`), for ``state_dict``."""
    return {"shuffle": int(bool(sampler.shuffle)), "sampler_seed": int(sampler.seed),
            "dataset_size": len(sampler.dataset)}  # type: ignore[arg-type]


def check_order(recorded: Mapping[str, Any], sampler: Any, rank: int) -> None:
    """The core's :func:`~odb_core.elastic.check_order` against this loader's sampler's order
    fields (a sampler other than a ``DistributedSampler`` has none to check)."""
    if isinstance(sampler, DistributedSampler):
        core_check_order(recorded, order_fields(sampler), rank)


def plan_resume(sampler: Any, rank: int, world: int, seed: int,
                state: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> tuple[GlobalState, ElasticEpoch]:
    """Merge ``state`` (every rank's state_dict, or a merged global state) and deal this rank its
    views; typed errors if the sampler's order is unknown or the states do not fit this loader."""
    ds = check_sampler(sampler, rank, world)
    merged = global_state_from(state)
    if merged.seed != seed:
        raise ResumeStateError(f"rank {rank}: the checkpoint's seed {merged.seed} is not this loader's {seed}",
                               field="seed", rank=rank)
    check_order(dict(merged.order), ds, rank)  # first: another dataset size is named as such
    expected = order_total(ds, merged.order_world, merged.order_tail)
    if expected != merged.total:
        raise ResumeStateError(
            f"rank {rank}: the checkpoint's order holds {merged.total} views, this dataset and sampler give "
            f"{expected} on {merged.order_world} ranks (another dataset or drop_last?)", field="total", rank=rank)
    views = tuple(assign_views(merged, world, rank))
    return merged, ElasticEpoch(merged.epoch, views, merged.total - len(merged.consumed), merged.order_world,
                                merged.total, merged.order_tail, merged.digest())


def check_state_total(state: Mapping[str, Any], sampler: Any, share: ElasticEpoch | None, rank: int) -> None:
    """A rank's own state against this loader's plain ``DistributedSampler``: the order it indexes
    (``total`` views of ``order_world`` ranks, the padded or pooled layout it recorded) must be the
    one this dataset and ``drop_last`` give, else :class:`ResumeStateError` (``field="total"``): its
    positions would name other samples, some twice and some never (P4). Other samplers, and states
    of an older ODB without ``total``, are checked as the epoch starts (positions in range)."""
    if type(sampler) is not DistributedSampler or "total" not in state:
        return
    if share is not None:
        world, tail = share.order_world, share.order_tail
    else:
        world, tail = int(state.get("order_world", state["world_size"])), float(state.get("shared_tail") or 0.0)
    expected = order_total(sampler, world, tail)
    if expected != int(state["total"]):
        raise ResumeStateError(
            f"rank {rank}: the checkpoint's order holds {int(state['total'])} views, this dataset and sampler give "
            f"{expected} on {world} ranks (another dataset or drop_last?)", field="total", ranks=[rank], rank=rank)


def rank_share(state: Mapping[str, Any]) -> ElasticEpoch | None:
    """The elastic share a same-world rank state carries (``views``), or None."""
    if state.get("views") is None:
        return None
    return ElasticEpoch(int(state["epoch"]), tuple(int(g) for g in state["views"]), int(state["pool"]),
                        int(state["order_world"]), int(state["total"]), float(state.get("order_tail", 0.0)))


class ElasticOrder:
    """The sampler the collate process runs after an elastic resume: in the resumed epoch the
    dataset indices of this rank's dealt views, in every other epoch the wrapped sampler's."""

    def __init__(self, sampler: DistributedSampler[Any], share: ElasticEpoch) -> None:
        self.sampler, self.share = sampler, share
        order = global_order(sampler, share.epoch, share.order_world, share.order_tail)
        self.indices = [order[g] for g in share.views]
        self.seed, self.shuffle, self.num_replicas = sampler.seed, sampler.shuffle, sampler.num_replicas
        self.epoch = share.epoch

    def dealt(self, epoch: int | None) -> bool:
        """Whether ``epoch`` runs over this rank's dealt views (the resumed epoch)."""
        return epoch == self.share.epoch

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices) if self.epoch == self.share.epoch else iter(self.sampler)

    def __len__(self) -> int:
        return len(self.indices) if self.epoch == self.share.epoch else len(self.sampler)
