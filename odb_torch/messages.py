"""The messages between a rank's trainer process (the loader) and its collate process.

Frozen dataclasses, pickled by :func:`encode` in the sender (so a batch that cannot be
pickled is an error there, not a silent loss) and put as bytes on two multiprocessing
queues: ``ctrl`` carries
:class:`StartEpoch` and :class:`Stop` from the loader; ``out`` carries :class:`Batch`,
:class:`EpochEnd` and :class:`Failure` back. A failure carries the exception object
itself (every :class:`~odb_core.errors.ODBError` pickles with its ``rank`` and
``indices``), so the trainer raises exactly what the collate process raised.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from multiprocessing.reduction import ForkingPickler
from typing import Any

from odb_core.errors import ODBError
from odb_torch.batch_transfer import PackedBatch, pack_batch, unpack_batch
from odb_torch.step_info import StepInfo


@dataclass(frozen=True)
class StartEpoch:
    """Serve one epoch: ``skip`` holds sampler positions already consumed (resume) and
    ``first_step`` the number of the first step; ``serial`` counts the epochs this loader
    started (the same on every rank; it names the run's trace files)."""

    epoch: int
    skip: tuple[int, ...]
    first_step: int
    serial: int
    resume: dict[str, Any] | None = None
    """A stream resumed from its dataset's state: the resume point (``stream_loading``)."""
    consumed_ids: tuple[int, ...] = ()
    """A stream with ``element_id``: the identities of the ``skip`` positions, in order."""
    tail: tuple[int, tuple[int, ...]] | None = None
    """A pooled epoch resumed mid-epoch: the pool's cursor and this rank's claims at the
    checkpoint (:class:`odb_core.tail.TailPosition`)."""
    order: str | None = None
    """A resumed epoch: the digest of the sampler order its state's positions index
    (:func:`odb_core.elastic.resumed_order`); the collate process refuses another order."""


@dataclass(frozen=True)
class Stop:
    """Leave the epoch (if any) and exit."""


@dataclass(frozen=True)
class Batch:
    """One step: what ``collate_fn`` returned, its step info, and the step's samples as
    positions in the epoch's sampler order (for ``state_dict``)."""

    batch: Any
    info: StepInfo
    positions: tuple[int, ...]
    resume: dict[str, Any] | None = None
    """A stream over a resumable dataset: the resume point after this batch (``stream_loading``)."""
    tail: tuple[int, tuple[int, ...]] | None = None
    """A pooled epoch: the pool's cursor after this batch's round and the pool views this rank
    claimed since its previous batch (for ``state_dict``)."""
    order: str | None = None
    """The digest of the epoch's sampler order the positions index (map-style samplers; for ``state_dict``)."""


@dataclass(frozen=True)
class EpochEnd:
    """This rank's loop over ``epoch`` ends here (every later item of the epoch is idle,
    or the epoch is over)."""

    epoch: int
    steps: int | None = None
    """The epoch's step count (idle included), sent when the epoch is over; None when this
    rank's loop ended early (``skip_idle``): a second ``EpochEnd`` with the count follows once
    every rank's is over (``state_dict`` reads it: the epoch's end is one step boundary, P2)."""


@dataclass(frozen=True)
class Failure:
    """The collate process failed with ``error``; it stays until told to stop."""

    error: ODBError


Command = StartEpoch | Stop
Reply = Batch | EpochEnd | Failure


def encode(item: Reply) -> bytes:
    """Pickle ``item`` as a multiprocessing queue would, but now, in the sender, so a value
    that cannot be pickled raises here instead of vanishing in the queue's feeder thread.
    A batch's tensors go in one flat buffer (:mod:`odb_torch.batch_transfer`): pickled once,
    here, by value or as one shared tensor. Put the bytes on the queue; :func:`decode` on
    the other end."""
    if isinstance(item, Batch):
        item = replace(item, batch=pack_batch(item.batch))
    return bytes(ForkingPickler.dumps(item))


def decode(payload: bytes) -> Reply:
    """The reply :func:`encode` pickled."""
    item = ForkingPickler.loads(payload)
    if not isinstance(item, (Batch, EpochEnd, Failure)):
        raise TypeError(f"unexpected message {item!r}")
    if isinstance(item, Batch) and isinstance(item.batch, PackedBatch):
        return replace(item, batch=unpack_batch(item.batch))
    return item
