"""Open-file descriptors the collate group needs, and the soft limit raised to fit them.

Gloo connects every pair of ranks (a full mesh): a collate process holds one connection
per peer and its store connection; rank 0 also serves the TCPStore, one connection per
rank. At W = 1024 that is about 1,040 descriptors per process and about 2,070 on rank 0,
past the common default soft limit of 1,024 (``ulimit -n``), where Gloo would fail
mid-rendezvous with an opaque socket error. The collate process (ours, not the user's)
raises its own soft limit up to the hard limit before joining, and raises
:class:`DescriptorLimitError` at once when even the hard limit is too low.
"""

from __future__ import annotations

import os

from odb_core.errors import DescriptorLimitError

HEADROOM = 64
"""Descriptors kept for everything else (the dataset's files, queues, DataLoader workers' pipes)."""


def needed(world: int, rank: int) -> int:
    """Descriptors the collate group needs on ``rank``: a pair per peer and the store
    connection, twice that on rank 0 (it also serves the store), plus :data:`HEADROOM`."""
    per_peer = 2 if rank == 0 else 1
    return per_peer * world + 1 + HEADROOM


def open_count() -> int:
    """Descriptors open in this process now (Linux: ``/proc/self/fd``; else 0)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


def ensure_descriptors(world: int, rank: int) -> int:
    """Make room for the collate group's descriptors in this process: raise the soft
    ``RLIMIT_NOFILE`` (never above the hard limit) when the open descriptors plus
    :func:`needed` exceed it. Returns the soft limit in force; raises
    :class:`DescriptorLimitError` (naming the rank, the need and the hard limit) when the
    hard limit is too low. A no-op where ``resource`` does not exist (Windows)."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not on Linux
        return -1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = open_count() + needed(world, rank)
    if soft == resource.RLIM_INFINITY or want <= soft:
        return int(soft)
    if hard != resource.RLIM_INFINITY and want > hard:
        raise DescriptorLimitError(
            f"rank {rank}: the collate group of {world} ranks needs about {want} open files here, but the hard "
            f"limit is {hard} (ulimit -Hn); raise it (ulimit -n {want} before starting, or LimitNOFILE= in the "
            "job's service/container settings)", rank=rank, needed=want, limit=int(hard))
    resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    return want
