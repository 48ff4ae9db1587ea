"""A padding ``collate_fn`` for token samples (optional: any collate_fn works with ODB,
Hugging Face's data collators included: ``tests/test_hf_collators.py``)."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import default_collate

from odb_core.errors import InvalidSampleError

#: fields padded to the batch's longest sample, and their fill values by default
PADDED = ("input_ids", "labels", "attention_mask")

#: padded fields whose integer rows become int64 (what embeddings and losses take, as in ``packed_collate``)
TOKEN_KEYS = ("input_ids", "labels")


def pad_collate(samples: Sequence[Mapping[str, Any]], pad_id: int = 0, label_pad_id: int = -100,
                attention_mask: bool = True) -> dict[str, Any]:
    """Right-pad ``input_ids`` (with ``pad_id``), ``labels`` (with ``label_pad_id``) and
    ``attention_mask`` (with 0) to the longest ``input_ids`` of the batch; every other
    field goes through torch's ``default_collate``.

    Integer ``input_ids`` and ``labels`` come back int64 (any integer dtype, unsigned ones
    included, as ``packed_collate`` and Hugging Face's collators return them); rows of other
    dtypes take their promoted dtype. Samples without an ``attention_mask`` get one, as
    Hugging Face models expect: int64, 1 over each sample's ``input_ids`` and 0 over its
    padding. ``attention_mask=False`` adds none (an ``attention_mask`` the samples carry is
    still padded). :class:`~odb_core.errors.InvalidSampleError` (a ValueError) names the field
    and the sample when a ``labels`` or ``attention_mask`` row is longer than that sample's own
    ``input_ids``, when samples have different fields (a field only some have is never
    dropped), or when ``default_collate`` fails on a field.
    """
    check_fields(samples, "pad_collate")
    lengths = [_length(s["input_ids"]) for s in samples]
    width = max(lengths)
    fills = {"input_ids": pad_id, "labels": label_pad_id, "attention_mask": 0}
    out: dict[str, Any] = {}
    for key in samples[0]:
        values = [s[key] for s in samples]
        if key in fills:
            out[key] = _pad([_row(v) for v in values], lengths, width, fills[key], key)
        else:
            out[key] = collate_field(values, key, "pad_collate")
    if attention_mask and "attention_mask" not in out:
        out["attention_mask"] = (torch.arange(width) < torch.tensor(lengths)[:, None]).to(torch.int64)
    return out


def check_fields(samples: Sequence[Mapping[str, Any]], who: str, exempt: frozenset[str] = frozenset()) -> None:
    """:class:`~odb_core.errors.InvalidSampleError` naming the field and the sample if the
    samples' fields other than ``exempt`` differ (``who``: the collate, for the message)."""
    first = samples[0].keys() - exempt if exempt else samples[0].keys()
    for k, sample in enumerate(samples[1:], start=1):
        keys = sample.keys() - exempt if exempt else sample.keys()
        if keys != first:
            extra, missing = sorted(keys - first, key=repr), sorted(first - keys, key=repr)
            parts = ([f"has {extra} that sample 0 lacks"] if extra else []) + ([f"lacks {missing}"] if missing else [])
            raise InvalidSampleError(f"{who}: sample {k} in the batch {' and '.join(parts)}; every sample of a batch "
                                     "needs the same fields")


def collate_field(values: list[Any], key: str, who: str) -> Any:
    """``default_collate(values)``; its failure as an :class:`~odb_core.errors.InvalidSampleError` naming ``key``."""
    try:
        return default_collate(values)
    except Exception as exc:
        raise InvalidSampleError(f"{who}: field {key!r} cannot be collated ({type(exc).__name__}: {exc}); pad or "
                                 "drop it in the dataset, or pass a collate_fn that handles it") from exc


def _length(x: Any) -> int:
    """A row's length: a tensor's first dimension (no ``Tensor.__len__`` dispatch), else ``len``."""
    return x.shape[0] if isinstance(x, torch.Tensor) and x.dim() else len(x)


def _row(value: Any) -> torch.Tensor:
    """``value`` as a tensor; an empty non-tensor sequence as an empty int64 row (``torch.as_tensor([])``
    is float32, and an empty sample comes first in its length-sorted group)."""
    if isinstance(value, torch.Tensor):
        return value
    return torch.as_tensor(value) if len(value) else torch.empty(0, dtype=torch.int64)


def _integral(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex)


def holds_counts(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` holds integers that mean numbers (token ids, labels, counts): not a float,
    complex or bool dtype (a cast of those to int64 would silently change or invent values)."""
    return _integral(dtype) and dtype != torch.bool


def _dtype(rows: list[torch.Tensor], sizes: list[int], key: str) -> torch.dtype:
    """The batch dtype of ``rows``: int64 for integer token rows and for mixed integer widths (no
    value wraps; unsigned dtypes do not promote), else the promoted dtype of the non-empty rows."""
    dtypes = {r.dtype for r, n in zip(rows, sizes) if n} or {rows[0].dtype}
    if all(map(_integral, dtypes)) and (key in TOKEN_KEYS or len(dtypes) > 1):
        return torch.int64
    return functools.reduce(torch.promote_types, dtypes)


def _pad(rows: list[torch.Tensor], lengths: list[int], width: int, fill: int, key: str) -> torch.Tensor:
    """``rows`` right-padded with ``fill`` to ``width``, stacked in :func:`_dtype`'s dtype;
    :class:`~odb_core.errors.InvalidSampleError` naming ``key`` and the sample if a row is
    longer than its sample's ``input_ids`` (``lengths``)."""
    sizes = lengths if key == "input_ids" else [_length(r) for r in rows]
    if sizes != lengths:
        over = next((k for k, (n, m) in enumerate(zip(sizes, lengths)) if n > m), None)
        if over is not None:
            raise InvalidSampleError(f"pad_collate: {key!r} of sample {over} in the batch has {sizes[over]} entries, "
                                     f"more than its own input_ids ({lengths[over]})")
    first = rows[0].dtype
    uniform = all(r.dim() == 1 and r.dtype == first for r in rows)
    dtype = _dtype(rows[:1], [1], key) if uniform else _dtype(rows, sizes, key)
    if not (uniform or all(r.dim() == 1 for r in rows)):  # rows of other shapes: copied one by one
        batch = torch.full((len(rows), width), fill, dtype=dtype)
        for k, row in enumerate(rows):
            batch[k, : len(row)] = row
        return batch
    if not uniform:
        rows = [r.to(dtype) for r in rows]
    elif dtype != first:  # one cast for the batch, before padding (where a fill of -100 could wrap)
        rows = list(torch.split(torch.cat(rows).to(dtype), sizes))
    batch = pad_sequence(rows, batch_first=True, padding_value=fill)
    return batch if batch.shape[1] == width else torch.nn.functional.pad(batch, (0, width - batch.shape[1]), value=fill)
