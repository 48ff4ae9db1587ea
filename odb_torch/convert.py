"""Bring your own DataLoader: turn a ``torch.utils.data.DataLoader`` a framework already
built into an :class:`~odb_torch.ODBDataLoader`.

``from_dataloader(dl, token_budget=8192)`` reads the DataLoader's public fields and keeps
what it can: the dataset, ``collate_fn``, ``num_workers``, ``prefetch_factor`` and the worker
start method (not ``timeout``, a worker's batch deadline: ODB's ``timeout`` bounds how long a
rank waits for its peers, so ODB's default stays unless given). Its fixed ``batch_size`` is what
ODB replaces (token-budgeted groups). The sampler is kept when it already is this rank's shard (a ``DistributedSampler``
of this group, or any sampler when training alone); torch's ``SequentialSampler`` and
``RandomSampler`` become ODB's ``DistributedSampler`` (``shuffle`` False / True, seeded by
ODB's ``seed``), so every rank trains its own shard and a resume replays the same order.

Nothing is patched and the DataLoader is not modified. What cannot be converted soundly
is refused before anything starts, with an :class:`~odb_core.errors.UnsupportedSettingError`
naming every such field: an ``IterableDataset`` (pass a stream to ``ODBDataLoader`` itself),
``batch_size=None``, a custom ``batch_sampler``, a ``RandomSampler`` drawing with replacement
or not over the whole dataset (it would become ODB's shuffled ``DistributedSampler``, which
visits each sample once; another sampler, weighted ones included, is kept as it is when
training alone), a non-distributed custom sampler under DDP, ``drop_last=True``
(ODB yields every sample once: there is no last partial batch to drop), a
``worker_init_fn`` (ODB's workers run their own), a DataLoader subclass. Pass an ODB keyword
(``sampler=``, ``collate_fn=`` ...) to replace a field, or ``ignore=("drop_last",
"worker_init_fn", "type")`` to accept losing those. ``pin_memory`` is kept (the trainer
pins each batch, :mod:`odb_torch.pinning`). ``pin_memory_device``, ``persistent_workers``,
``in_order`` and ``generator`` only tune speed or randomness and are dropped: batches reach
the trainer through a queue from ODB's persistent collate process, and shuffling follows
ODB's seed.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from odb_core.errors import UnsupportedSettingError
from odb_torch.loader import ODBDataLoader
from odb_torch.loader_options import rank_and_world

IGNORABLE = frozenset({"drop_last", "worker_init_fn", "type"})
"""Fields whose semantics the caller may accept losing with ``ignore=``."""

Problems = list[tuple[str, str]]


def from_dataloader(dataloader: DataLoader[Any], *, ignore: Collection[str] = (), **kwargs: Any) -> ODBDataLoader:
    """An :class:`ODBDataLoader` over ``dataloader``'s dataset, keeping its fields (see the module doc).

    ``kwargs`` are :class:`ODBDataLoader` keywords (``token_budget`` or ``config`` is
    required); one given replaces the field read from ``dataloader``. Raises
    :class:`~odb_core.errors.UnsupportedSettingError` naming every field that cannot be
    converted (``ignore`` waives ``drop_last``, ``worker_init_fn`` and ``type``).
    """
    dataset, keywords = loader_keywords(dataloader, ignore=ignore, **kwargs)
    return ODBDataLoader(dataset, **keywords)


def loader_keywords(dataloader: DataLoader[Any], *, ignore: Collection[str] = (),
                    **kwargs: Any) -> tuple[Any, dict[str, Any]]:
    """``(dataset, keywords)`` such that ``ODBDataLoader(dataset, **keywords)`` is the
    conversion :func:`from_dataloader` makes; starts nothing. Same errors."""
    unknown = sorted(set(ignore) - IGNORABLE)
    if unknown:
        raise ValueError(f"ignore={unknown}: only {sorted(IGNORABLE)} can be ignored")
    problems: Problems = []
    dl = dataloader
    if type(dl) is not DataLoader and "type" not in ignore:
        problems.append(("type", f"{type(dl).__name__} is a DataLoader subclass: only DataLoader's own fields "
                                 "are converted, whatever the subclass adds would be lost; convert the DataLoader "
                                 "before the framework wraps it, or pass ignore=('type',)"))
    map_style = _check_dataset(dl.dataset, problems)
    batch_sampler = _check_batching(dl, problems, ignore)
    workers = kwargs.get("num_workers", dl.num_workers)
    if dl.worker_init_fn is not None and workers and "worker_init_fn" not in ignore:
        problems.append(("worker_init_fn", "ODB's DataLoader workers run ODB's own worker_init_fn, so this one "
                                           "would not run; pass ignore=('worker_init_fn',) if it only seeds RNGs"))
    keywords = _read_fields(dl)
    if "sampler" not in kwargs and batch_sampler is not None and map_style:
        rank, world = rank_and_world(kwargs.get("rank"), kwargs.get("world_size"))
        keywords.update(_convert_sampler(batch_sampler.sampler, dl.dataset, rank, world, problems))
    if problems:
        raise UnsupportedSettingError(
            "cannot convert this DataLoader to an ODBDataLoader: "
            + "; ".join(f"{field}: {why}" for field, why in problems),
            fields=[field for field, _ in problems])
    keywords.update(kwargs)
    return dl.dataset, keywords


def _check_dataset(dataset: Any, problems: Problems) -> bool:
    """Whether ``dataset`` is map-style, with ``__len__`` and ``__getitem__`` (a stream goes to
    ``ODBDataLoader`` directly, whose stream arguments a ``DataLoader`` has no counterpart for)."""
    if isinstance(dataset, IterableDataset):
        problems.append(("dataset", f"{type(dataset).__name__} is an IterableDataset: from_dataloader "
                                    "converts map-style datasets; pass a stream to ODBDataLoader(stream, ...) "
                                    "directly (README: Streaming)"))
        return False
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        problems.append(("dataset", f"{type(dataset).__name__} has no __len__ or __getitem__: ODB needs a "
                                    "map-style dataset"))
        return False
    return True


def _check_batching(dl: DataLoader[Any], problems: Problems, ignore: Collection[str]) -> BatchSampler | None:
    """torch's own ``BatchSampler`` (whose fixed batch size ODB replaces), else a problem."""
    batch_sampler = dl.batch_sampler
    if batch_sampler is None:
        problems.append(("batch_size", "batch_size=None: the DataLoader yields single samples (no batching), "
                                       "so there is no batch for ODB to replace"))
        return None
    if type(batch_sampler) is not BatchSampler:
        problems.append(("batch_sampler", f"{type(batch_sampler).__name__} decides fixed batches itself; ODB forms "
                                          "its own token-budgeted batches and cannot keep them (rebuild the "
                                          "DataLoader with sampler= and batch_size= instead of batch_sampler=, or "
                                          "build an ODBDataLoader directly)"))
        return None
    if batch_sampler.drop_last and "drop_last" not in ignore:
        problems.append(("drop_last", "drop_last=True drops a last partial fixed-size batch; ODB yields every "
                                      "sample once per epoch and has no such batch; pass ignore=('drop_last',) "
                                      "to accept that"))
    return batch_sampler


