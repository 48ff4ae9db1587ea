"""W ranks in one process, with an in-memory all_gather and seeded delivery.

Drives one :class:`~odb_core.epoch.EpochDriver` per rank exactly as the torch collate
process does (the same epoch loop: chaining, quota, stall detection), so everything
checked here (P1-P8 on the core) is checked on the code the torch adapter runs.
Deterministic for a given (lengths, world, config, schedule) (P8).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from odb_core.config import ODBConfig
from odb_core.epoch import Delivery, EpochDriver
from odb_core.errors import RoundBoundError
from odb_core.protocol import RankProtocol, Step
from odb_core.quota import QuotaTracker
from odb_core.sampler import permutation, split_tail
from odb_core.schedules import check_schedule, deliver, shard
from odb_core.wire import HeaderGather, StepGather, payload_bytes

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


@dataclass
class Cursor:
    """Run bookkeeping beside the rank machines, as the spec tracks it (spec/README.md),
    read off the drivers (every rank's agrees): ``quota`` counts consumed global samples
    (non-join only); ``last_out`` holds, per rank, the view positions of each item of the
    last gather (``()`` = idle item); ``rounds`` counts emitting rounds in the logical
    iteration; ``done`` ends the epoch."""

    quota: QuotaTracker | None
    last_out: list[tuple[tuple[int, ...], ...]]
    rounds: int = 0
    done: bool = False
    pool_claimed: int = 0
    """The shared tail: pool views claimed so far (spec: pc)."""
    claims: list[tuple[int, ...]] = field(default_factory=list)
    """Per rank, the 0-based pool indices it claimed, in order (spec: claimed, 1-based)."""

    @classmethod
    def of(cls, drivers: Sequence[EpochDriver]) -> Cursor:
        """The cursor of a world of drivers (rank 0's shared fields)."""
        d = drivers[0]
        return cls(d.quota, [x.last_out for x in drivers], d.rounds, d.done, d.pool_applied,
                   [x.claimed_pool for x in drivers])


Packing = list[list[list[int]]]
"""Per rank, the candidate groups (view positions) a gather used; [] for other steps."""
Tracer = Callable[[str, list[RankProtocol], Cursor, Packing], None]


def gather_round(drivers: Sequence[EpochDriver]) -> tuple[bool, list[list[Step]]]:
    """One atomic round for every rank: header gather, align, step gather, emit.

    Returns ``(iteration_ended, delivered_steps_per_rank)``: in non-join mode the
    drivers deliver steps in order until the quota is reached (P5).

    Each gather is decoded once, as rank 0 decodes it, and the decoded value is handed to
    every rank (a round costs O(W x T), not O(W^2 x T)); a rank for which it is not the
    decoding of its own gather decodes the vectors itself (:meth:`RankProtocol.on_headers`),
    and a gather that fails to decode goes to every rank raw, so each rank raises what it
    would raise alone. Every decision is the rank's, as with raw vectors.
    """
    vectors = [d.begin_round() for d in drivers]
    p = drivers[0].protocol
    headers = _shared(lambda: HeaderGather.decode(vectors, len(drivers), p.iteration, p.round, p.header_length)
                      if p else None)
    plans = [d.on_headers(vectors if headers is None else headers) for d in drivers]
    if plans[0].done or plans[0].step_vector is None:
        return plans[0].done, [[] for _ in drivers]
    step_vectors = [plan.step_vector or [] for plan in plans]
    steps = _shared(lambda: StepGather(step_vectors, headers, len(step_vectors[0]) // 2) if headers else None)
    outs = [d.on_steps(step_vectors if steps is None else steps) for d in drivers]
    return False, [[o.step for o in out if isinstance(o, Delivery)] for out in outs]


_G = TypeVar("_G")


def _shared(decode: Callable[[], _G | None]) -> _G | None:
    """A gather decoded once for every rank, or None if it does not decode (the ranks then
    get the raw vectors and each raises its own error, as in a real run)."""
    try:
        return decode()
    except Exception:  # noqa: BLE001 - whatever it is, every rank meets it again in its own decoding
        return None


def simulate(
    lengths: Sequence[int],
    world: int,
    config: ODBConfig,
    schedule: str = "in_order",
    tokens: Sequence[int] | None = None,
    shuffle: bool = True,
    max_rounds: int | None = None,
    observer: Observer | None = None,
    tracer: Tracer | None = None,
    driver_cls: type[EpochDriver] = EpochDriver,
    events: list[list[dict[str, Any]]] | None = None,
) -> SimResult:
    """Run one epoch of W :class:`EpochDriver` s: one logical iteration in join mode;
    in non-join mode, chained iterations until the global count reaches N = len(lengths) (P5).

    ``tokens`` are per-sample loss tokens (default: the lengths). ``max_rounds``
    bounds each logical iteration (default 4 x (largest shard + pool views left + D) + 8, above the
    P6 bound); exceeding it raises :class:`RoundBoundError`. ``observer`` is
    called with every rank's state machine after each round (tests check P1/P2
    there); ``tracer`` after every state change, labelled like the spec's actions
    (``Init``, ``Fetch``, ``Drain``, ``Gather``), for trace validation; ``events``,
    if given, receives each rank's trace events (:class:`EpochDriver` ``trace``).
    ``driver_cls`` replaces the driver (the seeded bugs of ``model_checks.mutants``).
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
    if events is not None:
        events[:] = [[] for _ in range(world)]
    drivers = [driver_cls(config, r, world, 0, quota=n, trace=None if events is None else events[r])
               for r in range(world)]

    def protos() -> list[RankProtocol]:
        return [d.protocol for d in drivers if d.protocol is not None]

    def trace(label: str, grouped: list[RankProtocol] | None = None) -> None:
        """Report a state change; ``grouped``: the ranks whose candidate groups the gather used."""
        if tracer is not None:
            tracer(label, protos(), Cursor.of(drivers), [p.grouping for p in grouped] if grouped else [])

    _start_iterations(drivers, n, shuffle, schedule, result)
    trace("Init")
    while not drivers[0].done:
        ps = protos()
        pool = len(drivers[0].pool) - drivers[0].pool_cursor  # views left to claim (the packed reserve: k a round)
        limit = max_rounds or 4 * (max(len(p.views) for p in ps) + pool + config.outstanding_depth) + 8
        _run_iteration(drivers, lengths, toks, schedule, rng, result, limit, observer, trace)
        if drivers[0].pool:  # a shared tail: each rank's views are its shard and its claims
            result.shards[-1] = [list(p.views) for p in ps]
        result.max_wait_rounds = max([result.max_wait_rounds, *(p.max_wait_rounds for p in ps)])
        if drivers[0].quota is not None:
            delivered = [sum(len(s.positions) for s in steps if s.iteration == ps[0].iteration)
                         for steps in result.steps]
            result.unemitted_views += sum(len(p.in_flight) + len(p.buffered) + len(p.emitted) - k
                                          for p, k in zip(ps, delivered))
        if not drivers[0].done:  # a non-join logical iteration ended before the quota: chain the next
            _start_iterations(drivers, n, shuffle, schedule, result)
        result.final_states = protos()
        trace("Gather", ps)
    quota = drivers[0].quota
    if quota is not None:
        result.quota_emitted, result.max_step_samples = quota.emitted, quota.max_step
    result.seconds = time.perf_counter() - started
    return result


def _start_iterations(drivers: list[EpochDriver], n: int, shuffle: bool, schedule: str, result: SimResult) -> None:
    """Every driver starts its next logical iteration over its shard of the sampler epoch it names."""
    epoch = drivers[0].sampler_epoch
    config = drivers[0].config
    order = permutation(n, config.seed, epoch or 0, shuffle)
    own, pool_list = split_tail(order, config.shared_tail)
    pool = tuple(pool_list)  # one pool every driver reads
    shards = shard(own, len(drivers), schedule, config.seed)
    result.shards.append(shards)
    if epoch is not None:  # None: a quota of 0 ends the epoch before it starts
        for d, views in zip(drivers, shards):
            d.start_iteration(views, pool)


def _run_iteration(
    drivers: list[EpochDriver],
    lengths: Sequence[int],
    tokens: Sequence[int],
    schedule: str,
    rng: random.Random,
    result: SimResult,
    limit: int,
    observer: Observer | None,
    trace: Callable[[str, list[RankProtocol] | None], None],
) -> None:
    """Rounds until the logical iteration ends or the quota is reached. The gather that
    ends the iteration is traced by the caller, after it chains the next one (one spec step)."""
    world = len(drivers)
    pipelines: list[list[int]] = [[] for _ in range(world)]
    protos = [d.protocol for d in drivers if d.protocol is not None]
    for _ in range(limit):
        result.rounds += 1
        for r, d in enumerate(drivers):
            fetched = d.fetch()
            if fetched:
                pipelines[r].extend(fetched)
                trace("Fetch", None)
            for pos in deliver(schedule, r, world, pipelines[r], rng):
                ident = d.views[pos]
                d.arrive(pos, lengths[ident], tokens[ident])
                trace("Drain", None)
        ended, steps = gather_round(drivers)
        target = len(drivers[0].last_out)
        result.payload_bytes += payload_bytes(target, pooled=bool(drivers[0].config.shared_tail))
        if observer is not None:
            observer(protos)
        if ended:
            return
        for r in range(world):
            result.steps[r].extend(steps[r])
        if drivers[0].done:
            return
        trace("Gather", protos)
        if not target:
            result.skip_rounds += 1
    raise RoundBoundError(f"logical iteration exceeded {limit} rounds without terminating (P6)")
