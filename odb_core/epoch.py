"""One rank's whole epoch, sans-IO: the driver every caller of the protocol runs.

:class:`~odb_core.protocol.RankProtocol` is one logical iteration; an epoch is more:
the handshake that checks every rank runs the same protocol, logical iterations chained
up to the quota (non-join), the stop at the quota in the middle of a round, stall
detection, the ``skip_idle`` end of a rank's loop, and the resume skip. All of those
decisions live here, once; the simulator, the conformance harness and the torch
collate process drive this class and only move data. The caller loops::

    hello = driver.hello(facts)          # all_gather hello_header(hello), check_hello_header, then
                                         # all_gather hello itself and driver.check_hello(gathered)
    while not driver.done:
        if (e := driver.sampler_epoch) is not None:
            driver.start_iteration(sampler_order_of_epoch(e))
            continue
        request(driver.fetch())          # load these positions of driver.views
        while driver.needs_arrivals():   # block for loaded samples, then driver.arrive(...)
            ...
        plan = driver.on_headers(all_gather(driver.begin_round()))
        if plan.step_vector is not None:
            for out in driver.on_steps(all_gather(plan.step_vector)):
                hand_to_trainer(out)     # a Delivery, or LoopEnd (skip_idle)

Every rank yields the same number of deliveries per epoch, or ends its loop with
:class:`LoopEnd` at a point after which only idle items remain (P2); join mode delivers
every view not skipped once (P4); non-join stops at the first step whose cumulative
global sample count reaches N (P5). With ``trace`` set, every state change is appended
to it as a plain dict (the events ``model_checks.traces`` merges into a spec behaviour).
"""

from __future__ import annotations

import hashlib
from bisect import bisect_left
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

from odb_core.config import ODBConfig
from odb_core.elastic import check_positions
from odb_core.errors import (
    ConfigMismatchError,
    NonJoinStalledError,
    ProtocolStateError,
    ResumeStateError,
    UnsupportedSettingError,
)
from odb_core.protocol import CHAIN_STRIDE, Plan, RankProtocol, Step
from odb_core.quota import QuotaTracker
from odb_core.tail import TailPosition, resumed_positions, tail_claims
from odb_core.wire import GatheredBytes, Header, HeaderGather, Status, StepGather

HELLO_MAGIC = 0x0DB1
"""First value of the handshake vector (a peer running another wire format is caught)."""

PROTOCOL_FIELDS = ("token_budget", "budget", "buffer_size", "depth", "mode", "loss_scaling", "seed", "target_policy",
                   "overflow_policy", "output_capacity", "regroup_padding", "shuffle_steps", "shared_tail",
                   "reserve_divisor")
"""The :class:`ODBConfig` fields every rank must share (the handshake compares them, and names
the first that differs: ``budget`` before ``target_policy``, whose default follows it)."""


@dataclass(frozen=True)
class ClaimRule:
    """The shared tail's claims of one round for ``left`` pool views, at most ``cap`` each
    (:func:`~odb_core.tail.tail_claims`), with their prefix sums: a pure function of the
    gathered headers, so simulated ranks sharing a gather compute it once
    (:meth:`~odb_core.wire.HeaderGather.derived`, keyed by this value)."""

    left: int
    cap: int
    budget: int = 0
    """L_max where the packed budget's reserve applies (:func:`~odb_core.tail.tail_claims`), else 0."""
    spread: int = 1
    """The most ranks a reserve round deals to: ceil(W / ``ODBConfig.reserve_divisor``)."""

    def __call__(self, hs: Sequence[Header]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        counts = tail_claims([h.pending for h in hs], [h.load for h in hs], [h.samples for h in hs], self.left,
                             self.cap, [h.room for h in hs], self.budget, self.spread)
        return tuple(counts), tuple(accumulate(counts, initial=0))


@dataclass(frozen=True, slots=True)
class Delivery:
    """One step for the trainer: the core's :class:`Step` and where it sits in the epoch."""

    step: Step
    number: int
    """The step's number in the epoch (0-based; a resumed epoch continues the count)."""
    sampler_positions: tuple[int, ...]
    """The step's samples as positions in this epoch's sampler order (for ``state_dict``)."""


@dataclass(frozen=True, slots=True)
class LoopEnd:
    """``skip_idle``: this rank has no real step left in the epoch; its loop may end now, while
    its driver keeps taking part in the rounds (every later item of this rank is idle)."""


Output = Delivery | LoopEnd


def _digest(value: object) -> int:
    """A stable 62-bit digest of a value's repr (the same on every rank and process)."""
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(), "big") >> 2


