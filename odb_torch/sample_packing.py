"""Moving samples from DataLoader workers to the collate process in packed chunks.

ODB needs samples one by one (their lengths drive the grouping), but sharing each
sample's tensors separately costs one socket round trip per tensor under torch's
default ``file_descriptor`` strategy (about 0.5 ms each, measured). Workers therefore
load a chunk of consecutive sampler views, measure each sample (length and loss
tokens, in parallel across workers), and pack the chunk: uniform plain dicts as columns, one
buffer per tensor field (:mod:`odb_torch.chunk_columns`), anything else with every tensor
moved into one flat buffer per dtype. Buffers go as plain bytes through the pipe when the
chunk is small (no shared memory, no fd passing), as shared-memory tensors when it is large.
The collate process unpacks them into views of those buffers. Samples keep their structure,
values, dtypes and shapes; only tensors inside dicts, lists and tuples are packed, anything
else travels as is.
"""

from __future__ import annotations

import copy
import ctypes
import numbers
import operator
import reprlib
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import Dataset

from odb_core.errors import InvalidSampleError, ODBError, SampleLoadError
from odb_torch.chunk_columns import Column, column_measures, columns_of, inline, rows_of
from odb_torch.collate import holds_counts
from odb_torch.losses import signed_labels

INLINE_BYTES = 4 << 20
"""Chunks whose tensors total at most this many bytes travel by value through the pipe (columns
or per-dtype buffers alike); larger ones as shared tensors, one per dtype."""


@dataclass(frozen=True)
class _Slot:
    """Where a packed tensor was: its dtype, its index among that dtype's slots of the chunk
    (``PackedChunk.sizes`` holds their element counts, in the order of the flat buffer) and
    its shape."""

    dtype: torch.dtype
    index: int
    shape: tuple[int, ...]


@dataclass
class PackedChunk:
    """A chunk of samples with their tensors moved into one flat tensor per dtype, or the
    typed ``error`` that loading or measuring one of its samples raised (sent as a value:
    an exception raised in a DataLoader worker reaches the collate process rebuilt from
    its message, without its ``rank`` and ``indices``)."""

    skeletons: list[Any]
    buffers: dict[torch.dtype, torch.Tensor | bytes]
    sizes: dict[torch.dtype, list[int]] = field(default_factory=dict)
    """Per dtype, the element count of each of its slots, in traversal order."""
    measures: list[tuple[int, int]] | None = None
    error: ODBError | None = None
    columns: list[Column] | None = None
    """A chunk of uniform dict samples as columns (:mod:`odb_torch.chunk_columns`): then
    ``skeletons`` and ``buffers`` are empty and ``count`` says how many samples it holds."""
    count: int = 0


@dataclass(frozen=True)
class LoadFailed:
    """What :class:`IndexedDataset` returns for a sample whose ``__getitem__`` raised."""

    error: SampleLoadError


def describe_exception(exc: BaseException) -> str:
    """``Type: message`` and the traceback of the user's code that raised it."""
    return "".join(traceback.format_exception(exc)).rstrip()


def cause_line(exc: BaseException) -> str:
    """``Type: message`` of what failed, on one line (a peer's ``PeerError`` quotes the first line):
    for an error a DataLoader worker raised, re-raised as "Caught X in DataLoader worker process k."
    with the original traceback after it, that traceback's last line."""
    lines = [line for line in str(exc).splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].startswith("Caught ") and "DataLoader worker" in lines[0]:
        return lines[-1].strip()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


class IndexedDataset(Dataset):  # type: ignore[type-arg]
    """Wraps the user's dataset so a failing ``__getitem__`` is a :class:`LoadFailed`
    naming its index and rank (ODB's own object; the user's dataset is not touched)."""

    def __init__(self, dataset: Dataset[Any], rank: int) -> None:
        self.dataset = dataset
        self.rank = rank

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        try:
            return self.dataset[index]
        except Exception as exc:
            return LoadFailed(SampleLoadError(
                f"rank {self.rank}: loading dataset index {index} failed: {type(exc).__name__}: {exc}\n"
                f"{describe_exception(exc)}", rank=self.rank, indices=(index,)))


