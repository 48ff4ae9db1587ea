"""A chunk of uniform dict samples moved as columns: one flat buffer per tensor field.

Most datasets return the same plain dict for every sample (``input_ids``, ``labels``, an
index, ...). For such a chunk the workers send each field once: a tensor field as one flat
buffer of its values with every sample's element count (and shape, unless every value is
1-D), any other field as the list of its values. That replaces a skeleton per sample with a
marker per tensor, and the walks that build and rebuild it, by a few operations per field
(:mod:`odb_torch.sample_packing` keeps the general form for everything else). The collate
process rebuilds each sample as a dict of the same keys in the same order, every tensor a
view of a writable copy of its field's buffer (in a chunk too large to send by value, one
shared buffer per dtype). Moving data only: nothing here decides
anything (P1-P8 are the core's).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import torch

from odb_torch.collate import holds_counts
from odb_torch.losses import signed_labels

PLAIN_VALUES = (int, float, str, bytes, bool, type(None))
"""Field values that travel as they are (the queue pickles them): nothing inside to pack."""


@dataclass
class Column:
    """One field of a chunk: ``values`` as they are, or (``dtype`` set) every sample's tensor
    flattened in sample order into ``buffer`` from ``offset`` on (the fields of one dtype share
    one buffer in a chunk too large to send by value), ``sizes`` their element counts and ``shapes`` their shapes (None when every
    one is 1-D: its size is its shape)."""

    key: Any
    values: list[Any] | None = None
    dtype: torch.dtype | None = None
    buffer: torch.Tensor | bytes | None = None
    sizes: list[int] | None = None
    shapes: list[tuple[int, ...]] | None = None
    offset: int = 0

    def flat(self) -> torch.Tensor:
        """This tensor field's elements, in sample order (its part of a tensor ``buffer``)."""
        assert isinstance(self.buffer, torch.Tensor) and self.sizes is not None
        return self.buffer.narrow(0, self.offset, sum(self.sizes))


def columns_of(samples: list[Any]) -> list[Column] | None:
    """``samples`` as columns if every one is an exact ``dict`` with the same keys (of the same
    types) in the same order and each field holds, in every sample, plain CPU tensors of one
    dtype or plain values (:data:`PLAIN_VALUES`); else None (the general packing applies)."""
    if not samples or type(samples[0]) is not dict:
        return None
    keys = tuple(samples[0])
    kinds = tuple(map(type, keys))  # equal keys of other types (1 and True) stay each sample's own
    for s in samples:
        if type(s) is not dict or tuple(s) != keys or tuple(map(type, s)) != kinds:
            return None
    columns, tensors = [], []
    for key in keys:
        values = [s[key] for s in samples]
        column = _tensor_column(key, values) if type(values[0]) is torch.Tensor else None
        if column is None:
            if not all(isinstance(v, PLAIN_VALUES) for v in values):
                return None
            column = Column(key, values=values)
        else:
            tensors.append((column, values))
        columns.append(column)
    for column, values in tensors:  # copied once every field qualifies (else the general packing copies)
        with torch.no_grad():  # values only: a value that requires grad is sent as its values
            column.buffer = torch.cat(values if column.shapes is None else [v.reshape(-1) for v in values])
    return columns


def _tensor_column(key: Any, values: list[Any]) -> Column | None:
    """``values`` as a tensor column, its buffer still to fill, if every one is a plain strided
    CPU tensor (not quantized) of the first one's dtype, else None."""
    first, strided = values[0], torch.strided
    dtype = first.dtype
    if first.is_quantized:  # a quantized dtype: every value of this dtype is quantized
        return None
    flat, sizes = True, []
    for v in values:
        if type(v) is not torch.Tensor or v.dtype != dtype or not v.is_cpu or v.layout != strided:
            return None
        flat = flat and v.dim() == 1
        sizes.append(v.numel())
    return Column(key, dtype=dtype, sizes=sizes, shapes=None if flat else [tuple(v.shape) for v in values])


