"""W ranks in one process, with an in-memory all_gather and seeded delivery.

Drives :class:`~odb_core.protocol.RankProtocol` exactly as a transport would, so
everything checked here (P1-P8 on the core) is checked on the code the torch
adapter runs. Deterministic for a given (lengths, world, config, schedule) (P8).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from odb_core.config import ODBConfig
from odb_core.errors import NonJoinStalledError, ProtocolStateError
from odb_core.protocol import RankProtocol, Step
from odb_core.quota import QuotaTracker
from odb_core.sampler import permutation
from odb_core.schedules import check_schedule, deliver, shard
from odb_core.wire import payload_bytes


Observer = Callable[[list[RankProtocol]], None]


@dataclass
class SimResult:
    """Everything one simulated epoch produced, for :mod:`odb_core.audit`."""

    config: ODBConfig
    world: int
    lengths: list[int]
    schedule: str
    steps: list[list[Step]]
    """Per rank, every consumed item (real or idle) in order."""
    shards: list[list[list[int]]]
    """Per logical iteration, per rank, the sampler views (identities)."""
    rounds: int = 0
    skip_rounds: int = 0
    payload_bytes: int = 0
    """Bytes one rank sent over the whole run (every rank sends the same)."""
    max_wait_rounds: int = 0
    unemitted_views: int = 0
    """Non-join: views fetched but never consumed (in Q or B at a logical stop, or in
    aligned steps past the quota); never-fetched views are not counted."""
    quota_emitted: int = 0
    max_step_samples: int = 0
    seconds: float = 0.0
    final_states: list[RankProtocol] = field(default_factory=list)


def simulate(
    lengths: Sequence[int],
    world: int,
    config: ODBConfig,
    schedule: str = "in_order",
    tokens: Sequence[int] | None = None,
    shuffle: bool = True,
    max_rounds: int | None = None,
    observer: Observer | None = None,
) -> SimResult:
    """Run one epoch: one logical iteration in join mode; in non-join mode, chained
    iterations until the global emitted count reaches N = len(lengths) (P5).

    ``tokens`` are per-sample loss tokens (default: the lengths). ``max_rounds``
    bounds each logical iteration (default 4 x (largest shard + D) + 8, above the
    P6 bound); exceeding it raises :class:`ProtocolStateError`. ``observer`` is
    called with every rank's state machine after each round (tests check P1/P2 there).
    """
    check_schedule(schedule)
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    started = time.perf_counter()
    n = len(lengths)
    toks = list(lengths) if tokens is None else list(tokens)
    if len(toks) != n:
        raise ValueError(f"tokens has {len(toks)} entries for {n} samples")
    rng = random.Random(f"odb-schedule:{config.seed}:{schedule}")
    result = SimResult(config, world, list(lengths), schedule, [[] for _ in range(world)], [])
    quota = QuotaTracker(n) if config.mode == "non-join" else None
    iteration = 0
    while quota is None or not quota.reached:
        shards = shard(permutation(n, config.seed, iteration, shuffle), world, schedule, rng)
        result.shards.append(shards)
        protos = [RankProtocol(config, r, world, shards[r], iteration) for r in range(world)]
        limit = max_rounds or 4 * (max(map(len, shards)) + config.outstanding_depth) + 8
        consumed = _run_iteration(protos, lengths, toks, schedule, rng, result, quota, limit, observer)
        result.final_states = protos
        result.max_wait_rounds = max([result.max_wait_rounds, *(p.max_wait_rounds for p in protos)])
        if quota is None or config.mutant == "no-chain":
            break
        fetched_not_emitted = sum(len(p.in_flight) + len(p.buffered) for p in protos)
        emitted_not_consumed = sum(len(p.emitted) for p in protos) - consumed
        result.unemitted_views += fetched_not_emitted + emitted_not_consumed
        if not quota.reached and consumed == 0:
            empty = [r for r, s in enumerate(shards) if not s]
            raise NonJoinStalledError(
                f"non-join iteration {iteration} emitted nothing before a rank finished"
                + (f" (ranks {empty} have no views)" if empty else "")
            )
        iteration += 1
    if quota is not None:
        result.quota_emitted, result.max_step_samples = quota.emitted, quota.max_step
    result.seconds = time.perf_counter() - started
    return result


def _run_iteration(
    protos: list[RankProtocol],
    lengths: Sequence[int],
    tokens: Sequence[int],
    schedule: str,
    rng: random.Random,
    result: SimResult,
    quota: QuotaTracker | None,
    limit: int,
    observer: Observer | None,
) -> int:
    """One logical iteration; returns the global samples consumed in it."""
    world = len(protos)
    pipelines: list[list[int]] = [[] for _ in range(world)]
    consumed = 0
    for _ in range(limit):
        result.rounds += 1
        for r, proto in enumerate(protos):
            pipelines[r].extend(proto.fetch())
            for pos in deliver(schedule, r, world, pipelines[r], rng):
                ident = proto.views[pos]
                proto.arrive(pos, lengths[ident], tokens[ident])
        headers = [p.begin_round() for p in protos]
        plans = [p.on_headers(headers) for p in protos]
        result.payload_bytes += payload_bytes(plans[0].target)
        if plans[0].done or not plans[0].target:
            if observer is not None:
                observer(protos)
            if plans[0].done:
                return consumed
            result.skip_rounds += 1
            continue
        vectors = [plan.step_vector or [] for plan in plans]
        emitted = [p.on_steps(vectors) for p in protos]
        if observer is not None:
            observer(protos)
        for i in range(plans[0].target):
            if quota is not None and quota.reached:
                return consumed
            for r in range(world):
                result.steps[r].append(emitted[r][i])
            consumed += emitted[0][i].global_samples
            if quota is not None:
                quota.add(emitted[0][i].global_samples)
        if quota is not None and quota.reached:
            return consumed
    raise ProtocolStateError(f"logical iteration exceeded {limit} rounds without terminating (P6)")
