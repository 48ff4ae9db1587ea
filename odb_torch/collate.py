"""A padding ``collate_fn`` for token samples (optional: any collate_fn works with ODB)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import default_collate

#: fields padded to the batch's longest sample, and their fill values by default
PADDED = ("input_ids", "labels", "attention_mask")


def pad_collate(samples: Sequence[Mapping[str, Any]], pad_id: int = 0, label_pad_id: int = -100) -> dict[str, Any]:
    """Right-pad ``input_ids`` (with ``pad_id``), ``labels`` (with ``label_pad_id``) and
    ``attention_mask`` (with 0) to the longest ``input_ids`` of the batch; every other
    field goes through torch's ``default_collate``.
    """
    width = max(len(s["input_ids"]) for s in samples)
    fills = {"input_ids": pad_id, "labels": label_pad_id, "attention_mask": 0}
    out: dict[str, Any] = {}
    for key in samples[0]:
        values = [s[key] for s in samples]
        if key in fills:
            rows = [torch.as_tensor(v) for v in values]
            batch = torch.full((len(rows), width), fills[key], dtype=rows[0].dtype)
            for k, row in enumerate(rows):
                batch[k, : len(row)] = row
            out[key] = batch
        else:
            out[key] = default_collate(values)
    return out
