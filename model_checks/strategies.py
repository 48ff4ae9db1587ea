"""Hypothesis strategies for random simulation cases (shared by tests/ and the mutant hunts)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from hypothesis import strategies as st

from odb_core import ODBConfig
from odb_core.config import BUDGETS, OVERFLOW_POLICIES, TARGET_POLICIES
from odb_core.schedules import SCHEDULES


def lengths_from_seed(n: int, budget: int, seed: int, zero_fraction: float) -> list[int]:
    """``n`` lengths from 0 to 3x the budget: mostly short, a heavy tail, some zeros."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        u = rng.random()
        if u < zero_fraction:
            out.append(0)
        elif u < 0.75:
            out.append(rng.randint(1, max(1, budget // 4)))
        elif u < 0.95:
            out.append(rng.randint(1, budget))
        else:
            out.append(rng.randint(budget + 1, 3 * budget + 1))
    return out


@dataclass(frozen=True)
class Case:
    """One random simulation case."""

    world: int
    lengths: list[int]
    config: ODBConfig
    schedule: str
    mutant: str | None = None
    """A seeded bug of :mod:`model_checks.mutants` to run instead of the real driver."""

    def __repr__(self) -> str:  # keep falsifying examples readable
        return (
            f"Case(world={self.world}, n={len(self.lengths)}, schedule={self.schedule!r}, mutant={self.mutant!r}, "
            f"config={self.config!r}, lengths[:20]={self.lengths[:20]})"
        )


@st.composite
def cases(
    draw: st.DrawFn, modes: tuple[str, ...] = ("join", "non-join"), max_n: int = 5000, need_capacity: bool = False,
    budgets: tuple[str, ...] = BUDGETS, pooled: bool = False,
) -> Case:
    """Random W in 1..16, N in 0..max_n (N < W included), token budgets and budget kinds
    (padded, packed), buffers, depths, capacities, modes, policies, schedules and (join mode)
    shared-tail pools (always, with ``pooled``)."""
    world = draw(st.integers(1, 16))
    n = draw(st.one_of(st.integers(0, world + 1), st.integers(0, max_n)))
    budget = draw(st.sampled_from([1, 7, 64, 1000, 4096, 8192]))
    buffer_size = draw(st.one_of(st.integers(1, 8), st.integers(1, 300)))
    depth = buffer_size + draw(st.integers(0, 64))
    mode = draw(st.sampled_from(modes))
    config = ODBConfig(
        token_budget=budget,
        budget=draw(st.sampled_from(budgets)),
        buffer_size=buffer_size,
        depth=depth,
        mode=mode,  # type: ignore[arg-type]
        loss_scaling=draw(st.sampled_from(["none", "sample", "approx", "exact"])),
        seed=draw(st.integers(0, 2**16)),
        target_policy=draw(st.sampled_from(TARGET_POLICIES)),
        overflow_policy=draw(st.sampled_from(OVERFLOW_POLICIES)),
        output_capacity=draw(st.integers(1, 16) if need_capacity else st.one_of(st.none(), st.integers(1, 16))),
        regroup_padding=draw(st.sampled_from([None, 0.0, 0.02, 0.1])),
        shared_tail=draw(st.sampled_from([0.1, 0.5] if pooled else [0.0, 0.0, 0.1, 0.5])) if mode == "join" else 0.0,
        reserve_divisor=draw(st.sampled_from([8, 1, 2])),
    )
    schedule = draw(st.sampled_from(SCHEDULES))
    if config.mode == "non-join" and schedule == "empty_rank" and world > 1:
        schedule = "uneven"  # an empty rank stalls non-join by design; tested on its own
    lengths = lengths_from_seed(n, budget, draw(st.integers(0, 2**32)), draw(st.sampled_from([0.0, 0.02])))
    return Case(world, lengths, config, schedule)
