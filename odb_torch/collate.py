"""A padding ``collate_fn`` for token samples (optional: any collate_fn works with ODB,
Hugging Face's data collators included: ``tests/test_hf_collators.py``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
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
    adds none (an ``attention_mask`` the samples carry is still padded).
    """
    width = max(len(s["input_ids"]) for s in samples)
    fills = {"input_ids": pad_id, "labels": label_pad_id, "attention_mask": 0}
    out: dict[str, Any] = {}
    for key in samples[0]:
        values = [s[key] for s in samples]
        if key in fills:
            out[key] = _pad([torch.as_tensor(v) for v in values], width, fills[key])
        else:
            out[key] = default_collate(values)
    if attention_mask and "attention_mask" not in out:
        out["attention_mask"] = _pad([torch.ones(len(s["input_ids"]), dtype=torch.int64) for s in samples], width, 0)
    return out


def _pad(rows: list[torch.Tensor], width: int, fill: int) -> torch.Tensor:
    """``rows`` right-padded with ``fill`` to ``width``, stacked (the first row's dtype)."""
    batch = torch.full((len(rows), width), fill, dtype=rows[0].dtype)
    for k, row in enumerate(rows):
        batch[k, : len(row)] = row
    return batch
