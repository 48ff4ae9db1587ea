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


@dataclass
class Cursor:
    """Run bookkeeping beside the rank machines, as the spec tracks it (spec/README.md).

    ``quota`` counts consumed global samples (non-join only); ``last_out`` holds, per
    rank, the view positions of each item of the last gather (``()`` = idle item);
    ``rounds`` counts emitting rounds in the logical iteration; ``done`` ends the epoch.
    """

    quota: QuotaTracker | None
    last_out: list[tuple[tuple[int, ...], ...]]
    rounds: int = 0
    done: bool = False


Packing = list[list[list[int]]]
"""Per rank, the candidate groups (view positions) a gather used; [] for other steps."""
Tracer = Callable[[str, list[RankProtocol], Cursor, Packing], None]


def gather_round(protos: list[RankProtocol], cursor: Cursor) -> tuple[bool, list[list[Step]], int]:
    """One atomic round for every rank: header gather, align, step gather, emit.

    Returns ``(iteration_ended, consumed_steps_per_rank, consumed_global_samples)``.
    In non-join mode the trainer consumes steps in order until the quota is reached
    (P5); the remaining steps of that round are emitted but not consumed.
    """
    headers = [p.begin_round() for p in protos]
    plans = [p.on_headers(headers) for p in protos]
    cursor.last_out = [()] * len(protos)
    if plans[0].done or not plans[0].target:
        return plans[0].done, [[] for _ in protos], 0
    vectors = [plan.step_vector or [] for plan in plans]
    emitted = [p.on_steps(vectors) for p in protos]
    cursor.last_out = [tuple(s.positions for s in steps) for steps in emitted]
    cursor.rounds += 1
    take, consumed = plans[0].target, 0
    if cursor.quota is not None:
        for i, step in enumerate(emitted[0]):
            cursor.quota.add(step.global_samples)
            consumed += step.global_samples
            if cursor.quota.reached:
                take, cursor.done = i + 1, True
                break
    else:
        consumed = sum(step.global_samples for step in emitted[0])
    return False, [steps[:take] for steps in emitted], consumed


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
) -> SimResult:
    """Run one epoch: one logical iteration in join mode; in non-join mode, chained
    iterations until the global emitted count reaches N = len(lengths) (P5).

    ``tokens`` are per-sample loss tokens (default: the lengths). ``max_rounds``
    bounds each logical iteration (default 4 x (largest shard + D) + 8, above the
    P6 bound); exceeding it raises :class:`ProtocolStateError`. ``observer`` is
    called with every rank's state machine after each round (tests check P1/P2
    there); ``tracer`` after every state change, labelled like the spec's actions
    (``Init``, ``Fetch``, ``Drain``, ``Gather``), for trace validation.
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
    cursor = Cursor(QuotaTracker(n) if config.mode == "non-join" else None, [()] * world)
    cursor.done = cursor.quota is not None and cursor.quota.reached

    def start(iteration: int) -> list[RankProtocol]:
        shards = shard(permutation(n, config.seed, iteration, shuffle), world, schedule, config.seed)
        result.shards.append(shards)
        return [RankProtocol(config, r, world, shards[r], iteration) for r in range(world)]

    def trace(label: str, protos: list[RankProtocol], grouped: list[RankProtocol] | None = None) -> None:
        """Report a state change; ``grouped``: the ranks whose candidate groups the gather used."""
        if tracer is not None:
            tracer(label, protos, cursor, [p.grouping for p in grouped] if grouped else [])

    iteration = 0
    protos = start(iteration)
    result.final_states = protos
    trace("Init", protos)
    while not cursor.done:
        limit = max_rounds or 4 * (max(len(p.views) for p in protos) + config.outstanding_depth) + 8
        consumed = _run_iteration(protos, lengths, toks, schedule, rng, result, cursor, limit, observer, trace)
        result.max_wait_rounds = max([result.max_wait_rounds, *(p.max_wait_rounds for p in protos)])
        if cursor.quota is not None:
            fetched_not_emitted = sum(len(p.in_flight) + len(p.buffered) for p in protos)
            emitted_not_consumed = sum(len(p.emitted) for p in protos) - consumed
            result.unemitted_views += fetched_not_emitted + emitted_not_consumed
        if cursor.done:
            break
        # a non-join logical iteration ended before the quota: chain the next one
        if config.mutant == "no-chain":
            cursor.done = True
            trace("Gather", protos, protos)
            break
        if consumed == 0:
            empty = [r for r, p in enumerate(protos) if not p.views]
            raise NonJoinStalledError(
                f"non-join iteration {iteration} emitted nothing before a rank finished"
                + (f" (ranks {empty} have no views)" if empty else "")
            )
        iteration += 1
        ended_protos, protos = protos, start(iteration)
        result.final_states = protos
        cursor.rounds, cursor.last_out = 0, [()] * world
        trace("Gather", protos, ended_protos)
    if cursor.quota is not None:
        result.quota_emitted, result.max_step_samples = cursor.quota.emitted, cursor.quota.max_step
    result.seconds = time.perf_counter() - started
    return result


def _run_iteration(
    protos: list[RankProtocol],
    lengths: Sequence[int],
    tokens: Sequence[int],
    schedule: str,
    rng: random.Random,
    result: SimResult,
    cursor: Cursor,
    limit: int,
    observer: Observer | None,
    trace: Callable[[str, list[RankProtocol], list[RankProtocol] | None], None],
) -> int:
    """Rounds until the logical iteration ends or the quota is reached; returns the
    global samples consumed. The ending gather of a non-join iteration is traced by
    the caller, after it chains the next iteration (one spec step)."""
    world = len(protos)
    pipelines: list[list[int]] = [[] for _ in range(world)]
    consumed = 0
    for _ in range(limit):
        result.rounds += 1
        for r, proto in enumerate(protos):
            fetched = proto.fetch()
            if fetched:
                pipelines[r].extend(fetched)
                trace("Fetch", protos, None)
            for pos in deliver(schedule, r, world, pipelines[r], rng):
                ident = proto.views[pos]
                proto.arrive(pos, lengths[ident], tokens[ident])
                trace("Drain", protos, None)
        ended, steps, got = gather_round(protos, cursor)
        consumed += got
        result.payload_bytes += payload_bytes(len(cursor.last_out[0]) if cursor.last_out else 0)
        if observer is not None:
            observer(protos)
        if ended:
            if cursor.quota is None:
                cursor.done = True
                trace("Gather", protos, protos)
            return consumed
        trace("Gather", protos, protos)
        if not cursor.last_out[0]:  # T = 0
            result.skip_rounds += 1
        for r in range(world):
            result.steps[r].extend(steps[r])
        if cursor.done:
            return consumed
    raise ProtocolStateError(f"logical iteration exceeded {limit} rounds without terminating (P6)")
