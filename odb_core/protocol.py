"""The per-rank ODB state machine over R/Q/B/E, sans-IO (README: "Guarantees", P1-P8).

The caller owns all I/O. Per logical iteration it loops:

1. ``fetch()`` -> view positions to request from workers (R -> Q, bounded by D);
2. ``arrive(pos, length, tokens)`` for each sample that came back (Q -> B);
3. ``begin_round()`` -> header vector; all_gather it across ranks;
4. ``on_headers(gathered)`` -> :class:`Plan`; if ``plan.step_vector`` is not None,
   all_gather it and pass the result to ``on_steps(gathered)`` -> emitted
   :class:`Step` items (B -> E), exactly ``plan.target`` of them on every rank;
5. stop when ``plan.done``.

Invariants: R, Q, B, E partition the rank's views at every call boundary (P1); every
rank emits the same number of items per round (P2); no emitted group of >= 2
samples exceeds the budget (P3); in join mode ``done`` comes only when every rank
holds nothing (P4). The machine never blocks, sleeps or talks to anything.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction

from odb_core.alignment import TARGET_FUNCTIONS, align
from odb_core.budgets import BUFFER_RULES
from odb_core.config import ODBConfig
from odb_core.errors import InvalidSampleError, PeerInconsistencyError, ProtocolStateError, UnsupportedSettingError
from odb_core.grouping import check_length, hold_sparse
from odb_core.loss import round_denominators, share
from odb_core.wire import (
    HEADER_LEN,
    TAIL_HEADER_LEN,
    GatheredBytes,
    Header,
    HeaderGather,
    Status,
    StepGather,
    encode_steps,
)

CHAIN_STRIDE = 1 << 20
"""Non-join: chained iteration k of epoch e reads the sampler's permutation of epoch e + k x CHAIN_STRIDE."""


class Phase(enum.Enum):
    """Where the rank is inside a round."""

    OPEN = "open"  # fetch/arrive allowed; next: begin_round
    HEADER_SENT = "header_sent"  # next: on_headers
    STEPS_SENT = "steps_sent"  # next: on_steps
    DONE = "done"  # the logical iteration is over


@dataclass(frozen=True, slots=True)
class Plan:
    """What the round decided, identical on every rank except ``step_vector``."""

    target: int
    """T_grp: items every rank emits this round (0: skip round)."""
    done: bool
    """The logical iteration is over (join: all finished; non-join: any finished)."""
    step_vector: list[int] | None
    """The vector to all_gather next, or None when nothing is emitted."""


@dataclass(frozen=True, slots=True)
class Step:
    """One emitted item: a real group or an idle item, with its accounting (P7)."""

    iteration: int
    round: int
    index: int
    """Index of this item among the round's T items."""
    positions: tuple[int, ...]
    """View positions (into the rank's view list), short to long; empty when idle."""
    identities: tuple[int, ...]
    lengths: tuple[int, ...]
    is_idle: bool
    local_samples: int
    global_samples: int
    local_tokens: int
    global_tokens: int
    weight: Fraction
    """This rank's share of the step's loss; weights of all ranks sum to 1 (P7)."""
    world: int
    over_budget: int
    """1 if this is a lone sample longer than the token budget (reported, never dropped)."""

    @property
    def loss_scale(self) -> float:
        """Multiply the local mean loss by this before DDP's average: W x weight."""
        return float(self.weight * self.world)


def _mean_tokens(headers: Sequence[Header]) -> list[Fraction]:
    """Each rank's pre-alignment loss tokens per sample (``loss_scaling="approx"``)."""
    return [Fraction(h.tokens, h.samples) if h.samples else Fraction(0) for h in headers]