def _map_leaves(x: Any, leaf: Callable[[Any], Any]) -> Any:
    """Apply ``leaf`` to every leaf inside dicts, lists and (plain) tuples."""
    kind = type(x)
    if kind is torch.Tensor or kind is _Slot or kind is int:  # the common leaves, without the checks below
        return leaf(x)
    if kind is dict:
        return {k: _map_leaves(v, leaf) for k, v in x.items()}
    if isinstance(x, dict):  # a copy keeps a subclass's own state (a defaultdict's factory), then new values
        out = copy.copy(x)
        for k, v in x.items():
            out[k] = _map_leaves(v, leaf)
        return out
    if isinstance(x, list):
        return [_map_leaves(v, leaf) for v in x]
    if isinstance(x, tuple) and not hasattr(x, "_fields"):
        return tuple(_map_leaves(v, leaf) for v in x)
    return leaf(x)


def pack(samples: list[Any]) -> PackedChunk:
    """Worker side (the DataLoader's collate_fn): a chunk of uniform dict samples as columns
    (:func:`odb_torch.chunk_columns.columns_of`), anything else with its tensors packed per dtype."""
    return _pack(samples, columns_of(samples))


def _pack(samples: list[Any], columns: list[Column] | None) -> PackedChunk:
    """``samples`` as their ``columns`` (:func:`~odb_torch.chunk_columns.columns_of`), or packed per
    dtype when there are none."""
    if columns is None:
        return _pack_leaves(samples)
    inline(columns, INLINE_BYTES)
    return PackedChunk([], {}, columns=columns, count=len(samples))


def _pack_leaves(samples: list[Any]) -> PackedChunk:
    """Every tensor inside dicts, lists and tuples moved into one flat buffer per dtype."""
    pieces: dict[torch.dtype, list[torch.Tensor]] = {}

    def strip(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.layout == torch.strided and x.device.type == "cpu":
            same = pieces.setdefault(x.dtype, [])
            same.append(x if x.dim() == 1 else x.reshape(-1))
            return _Slot(x.dtype, len(same) - 1, tuple(x.shape))
        return x

    skeletons = [_map_leaves(s, strip) for s in samples]
    sizes = {dt: [t.numel() for t in ts] for dt, ts in pieces.items()}
    with torch.no_grad():  # values only: a tensor that requires grad would not pickle (a large chunk)
        flat = {dt: torch.cat(ts) for dt, ts in pieces.items()}
    if sum(t.numel() * t.element_size() for t in flat.values()) <= INLINE_BYTES:
        return PackedChunk(skeletons, {dt: ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())
                                       for dt, t in flat.items()}, sizes)
    return PackedChunk(skeletons, dict(flat), sizes)


