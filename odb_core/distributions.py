"""Named, seeded sample-length distributions (fits to the paper's Table 9)."""

from __future__ import annotations

import random
from collections.abc import Callable


def _lognormal(mu: float, sigma: float, cap: int) -> Callable[[random.Random], int]:
    return lambda rng: min(cap, max(1, round(rng.lognormvariate(mu, sigma))))


def _llava(rng: random.Random) -> int:
    mu, sigma = (6.519, 0.148) if rng.random() < 0.465 else (5.850, 0.194)
    return min(1260, max(1, round(rng.lognormvariate(mu, sigma))))


DISTRIBUTIONS: dict[str, Callable[[random.Random], int]] = {
    "ultrachat": _lognormal(6.998, 0.440, 4471),
    "llava": _llava,
    "sharegpt4o": _lognormal(6.882, 0.949, 12110),
    "uniform": lambda rng: rng.randint(16, 4096),
}


def sample_lengths(name: str, n: int, seed: int = 0) -> list[int]:
    """``n`` lengths drawn from the named distribution with a seeded RNG (P8)."""
    if name not in DISTRIBUTIONS:
        raise ValueError(f"unknown length distribution {name!r}; choose one of {', '.join(DISTRIBUTIONS)}")
    rng = random.Random(f"odb-lengths:{name}:{seed}")
    draw = DISTRIBUTIONS[name]
    return [draw(rng) for _ in range(n)]