class RankProtocol:
    """One rank's ODB state machine for one logical iteration.

    Args:
        config: the shared protocol configuration.
        rank, world: this rank and the world size.
        views: this rank's sampler views (dataset identities) in sampler order.
        iteration: logical iteration number within the epoch (chained non-join iterations).
        epoch: the epoch (with ``iteration``, it seeds this rank's step order, P8).
        stream: a stream whose view count is unknown until it ends: ``views`` must be empty,
            ``fetch`` takes positions without an upper bound and names each one's identity
            ``stream(position)`` (called once per position, in order), and the rank reports
            FINISHED only after :meth:`end` told where the stream ended and R, Q, B drained (P4).
        pool_open: a shared tail's pool is open: :meth:`claim` appends pool views to R, and the
            view count is final (the rank may drain and finish) only after :meth:`close_pool`.
    """

    def __init__(self, config: ODBConfig, rank: int, world: int, views: Sequence[int], iteration: int = 0,
                 epoch: int = 0, *, stream: Callable[[int], int] | None = None, pool_open: bool = False) -> None:
        if not 0 <= rank < world:
            raise UnsupportedSettingError(f"rank {rank} outside world of size {world}", field="rank", rank=rank)
        self.config = config
        self.rank = rank
        self.world = world
        self.views = list(views)
        if stream is not None and self.views:
            raise ValueError("a stream's views are named by stream(position) as they are fetched: pass views=()")
        self._stream = stream
        if stream is not None and pool_open:
            raise ValueError("a stream has no shared tail: pool_open needs views given as a list")
        self.ended = stream is None and not pool_open
        self._header_len = TAIL_HEADER_LEN if config.shared_tail else HEADER_LEN
        """The view count is known: always for a list of views, after :meth:`end` for a stream."""
        self.streamed = stream is not None
        """The views are a stream's (their count was unknown at the start)."""
        self.iteration = iteration
        self.epoch = epoch
        self._target_policy = TARGET_FUNCTIONS[config.target_policy]
        self._rule = BUFFER_RULES[config.budget]
        self._hold_area = config.token_budget if config.budget == "packed" else None  # hold_sparse's area
        self._next = 0  # R = views[_next:]
        self._inflight: set[int] = set()  # Q
        self._length: dict[int, int] = {}  # B: pos -> realized length
        self._tokens: dict[int, int] = {}  # B: pos -> loss tokens
        self._arrival: dict[int, int] = {}  # B: pos -> arrival sequence number
        self._arrival_round: dict[int, int] = {}
        self._buffer_tokens = 0
        self._emitted: list[int] = []  # E, in emission order
        self._seq = 0
        self.round = 0
        self.phase = Phase.OPEN
        self._groups: list[list[int]] = []
        self._candidates: list[list[int]] = []
        self._grouping: list[list[int]] = []  # the full grouping of this round (the budget's rule)
        self._holding: list[list[int]] = []  # groups held back this round (regroup_padding)
        self._held: set[int] = set()  # H: positions held back at the last emitting round
        self._regroup = config.regroup_fraction  # exact threshold, computed once
        self._header: Header | None = None
        self._headers: HeaderGather = HeaderGather((), iteration, -1)
        self._pending: list[list[int]] = []
        self._dropped: list[int] = []
        self._step_vector: list[int] | None = None
        # measurements
        self.max_wait_rounds = 0
        self.skip_rounds = 0

    # ---- state queries -------------------------------------------------------------
    @property
    def remaining(self) -> list[int]:
        """R: positions not yet fetched, in sampler order (a stream's unknown rest is not listed)."""
        return list(range(self._next, len(self.views)))

    @property
    def in_flight(self) -> set[int]:
        """Q: positions fetched but not arrived."""
        return set(self._inflight)

    @property
    def buffered(self) -> dict[int, int]:
        """B: position -> length of arrived, not yet emitted samples (overflow included)."""
        return dict(self._length)

    @property
    def emitted(self) -> list[int]:
        """E: emitted positions in emission order."""
        return list(self._emitted)

    @property
    def next_position(self) -> int:
        """The first position of R (``len(views)`` once the sampler is drained)."""
        return self._next

    @property
    def buffer_fill(self) -> int:
        """|B \\ H|: buffered samples that count toward ``buffer_size`` (held-back ones do not);
        the buffer is full, and the rank ready, once this reaches ``buffer_size``."""
        return len(self._length) - len(self._held)

    def fetch_room(self) -> int:
        """D - |Q| - |B \\ H|: how many views ``fetch()`` may still move (if R has them)."""
        return self.config.outstanding_depth - len(self._inflight) - len(self._length) + len(self._held)

    @property
    def candidates(self) -> list[list[int]]:
        """The candidate groups (positions, short to long) formed by the last
        ``begin_round`` before alignment; empty if the rank was not ready."""
        return [list(g) for g in self._candidates]

    @property
    def grouping(self) -> list[list[int]]:
        """The full grouping of the buffer (B(l) walk or packing) by the last ``begin_round``: the
        candidates plus the groups held back to regroup, in walk order; empty if the rank did not group
        (a rank holding every group for the pool reports WAITING but grouped)."""
        return [list(g) for g in self._grouping]

    @property
    def held(self) -> set[int]:
        """H: positions held back at the last emitting round to regroup; a subset of B that
        counts toward neither ``buffer_size`` nor the depth, and is not held again next round."""
        return set(self._held)

    @property
    def header_length(self) -> int:
        """Values per header on the wire: ``TAIL_HEADER_LEN`` with a shared tail, else ``HEADER_LEN``."""
        return self._header_len

    @property
    def headers(self) -> HeaderGather:
        """The last round's gathered headers (decoded)."""
        return self._headers

    @property
    def finished(self) -> bool:
        """R, Q and B are all empty (a stream's R is empty only once its end is known)."""
        return self.ended and self._next == len(self.views) and not self._inflight and not self._length

    # ---- 1. fetch ------------------------------------------------------------------
    def fetch(self) -> list[int]:
        """Move views R -> Q while |Q| + |B| < D; return the positions to request."""
        self._require(Phase.OPEN, "fetch")
        room = max(0, self.fetch_room())
        take = room if self._stream is not None and not self.ended else min(room, len(self.views) - self._next)
        fetched = list(range(self._next, self._next + take))
        if self._stream is not None and not self.ended:
            self.views.extend(map(self._stream, fetched))
        self._next += take
        self._inflight.update(fetched)
        return fetched

    def end(self, n: int) -> None:
        """The stream ended at position ``n`` (it has exactly ``n`` views): the positions from
        ``n`` on were fetched past its end and leave Q; R is empty from now on. ``n`` must not be
        beyond what was fetched, and no position from ``n`` on may have arrived
        (:class:`ProtocolStateError`)."""
        self._require(Phase.OPEN, "end")
        if self._stream is None or self.ended:
            raise ProtocolStateError(f"rank {self.rank}: end({n}) but this rank's view count is already known")
        past = [p for p in range(n, self._next) if p not in self._inflight]
        if not 0 <= n <= self._next or past:
            raise ProtocolStateError(f"rank {self.rank}: the stream cannot end at position {n}: "
                                     f"{self._next} positions were fetched, positions {past} arrived or left",
                                     indices=past)
        self._inflight.difference_update(range(n, self._next))
        del self.views[n:]
        self._next, self.ended = n, True

    def claim(self, views: Sequence[int]) -> None:
        """Pool views this rank claimed (the shared tail): appended to R, in pool order."""
        if self.ended or self._stream is not None:
            raise ProtocolStateError(f"rank {self.rank}: claim() without an open pool")
        self.views.extend(views)

    def close_pool(self) -> None:
        """The pool is empty: this rank's view count is final (it may drain and finish, P4)."""
        if self._stream is not None:
            raise ProtocolStateError(f"rank {self.rank}: close_pool() on a stream")
        self.ended = True

    # ---- 2. arrive -----------------------------------------------------------------
    def arrive(self, pos: int, length: int, tokens: int | None = None) -> None:
        """A requested sample came back: Q -> B with its realized length.

        ``tokens`` (loss tokens, default ``length``) must be an int in [0, length].
        Raises :class:`InvalidSampleError` naming the dataset index on a bad value,
        :class:`ProtocolStateError` if ``pos`` is not in flight.
        """
        self._require(Phase.OPEN, "arrive")
        if pos not in self._inflight:
            raise ProtocolStateError(f"rank {self.rank}: position {pos} arrived but is not in flight")
        what = f"sample {self.views[pos]} (rank {self.rank} view {pos})"
        try:
            check_length(length, what)
        except InvalidSampleError as exc:
            raise InvalidSampleError(str(exc), rank=self.rank, indices=(self.views[pos],)) from None
        if tokens is None:
            tokens = length
        elif isinstance(tokens, bool) or not isinstance(tokens, int) or not 0 <= tokens <= length:
            raise InvalidSampleError(f"{what}: loss tokens must be an int in [0, length={length}], got {tokens!r}",
                                     rank=self.rank, indices=(self.views[pos],))
        self._inflight.discard(pos)
        self._length[pos] = length
        self._tokens[pos] = tokens
        self._arrival[pos] = self._seq
        self._arrival_round[pos] = self.round
        self._seq += 1
        self._buffer_tokens += tokens

    # ---- 3. header -----------------------------------------------------------------
    def begin_round(self) -> list[int]:
        """Group if the buffer is full or the sampler is drained; return the header vector."""
        self._require(Phase.OPEN, "begin_round")
        nbuf = len(self._length)
        drained = self.ended and self._next == len(self.views) and not self._inflight
        if self._reports_finished(drained):
            status, self._groups = Status.FINISHED, []
            nbuf = 0
        elif self._pool_dry() and not nbuf:  # nothing to emit now: it claims, and blocks nobody
            status, self._groups = Status.IDLE, []
        elif nbuf and (nbuf - len(self._held) >= self.config.buffer_size or drained or self._pool_dry()):
            status = Status.READY
            self._groups = self._group()
        else:
            status, self._groups = Status.WAITING, []
        self._grouping, self._holding = self._groups, []
        room = 0
        if status is Status.READY and not drained and self._regroup is not None:
            pool = self._hold_area is not None and self._pool_dry()
            self._groups, self._holding = hold_sparse(self._groups, self._length, self._regroup, self._held,
                                                      limit=self.config.outstanding_depth, area=self._hold_area,
                                                      pool=pool)
            if pool:
                room = self._room(self._holding)
                if not self._groups:  # every group waits for the pool's views
                    status = Status.WAITING
        self._candidates = self._groups  # replaced, never mutated, by the round; copied on read
        self._header = Header(
            iteration=self.iteration,
            round=self.round,
            status=status,
            groups=len(self._groups),
            capacity=self.config.output_capacity or 0,
            samples=nbuf,
            tokens=self._buffer_tokens if nbuf else 0,
            pending=len(self.views) - self._next + len(self._inflight) if self._header_len != HEADER_LEN else 0,
            load=sum(self._length.values()) if nbuf and self._header_len != HEADER_LEN else 0,
            room=room if self._header_len != HEADER_LEN else 0,
        )
        self.phase = Phase.HEADER_SENT
        return self._header.encode(self._header_len)

    # ---- 4. align ------------------------------------------------------------------
    def on_headers(self, gathered: Sequence[Sequence[int]] | HeaderGather) -> Plan:
        """Decide the round from every rank's header (identical on all ranks, P2).

        ``gathered``: the gathered header vectors, or a :class:`HeaderGather` already
        decoded from them (one decoding shared by simulated ranks); one decoded for another
        world, iteration or round is decoded again here, as raw vectors would be.
        """
        self._require(Phase.HEADER_SENT, "on_headers")
        length = self._header_len
        if not (isinstance(gathered, HeaderGather) and gathered.belongs_to(self.world, self.iteration, self.round,
                                                                           length)):
            vectors = gathered.encode() if isinstance(gathered, HeaderGather) else gathered
            gathered = HeaderGather.decode(vectors, self.world, self.iteration, self.round, length)
        headers = gathered
        assert self._header is not None
        if headers[self.rank] != self._header:
            raise PeerInconsistencyError(f"rank {self.rank}: gathered header differs from the one sent")
        self._headers = headers
        if self.config.mode == "join":
            done = headers.finished == len(headers)
        else:
            done = headers.finished > 0
        if done:
            self.phase = Phase.DONE
            return Plan(target=0, done=True, step_vector=None)
        target = self._target(headers)
        if target == 0:
            self.skip_rounds += 1
            self._end_round()
            return Plan(target=0, done=False, step_vector=None)
        if self._header.status is Status.READY:
            groups, holding = self._groups, self._holding
            if len(groups) < target and holding:  # emit held groups before splitting any
                back = holding[: target - len(groups)]
                holding = holding[len(back):]
                still = {id(g) for g in holding}
                groups = [g for g in self._grouping if id(g) not in still]
            self._held = {p for g in holding for p in g}  # they stay in B (spec: H)
            emitted, recirculated = self._align(groups, target)
            emitted, self._dropped = self._settle_overflow(emitted, recirculated)
            if self.config.shuffle_steps and len(emitted) > 1:
                # this rank's own order (spec: Orders); fixed before the step vectors are gathered
                emitted = list(emitted)  # may be the candidates list itself
                random.Random(f"odb-steps:{self.config.seed}:{self._order_key}:{self.round}:{self.rank}").shuffle(emitted)
            self._pending = emitted
        else:
            self._pending = [[] for _ in range(target)]
        tokens_of = self._tokens.__getitem__
        items = [(len(g), sum(map(tokens_of, g))) for g in self._pending]
        self._step_vector = encode_steps(items)
        self.phase = Phase.STEPS_SENT
        return Plan(target=target, done=False, step_vector=list(self._step_vector))

    # ---- 5. emit -------------------------------------------------------------------
    def on_steps(self, gathered: Sequence[Sequence[int]] | GatheredBytes | StepGather) -> list[Step]:
        """Emit this round's items (B -> E) with their global accounting.

        ``gathered``: the gathered step vectors, the gather's raw little-endian int64 bytes
        (:data:`~odb_core.wire.GatheredBytes`: checked and summed without lists, P6), or a
        :class:`StepGather` decoded from either against this round's headers and target
        (shared by simulated ranks); one decoded against anything else is decoded again here.
        """
        self._require(Phase.STEPS_SENT, "on_steps")
        target = len(self._pending)
        if not (isinstance(gathered, StepGather) and gathered.belongs_to(self._headers, target)):
            raw = gathered.gathered if isinstance(gathered, StepGather) else gathered
            gathered = StepGather(raw, self._headers, target)
        mine = gathered.vector(self.rank)
        if mine != self._step_vector:
            raise PeerInconsistencyError(f"rank {self.rank}: gathered step vector differs from the one sent")
        mode = self.config.loss_scaling
        mean_tokens = self._headers.derived(_mean_tokens) if mode == "approx" else []
        mean = mean_tokens[self.rank] if mode == "approx" else Fraction(0)
        steps_gather = gathered
        denominators = gathered.derived(("weight_denominators", mode), lambda: round_denominators(
            mode, self.world, steps_gather.global_samples, steps_gather.global_tokens, steps_gather.columns,
            mean_tokens))
        steps: list[Step] = []
        length_of, arrived_in, view_of = self._length.__getitem__, self._arrival_round.__getitem__, self.views.__getitem__
        budget = self.config.token_budget
        for i, group in enumerate(self._pending):
            local_samples, local_tokens = mine[2 * i], mine[2 * i + 1]
            weight = share(mode, local_samples, local_tokens, mean, denominators[i])
            lengths = tuple(map(length_of, group))
            if group:
                self.max_wait_rounds = max(self.max_wait_rounds, self.round - min(map(arrived_in, group)))
            steps.append(
                Step(
                    iteration=self.iteration,
                    round=self.round,
                    index=i,
                    positions=tuple(group),
                    identities=tuple(map(view_of, group)),
                    lengths=lengths,
                    is_idle=not group,
                    local_samples=local_samples,
                    global_samples=gathered.global_samples[i],
                    local_tokens=local_tokens,
                    global_tokens=gathered.global_tokens[i],
                    weight=weight,
                    world=self.world,
                    over_budget=sum(n > budget for n in lengths) if lengths and max(lengths) > budget else 0,
                )
            )
            self._remove(group)
        for p in self._dropped:  # only a seeded bug (model_checks.mutants) drops anything
            del self._length[p], self._arrival[p], self._arrival_round[p]
            self._buffer_tokens -= self._tokens.pop(p)
        self._dropped = []
        self._end_round()
        return steps

    @property
    def _order_key(self) -> int:
        """The sampler epoch this iteration reads (epoch + iteration x CHAIN_STRIDE): seeds the step order."""
        return self.epoch + self.iteration * CHAIN_STRIDE

    # ---- hooks (the seeded bugs of model_checks.mutants override these) -------------
    def _group(self) -> list[list[int]]:
        """The buffer's groups under the configured budget, short to long (P3): the B(l) walk
        (padded) or best-fit decreasing, held samples walked first (packed); :mod:`odb_core.budgets`."""
        return self._rule(self._length, self.config.token_budget, self._held)

    def _pool_dry(self) -> bool:
        """A shared tail's pool is open and every view of this rank has arrived: it groups what it
        has (a partial buffer is ready, an empty one IDLE) rather than wait for claims, so its
        samples wait no longer than without a pool; under the packed budget with regroup its
        part-full groups stay open for the pool's reserve (``hold_sparse`` with ``pool``)."""
        return not self.ended and self._stream is None and self._next == len(self.views) and not self._inflight

    def _room(self, held: list[list[int]]) -> int:
        """The most budget a held group leaves unused (the packed budget; 0 if none is held): the
        header's ``room``, which directs the pool's next view to this rank (:mod:`odb_core.tail`)."""
        assert self._hold_area is not None
        return max((self._hold_area - sum(map(self._length.__getitem__, g)) for g in held), default=0)

    def _reports_finished(self, drained: bool) -> bool:
        """The header says FINISHED: R, Q and B are empty (P4 rests on this)."""
        return drained and not self._length

    def _target(self, headers: HeaderGather) -> int:
        """T for this round, from every rank's header (the configured target policy; a pure
        function of the headers, so computed once per gather however many ranks share it)."""
        return headers.derived(self._target_policy)

    def _align(self, groups: list[list[int]], target: int) -> tuple[list[list[int]], list[list[int]]]:
        """This rank's groups split or overflowed to ``target`` (Alg. 1, :func:`align`): ``(emitted,
        recirculated)``; each buffered sample in exactly one of them once (P1, P4)."""
        return align(groups, target, self.config.overflow_policy, self._arrival)

    def _settle_overflow(self, emitted: list[list[int]],
                         recirculated: list[list[int]]) -> tuple[list[list[int]], list[int]]:
        """The items to emit and the positions to drop; overflow stays in B (P1), nothing is dropped."""
        return emitted, []

    @property
    def finished_ranks(self) -> list[int]:
        """The ranks whose header of this round said FINISHED."""
        return [r for r, h in enumerate(self._headers) if h.status is Status.FINISHED]

    @property
    def status(self) -> Status | None:
        """The status this rank reported in the current round's header (None before ``begin_round``)."""
        return None if self._header is None else self._header.status

    # ---- helpers -------------------------------------------------------------------
    def _remove(self, group: list[int]) -> None:
        length, arrival, arrival_round = self._length, self._arrival, self._arrival_round
        for p in group:
            del length[p], arrival[p], arrival_round[p]
        self._buffer_tokens -= sum(map(self._tokens.pop, group))
        self._emitted.extend(group)

    def _end_round(self) -> None:
        self._pending = []
        self._groups = []
        self._holding = []
        self._step_vector = None
        self.round += 1
        self.phase = Phase.OPEN

    def _require(self, phase: Phase, call: str) -> None:
        if self.phase is not phase:
            raise ProtocolStateError(
                f"rank {self.rank}: {call}() called in phase {self.phase.value}, needs {phase.value}"
            )
