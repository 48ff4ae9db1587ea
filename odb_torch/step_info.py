"""Per-step metadata the loader exposes as ``loader.step_info`` (plain, picklable data)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepInfo:
    """Accounting of the batch just yielded.

    ``loss_scale`` multiplies the local mean loss before backward so that DDP's
    average equals the per-token mean over every rank's tokens of this step (P7,
    ``loss_scaling="exact"``); it is 0 on idle steps. ``weight_num / weight_den`` is
    this rank's exact share of the step (the shares of all ranks sum to 1).
    """

    epoch: int
    step: int
    """Index of this step in the epoch (the same on every rank, P2)."""
    round: int
    """Protocol round that emitted it (a round's gathers carry 8 x (7 + 2T) bytes per rank)."""
    is_idle: bool
    """A zero-weight filler step: this rank had nothing to emit but DDP must step."""
    local_samples: int
    global_samples: int
    local_tokens: int
    global_tokens: int
    loss_scale: float
    weight_num: int
    weight_den: int
    over_budget: int
    """1 if this batch is a single sample longer than the token budget."""
    indices: tuple[int, ...]
    """Dataset indices in this batch (empty when idle)."""
