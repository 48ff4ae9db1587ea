"""Moving a collated batch from the collate process to the trainer in one flat buffer.

A multiprocessing queue shares each tensor of a batch separately under torch's default
``file_descriptor`` strategy: a shared-memory copy in the sender and, in the receiver, one
authenticated socket round trip per tensor to fetch its descriptor (about 1 ms each under
load, measured: most of the trainer's time per batch). :func:`pack_batch` instead copies
every plain tensor of the batch into one byte buffer (16-byte aligned slots): pickled by
value with the message when it is small (no shared memory, no descriptor), one
shared-memory tensor (one descriptor) when it is large. :func:`unpack_batch` rebuilds the
batch in the trainer with the same structure, values, dtypes and shapes; each tensor has
its own storage over the received buffer (by value) or, in a large batch, is a view of the
shared buffer (tensors under :data:`OWN_STORAGE_BYTES` are copied out of it, so keeping or
saving a small one, such as the batch's indices, holds or writes only its own bytes). A tensor
that appears several times in the batch arrives as one tensor appearing as often (views of one
base that are different tensors arrive as separate tensors). A conjugate or negative view is
resolved before packing, so its values arrive (torch's queue pickler drops those bits).
Only contiguous CPU tensors without autograd, inside exact dicts, lists and tuples and
inside the ``data`` dict of a ``collections.UserDict`` (Hugging Face's ``BatchEncoding``,
which its collators return), are packed; anything else (tensor subclasses, other mapping
subclasses, strings, numbers) travels as the queue's pickler sends it. A ``UserDict`` is
rebuilt as ``copy.copy`` of it around the unpacked ``data`` (its other attributes travel
as its pickling sends them). Moving data only: nothing here decides anything (P1-P8 are
the core's).
"""

from __future__ import annotations

import copy
from collections import UserDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

INLINE_BYTES = 4 << 20
"""Batches whose packed tensors total at most this many bytes travel by value through the pipe."""
OWN_STORAGE_BYTES = 64 << 10
"""In a shared (large) batch, tensors smaller than this are copied out of the shared buffer."""
ALIGN = 16
"""Every slot starts at a multiple of this many bytes (any dtype's element size divides it)."""


@dataclass(frozen=True)
class _Slot:
    """A packed tensor: its byte offset in the buffer, dtype and shape."""

    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass
class PackedBatch:
    """A batch with its plain tensors replaced by :class:`_Slot` and their bytes in ``buffer``
    (a ``bytearray`` sent by value, or a shared uint8 tensor)."""

    skeleton: Any
    buffer: bytearray | torch.Tensor


def _map(x: Any, leaf: Callable[[Any], Any]) -> Any:
    """Apply ``leaf`` to every leaf inside exact dicts, lists and tuples and a ``UserDict``'s
    exact ``data`` dict (other subclasses are leaves)."""
    if type(x) is dict:
        return {k: _map(v, leaf) for k, v in x.items()}
    if isinstance(x, UserDict) and type(x.data) is dict:
        out = copy.copy(x)  # UserDict.__copy__: the instance's attributes, not its data, shared
        out.data = {k: _map(v, leaf) for k, v in x.data.items()}
        return out
    if type(x) is list:
        return [_map(v, leaf) for v in x]
    if type(x) is tuple:
        return tuple(_map(v, leaf) for v in x)
    return leaf(x)


def _packable(x: Any) -> bool:
    return (type(x) is torch.Tensor and x.layout == torch.strided and x.device.type == "cpu"
            and not x.requires_grad and not x.is_quantized and x.is_contiguous())


def pack_batch(batch: Any) -> PackedBatch:
    """Collate-process side: one buffer holding every packable tensor of ``batch``."""
    tensors: list[tuple[int, torch.Tensor]] = []
    seen: dict[int, _Slot] = {}  # id of a tensor already packed -> its slot (one slot, one tensor again)
    size = 0

    def strip(x: Any) -> Any:
        nonlocal size
        if id(x) in seen:
            return seen[id(x)]
        if not _packable(x):
            return x
        key = id(x)
        if x.is_conj() or x.is_neg():  # lazy views: their bytes are not their values
            x = x.resolve_conj().resolve_neg()
        tensors.append((size, x))
        slot = seen[key] = _Slot(size, x.dtype, tuple(x.shape))
        size += -(-x.numel() * x.element_size() // ALIGN) * ALIGN
        return slot

    skeleton = _map(batch, strip)
    if size <= INLINE_BYTES:
        raw = bytearray(size)
        flat = torch.frombuffer(raw, dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)
        buffer: bytearray | torch.Tensor = raw
    else:
        flat = buffer = torch.empty(size, dtype=torch.uint8).share_memory_()  # type: ignore[no-untyped-call]
    for offset, t in tensors:
        nbytes = t.numel() * t.element_size()
        if nbytes:
            src = t.reshape(-1)
            if src.stride(0) != 1:  # a one-element view of a wider storage (a complex tensor's .real): contiguous,
                src = src.clone(memory_format=torch.contiguous_format)  # yet its stride forbids a byte view
            flat[offset : offset + nbytes].copy_(src.view(torch.uint8))
    return PackedBatch(skeleton, buffer)


def unpack_batch(packed: PackedBatch) -> Any:
    """Trainer side: the batch :func:`pack_batch` packed (no copy of the received bytes)."""
    buffer = packed.buffer
    made: dict[int, torch.Tensor] = {}  # id of a slot -> its tensor (a slot met twice: the same tensor)

    def fill(x: Any) -> Any:
        if not isinstance(x, _Slot):
            return x
        if id(x) not in made:
            made[id(x)] = _tensor(buffer, x)
        return made[id(x)]

    return _map(packed.skeleton, fill)


def _tensor(buffer: bytearray | torch.Tensor, x: _Slot) -> torch.Tensor:
    count = 1
    for d in x.shape:
        count *= d
    if count == 0:
        return torch.empty(x.shape, dtype=x.dtype)
    if isinstance(buffer, torch.Tensor):
        nbytes = count * x.dtype.itemsize
        view = buffer[x.offset : x.offset + nbytes].view(x.dtype).view(x.shape)
        return view.clone() if nbytes < OWN_STORAGE_BYTES else view
    return torch.frombuffer(buffer, dtype=x.dtype, count=count, offset=x.offset).view(x.shape)
