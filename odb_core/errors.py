"""Every exception ODB raises, defined in one place.

All derive from :class:`ODBError`, so ``except ODBError`` catches anything the
protocol core or the adapter raises on purpose.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def _rebuild(cls: type[ODBError], args: tuple[Any, ...], state: dict[str, Any]) -> ODBError:
    exc = cls.__new__(cls)
    Exception.__init__(exc, *args)
    exc.__dict__.update(state)
    return exc


class ODBError(Exception):
    """Base class of every error raised on purpose by ODB.

    ``rank`` is the rank the error is about (``None`` when not rank-specific) and
    ``indices`` the dataset indices involved (empty when none). Instances pickle with
    their attributes, so the collate process sends the error object itself.
    """

    def __init__(self, message: str = "", *, rank: int | None = None, indices: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.rank = rank
        self.indices = tuple(int(i) for i in indices)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.args, dict(self.__dict__)))


class InvalidSampleError(ODBError, ValueError):
    """A sample's length or loss-token count is unusable; the message names the sample."""


class WireFormatError(ODBError, ValueError):
    """A gathered vector is malformed: wrong length, out-of-range or negative field."""


class PeerInconsistencyError(ODBError):
    """A peer's gathered vector is well-formed but contradicts itself or the round.

    Examples: a rank reports ``finished`` while holding samples, reports more groups
    than samples, or is in a different round or iteration than we are.
    """


class ProtocolStateError(ODBError, RuntimeError):
    """The caller drove the sans-IO state machine out of order (e.g. two headers in a row)."""


class RoundBoundError(ProtocolStateError):
    """A simulated logical iteration ran past its round bound (``simulate``'s ``max_rounds``):
    it would not terminate (P6)."""


class NonJoinStalledError(ODBError, RuntimeError):
    """Non-join quota chaining cannot make progress: a logical iteration emitted nothing.

    Happens when some rank's shard is empty: it reports ``finished`` at once and, in
    non-join mode, ends every logical iteration before anything is emitted (P6 would fail).
    """


class SampleLoadError(ODBError):
    """Loading a sample failed (``__getitem__`` raised or a worker died); names the index and rank."""


class CollateFnError(ODBError):
    """The user's ``collate_fn`` raised; names the dataset indices of the group and the rank."""


class LoaderStateError(ODBError, RuntimeError):
    """The loader was driven out of order: ``next()`` on an iterator after ``close()``, or
    on an iterator superseded by a newer ``iter(loader)`` (one live iterator per loader)."""


class PinMemoryError(ODBError, RuntimeError):
    """Page-locking a batch in the trainer failed (``pin_memory=True``: page-locked memory
    exhausted, a driver error); names the rank and the batch's dataset indices. The batch was not
    yielded, and the loader's position is before it (a resume serves it again)."""


class CollateProcessError(ODBError):
    """A rank's collate process died or could not start; names the rank and exit code."""


class StartMethodError(CollateProcessError):
    """The collate process cannot start with the chosen ``start_method`` (``spawn`` or
    ``forkserver`` re-import the script that started training): raised on every rank before
    any process starts; the message names the cause and the fix."""


class DescriptorLimitError(CollateProcessError):
    """The collate group of W ranks needs more open files than the hard ``RLIMIT_NOFILE``
    allows on this rank (raised by its collate process before it joins the group);
    ``needed`` and ``limit`` are the two counts."""

    def __init__(self, message: str = "", *, rank: int | None = None, needed: int = 0, limit: int = 0) -> None:
        super().__init__(message, rank=rank)
        self.needed, self.limit = needed, limit


class PeerError(ODBError):
    """A collective of the collate group failed: a peer rank died, or a straggler exceeded the
    timeout. ``ranks``: the peers that reported a failure of their own before (their error named
    in the message); empty when none could (a peer killed, or rank 0's store gone with it)."""

    def __init__(self, message: str = "", *, rank: int | None = None, ranks: Sequence[int] = ()) -> None:
        super().__init__(message, rank=rank)
        self.ranks = tuple(ranks)


