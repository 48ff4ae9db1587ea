"""Learning-rate schedules that follow samples seen instead of optimizer steps.

With ODB a step holds a varying number of samples, so a schedule over step counts
stretches or squeezes over the data. :class:`ProgressLR` evaluates factor functions at
a progress counter (the adapters pass the global samples seen); the shapes below are the
usual ones over progress units.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

Factor = Callable[[int], float]


def warmup_linear(warmup: int, total: int) -> Factor:
    """0 -> 1 over ``warmup`` units, then linearly to 0 at ``total``."""
    def factor(at: int) -> float:
        if at < warmup:
            return at / max(warmup, 1)
        return max(0.0, (total - at) / max(total - warmup, 1))
    return factor


def warmup_cosine(warmup: int, total: int, floor: float = 0.0) -> Factor:
    """0 -> 1 over ``warmup`` units, then a half cosine down to ``floor`` at ``total``."""
    def factor(at: int) -> float:
        if at < warmup:
            return at / max(warmup, 1)
        done = min(1.0, (at - warmup) / max(total - warmup, 1))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * done))
    return factor


class ProgressLR(LRScheduler):
    """``lr = base_lr x factor(progress())`` for each parameter group; ``step()`` re-reads progress.

    Its state is only the last LRs: the progress lives with the data position
    (:class:`~odb_torch.windows.AccumulationWindows`), which checkpoints restore.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, factors: Factor | Sequence[Factor],
                 progress: Callable[[], int]) -> None:
        groups = len(optimizer.param_groups)
        self._factors = list(factors) if isinstance(factors, Sequence) else [factors] * groups
        if len(self._factors) != groups:
            raise ValueError(f"{len(self._factors)} factor functions for {groups} parameter groups")
        self._progress = progress
        super().__init__(optimizer)

    def get_lr(self) -> list[float]:  # type: ignore[override]
        return self.lrs_at(self._progress())

    def lrs_at(self, at: int) -> list[float]:
        """Each parameter group's learning rate at progress ``at`` (samples seen)."""
        return [float(base) * float(factor(at)) for base, factor in zip(self.base_lrs, self._factors)]

    def state_dict(self) -> dict[str, Any]:
        return {"last_epoch": self.last_epoch, "_last_lr": list(self._last_lr), "base_lrs": list(self.base_lrs)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.last_epoch = int(state_dict["last_epoch"])
        self.base_lrs = list(state_dict["base_lrs"])
        self._last_lr = list(state_dict["_last_lr"])
