"""W ranks over streams in one process: each rank's view count unknown until its stream ends.

Drives one :class:`~odb_core.epoch.EpochDriver` (``stream=True``) per rank exactly as the
torch stream loader does: the driver fetches positions, each is read from the rank's
stream (its stream position, passing over a resume's consumed positions), the reads come
back in a seeded order, and a read past the stream's end reports :meth:`EpochDriver.end_stream`.
Checks of P1-P6 over streams run on this (tests/test_stream_properties.py). Deterministic
for given streams, config, seed and skips (P8).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from odb_core.config import ODBConfig
from odb_core.epoch import Delivery, EpochDriver
from odb_core.errors import ProtocolStateError
from odb_core.protocol import RankProtocol, Step


@dataclass
class StreamResult:
    """Per rank, every consumed item (real or idle) in order; the rounds run."""

    steps: list[list[Step]]
    deliveries: list[list[Delivery]] = field(default_factory=list)
    rounds: int = 0
    final_states: list[RankProtocol] = field(default_factory=list)


def simulate_streams(streams: Sequence[Sequence[int]], config: ODBConfig, seed: int = 0, *,
                     skips: Sequence[Sequence[int]] | None = None, first_step: int = 0,
                     stop_after: int | None = None, driver_cls: type[EpochDriver] = EpochDriver,
                     observer: Callable[[list[RankProtocol]], None] | None = None,
                     max_rounds: int | None = None) -> StreamResult:
    """One join epoch of ``len(streams)`` ranks; rank r's stream has the lengths ``streams[r]``.

    ``skips[r]``: stream positions rank r consumed before a resume (left out). ``stop_after``:
    stop after that many steps (a checkpoint at a step boundary). Raises
    :class:`ProtocolStateError` past ``max_rounds`` (default above the P6 bound)."""
    world = len(streams)
    drivers = [driver_cls(config, r, world, 0, skip=skips[r] if skips else (), first_step=first_step, stream=True)
               for r in range(world)]
    for d in drivers:
        d.start_iteration(())
    rng = random.Random(f"odb-stream:{seed}")
    result = StreamResult([[] for _ in range(world)], [[] for _ in range(world)])
    pipelines: list[list[int]] = [[] for _ in range(world)]
    limit = max_rounds or 4 * (max(map(len, streams), default=0) + config.outstanding_depth) + 8
    while not drivers[0].done:
        if result.rounds >= limit:
            raise ProtocolStateError(f"stream epoch exceeded {limit} rounds without terminating (P6)")
        result.rounds += 1
        for r, d in enumerate(drivers):
            _read(d, streams[r], pipelines[r], rng)
        outs = _round(drivers)
        if observer is not None:
            observer([d.protocol for d in drivers if d.protocol is not None])
        for r, out in enumerate(outs):
            result.deliveries[r].extend(out)
            result.steps[r].extend(o.step for o in out)
        if stop_after is not None and len(result.steps[0]) >= stop_after:
            break
    result.final_states = [d.protocol for d in drivers if d.protocol is not None]
    return result


def _read(driver: EpochDriver, stream: Sequence[int], pipeline: list[int], rng: random.Random) -> None:
    """Fetch what the driver allows; a seeded subset of the reads in flight comes back.
    A read past the stream's end reports the end (the reads before it may still be in flight)."""
    fetched = driver.fetch()
    stream_pos = driver.stream_positions(fetched)
    if driver.protocol is not None and not driver.protocol.ended and any(s >= len(stream) for s in stream_pos):
        driver.end_stream(len(stream))
    pipeline.extend(p for p, s in zip(fetched, stream_pos) if s < len(stream))
    if driver.protocol is not None:  # reads the driver no longer awaits are dropped, as the adapter drops them
        pipeline[:] = [p for p in pipeline if p in driver.protocol.in_flight]
    rng.shuffle(pipeline)
    for _ in range(rng.randint(0, len(pipeline))):
        pos = pipeline.pop()
        driver.arrive(pos, stream[driver.stream_positions([pos])[0]])
    if not driver.needs_arrivals():
        return
    while pipeline and driver.needs_arrivals():  # the adapter blocks for arrivals (needs_arrivals)
        pos = pipeline.pop()
        driver.arrive(pos, stream[driver.stream_positions([pos])[0]])


def _round(drivers: list[EpochDriver]) -> list[list[Delivery]]:
    """One gather round; each rank's deliveries."""
    vectors = [d.begin_round() for d in drivers]
    plans = [d.on_headers(vectors) for d in drivers]
    if plans[0].step_vector is None:
        return [[] for _ in drivers]
    step_vectors = [plan.step_vector or [] for plan in plans]
    return [[o for o in d.on_steps(step_vectors) if isinstance(o, Delivery)] for d in drivers]
