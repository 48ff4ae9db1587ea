"""Moving samples from DataLoader workers to the collate process in packed chunks.

ODB needs samples one by one (their lengths drive the grouping), but sharing each
sample's tensors separately costs one socket round trip per tensor under torch's
default ``file_descriptor`` strategy (about 0.5 ms each, measured). Workers therefore
load a chunk of consecutive sampler views, measure each sample (length and loss
tokens, in parallel across workers), and pack every tensor of the chunk into one flat
buffer per dtype: plain bytes through the pipe when the chunk is small (no shared
memory, no fd passing), a shared-memory tensor when it is large. The collate process
unpacks them into views of that buffer. Samples keep their structure, values, dtypes
and shapes; only tensors inside dicts, lists and tuples are packed, anything else
travels as is.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset

from odb_core.errors import InvalidSampleError, SampleLoadError

INLINE_BYTES = 4 << 20
"""Chunks whose tensors total at most this many bytes travel by value through the pipe."""


@dataclass(frozen=True)
class _Slot:
    """Where a packed tensor lives: its dtype's flat buffer, offset and shape."""

    dtype: torch.dtype
    offset: int
    shape: tuple[int, ...]


@dataclass
class PackedChunk:
    """A chunk of samples with their tensors moved into one flat tensor per dtype."""

    skeletons: list[Any]
    buffers: dict[torch.dtype, torch.Tensor | bytes]
    measures: list[tuple[int, int]] | None = None


class IndexedDataset(Dataset):  # type: ignore[type-arg]
    """Wraps the user's dataset so a failing ``__getitem__`` names its index (ODB's own object)."""

    def __init__(self, dataset: Dataset[Any], rank: int) -> None:
        self.dataset = dataset
        self.rank = rank

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        try:
            return self.dataset[index]
        except Exception as exc:
            raise SampleLoadError(f"rank {self.rank}: loading dataset index {index} failed: "
                                  f"{type(exc).__name__}: {exc}") from None


def _map_leaves(x: Any, leaf: Callable[[Any], Any]) -> Any:
    """Apply ``leaf`` to every leaf inside dicts, lists and (plain) tuples."""
    if isinstance(x, dict):
        return type(x)((k, _map_leaves(v, leaf)) for k, v in x.items())
    if isinstance(x, list):
        return [_map_leaves(v, leaf) for v in x]
    if isinstance(x, tuple) and not hasattr(x, "_fields"):
        return tuple(_map_leaves(v, leaf) for v in x)
    return leaf(x)


def pack(samples: list[Any]) -> PackedChunk:
    """Worker side (the DataLoader's collate_fn): pack a chunk's tensors per dtype."""
    pieces: dict[torch.dtype, list[torch.Tensor]] = {}
    sizes: dict[torch.dtype, int] = {}

    def strip(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.layout == torch.strided and x.device.type == "cpu":
            offset = sizes.get(x.dtype, 0)
            pieces.setdefault(x.dtype, []).append(x.reshape(-1))
            sizes[x.dtype] = offset + x.numel()
            return _Slot(x.dtype, offset, tuple(x.shape))
        return x

    skeletons = [_map_leaves(s, strip) for s in samples]
    flat = {dt: torch.cat(ts) for dt, ts in pieces.items()}
    if sum(t.numel() * t.element_size() for t in flat.values()) <= INLINE_BYTES:
        return PackedChunk(skeletons, {dt: ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())
                                       for dt, t in flat.items()})
    return PackedChunk(skeletons, dict(flat))


def _tensor(buffer: torch.Tensor | bytes, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(buffer, torch.Tensor):
        return buffer
    if not buffer:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(bytearray(buffer), dtype=dtype)  # a writable copy the samples own


def unpack(chunk: PackedChunk) -> list[Any]:
    """Collate-process side: rebuild the samples, their tensors as views of the chunk's buffers."""
    flat = {dt: _tensor(b, dt) for dt, b in chunk.buffers.items()}

    def fill(x: Any) -> Any:
        if isinstance(x, _Slot):
            return flat[x.dtype][x.offset : x.offset + math.prod(x.shape)].view(x.shape)
        return x

    return [_map_leaves(s, fill) for s in chunk.skeletons]


def default_length(sample: Any) -> int:
    """``len(sample["input_ids"])``."""
    return len(sample["input_ids"])


def default_loss_tokens(sample: Any, length: int) -> int:
    """Labels != -100 when the sample has ``labels``, else its length."""
    if isinstance(sample, dict) and "labels" in sample:
        labels = sample["labels"]
        if isinstance(labels, torch.Tensor):
            return int((labels != -100).sum())
        return sum(1 for x in labels if x != -100)
    return length


@dataclass
class Packer:
    """The workers' ``collate_fn``: measures each ``(index, sample)`` of a chunk, then packs it.

    A sample whose length cannot be taken raises :class:`InvalidSampleError` naming its
    dataset index (it reaches the collate process as that type).
    """

    rank: int
    length_fn: Callable[[Any], int] | None = None
    loss_tokens_fn: Callable[[Any], int] | None = None

    def measure(self, sample: Any, index: int) -> tuple[int, int]:
        try:
            length = (self.length_fn or default_length)(sample)
        except Exception as exc:
            raise InvalidSampleError(f"rank {self.rank}: sample {index} has no length "
                                     f"({type(exc).__name__}: {exc}); pass length_fn") from None
        if self.loss_tokens_fn is not None:
            tokens = self.loss_tokens_fn(sample)
        else:
            tokens = default_loss_tokens(sample, length)
        return int(length), int(tokens)

    def __call__(self, items: list[tuple[int, Any]]) -> PackedChunk:
        measures = [self.measure(sample, index) for index, sample in items]
        chunk = pack([sample for _, sample in items])
        chunk.measures = measures
        return chunk
