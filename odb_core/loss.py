"""Loss-scaling weights of one aligned step (P7), from integer counts.

A rank's weight w_r multiplies its local mean loss by W x w_r before DDP averages,
so DDP's result is sum_r w_r x mean_r. Weights are exact :class:`~fractions.Fraction`
values computed from integers, so in ``"exact"``, ``"sample"`` and ``"approx"``
modes they sum to exactly one whenever the step holds any token (or sample).
"""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction

ZERO = Fraction(0)


def rank_weight(
    mode: str,
    samples: Sequence[int],
    tokens: Sequence[int],
    mean_tokens: Sequence[Fraction],
    rank: int,
) -> Fraction:
    """Rank ``rank``'s weight of one step (what a rank needs; one division, integers
    where the mode allows).

    Args:
        mode: ``"exact"`` w_r = t_r / sum t (the only per-token-exact choice, Eq. 5);
            ``"sample"`` w_r = n_r / sum n; ``"approx"`` w_r proportional to
            n_r x mean_tokens[r] (the paper's pre-alignment estimate);
            ``"none"`` w_r = 1 / W for ranks with samples (plain DDP mean).
        samples, tokens: each rank's sample and loss-token counts in this step.
        mean_tokens: each rank's pre-alignment tokens per sample (``"approx"`` only).

    A step whose denominator is zero (no tokens at all in ``"exact"``) gets all-zero
    weights: it contributes no gradient.
    """
    if mode == "none":
        return Fraction(1, len(samples)) if samples[rank] else ZERO
    if mode == "exact":
        total = sum(tokens)
        return Fraction(tokens[rank], total) if total else ZERO
    if mode == "sample":
        total = sum(samples)
        return Fraction(samples[rank], total) if total else ZERO
    if mode == "approx":
        estimate = sum((n * m for n, m in zip(samples, mean_tokens)), ZERO)
        return samples[rank] * mean_tokens[rank] / estimate if estimate else ZERO
    raise ValueError(f"unknown loss scaling mode {mode!r}")


def step_weights(
    mode: str,
    samples: Sequence[int],
    tokens: Sequence[int],
    mean_tokens: Sequence[Fraction],
) -> list[Fraction]:
    """Every rank's weight of one step (:func:`rank_weight` for each rank); they sum to
    exactly one whenever the step's denominator is positive (P7)."""
    return [rank_weight(mode, samples, tokens, mean_tokens, r) for r in range(len(samples))]