def _tensor(buffer: torch.Tensor | bytes, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(buffer, torch.Tensor):
        return buffer
    if not buffer:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(bytearray(buffer), dtype=dtype)  # a writable copy the samples own


def unpack(chunk: PackedChunk) -> list[Any]:
    """Collate-process side: rebuild the samples, their tensors as views of the chunk's buffers
    (one split per dtype makes every view of it at once)."""
    if chunk.columns is not None:
        return rows_of(chunk.columns, chunk.count)
    parts = {dt: _tensor(b, dt).split_with_sizes(chunk.sizes[dt]) for dt, b in chunk.buffers.items()}

    def fill(x: Any) -> Any:
        if type(x) is _Slot:
            # detached: a collate_fn may edit a sample in place, even with an operand that requires grad
            # (autograd forbids that on the outputs of a split, which are views of one node)
            part = parts[x.dtype][x.index].detach()
            return part if len(x.shape) == 1 else part.view(x.shape)
        return x

    return [_map_leaves(s, fill) for s in chunk.skeletons]


def default_length(sample: Any) -> int:
    """``len(sample["input_ids"])`` of a 1-D sequence of token ids; a ValueError naming the field
    for anything else (a tokenizer's ``return_tensors="pt"`` row of shape ``[1, L]`` would
    otherwise count as one token, a string as its characters; a float or bool tensor holds no
    token ids)."""
    ids = sample["input_ids"]
    ndim = getattr(ids, "ndim", 1)  # tensors and arrays say their dimensions
    if ndim != 1:
        raise ValueError(f"input_ids has shape {list(ids.shape)}, not one row of token ids (squeeze a "
                         "tokenizer's batch dimension)")
    if isinstance(ids, torch.Tensor):
        if ids.numel() and not holds_counts(ids.dtype):
            raise ValueError(f"input_ids are {ids.dtype}, not integer token ids")
        return ids.shape[0]
    if isinstance(ids, (str, bytes)) or (len(ids) and not _is_index(ids[0])):
        raise ValueError(f"input_ids is a {type(ids).__name__} starting {reprlib.repr(ids[0] if len(ids) else ids)}, "
                         "not one row of token ids")
    return len(ids)


def _is_index(value: Any) -> bool:
    """An integer token id: anything ``operator.index`` takes (ints, NumPy integers and 0-d integer
    arrays, 0-d integer tensors)."""
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def default_loss_tokens(sample: Any, length: int) -> int:
    """Labels != -100 when the sample has ``labels``, else its length (compared as the collates
    cast them, int64: an unsigned label never wraps onto -100)."""
    if isinstance(sample, dict) and "labels" in sample:
        labels = sample["labels"]
        if isinstance(labels, torch.Tensor):
            return int(signed_labels(labels).ne(-100).sum())
        return sum(1 for x in labels if x != -100)
    return length


def _countable_labels(sample: Any) -> torch.Tensor | None:
    """``sample``'s ``labels`` if :func:`label_counts` counts them (a plain CPU tensor of a real,
    non-bool dtype), else None (:func:`default_loss_tokens` counts those one by one)."""
    if not isinstance(sample, dict) or "labels" not in sample:
        return None
    labels = sample["labels"]
    if (type(labels) is not torch.Tensor or labels.layout != torch.strided or labels.device.type != "cpu"
            or labels.is_quantized or labels.dtype.is_complex or labels.dtype == torch.bool):
        return None
    return labels


def label_counts(samples: list[Any]) -> list[int | None]:
    """Per sample, what :func:`default_loss_tokens` counts (labels != -100) for tensor
    ``labels``, with a few tensor operations per dtype for the whole chunk instead of three
    per sample; None where it does not apply, and for every sample if counting fails (each
    is then counted alone, and a sample that cannot be is reported by name)."""
    try:
        return _label_counts(samples)
    except Exception:
        return [None] * len(samples)


def _label_counts(samples: list[Any]) -> list[int | None]:
    counts: list[int | None] = [None] * len(samples)
    by_dtype: dict[torch.dtype, list[tuple[int, torch.Tensor]]] = {}
    for k, sample in enumerate(samples):
        labels = _countable_labels(sample)
        if labels is not None:
            by_dtype.setdefault(labels.dtype, []).append((k, labels.reshape(-1)))
    for rows in by_dtype.values():
        bounds = [0]
        for _, row in rows:
            bounds.append(bounds[-1] + row.shape[0])
        kept = torch.cat([torch.zeros(1, dtype=torch.int64), signed_labels(torch.cat([r for _, r in rows])).ne(-100).cumsum(0)])
        at = kept[torch.tensor(bounds)].tolist()
        for j, (k, _) in enumerate(rows):
            counts[k] = at[j + 1] - at[j]
    return counts


def as_count(value: object) -> int | None:
    """``value`` as an int if it is an integer (a Python or NumPy int, or a one-element
    integer tensor), else None. Floats, strings, bools and None are not counts."""
    if type(value) is int:  # the common case, without the ABC checks below
        return value
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or not holds_counts(value.dtype):
            return None
        return int(value.item())
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return None
    return int(value)


@dataclass
class Packer:
    """The workers' ``collate_fn``: measures each ``(index, sample)`` of a chunk, then packs it.

    A length that is not an integer >= 0, a loss-token count that is not an integer in
    [0, length], or a failing ``length_fn``/``loss_tokens_fn`` is an
    :class:`InvalidSampleError` naming the sample's dataset index and the rank; a failed
    ``__getitem__`` (:class:`LoadFailed`) its :class:`SampleLoadError`. Either is returned
    as the chunk's ``error``, never raised in the worker (so it keeps its attributes).
    """

    rank: int
    length_fn: Callable[[Any], int] | None = None
    loss_tokens_fn: Callable[[Any], int] | None = None

    def _invalid(self, index: int, problem: str) -> InvalidSampleError:
        return InvalidSampleError(f"rank {self.rank}: sample {index} {problem}", rank=self.rank, indices=(index,))

    def measure(self, sample: Any, index: int, label_count: int | None = None) -> tuple[int, int]:
        """(length, loss tokens) of one sample; raises :class:`InvalidSampleError` naming it.
        ``label_count``: the default loss-token count, counted already (:func:`label_counts`)."""
        try:
            raw = (self.length_fn or default_length)(sample)
        except Exception as exc:
            raise self._invalid(index, f"has no length ({type(exc).__name__}: {exc}); pass length_fn") from None
        length = as_count(raw)
        if length is None or length < 0:
            raise self._invalid(index, f"has length {raw!r} ({type(raw).__name__}); length_fn must return an "
                                       "int >= 0")
        try:
            raw = (self.loss_tokens_fn(sample) if self.loss_tokens_fn is not None
                   else label_count if label_count is not None else default_loss_tokens(sample, length))
        except Exception as exc:
            raise self._invalid(index, f"has no loss-token count ({type(exc).__name__}: {exc})") from None
        tokens = as_count(raw)
        if tokens is None or not 0 <= tokens <= length:
            if self.loss_tokens_fn is None:
                raise self._invalid(index, f"has {raw!r} loss tokens (its labels other than -100, the default count) "
                                           f"for length {length}; its labels need no more of them than its length")
            raise self._invalid(index, f"has {raw!r} loss tokens ({type(raw).__name__}) for length {length}; "
                                       "loss_tokens_fn must return an int in [0, length]")
        return length, tokens

    def __call__(self, items: list[tuple[int, Any]]) -> PackedChunk:
        samples = [sample for _, sample in items]
        try:
            for sample in samples:
                if isinstance(sample, LoadFailed):
                    raise sample.error
            columns, measures = self._columns_and_measures(items, samples)
        except ODBError as exc:
            return PackedChunk([], {}, error=exc)
        chunk = _pack(samples, columns)
        chunk.measures = measures
        return chunk

    def _columns_and_measures(self, items: list[tuple[int, Any]],
                              samples: list[Any]) -> tuple[list[Column] | None, list[tuple[int, int]]]:
        """The chunk's columns (None: the general packing) and every sample's (length, loss tokens):
        by whole columns where the default rules apply to them
        (:func:`~odb_torch.chunk_columns.column_measures`), else sample by sample. A user's
        ``length_fn`` or ``loss_tokens_fn`` runs before the columns copy the samples, so what it
        does to a sample travels with it, as in the general packing."""
        if self.length_fn is None and self.loss_tokens_fn is None:
            columns = columns_of(samples)
            measures = column_measures(columns, len(items)) if columns is not None else None
            return columns, measures if measures is not None else self._each(items, samples)
        measures = self._each(items, samples)  # first: the user's functions may change the samples
        return columns_of(samples), measures

    def _each(self, items: list[tuple[int, Any]], samples: list[Any]) -> list[tuple[int, int]]:
        """Every sample's (length, loss tokens), measured one by one (:meth:`measure`)."""
        counted = label_counts(samples) if self.loss_tokens_fn is None else [None] * len(items)
        return [self.measure(sample, index, n) for (index, sample), n in zip(items, counted)]
