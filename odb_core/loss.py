"""Loss-scaling weights of one aligned step (P7), from integer counts.

A rank's weight w_r multiplies its local mean loss by W x w_r before DDP averages,
so DDP's result is sum_r w_r x mean_r. Weights are exact :class:`~fractions.Fraction`
values computed from integers, so in ``"exact"``, ``"sample"`` and ``"approx"``
modes they sum to exactly one whenever the step holds any token (or sample).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from fractions import Fraction
from math import lcm
from operator import mul

ZERO = Fraction(0)


def weight_denominator(
    mode: str,
    samples: Sequence[int],
    tokens: Sequence[int],
    mean_tokens: Sequence[Fraction],
) -> int | Fraction:
    """The denominator all ranks' weights of one step share (see :func:`rank_weight`):
    the world size (``"none"``), the step's tokens (``"exact"``) or samples (``"sample"``),
    or sum_r n_r x mean_tokens[r] (``"approx"``). O(W); the same on every rank."""
    if mode == "none":
        return len(samples)
    if mode == "exact":
        return sum(tokens)
    if mode == "sample":
        return sum(samples)
    if mode == "approx":
        return sum((n * m for n, m in zip(samples, mean_tokens)), ZERO)
    raise ValueError(f"unknown loss scaling mode {mode!r}")


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
    mean = mean_tokens[rank] if mode == "approx" else ZERO
    return share(mode, samples[rank], tokens[rank], mean, weight_denominator(mode, samples, tokens, mean_tokens))


def share(mode: str, samples: int, tokens: int, mean: Fraction, denominator: int | Fraction) -> Fraction:
    """A rank's weight of one step from its own counts (and its mean tokens per sample,
    ``"approx"``) and the step's :func:`weight_denominator`: O(1)."""
    if mode == "none":
        return Fraction(1, denominator) if samples else ZERO
    if mode == "exact":
        return Fraction(tokens, denominator) if denominator else ZERO
    if mode == "sample":
        return Fraction(samples, denominator) if denominator else ZERO
    if mode == "approx":
        return samples * mean / denominator if denominator else ZERO
    raise ValueError(f"unknown loss scaling mode {mode!r}")


def round_denominators(
    mode: str,
    world: int,
    global_samples: Sequence[int],
    global_tokens: Sequence[int],
    columns: Callable[[], tuple[Sequence[Sequence[int]], Sequence[Sequence[int]]]],
    mean_tokens: Sequence[Fraction],
) -> list[int | Fraction]:
    """:func:`weight_denominator` of each step of a round, from the steps' global sample and
    token counts (O(T)); ``"approx"`` needs every rank's counts, ``columns()`` (O(W x T))."""
    if mode == "none":
        return [world] * len(global_samples)
    if mode == "exact":
        return list(global_tokens)
    if mode == "sample":
        return list(global_samples)
    if mode == "approx":
        # sum_r n_r x p_r / q_r over a common denominator: integer dot products, the same
        # Fraction as weight_denominator's sum of Fractions (whose denominators grow with W)
        common = lcm(*(m.denominator for m in mean_tokens))
        scaled = [m.numerator * (common // m.denominator) for m in mean_tokens]
        return [Fraction(sum(map(mul, samples, scaled)), common) for samples in columns()[0]]
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