class LossTokenMismatchError(ODBError, ValueError):
    """A trainer adapter's loss summed over a different number of tokens than the loader
    measured (``loss_tokens_fn``), so the exact loss weights (P7) would be wrong; names the
    dataset indices and both counts."""


class PackedAttentionError(ODBError, ValueError):
    """A model whose attention would let the sequences of a packed (padding-free) row
    attend to each other (P7's per-sequence loss would silently change); ``model_class``
    and ``attn_implementation`` name the combination, the message the fix."""

    def __init__(self, message: str = "", *, model_class: str = "", attn_implementation: str = "") -> None:
        super().__init__(message)
        self.model_class, self.attn_implementation = model_class, attn_implementation


class ODBWarning(UserWarning):
    """Base class of ODB's warnings: what it warns of is correct, but not what the user meant
    or costs more than it has to."""


class PackedAttentionCostWarning(ODBWarning):
    """Packed rows under ``eager`` or ``sdpa`` on an accelerator: the sequences stay apart (a
    dense ``L_max x L_max`` mask), but attention then costs the square of the row, not the sum
    of the sequences' squares (0.54x the padded budget's samples/s on an H200,
    ``docs/packing.md``); ``model_class`` and ``attn_implementation`` name the combination."""

    def __init__(self, message: str = "", *, model_class: str = "", attn_implementation: str = "") -> None:
        super().__init__(message)
        self.model_class, self.attn_implementation = model_class, attn_implementation


class CheckpointStateError(ODBError, ValueError):
    """A checkpoint lacks ODB's loader state for this rank, or holds one that does not fit
    this run (rank, world size, seed, accumulation steps); names the file. ``ranks``: the
    ranks whose state could not be loaded, when known (a peer's, as this rank learns it)."""

    def __init__(self, message: str = "", *, rank: int | None = None, indices: Sequence[int] = (),
                 ranks: Sequence[int] = ()) -> None:
        super().__init__(message, rank=rank, indices=indices)
        self.ranks = tuple(ranks)


class UnsupportedSettingError(ODBError, ValueError):
    """A setting ODB cannot honour soundly (a TRL option such as ``packing``, a DataLoader
    field such as ``batch_sampler``), refused before anything starts rather than silently
    dropped; ``field`` names the first such setting, ``fields`` all of them, and the message
    says why and what to do instead."""

    def __init__(self, message: str = "", *, field: str = "", fields: Sequence[str] = (),
                 rank: int | None = None) -> None:
        super().__init__(message, rank=rank)
        self.fields = tuple(fields) or ((field,) if field else ())
        self.field = field or (self.fields[0] if self.fields else "")


class ConfigMismatchError(ODBError):
    """Ranks disagree on the protocol configuration, the epoch or the sampler (raised on every
    rank at the epoch's first gather, before any batch); ``field`` names what differs and
    ``ranks`` the ranks whose value differs from this rank's."""

    def __init__(self, message: str = "", *, rank: int | None = None, field: str = "",
                 ranks: Sequence[int] = ()) -> None:
        super().__init__(message, rank=rank)
        self.field = field
        self.ranks = tuple(ranks)


class ResumeStateError(CheckpointStateError):
    """Loader states cannot be merged into one sound global state for an elastic resume
    (a rank missing or twice, ranks disagreeing on the epoch, steps or seed, a position
    consumed twice or out of range); ``field`` names what is wrong, ``ranks`` the ranks
    involved (this ``rank`` when none are given: its own state) and ``indices`` the offending
    positions."""

    def __init__(self, message: str = "", *, field: str = "", ranks: Sequence[int] = (),
                 indices: Sequence[int] = (), rank: int | None = None) -> None:
        super().__init__(message, rank=rank, indices=indices)
        self.field = field
        self.ranks = tuple(ranks) or ((rank,) if rank is not None else ())
