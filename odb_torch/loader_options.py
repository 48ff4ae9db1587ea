"""Resolving :class:`~odb_torch.loader.ODBDataLoader`'s keywords: the protocol
configuration, this rank's place in the group, and the collate group's rendezvous.

Protocol keywords left out take :class:`~odb_core.ODBConfig`'s defaults (one source of
defaults); passed together with ``config=``, a keyword must agree with it, else the
loader refuses to start rather than silently ignore one of the two.
"""

from __future__ import annotations

import os
import threading
import warnings
from typing import Any

from odb_core import ODBConfig
from odb_core.errors import ODBWarning, UnsupportedSettingError
from odb_torch.ports import free_port


class _ConfigDefault:
    """Marks a loader keyword the caller left out."""

    def __repr__(self) -> str:
        return "<ODBConfig default>"


CONFIG_DEFAULT: Any = _ConfigDefault()
"""Default of every protocol keyword of the loader: "what ``ODBConfig`` says"."""


def protocol_config(config: ODBConfig | None, token_budget: int | None, keywords: dict[str, Any]) -> ODBConfig:
    """The loader's :class:`ODBConfig`: ``config`` (checked against the keywords given with
    it), else one built from ``token_budget`` and the keywords given (the others default).

    Raises ``ValueError`` naming every keyword that contradicts ``config``, or when no budget
    is given; pydantic's ``ValidationError`` (naming the field) for an invalid value.
    """
    given = {k: v for k, v in keywords.items() if v is not CONFIG_DEFAULT}
    if config is None:
        if token_budget is None:
            raise ValueError("ODBDataLoader needs token_budget (or config=ODBConfig(...))")
        return ODBConfig(token_budget=token_budget, **given)
    if token_budget is not None:
        given["token_budget"] = token_budget
    clashes = [f"{k}={v!r} contradicts config.{k}={getattr(config, k)!r}"
               for k, v in given.items() if getattr(config, k) != v]
    if clashes:
        raise ValueError("; ".join(clashes) + ": pass each setting once (in config=, or as a keyword)")
    return config


def usable_cpus() -> int | None:
    """The CPUs this process may run on, by torch's DataLoader rule: ``os.sched_getaffinity``
    where available (it respects cpusets and ``taskset``), else ``os.cpu_count()``."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count()


def warn_worker_count(num_workers: int, rank: int, stacklevel: int = 2) -> None:
    """An :class:`~odb_core.errors.ODBWarning` if ``num_workers`` exceeds :func:`usable_cpus` (or
    they are unknown), torch's DataLoader's rule: said once here, in the trainer, where the
    collate process's own DataLoaders are kept quiet (``collate_process.quiet_worker_advice``)."""
    cpus = usable_cpus()
    if num_workers and (cpus is None or num_workers > cpus):
        have = "an unknown number of CPUs" if cpus is None else f"{cpus} CPU{'s' if cpus != 1 else ''}"
        warnings.warn(ODBWarning(
            f"rank {rank}: num_workers={num_workers} DataLoader workers per rank, and this process may run on {have}: "
            "excessive workers can slow loading or freeze it; lower num_workers if loading is slow"),
            stacklevel=stacklevel + 1)


def rank_and_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """This rank and the world size: as given, else from the initialised process group, else env."""
    import torch.distributed as dist

    live = dist.is_available() and dist.is_initialized()
    if rank is None:
        rank = dist.get_rank() if live else int(os.environ.get("RANK", 0))
    if world_size is None:
        world_size = dist.get_world_size() if live else int(os.environ.get("WORLD_SIZE", 1))
    return rank, world_size


def check_rank_sampler(sampler: Any, rank: int, world: int) -> None:
    """A user's sampler that shards by rank (``num_replicas`` and ``rank``, as ``DistributedSampler``)
    must be this rank's shard of this world: one built for another rank repeats that rank's views and
    leaves this rank's untrained, one for another world size repeats or drops views (P4):
    :class:`UnsupportedSettingError` (``field="sampler"``). ``num_replicas=1`` (each rank its whole,
    own dataset: pre-sharded data) is allowed, with an :class:`ODBWarning` at a world of 2 or more."""
    replicas, its_rank = getattr(sampler, "num_replicas", None), getattr(sampler, "rank", None)
    if not isinstance(replicas, int) or not isinstance(its_rank, int) or (replicas, its_rank) == (world, rank):
        return
    if replicas == 1 and its_rank == 0:
        if world > 1:
            warnings.warn(ODBWarning(
                f"rank {rank}: the sampler ({type(sampler).__name__}) has num_replicas=1: this rank iterates its whole "
                f"dataset, right when each rank loads its own data, wrong for one dataset shared by the {world} ranks "
                "(every sample trained on every rank): build it with num_replicas=world_size, rank=rank"),
                stacklevel=3)
        return
    raise UnsupportedSettingError(
        f"rank {rank}: the sampler ({type(sampler).__name__}) was built for rank {its_rank} of {replicas}, this loader "
        f"is rank {rank} of {world}: its views would repeat another rank's and leave this rank's untrained; build it "
        "with num_replicas=world_size, rank=rank (or leave sampler= out)", field="sampler", rank=rank)


def collate_rendezvous(init_method: str | None, world_size: int, slot: int = 0) -> str:
    """The collate group's ``tcp://`` rendezvous: as given; else under DDP ``ODB_COLLATE_PORT +
    slot``, or ``MASTER_PORT + 1 + slot``, on ``MASTER_ADDR`` (``slot``: :func:`take_port_slot`'s);
    else (one rank) a free local port."""
    if init_method is not None:
        return init_method
    if uses_default_port(init_method, world_size):
        base = int(os.environ.get("ODB_COLLATE_PORT", int(os.environ.get("MASTER_PORT", 29500)) + 1))
        return f"tcp://{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{base + slot}"
    return f"tcp://127.0.0.1:{free_port()}"


def uses_default_port(init_method: str | None, world_size: int) -> bool:
    """Whether :func:`collate_rendezvous` picks the port from the environment and a slot: a
    loader of several ranks without an ``init_method``."""
    return init_method is None and world_size > 1


_SLOTS: set[int] = set()
_SLOTS_LOCK = threading.Lock()


def take_port_slot() -> int:
    """The lowest default-port slot no running collate group of this process holds, now held
    (from the collate process's start to the loader's ``close()``): a training and an evaluation
    loader running at once get ports of their own. Ranks start and close their loaders in the
    same order, so their slots agree. Freed by :func:`free_port_slot`."""
    with _SLOTS_LOCK:
        slot = next(k for k in range(len(_SLOTS) + 1) if k not in _SLOTS)
        _SLOTS.add(slot)
    return slot


def free_port_slot(slot: int) -> None:
    """``slot`` is free again (its collate process is gone)."""
    with _SLOTS_LOCK:
        _SLOTS.discard(slot)
