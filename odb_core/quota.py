"""Trainer-side sample-quota closure for non-join mode (P5).

The trainer counts the global samples of every aligned step it runs and stops at
the first step whose cumulative count reaches the quota N, chaining logical
iterations as needed. Every rank sees the same ``global_samples`` per step, so
every rank stops at the same step (P2). Hence N <= S_emit <= N + S_max, where
S_max is the largest global sample count of one step.
"""

from __future__ import annotations


class QuotaTracker:
    """Counts globally emitted samples against a quota."""

    def __init__(self, quota: int) -> None:
        if quota < 0:
            raise ValueError(f"quota must be >= 0, got {quota}")
        self.quota = quota
        self.emitted = 0
        self.max_step = 0
        self.last_step = 0

    @property
    def reached(self) -> bool:
        """True once the cumulative global emitted count is >= the quota."""
        return self.emitted >= self.quota

    def add(self, global_samples: int) -> None:
        """Account one consumed step."""
        self.emitted += global_samples
        self.max_step = max(self.max_step, global_samples)
        self.last_step = global_samples