def column_measures(columns: list[Column], count: int) -> list[tuple[int, int]] | None:
    """Every sample's (length, loss tokens) by the default rules (``default_length``,
    ``default_loss_tokens``) when they apply to whole columns: ``input_ids`` 1-D tensors of an
    integer dtype, and ``labels`` (if any) tensors of a countable dtype. None otherwise, and
    when a count is out of range (the sample-by-sample measure then names the sample)."""
    by_key = {c.key: c for c in columns}
    ids, labels = by_key.get("input_ids"), by_key.get("labels")
    if ids is None or ids.dtype is None or ids.shapes is not None or not holds_counts(ids.dtype):
        return None
    assert ids.sizes is not None
    lengths = ids.sizes
    if labels is None:
        return [(n, n) for n in lengths]
    if labels.dtype is None or labels.dtype == torch.bool or labels.dtype.is_complex:
        return None
    assert labels.sizes is not None
    kept = torch.zeros(count + 1, dtype=torch.int64)
    marks = signed_labels(labels.flat()).ne(-100).cumsum(0)
    ends = torch.tensor(labels.sizes, dtype=torch.int64).cumsum(0)
    if marks.numel():
        kept[1:] = marks[(ends - 1).clamp(min=0)] * (ends > 0)
    tokens = kept.diff().tolist()
    if any(not 0 <= t <= n for t, n in zip(tokens, lengths)):
        return None
    return list(zip(lengths, tokens))


def inline(columns: list[Column], limit: int) -> None:
    """Every tensor buffer as bytes (sent through the pipe by value) when they total at most
    ``limit`` bytes; else one tensor per dtype, which the queue shares once (a shared tensor
    costs a descriptor's round trip: one per dtype, not one per field)."""
    tensors = [c for c in columns if isinstance(c.buffer, torch.Tensor)]
    if sum(c.flat().nbytes for c in tensors) > limit:
        by_dtype: dict[torch.dtype | None, list[Column]] = {}
        for c in tensors:
            by_dtype.setdefault(c.dtype, []).append(c)
        for same in (cs for cs in by_dtype.values() if len(cs) > 1):
            buffer, offset = torch.cat([c.flat() for c in same]), 0
            for c in same:
                c.buffer, c.offset = buffer, offset
                offset += sum(c.sizes or ())
        return
    for c in tensors:
        t = c.flat()
        c.buffer, c.offset = ctypes.string_at(t.data_ptr(), t.nbytes) if t.numel() else b"", 0


def rows_of(columns: list[Column], count: int) -> list[dict[Any, Any]]:
    """The ``count`` samples of ``columns``, each a dict of the fields in their order; tensors are
    detached views of a writable copy of their field's buffer (of the shared buffer, in a large
    chunk), each sample's its own (a ``collate_fn`` may edit them in place, also with an operand
    that requires grad)."""
    if not columns:
        return [{} for _ in range(count)]
    fields: list[list[Any]] = []
    for c in columns:
        if c.dtype is None:
            assert c.values is not None
            fields.append(c.values)
            continue
        assert c.buffer is not None and c.sizes is not None
        if isinstance(c.buffer, torch.Tensor):  # shared by the fields of its dtype (a large chunk)
            base = c.buffer
        else:  # bytes: each field's own copy (equal small bytes may be one object: b"", b"\x01")
            base = torch.frombuffer(bytearray(c.buffer), dtype=c.dtype) if c.buffer else torch.empty(0, dtype=c.dtype)
        parts = base.narrow(0, c.offset, sum(c.sizes)).split_with_sizes(c.sizes)
        if c.shapes is None:
            fields.append([p.detach() for p in parts])
        else:
            fields.append([p.detach().view(s) for p, s in zip(parts, c.shapes)])
    keys = [c.key for c in columns]
    return [dict(zip(keys, row)) for row in zip(*fields)]