class EpochDriver:
    """One rank's epoch of the protocol.

    Args:
        config: the protocol configuration (every rank's must be equal: :meth:`hello`).
        rank, world: this rank and the world size.
        epoch: the epoch number (the sampler permutation of join mode and of the first
            non-join iteration; part of the step order's seed).
        quota: N, the non-join sample quota (the dataset size); ignored in join mode.
        skip: join mode, resume: sampler positions already consumed; they are left out.
        tail: resume of a pooled epoch (``shared_tail`` > 0): the pool's cursor and this rank's
            claims at the checkpoint's step (:class:`odb_core.tail.TailPosition`); its claimed
            views not in ``skip`` are served again as its own, the pool goes on from the cursor.
        first_step: the number of the first delivery (a resumed epoch continues its count).
        skip_idle: end this rank's loop with :class:`LoopEnd` once it is finished (join only).
        trace: a list to append trace events to, or None (no cost).
        stream: this rank's views are a stream whose length is unknown until it ends (an
            ``IterableDataset``): :meth:`start_iteration` takes no order, a view's identity and
            sampler position is its position in the stream (``skip``: stream positions already
            consumed, left out), and the caller reports the end with :meth:`end_stream`. Join
            mode only: non-join's quota N is the dataset size, unknown for a stream
            (:class:`UnsupportedSettingError`, field ``mode``).
    """

    protocol_cls: type[RankProtocol] = RankProtocol
    """The per-iteration state machine (the seeded bugs of ``model_checks.mutants`` replace it)."""
    claim_rule_cls: type[ClaimRule] = ClaimRule
    """The shared tail's claim rule (the seeded bugs of ``model_checks.mutants`` replace it)."""

    def __init__(self, config: ODBConfig, rank: int, world: int, epoch: int = 0, *, quota: int | None = None,
                 skip: Sequence[int] = (), first_step: int = 0, skip_idle: bool = False,
                 trace: list[dict[str, Any]] | None = None, stream: bool = False,
                 tail: TailPosition | None = None) -> None:
        if not 0 <= rank < world:
            raise UnsupportedSettingError(f"rank {rank} is not one of the {world} ranks (0..{world - 1})", field="rank",
                                          rank=rank)
        self.config, self.rank, self.world, self.epoch = config, rank, world, epoch
        self.join = config.mode == "join"
        self.stream = stream
        if stream and not self.join:
            raise UnsupportedSettingError(
                f"rank {rank}: mode='non-join' over a stream: non-join ends the epoch at a quota of N samples "
                "(the dataset size), and a stream's size is unknown until it ends; use mode='join'",
                field="mode", rank=rank)
        if skip and not self.join:
            raise UnsupportedSettingError(
                f"rank {rank}: skip (a resumed epoch's consumed positions) in mode='non-join': non-join resumes "
                "at an iteration boundary, not mid-epoch; use mode='join'", field="mode", rank=rank)
        if not self.join and quota is None:
            raise ValueError("non-join mode needs the sample quota N (the dataset size)")
        self.quota = None if self.join else QuotaTracker(quota or 0)
        self.skip = frozenset(skip)
        self.tail = tail
        self.skip_idle = skip_idle and self.join
        self.trace = trace
        self.next_step = first_step
        self.iteration = -1
        self.protocol: RankProtocol | None = None
        self.kept: list[int] = []  # position in the iteration -> position in the sampler order
        self.rounds = 0  # emitting rounds in the current logical iteration (spec: rounds)
        self.last_out: tuple[tuple[int, ...], ...] = ()  # positions of each item of the last gather
        self.loop_ended = False
        self.done = self.quota is not None and self.quota.reached
        self.pool: tuple[int, ...] = ()  # the shared tail's views (identities), in sampler order
        self.pool_cursor = 0  # pool views claimed so far (by every rank)
        packed_holds = config.budget == "packed" and config.regroup_fraction is not None
        self._fill_budget = config.token_budget if packed_holds else 0  # the claims' reserve (odb_core.tail)
        self._fill_spread = -(-world // config.reserve_divisor)  # the ranks a reserve round deals to
        self._claim: tuple[int, int] = (0, 0)  # this round's own claim: (first pool index, count)
        self._pool_base = 0  # the sampler position of pool view 0 (after this rank's own views)
        self._pool_origin = 0  # the pool's cursor when the iteration began (a resumed pooled epoch's)
        self._first_count = 0
        self._iteration_start = 0
        self._record(ev="begin", rank=rank, world=world, epoch=epoch, config=self._trace_config(),
                     quota=0 if self.quota is None else self.quota.quota)

    # ---- the handshake ----------------------------------------------------------------
    def hello(self, facts: Mapping[str, object] | None = None) -> list[int]:
        """The handshake vector: the epoch and a digest of every protocol field, of the pool's
        cursor of a resumed pooled epoch, of ``skip_idle``, and of the caller's ``facts`` (sampler
        seed, dataset size, ...), in a fixed order."""
        # a resumed pooled epoch's cursor: ranks that disagree would claim the pool differently (P8);
        # skip_idle: ranks that disagree would end their loops after different numbers of steps (P2)
        facts = {**(facts or {}), "pool_cursor": self.tail.cursor if self.tail is not None else 0,
                 "skip_idle": int(self.skip_idle)}
        self._hello_fields = [*PROTOCOL_FIELDS, *sorted(facts)]
        # depth as used (None: the buffer size), so a default and the same value given agree
        values: list[object] = [self.config.outstanding_depth if f == "depth" else getattr(self.config, f)
                                for f in PROTOCOL_FIELDS]
        values += [facts[k] for k in sorted(facts)]
        self._hello_values = values
        return [HELLO_MAGIC, len(values), self.epoch, *(_digest(v) for v in values)]

    @staticmethod
    def hello_header(vector: Sequence[int]) -> list[int]:
        """The fixed-size head of a :meth:`hello` vector (its magic and its length): gathered first,
        so ranks whose vectors differ in length (another ODB version, or a stream on one rank and
        a map-style dataset on another: other facts) get a typed error, not a collective of
        mismatched sizes."""
        return [int(vector[0]), int(vector[1])]

    def check_hello_header(self, gathered: Sequence[Sequence[int]]) -> None:
        """:class:`ConfigMismatchError` (``field="version"``, the same verdict on every rank) unless
        every rank's :meth:`hello_header` is this rank's."""
        mine = [int(v) for v in gathered[self.rank]]
        differ = [r for r, v in enumerate(gathered) if [int(x) for x in v] != mine]
        if differ:
            r = differ[0]
            other = [int(x) for x in gathered[r]]
            raise ConfigMismatchError(
                f"rank {self.rank}: rank {r} runs another ODB handshake ({other} vs {mine}: magic and length): "
                "another ODB version, or a stream (IterableDataset) on one rank and a map-style dataset on another",
                rank=self.rank, field="version", ranks=differ)

    def check_hello(self, gathered: Sequence[Sequence[int]]) -> None:
        """Raise :class:`ConfigMismatchError` (the same verdict on every rank) if any rank's
        handshake differs from this rank's, naming the first field that differs."""
        mine = [int(v) for v in gathered[self.rank]]
        for r, vector in enumerate(gathered):
            other = [int(v) for v in vector]
            if other[:2] != mine[:2] or len(other) != len(mine):
                raise ConfigMismatchError(f"rank {self.rank}: rank {r} runs another ODB handshake "
                                          f"({other[:2]} vs {mine[:2]})", rank=self.rank, field="version", ranks=[r])
        names = ["epoch", *self._hello_fields]
        for k, name in enumerate(names):
            differ = [r for r, v in enumerate(gathered) if int(v[2 + k]) != mine[2 + k]]
            if differ:
                value = self.epoch if k == 0 else self._hello_values[k - 1]
                fix = ("every rank must call set_epoch with the same epoch before iterating" if k == 0 else
                       "every rank must build its loader with the same protocol configuration, sampler and dataset")
                raise ConfigMismatchError(
                    f"rank {self.rank}: ranks disagree on {name}: this rank has {value!r}, ranks {differ} "
                    f"have another value; {fix}", rank=self.rank, field=name, ranks=differ)

    # ---- logical iterations -------------------------------------------------------------
    @property
    def sampler_epoch(self) -> int | None:
        """The sampler epoch whose order :meth:`start_iteration` needs now; None while an
        iteration runs or once the epoch is over. Non-join iteration k of epoch e reads
        epoch e + k x CHAIN_STRIDE (a fresh permutation per chained iteration)."""
        if self.done or self.protocol is not None:
            return None
        return self.epoch + (self.iteration + 1) * CHAIN_STRIDE

    def start_iteration(self, order: Sequence[int], pool: Sequence[int] = ()) -> None:
        """Begin the next logical iteration over ``order`` (dataset identities in sampler
        order). Join mode leaves out the positions in ``skip`` (a resumed epoch). ``pool``: the
        shared tail's views (every rank's the same, in sampler order); pool view j claimed by
        this rank has sampler position ``len(order) + j``."""
        if self.sampler_epoch is None:
            raise ProtocolStateError(f"rank {self.rank}: start_iteration() while an iteration runs or after the end")
        if self.stream and len(order):
            raise ProtocolStateError(f"rank {self.rank}: a stream has no sampler order: start_iteration(())")
        if pool and (self.stream or not self.config.shared_tail or (self.skip and self.tail is None)):
            raise UnsupportedSettingError(
                f"rank {self.rank}: a shared-tail pool needs shared_tail > 0, views given as a list, and to resume "
                "mid-epoch the pool's position (tail)", field="shared_tail", rank=self.rank)
        if not pool and self.tail is not None and (self.tail.cursor or self.tail.claimed):
            raise ResumeStateError(
                f"rank {self.rank}: a resumed pooled epoch (pool cursor {self.tail.cursor}, {len(self.tail.claimed)} "
                "claims) started without its pool: its claimed views would never be read (P4)",
                field="pool_cursor", rank=self.rank)
        self.pool = pool if isinstance(pool, tuple) else tuple(pool)  # ranks may share one pool: read only
        self._pool_base = len(order)
        self.iteration += 1
        self.kept = self._first_positions(len(order))
        views = [order[p] if p < len(order) else self.pool[p - len(order)] for p in self.kept]
        self._pool_origin = self.pool_cursor  # a resumed pool goes on from its cursor (traces count from there)
        self._first_count = len(self.kept)  # later positions are this iteration's claims
        self.protocol = self.protocol_cls(self.config, self.rank, self.world, views, iteration=self.iteration,
                                          epoch=self.epoch, stream=self._next_kept if self.stream else None,
                                          pool_open=self.pool_cursor < len(self.pool))
        self.rounds, self.last_out = 0, ()
        self._iteration_start = self.quota.emitted if self.quota is not None else 0
        self._record(ev="iteration", iteration=self.iteration, views=-1 if self.stream else len(views),
                     pool=len(self.pool) - self._pool_origin)

    def _first_positions(self, own: int) -> list[int]:
        """The sampler positions the iteration starts with: every one (non-join), those not in
        ``skip`` (join), and a resumed pooled epoch's claimed views not yet yielded (P4)."""
        self.pool_cursor = 0
        if not self.join:
            return list(range(own))
        if self.pool and self.tail is not None:
            self.pool_cursor = self.tail.cursor
            return resumed_positions(own, len(self.pool), self.skip, self.tail, self.rank)
        if not self.stream:  # P4: a position the epoch lacks is a resume of another one (a stream's grow)
            check_positions(self.skip, own, self.rank)
        return [p for p in range(own) if p not in self.skip]

    @property
    def views(self) -> list[int]:
        """The current iteration's views (dataset identities), indexed by position."""
        return self._proto().views

    # ---- one round --------------------------------------------------------------------
    def fetch(self) -> list[int]:
        """R -> Q within the depth: the positions to load now (P1)."""
        fetched = self._proto().fetch()
        if fetched:
            self._record(ev="fetch", positions=fetched)
        return fetched

    def stream_positions(self, positions: Sequence[int]) -> list[int]:
        """The stream positions of fetched ``positions`` (increasing: read the stream up to each,
        passing over the positions left out)."""
        return [self.kept[p] for p in positions]

    def end_stream(self, count: int) -> None:
        """The stream ended after ``count`` elements (stream positions 0..count-1): every fetched
        position at or past it leaves Q and the rank finishes once B drains (P4). A resumed
        stream shorter than its consumed positions is a :class:`ResumeStateError`."""
        if not self.kept or not 0 <= count <= self.kept[-1]:
            raise ProtocolStateError(f"rank {self.rank}: the stream cannot end after {count} elements: its end is "
                                     f"found reading a fetched stream position, and the last is {self.kept[-1:]}")
        beyond = sorted(p for p in self.skip if p >= count)
        if beyond:
            raise ResumeStateError(f"rank {self.rank}: the stream ended after {count} elements, but the checkpoint "
                                   f"consumed stream positions {beyond[:8]}: the stream changed since the checkpoint",
                                   field="consumed", indices=beyond, rank=self.rank)
        n = bisect_left(self.kept, count)
        self._proto().end(n)
        self._record(ev="stream_end", pos=n)

    def _next_kept(self, pos: int) -> int:
        """A stream view's identity: its stream position, passing over ``skip``."""
        s = self.kept[-1] + 1 if self.kept else 0
        while s in self.skip:
            s += 1
        self.kept.append(s)
        return s

    def arrive(self, pos: int, length: int, tokens: int | None = None) -> None:
        """A loaded sample: Q -> B (raises :class:`InvalidSampleError` on a bad length)."""
        self._proto().arrive(pos, length, tokens)
        self._record(ev="arrive", pos=pos, length=length)

    def needs_arrivals(self) -> bool:
        """Wait for loaded samples before the next gather: the buffer is not full and some
        fetched view has not arrived. Gathering only then makes every round count."""
        proto = self._proto()
        return proto.buffer_fill < self.config.buffer_size and bool(proto.in_flight)

    def begin_round(self) -> list[int]:
        """The header vector of this round (all_gather it)."""
        return self._proto().begin_round()

    def on_headers(self, gathered: Sequence[Sequence[int]] | HeaderGather) -> Plan:
        """Decide the round from every rank's header. ``plan.done``: the logical iteration
        ended; the epoch ends with it (join, or the quota reached) or the next iteration
        is chained (:attr:`sampler_epoch`). Raises :class:`NonJoinStalledError` if a
        non-join iteration ended without consuming anything."""
        proto = self._proto()
        plan = proto.on_headers(gathered)
        if self.pool_cursor < len(self.pool) and not plan.done:
            self._plan_claims(proto)
        if plan.done:
            self._end_iteration(proto)
        elif plan.step_vector is None:
            self.last_out = ()
            self._record_gather(proto, target=0, ended=False)
            self._apply_claims(proto)
        return plan

    def _plan_claims(self, proto: RankProtocol) -> None:
        """The shared tail: every rank's claims from the gathered headers (the same on every rank,
        P8), this rank's kept for after the round's emission."""
        rule = self.claim_rule_cls(len(self.pool) - self.pool_cursor, self.config.buffer_size, self._fill_budget,
                                   self._fill_spread)
        counts, before = proto.headers.derived(rule)
        self._claim = (self.pool_cursor + before[self.rank], counts[self.rank])
        self.pool_cursor += before[-1]

    @property
    def claimed_pool(self) -> tuple[int, ...]:
        """The pool indices this rank claimed in the epoch, in order (applied claims; a resumed
        pooled epoch's start with those of its :class:`TailPosition`)."""
        return self.claims_since(0)

    def claims_since(self, n: int) -> tuple[int, ...]:
        """``claimed_pool[n:]``, built from the claims after the first ``n`` only (the collate
        process reports each batch's new claims: O(new claims) per batch, not O(all))."""
        if not self.pool:
            return ()
        before = self.tail.claimed if self.tail is not None and self.join else ()
        later = self.kept[self._first_count + max(0, n - len(before)):]
        return before[n:] + tuple(k - self._pool_base for k in later)

    @property
    def pool_applied(self) -> int:
        """Pool views claimed by every rank (between rounds, every claim is applied)."""
        return self.pool_cursor

    def _apply_claims(self, proto: RankProtocol) -> None:
        """This round's claim joins R; the last claim of the pool makes every view count final."""
        start, count = self._claim
        if count:
            proto.claim(self.pool[start : start + count])
            self.kept.extend(range(self._pool_base + start, self._pool_base + start + count))
            # round: the gather that applies it (logged after a skip round's gather, before an emitting one's)
            self._record(ev="claim", round=proto.round - 1, first=start - self._pool_origin, count=count,
                         cursor=self.pool_cursor - self._pool_origin)
        self._claim = (0, 0)
        if self.pool and self.pool_cursor == len(self.pool) and not proto.ended:
            proto.close_pool()

    def on_steps(self, gathered: Sequence[Sequence[int]] | GatheredBytes | StepGather) -> list[Output]:
        """Emit the round's items (``gathered`` as :meth:`RankProtocol.on_steps` takes it); return
        what the trainer gets, in order: every item up to the one that reaches the quota
        (non-join), none of this rank's idle items after its :class:`LoopEnd` (``skip_idle``)."""
        proto = self._proto()
        steps = proto.on_steps(gathered)
        self._apply_claims(proto)
        self.rounds += 1
        self.last_out = tuple(s.positions for s in steps)
        out: list[Output] = []
        for s in steps:
            if self.done and self._stops_at_quota():
                break  # the quota was reached earlier in this round: the rest is not consumed
            if not self.loop_ended:
                out.append(Delivery(s, self.next_step, tuple(map(self.kept.__getitem__, s.positions))))
            self.next_step += 1
            if self.quota is not None:
                self.quota.add(self._quota_count(s))
                self.done = self.quota.reached
        if self.skip_idle and not self.loop_ended and proto.finished:
            self.loop_ended = True
            out.append(LoopEnd())
        self._record_gather(proto, target=len(steps), ended=False)
        if self.done:
            self._record(ev="end")
        return out

    # ---- hooks (the seeded bugs of model_checks.mutants override these) -----------------
    def _quota_count(self, step: Step) -> int:
        """What a consumed step adds to the quota: its global sample count (P5)."""
        return step.global_samples

    def _stops_at_quota(self) -> bool:
        """Non-join: the epoch ends at the step that reaches the quota, mid-round (P5)."""
        return True

    def _chains(self) -> bool:
        """Non-join: whether an iteration that ends before the quota chains the next one (P5)."""
        return True

    # ---- helpers ----------------------------------------------------------------------
    def _end_iteration(self, proto: RankProtocol) -> None:
        self.last_out = ()
        if self.quota is None or not self._chains():
            self.done = True
        elif self.quota.emitted == self._iteration_start:
            self._record_gather(proto, target=0, ended=True)
            raise NonJoinStalledError(
                f"rank {self.rank}: non-join iteration {self.iteration} of epoch {self.epoch} consumed nothing "
                f"before ranks {proto.finished_ranks} finished (does a rank have no data?)", rank=self.rank)
        self._record_gather(proto, target=0, ended=True)
        if self.done:
            self._record(ev="end")
        else:
            self.protocol = None  # chain: sampler_epoch names the next order

    def _proto(self) -> RankProtocol:
        if self.protocol is None:
            raise ProtocolStateError(f"rank {self.rank}: no logical iteration is running "
                                     "(call start_iteration with the order of sampler_epoch)")
        return self.protocol

    def _trace_config(self) -> dict[str, Any]:
        frac = self.config.regroup_fraction
        return {"token_budget": self.config.token_budget, "budget": self.config.budget,
                "buffer_size": self.config.buffer_size,
                "depth": self.config.outstanding_depth, "mode": self.config.mode,
                "target_policy": self.config.target_policy, "overflow_policy": self.config.overflow_policy,
                "output_capacity": self.config.output_capacity or 0,
                "regroup": [0, 0] if frac is None else [frac.numerator, frac.denominator],
                "reserve_divisor": self.config.reserve_divisor}

    def _record(self, **event: Any) -> None:
        if self.trace is not None:
            self.trace.append(event)

    def _record_gather(self, proto: RankProtocol, target: int, ended: bool) -> None:
        if self.trace is None:
            return
        status = proto.status or Status.WAITING
        quota = self.quota or QuotaTracker(0)
        self.trace.append({
            "ev": "gather", "round": proto.round - (0 if ended else 1), "status": status.name.lower(),
            "grouping": proto.grouping, "target": target, "ended": ended,
            "out": [list(o) for o in self.last_out], "held": sorted(proto.held),
            "consumed": quota.emitted, "last_step": quota.last_step, "done": self.done,
        })

