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


def step_weights(
    mode: str,
    samples: Sequence[int],
    tokens: Sequence[int],
    mean_tokens: Sequence[Fraction],
) -> list[Fraction]:
    """Per-rank weights of one step.

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
    world = len(samples)
    if mode == "exact":
        basis = [Fraction(t) for t in tokens]
    elif mode == "sample":
        basis = [Fraction(n) for n in samples]
    elif mode == "approx":
        basis = [n * m for n, m in zip(samples, mean_tokens)]
    elif mode == "none":
        return [Fraction(1, world) if n else ZERO for n in samples]
    else:
        raise ValueError(f"unknown loss scaling mode {mode!r}")
    total = sum(basis, ZERO)
    if total == 0:
        return [ZERO] * world
    return [b / total for b in basis]