def _read_fields(dl: DataLoader[Any]) -> dict[str, Any]:
    """The DataLoader fields ODB keeps, as :class:`ODBDataLoader` keywords."""
    workers = int(dl.num_workers)
    keywords: dict[str, Any] = {"collate_fn": dl.collate_fn, "num_workers": workers,
                                "prefetch_factor": dl.prefetch_factor if workers else None,
                                "pin_memory": bool(dl.pin_memory)}
    context = dl.multiprocessing_context
    if workers and context is not None:
        keywords["worker_start_method"] = context if isinstance(context, str) else context.get_start_method()
    # dl.timeout is not carried: it bounds one batch from the DataLoader's workers, ODB's timeout
    # also how long a rank waits for its peers (one evaluating or checkpointing while the others wait)
    return keywords


def _convert_sampler(sampler: Any, dataset: Any, rank: int, world: int, problems: Problems) -> dict[str, Any]:
    """ODB's sampler keywords for the DataLoader's sampler: kept, or mapped to ODB's
    ``DistributedSampler`` (``sampler=None`` and ``shuffle``), or a problem."""
    if type(sampler) is SequentialSampler:
        return {"sampler": None, "shuffle": False}
    if type(sampler) is RandomSampler:
        if sampler.replacement or sampler.num_samples != len(dataset):
            problems.append(("sampler", f"RandomSampler(replacement={sampler.replacement}, num_samples="
                                        f"{sampler.num_samples}) does not visit each of the {len(dataset)} samples "
                                        "once per epoch; pass sampler=... (each rank's views)"))
            return {}
        return {"sampler": None, "shuffle": True}
    if not hasattr(sampler, "__len__"):
        problems.append(("sampler", f"{type(sampler).__name__} has no __len__: ODB needs the number of views "
                                    "per epoch"))
        return {}
    shard = (getattr(sampler, "num_replicas", None), getattr(sampler, "rank", None))
    if isinstance(sampler, DistributedSampler) or world > 1:
        if shard != (world, rank):
            problems.append(("sampler", f"{type(sampler).__name__} (num_replicas, rank) = {shard} is not this "
                                        f"rank's shard ({world}, {rank}): under DDP each rank needs its own "
                                        "views; pass sampler=... or build the DataLoader with a "
                                        "DistributedSampler of this group"))
            return {}
    return {"sampler": sampler}
