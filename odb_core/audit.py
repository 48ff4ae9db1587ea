"""Audits of a simulated epoch: coverage, lockstep, batch shapes and costs.

Measures (as README.md's "Measured" reports them): padding fraction = 1 - sum real tokens /
sum (max len x size) under the padded budget, 0 under the packed one; budget fill = real
tokens / (L_max x groups); samples/update; alignment overhead = steps per rank with alignment
/ mean groups per rank when each rank groups alone - 1; gather payload = bytes one rank sends
per round.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

from odb_core.budgets import form
from odb_core.simulator import SimResult, simulate


@dataclass(frozen=True)
class Audit:
    """The figures ``odb simulate --json`` prints."""

    world: int
    samples: int
    mode: str
    schedule: str
    emitted_per_rank: list[int]
    steps_per_rank: list[int]
    idle_steps_per_rank: list[int]
    unique_identities: int
    duplicate_emits: int
    sampler_padding: int
    """Views DistributedSampler-style padding added (W x ceil(N/W) - N, summed over iterations)."""
    coverage_exact: bool
    """Emitted identity multiset == the shards' view multiset (P4; join mode's promise)."""
    rounds: int
    skip_rounds: int
    padding_fraction: float
    """1 - real tokens / (max len x size) over the emitted groups under the padded budget; 0 under
    the packed budget, whose groups are padding-free rows of real tokens (``budget_fill`` says how
    full they are)."""
    budget_fill: float
    """Real tokens / (L_max x groups), over-budget singletons left out: the share of each
    group's budget its samples use (the packed budget's packing efficiency)."""
    samples_per_update: float
    alignment_overhead: float
    payload_bytes_per_round: float
    max_wait_rounds: int
    over_budget_singletons: int
    unemitted_views: int
    quota_emitted: int
    seconds: float

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict of every field."""
        return asdict(self)


def alone_groups(result: SimResult) -> float:
    """Mean groups per rank if each rank ran ODB alone on its emitted views (no alignment):
    its views in sampler order, cut into buffer_size chunks, each grouped by the budget's
    rule (P3); with regroup on, the protocol itself on one rank (regroup carries groups
    across chunks)."""
    config = result.config
    buf, budget = config.buffer_size, config.token_budget
    alone = config.model_copy(update={"mode": "join"})
    per_rank = [0] * result.world
    for r, steps in enumerate(result.steps):
        by_iter: dict[int, list[int]] = {}
        for s in steps:
            by_iter.setdefault(s.iteration, []).extend(s.positions)
        for it, positions in by_iter.items():
            views = result.shards[it][r]
            lengths = [result.lengths[views[p]] for p in sorted(positions)]
            if config.regroup_padding is not None:
                per_rank[r] += len(simulate(lengths, 1, alone, "in_order", shuffle=False).steps[0])
                continue
            for i in range(0, len(lengths), buf):
                per_rank[r] += len(form(config.budget, lengths[i : i + buf], budget))
    return sum(per_rank) / result.world


def audit(result: SimResult) -> Audit:
    """Compute every audit figure of a simulated epoch."""
    emitted = [sum(s.local_samples for s in steps) for steps in result.steps]
    steps_per_rank = [len(steps) for steps in result.steps]
    idle = [sum(1 for s in steps if s.is_idle) for steps in result.steps]
    identities = Counter(i for steps in result.steps for s in steps for i in s.identities)
    expected = Counter(v for shards in result.shards for views in shards for v in views)
    real = sum(len(ls) and sum(ls) for steps in result.steps for s in steps for ls in [s.lengths])
    padded = sum(max(s.lengths) * len(s.lengths) for steps in result.steps for s in steps if s.lengths)
    within = [sum(s.lengths) for steps in result.steps for s in steps if s.lengths and not s.over_budget]
    updates = steps_per_rank[0] if steps_per_rank else 0
    alone = alone_groups(result)
    total_emitted = sum(emitted)
    return Audit(
        world=result.world,
        samples=len(result.lengths),
        mode=result.config.mode,
        schedule=result.schedule,
        emitted_per_rank=emitted,
        steps_per_rank=steps_per_rank,
        idle_steps_per_rank=idle,
        unique_identities=len(identities),
        duplicate_emits=total_emitted - len(identities),
        sampler_padding=sum(expected.values()) - len(result.lengths) * len(result.shards),
        coverage_exact=identities == expected,
        rounds=result.rounds,
        skip_rounds=result.skip_rounds,
        padding_fraction=1 - real / padded if padded and result.config.budget == "padded" else 0.0,
        budget_fill=sum(within) / (len(within) * result.config.token_budget) if within else 0.0,
        samples_per_update=total_emitted / updates if updates else 0.0,
        alignment_overhead=updates / alone - 1 if alone else 0.0,
        payload_bytes_per_round=result.payload_bytes / result.rounds if result.rounds else 0.0,
        max_wait_rounds=result.max_wait_rounds,
        over_budget_singletons=sum(s.over_budget for steps in result.steps for s in steps),
        unemitted_views=result.unemitted_views,
        quota_emitted=result.quota_emitted,
        seconds=result.seconds,
    )
