"""A padding ``collate_fn`` for token samples (optional: any collate_fn works with ODB,
Hugging Face's data collators included: ``tests/test_hf_collators.py``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import default_collate

#: fields padded to the batch's longest sample, and their fill values by default
PADDED = ("input_ids", "labels", "attention_mask")


def pad_collate(samples: Sequence[Mapping[str, Any]], pad_id: int = 0, label_pad_id: int = -100,
                attention_mask: bool = True) -> dict[str, Any]:
    """Right-pad ``input_ids`` (with ``pad_id``), ``labels`` (with ``label_pad_id``) and
    ``attention_mask`` (with 0) to the longest ``input_ids`` of the batch; every other
    field goes through torch's ``default_collate``.

    Samples without an ``attention_mask`` get one, as Hugging Face models expect: int64,
    1 over each sample's ``input_ids`` and 0 over its padding. ``attention_mask=False``
    adds none (an ``attention_mask`` the samples carry is still padded). A padded field
    longer than the batch's longest ``input_ids`` is a ValueError naming it and the sample, and
    so are samples with different fields (a field only some samples have is never dropped).
    """
    _check_fields(samples)
    lengths = [_length(s["input_ids"]) for s in samples]
    width = max(lengths)
    fills = {"input_ids": pad_id, "labels": label_pad_id, "attention_mask": 0}
    out: dict[str, Any] = {}
    for key in samples[0]:
        values = [s[key] for s in samples]
        if key in fills:
            out[key] = _pad([_row(v) for v in values], width, fills[key], key)
        else:
            out[key] = default_collate(values)
    if attention_mask and "attention_mask" not in out:
        out["attention_mask"] = (torch.arange(width) < torch.tensor(lengths)[:, None]).to(torch.int64)
    return out


def _check_fields(samples: Sequence[Mapping[str, Any]]) -> None:
    """ValueError naming the field and the sample if the samples' fields differ."""
    first = samples[0].keys()
    for k, sample in enumerate(samples[1:], start=1):
        if sample.keys() != first:
            extra, missing = sorted(sample.keys() - first, key=repr), sorted(first - sample.keys(), key=repr)
            parts = ([f"has {extra} that sample 0 lacks"] if extra else []) + ([f"lacks {missing}"] if missing else [])
            raise ValueError(f"pad_collate: sample {k} in the batch {' and '.join(parts)}; every sample of a batch "
                             "needs the same fields")


def _length(x: Any) -> int:
    """A row's length: a tensor's first dimension (no ``Tensor.__len__`` dispatch), else ``len``."""
    return x.shape[0] if isinstance(x, torch.Tensor) and x.dim() else len(x)


def _row(value: Any) -> torch.Tensor:
    """``value`` as a tensor; an empty non-tensor sequence as an empty int64 row (``torch.as_tensor([])``
    is float32, and an empty sample comes first in its length-sorted group)."""
    if isinstance(value, torch.Tensor):
        return value
    return torch.as_tensor(value) if len(value) else torch.empty(0, dtype=torch.int64)


def _pad(rows: list[torch.Tensor], width: int, fill: int, key: str) -> torch.Tensor:
    """``rows`` right-padded with ``fill`` to ``width``, stacked (the dtype of the first non-empty
    row, else the first row's); ValueError naming ``key`` and the sample if a row is longer than
    ``width``."""
    sizes = [_length(r) for r in rows]
    dtype = next((r.dtype for r, n in zip(rows, sizes) if n), rows[0].dtype)
    longest = max(range(len(rows)), key=sizes.__getitem__)
    if sizes[longest] > width:
        raise ValueError(f"pad_collate: {key!r} of sample {longest} in the batch has {sizes[longest]} "
                         f"entries, more than its input_ids' longest ({width})")
    if all(r.dim() == 1 and r.dtype == dtype for r in rows):
        batch = pad_sequence(rows, batch_first=True, padding_value=fill)
        return batch if batch.shape[1] == width else torch.nn.functional.pad(batch, (0, width - batch.shape[1]),
                                                                            value=fill)
    batch = torch.full((len(rows), width), fill, dtype=dtype)
    for k, row in enumerate(rows):
        batch[k, : len(row)] = row
    return batch
