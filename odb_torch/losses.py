"""Summed per-token losses and the matching loss-token counts, for the trainer adapters.

Exact loss scaling (P7) multiplies a rank's *summed* token loss by ``W / window_tokens``;
the count the loader measures per sample (``loss_tokens_fn``) must equal the count the
loss sums over, or the weights are off. For causal LMs the loss is over shifted labels,
so the first position never counts: :func:`shifted_loss_tokens` and
:func:`causal_lm_loss_sum` agree on that.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from odb_core.errors import LossTokenMismatchError

IGNORE_INDEX = -100


def check_loss_tokens(tokens: int | torch.Tensor, counted: int, indices: Sequence[int], rank: int,
                      weighted: bool = True, what: str = "the loss") -> None:
    """:class:`~odb_core.errors.LossTokenMismatchError` naming ``rank`` and the dataset
    ``indices`` if ``what`` summed over ``tokens`` tokens where the loader counted ``counted``
    (its ``loss_tokens_fn``): P7's weights are exact only when both count the same tokens.
    ``weighted=False`` (an idle or padding micro-batch, weight 0): nothing to check."""
    if weighted and int(tokens) != int(counted):
        raise LossTokenMismatchError(
            f"rank {rank}: {what} summed over {int(tokens)} tokens, the loader measured {int(counted)} for dataset "
            f"indices {list(indices)}; make {what} and the loader's loss_tokens_fn count the same tokens (causal "
            "LMs: shifted labels, odb_torch.losses.shifted_loss_tokens)",
            rank=rank, indices=tuple(int(i) for i in indices))


def shifted_loss_tokens(sample: Mapping[str, Any]) -> int:
    """Loss tokens of a causal-LM sample: labels after the first position that are not -100
    (without labels: every position after the first). Labels that are not one row are a
    ValueError (the loader reports it as the sample's ``InvalidSampleError``)."""
    labels = sample.get("labels")
    if labels is None:
        return max(len(sample["input_ids"]) - 1, 0)
    row = torch.as_tensor(labels)
    if row.dim() != 1:  # rows of a [1, L] tensor would be sliced instead of positions
        raise ValueError(f"labels has shape {list(row.shape)}, not one row of labels (squeeze a tokenizer's "
                         "batch dimension)")
    return int((signed_labels(row[1:]) != IGNORE_INDEX).sum())


def signed_labels(labels: torch.Tensor) -> torch.Tensor:
    """``labels`` as int64 if their dtype is unsigned, else as they are: compared with -100 as the
    collates cast them (in ``uint8``, -100 wraps to 156, a real label)."""
    return labels if labels.dtype.is_signed else labels.to(torch.int64)


def logits_of(outputs: Any) -> torch.Tensor:
    """The logits of a model output: ``outputs.logits``, ``outputs["logits"]``, a tuple's first item, or a tensor."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    logits = getattr(outputs, "logits", None)
    if logits is None and isinstance(outputs, Mapping):
        logits = outputs.get("logits")
    if logits is None and isinstance(outputs, (tuple, list)):
        logits = outputs[0]
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"cannot find logits in the model output of type {type(outputs).__name__}")
    return logits


def causal_lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Sum of next-token cross-entropies over labels != -100 (shifted by one), and their count."""
    shift_logits = logits[..., :-1, :].reshape(-1, logits.size(-1)).float()
    shift_labels = labels[..., 1:].reshape(-1).to(shift_logits.device)
    loss_sum = F.cross_entropy(shift_logits, shift_labels, ignore_index=IGNORE_INDEX, reduction="sum")
    return loss_sum, int((shift_labels != IGNORE_INDEX).sum())
