"""``ODBDataLoader``: the drop-in loader that yields token-budgeted, rank-aligned batches."""

from __future__ import annotations

import dataclasses
import inspect
import os
import pickle
import queue
import signal
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal, NoReturn

import torch.multiprocessing as tmp
from torch.utils.data import Dataset, DistributedSampler, default_collate

from odb_core import ODBConfig
from odb_core.config import BudgetName, LossScaling, Mode, TargetPolicyName
from odb_core.elastic import (
    check_own_state,
    check_resumed_epoch,
    check_single_state,
    deals_views,
    tail_resume,
    typed_state_errors,
)
from odb_core.epoch import EpochDriver
from odb_core.errors import (
    CollateProcessError,
    LoaderStateError,
    ODBWarning,
    PeerError,
    PinMemoryError,
    ResumeStateError,
    UnsupportedSettingError,
)
from odb_core.sampler import pool_size
from odb_core.tail import TailPosition
from odb_torch.collate_process import (
    STACK_SIGNAL,
    CollateSpec,
    Rendezvous,
    collate_main,
    file_system_sharing,
    release_payload,
)
from odb_torch.elastic import (
    ElasticEpoch,
    ElasticOrder,
    check_order,
    check_sampler,
    check_state_total,
    order_fields,
    order_total,
    plan_resume,
    rank_share,
)
from odb_torch.inbox import Inbox
from odb_torch.loader_options import (
    CONFIG_DEFAULT,
    check_rank_sampler,
    collate_rendezvous,
    free_port_slot,
    protocol_config,
    rank_and_world,
    take_port_slot,
    uses_default_port,
    warn_worker_count,
)
from odb_torch.losses import shifted_loss_tokens
from odb_torch.messages import Batch, EpochEnd, Failure, Reply, StartEpoch, Stop, decode
from odb_torch.padding_free import packed_collate, unwrapped
from odb_torch.pinning import pin_batch, pinning_available
from odb_torch.process_guard import close_at_exit
from odb_torch.shared_tail import check_tail_sampler
from odb_torch.start_failure import (
    StartMethod,
    check_spawnable,
    explain_start_failure,
    resolve_start_method,
    unpicklable_error,
)
from odb_torch.step_info import StepInfo
from odb_torch.stream_loading import (
    StreamSampler,
    check_stream_config,
    check_stream_ids,
    check_stream_start,
    is_stream,
    stream_resume,
    stream_state,
)

_STARTS: dict[str, int] = {}
"""Collate groups started by this process per rendezvous address (:attr:`CollateSpec.start`)."""


def _close_writer(q: Any) -> None:
    """Close this process's write end of ``q``'s pipe (``multiprocessing.Queue`` keeps it as
    ``_writer``; nothing is written here): with its sender gone, a read of the pipe then ends
    at once (:meth:`odb_torch.inbox.Inbox.stop`). Skipped where the queue has no such end."""
    writer = getattr(q, "_writer", None)
    try:
        if writer is not None:
            writer.close()
    except OSError:
        pass


def _release_unread(inbox: Inbox, out: Any) -> None:
    """Under torch's ``file_system`` sharing strategy, give back the batches the collate process
    (gone now) queued that nobody read (:func:`~odb_torch.collate_process.release_payload`: an
    unread batch's ``/dev/shm`` segment stayed until every process of the job had exited, 7
    segments per abandoned loop, measured)."""
    reader = getattr(out, "_reader", None)

    def pending() -> bool:
        try:
            return reader is not None and bool(reader.poll(0))
        except OSError:
            return False

    for payload in inbox.drain(pending):
        release_payload(payload)


def _signal_name(number: int) -> str:
    """``SIGKILL`` for 9; ``signal 40`` for a number without a name (a real-time signal)."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


COLLECTIVE_GRACE = 0.25
"""Seconds :meth:`ODBDataLoader.close` waits for a collate process still inside its collate group's
rendezvous, where it reads no Stop, before it terminates it: the peers that are coming arrive
within milliseconds of each other, one that never started not before the group's timeout (close()
waited its whole timeout for it: 10 s, 5 s at exit after a Ctrl-C)."""
POLL = 0.02
"""Seconds between :func:`await_exit`'s looks at a collate process told to stop."""


def await_exit(proc: Any, rendezvous: Rendezvous, timeout: float, grace: float = COLLECTIVE_GRACE,
               clock: Callable[[], float] = time.monotonic) -> None:
    """Wait up to ``timeout`` seconds for ``proc``, told to stop, to exit; return after ``grace``
    seconds if it is inside its group's rendezvous (:attr:`Rendezvous.waiting`): it cannot read the
    Stop before its peers come, and they may never come. A process in a later gather is waited for:
    its peers joined the group once, so the gather completes, or fails as soon as a peer exits, and
    it then reads the Stop or ends; so is one loading, collating or waiting for room or a command."""
    deadline = clock() + timeout
    since: float | None = None
    while (left := deadline - clock()) > 0:
        proc.join(min(left, POLL))
        if proc.exitcode is not None:
            return
        if not rendezvous.waiting:
            since = None
        elif since is None:
            since = clock()
        elif clock() - since >= grace:
            return


SILENCE_GRACE = 2.0
"""The trainer waits ``timeout * SILENCE_GRACE`` for a live but silent collate process, so
that the collate process's own, more precise timeouts (collate group, DataLoader workers,
both ``timeout``) report first."""


EPOCH_END_PATIENCE = 30.0
"""Seconds a ``skip_idle`` rank whose loop ended early waits in :meth:`ODBDataLoader.state_dict` for the
epoch's step count (at most its ``timeout``): once every rank's loop is over its collate process
reports it within a round or two, milliseconds."""


class _NoMessage(Exception):
    """No message from the collate process within the patience :meth:`ODBDataLoader._receive` was given."""


class ODBDataLoader:
    """Online Dynamic Batching over a map-style dataset or a stream, under DDP or alone.

    Each yielded batch is exactly what ``collate_fn`` returned for one token-budgeted
    group (P3); every rank yields the same number of batches per epoch (P2), idle
    ranks getting zero-weight batches (``step_info.is_idle``, ``loss_scale == 0``)
    unless ``skip_idle=True`` (for trainers using torch's ``Join``): then a rank's epoch
    loop ends as soon as the rank has no real batch left, while its collate process
    keeps serving the epoch's rounds for its peers (so the rank can join instead of
    waiting in a collective its peers cannot reach); keep the loader open until every
    rank's loop ended, as ``Join``'s context does. Leaving an epoch
    early (``break``) and iterating again restarts the collate process, so no stale
    batch carries over; do it at the same step on every rank. In join mode
    every sampler view is yielded once per epoch (P4). Multiply the local mean loss
    by ``loader.step_info.loss_scale`` before ``backward()`` for the exact per-token
    gradient (P7).

    Args:
        dataset: a map-style dataset (picklable: it is sent to the collate process), or an
            ``IterableDataset``: this rank's stream (its shard, e.g. ``split_dataset_by_node``),
            read in its own order with no ``len()`` (join mode, no sampler; an element's index
            is its position in the stream; ``set_epoch`` is forwarded to it; README "Streaming").
        token_budget: L_max, padded tokens per batch.
        config: the core's :class:`~odb_core.ODBConfig` instead of the protocol keywords
            (token_budget, buffer_size, depth, mode, loss_scaling, target_policy, seed, shuffle_steps,
            regroup_padding, budget, shared_tail, reserve_divisor); a keyword given with it must agree with it
            (``ValueError`` naming the keyword otherwise). Protocol keywords left out take
            ``ODBConfig``'s defaults (buffer 1024, depth = buffer, join, exact, target policy
            ``balanced`` under the padded budget and ``min`` under the packed one, seed 0,
            shuffled steps, regroup above 2% padding, padded budget, no pool).
        collate_fn: turns a list of samples into a batch (default ``default_collate``).
        mode: ``"join"`` (default): every sampler view is yielded once per epoch (P4);
            ``"non-join"``: the paper's opt-in mode, where an epoch ends at the first step
            whose cumulative global sample count reaches ``len(dataset)`` (P5), chaining
            logical iterations over fresh permutations; fetched views may go unyielded.
        sampler: this rank's sampler (a ``DistributedSampler`` or compatible, with
            ``set_epoch``); default ``DistributedSampler(drop_last=False)``.
        length_fn: a sample's length (default ``len(sample["input_ids"])``).
        loss_tokens_fn: a sample's loss tokens (default: labels != -100 if it has
            labels, else its length; with ``collate_fn=packed_collate`` (or a ``functools.partial``
            of it), whose first label per sample is -100: ``losses.shifted_loss_tokens``, what a loss
            over its rows counts; a function that calls ``packed_collate`` needs it passed).
        shuffle_steps: each rank emits a round's steps in a seeded order of its own
            (default True; ``ODBConfig.shuffle_steps``), fixed before the ranks exchange
            step sizes, so pairing and loss weights hold (P2, P7) while a global step mixes
            lengths across ranks and rounds do not run from short to long samples.
        regroup_padding: hold back groups padded above this fraction for one round to
            regroup with the next arrivals (default 0.02; None: off;
            ``ODBConfig.regroup_padding``).
        budget: ``"padded"`` (default: max length x group size <= token_budget) or
            ``"packed"`` (sum of lengths <= token_budget; pair it with
            :func:`~odb_torch.padding_free.packed_collate`, ``docs/packing.md``).
        shared_tail: the fraction of each epoch's global order kept as a pool that ranks claim
            from as their own views run out, the least loaded first (join mode, the default
            ``DistributedSampler``; a pooled epoch resumes mid-epoch: on the same world size
            from each rank's own state, on another from every rank's states). Cuts the alignment
            overhead at large world sizes (``docs/scale.md``); 0 (default): none.
        reserve_divisor: under the packed budget with a pool, a round of the pool's reserve
            deals one view each to the ceil(W / reserve_divisor) roomiest ranks (default 8: one
            a round up to W=8; ``ODBConfig.reserve_divisor``).
        init_method: rendezvous of the collate group (default ``tcp://MASTER_ADDR:
            MASTER_PORT+1``, +2 for a second loader running at once, and so on; env
            ``ODB_COLLATE_PORT`` in place of ``MASTER_PORT+1``; a free local port when alone).
        timeout: seconds before a silent collate process or peer is an error.
        start_method: how the collate process starts: ``"auto"`` (default): ``fork`` on
            Linux, as a plain DataLoader starts its workers (nothing pickled, the script
            never re-run: notebooks, ``python - < script`` and scripts without a main guard
            work; the collate process never touches CUDA), else ``spawn``; or ``"spawn"``,
            ``"forkserver"``, ``"fork"``. Under spawn and forkserver, what cannot start is
            refused before any process starts (:class:`~odb_core.errors.StartMethodError`).
        worker_start_method: how the collate process starts its DataLoader workers
            (default ``fork`` where available: the collate process is a fresh process
            that has touched no CUDA, so forking it is safe and skips re-importing torch
            and re-pickling the dataset per worker; else ``spawn``).
        rank, world_size: default from the initialised process group, else env.
        idle_sample: streams: a sample whose collated batch is the idle batch of a rank whose
            stream is empty (it saw no sample to build one from).
        element_id: streams: the key of each element's own integer identity (e.g. ``"id"``),
            unique in the epoch: ``step_info.indices`` and the resume's checks use it instead
            of the element's stream position (README "Streaming").
        pin_memory: copy each yielded batch's tensors into page-locked memory, in the
            trainer, as a plain DataLoader's ``pin_memory=True`` does (so ``.to("cuda",
            non_blocking=True)`` is asynchronous; :mod:`odb_torch.pinning`). Where no
            accelerator is available it warns once, as DataLoader does, and leaves batches
            as they are. Default False.
    """

    driver_cls: type[EpochDriver] = EpochDriver
    """The core's epoch driver the collate process runs (checks subclass the loader to seed bugs)."""

    def __init__(
        self,
        dataset: Dataset[Any],
        *,
        token_budget: int | None = None,
        config: ODBConfig | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        sampler: Any = None,
        shuffle: bool = True,
        num_workers: int = 4,
        prefetch_factor: int | None = 2,
        buffer_size: int = CONFIG_DEFAULT,
        depth: int | None = CONFIG_DEFAULT,
        mode: Mode = CONFIG_DEFAULT,
        loss_scaling: LossScaling = CONFIG_DEFAULT,
        target_policy: TargetPolicyName = CONFIG_DEFAULT,
        seed: int = CONFIG_DEFAULT,
        length_fn: Callable[[Any], int] | None = None,
        loss_tokens_fn: Callable[[Any], int] | None = None,
        skip_idle: bool = False,
        shuffle_steps: bool = CONFIG_DEFAULT,
        regroup_padding: float | None = CONFIG_DEFAULT,
        budget: BudgetName = CONFIG_DEFAULT,
        shared_tail: float = CONFIG_DEFAULT,
        reserve_divisor: int = CONFIG_DEFAULT,
        init_method: str | None = None,
        timeout: float = 300.0,
        start_method: StartMethod = "auto",
        worker_start_method: Literal["fork", "spawn", "forkserver"] | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        queue_size: int = 8,
        idle_sample: Any = None,
        element_id: str | None = None,
        pin_memory: bool = False,
    ) -> None:
        self.config = protocol_config(config, token_budget, dict(
            buffer_size=buffer_size, depth=depth, mode=mode, loss_scaling=loss_scaling, target_policy=target_policy,
            seed=seed, shuffle_steps=shuffle_steps, regroup_padding=regroup_padding, budget=budget,
            shared_tail=shared_tail, reserve_divisor=reserve_divisor))
        seed = self.config.seed
        rank, world_size = rank_and_world(rank, world_size)
        self.rank, self.world_size = rank, world_size
        self._default_port = uses_default_port(init_method, world_size)  # its slot's port, at each start
        init_method = collate_rendezvous(init_method, world_size)
        if stream := is_stream(dataset):  # an IterableDataset: odb_torch.stream_loading
            check_stream_config(self.config, rank, world_size, sampler)
        elif element_id is not None:
            raise UnsupportedSettingError(f"rank {rank}: element_id= names a stream element's identity; a map-style "
                                          "dataset's is its index", field="element_id", rank=rank)
        self.sampler: Any = StreamSampler(idle_sample, element_id) if stream else sampler if sampler is not None else \
            DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed, drop_last=False)
        check_rank_sampler(self.sampler, rank, world_size)
        if self.config.shared_tail:  # the pool is cut from the sampler's global order
            check_tail_sampler(self.sampler, rank, world_size)
        if loss_tokens_fn is None and unwrapped(collate_fn) is packed_collate:  # its rows count no first label (P7)
            loss_tokens_fn = shifted_loss_tokens
        elif loss_tokens_fn is None and collate_fn is not None and self.config.budget == "packed":
            warnings.warn(ODBWarning(
                f"rank {rank}: budget='packed' with collate_fn={getattr(collate_fn, '__name__', collate_fn)!r} and no "
                "loss_tokens_fn: each sample's loss tokens are its labels != -100; if the collate masks every "
                "sequence's first label as packed_collate does (a function calling it), pass "
                "loss_tokens_fn=odb_torch.losses.shifted_loss_tokens, else the loss scale counts one token per "
                "sample too many (P7)"), stacklevel=2)
        self._spec = CollateSpec(
            dataset=dataset, collate_fn=collate_fn or default_collate, length_fn=length_fn,
            loss_tokens_fn=loss_tokens_fn, config=self.config, rank=rank, world=world_size,
            init_method=init_method, timeout=timeout, num_workers=num_workers,
            prefetch_factor=prefetch_factor,
            skip_idle=skip_idle, driver_cls=self.driver_cls,
            worker_start_method=worker_start_method or ("fork" if "fork" in tmp.get_all_start_methods() else "spawn"),
        )
        warn_worker_count(num_workers, rank)  # once, here: the collate process's DataLoaders keep torch's quiet
        self.skip_idle = skip_idle
        self.pin_memory = pin_memory and pinning_available()
        if pin_memory and not self.pin_memory:
            warnings.warn(f"rank {rank}: pin_memory=True but no accelerator is available: batches are not pinned",
                          UserWarning, stacklevel=2)
        self.timeout = timeout
        self.epoch = 0
        self._start_method = resolve_start_method(start_method, tmp.get_all_start_methods())
        self._ctx: Any = tmp.get_context(self._start_method)
        self._queue_size = queue_size
        self._init_run_state()

    def _init_run_state(self) -> None:
        """The collate process's handles and the epoch's bookkeeping, before any ``iter()``."""
        self._proc: Any = None
        self._rendezvous = Rendezvous()  # the running collate process's (_start)
        self._ctrl: Any = None
        self._out: Any = None
        self._inbox: Inbox | None = None  # reads self._out in a thread (odb_torch.inbox)
        self._step_info: StepInfo | None = None
        self._consumed: list[int] = []  # sampler positions yielded this epoch
        self._steps = 0  # steps (idle included) consumed this epoch
        # (positions, steps, stream resume point) each recent yield added, for state_dict(unconsumed=k)
        self._recent: deque[tuple[int, int, Any]] = deque(maxlen=64)
        self._stream_point: Any = None  # a stream's resume point before the oldest of _recent (None: re-read)
        self._stream_start: Any = None  # the loaded resume point, for the resumed epoch's StartEpoch
        self._consumed_ids: list[int] = []  # a stream's element_id identities of _consumed, in order
        self._resume: tuple[int, list[int], int] | None = None
        self._tail_resume: TailPosition | None = None  # a loaded pooled position, for the resumed StartEpoch
        self._order: str | None = None  # the digest of this epoch's sampler order (odb_core.elastic.order_digest)
        self._order_resume: str | None = None  # a loaded state's order digest, for the resumed StartEpoch
        self._tail = TailPosition(0, ())  # a pooled epoch's pool position at the last yielded step
        self._epoch_open = False  # an iteration started and has not reached its EpochEnd
        self._completed: int | None = None  # the epoch whose EpochEnd was reached last
        self._awaiting_total = False  # skip_idle: the loop ended early; the epoch's step count is still to come
        self._slot: int | None = None  # the default-port slot its running collate process holds
        self._serial = 0  # epochs started by this loader (the same on every rank: names trace files)
        self._generation = 0  # bumped by every iter() and close(): older iterators are stale
        self._running = 0  # the generation of the iterator that started last (its first next())
        self._stale_reason = ""
        self._elastic: ElasticEpoch | None = None  # this rank's share of an epoch resumed on another world size
        self._heard = False  # the current collate process has sent a message

    @property
    def step_info(self) -> StepInfo:
        """The :class:`StepInfo` of the batch just yielded."""
        if self._step_info is None:
            raise RuntimeError("step_info is available once the loader has yielded a batch")
        return self._step_info

    def set_epoch(self, epoch: int) -> None:
        """Select the sampler permutation of ``epoch`` (call it on every rank, as with DistributedSampler).
        Another epoch than the current one starts at its beginning: :meth:`state_dict` then holds
        nothing consumed (a position loaded by :meth:`load_state_dict` stays held, its epoch checked
        at ``iter``)."""
        if epoch != self.epoch and self._epoch_open:  # a live iterator of the old epoch would append to the new
            self._invalidate(f"set_epoch({epoch}) changed the epoch")
        if epoch != self.epoch and self._resume is None:
            self._consumed, self._steps, self._consumed_ids = [], 0, []
            self._awaiting_total = False
            self._tail = TailPosition(0, ())
            self._recent.clear()
            self._stream_point = None
        self.epoch = epoch

    def _warn_repeated_epoch(self, epoch: int) -> None:
        """An :class:`~odb_core.errors.ODBWarning` when a shuffling sampler's epoch, completed, starts
        again without a resumed position: ``set_epoch`` was not called, so every epoch repeats its
        order, and ``state_dict`` names it (a resume from ``loader.epoch`` would rerun epochs).
        torch's ``DistributedSampler`` repeats silently; an unshuffled order (an evaluation loader)
        is the same every epoch, so nothing is said there."""
        if self._resume is None and self._completed == epoch and getattr(self.sampler, "shuffle", False):
            warnings.warn(ODBWarning(
                f"rank {self.rank}: epoch {epoch} starts again, in the order it had: call loader.set_epoch(epoch) "
                f"before each epoch, as with DistributedSampler; else every epoch repeats epoch {epoch}'s order "
                f"and state_dict() records epoch {epoch}"), stacklevel=3)

    def _invalidate(self, reason: str) -> None:
        """Make a live (started) iterator raise :class:`LoaderStateError` on its next ``next()``; the
        next ``iter(loader)`` restarts the collate process (the epoch it was in is abandoned)."""
        if self._running == self._generation:  # an iterator made but not started is not live yet
            self._generation += 1
            self._stale_reason = reason

    def state_dict(self, unconsumed: int = 0) -> dict[str, Any]:
        """The loader's position at the current step boundary (take it on every rank at the same step).

        Restoring it with :meth:`load_state_dict` makes the next iteration emit exactly
        the sampler views of this epoch not yet yielded: nothing lost, nothing twice.
        ``unconsumed=k`` gives the position before the last ``k`` yielded batches, for a
        wrapper that reads ahead (at most 64): they are emitted again after a resume.
        Join mode only: a non-join epoch chains iterations and may not yield every view.
        With a plain ``DistributedSampler`` it also records the epoch's global order (``total``,
        ``order_world``; after an elastic resume the global positions dealt to this rank,
        ``views``, and ``pool``), so that every rank's states resume on another world size.
        With ``shared_tail`` it records the pool's cursor and this rank's claims (``pool_cursor``,
        ``claimed``): a pooled epoch resumes mid-epoch on the same world size, each rank from its
        own state (:func:`odb_core.elastic.tail_resume`).
        """
        if self.config.mode != "join":
            raise UnsupportedSettingError(f"rank {self.rank}: state_dict/load_state_dict resume mid-epoch in join "
                                          "mode only; in non-join mode checkpoint at epoch boundaries", field="mode",
                                          rank=self.rank)
        if not 0 <= unconsumed <= len(self._recent):
            raise ValueError(f"unconsumed={unconsumed}: only the last {len(self._recent)} yielded batches "
                             "of this epoch can be handed back")
        if self._awaiting_total and not unconsumed:
            self._await_epoch_total()
        back = list(self._recent)[len(self._recent) - unconsumed:]
        n_pos, n_steps = sum(b[0] for b in back), sum(b[1] for b in back)
        consumed = self._consumed[: len(self._consumed) - n_pos]
        order = sorted(range(len(consumed)), key=consumed.__getitem__)  # consumed_ids follow it (streams)
        # a loaded position still held names its own epoch, whatever set_epoch was called with since
        epoch = self._resume[0] if self._resume is not None else self.epoch
        state: dict[str, Any] = {"epoch": epoch, "steps": self._steps - n_steps, "consumed": [consumed[k] for k in order],
                                 "rank": self.rank, "world_size": self.world_size, "seed": self.config.seed}
        state.update(self._order_state(epoch, unconsumed, order))
        if self._order is not None and consumed:  # what the positions index: a resume checks it
            state["order_digest"] = self._order
        return state

    def _order_state(self, epoch: int, unconsumed: int, order: list[int]) -> dict[str, Any]:
        """What a state's positions index: an elastic share's views of the global order (plain or
        pooled, ``order_tail``), the global order of a plain ``DistributedSampler`` (pooled with a
        shared tail: ``pool_size``), or this rank's stream (``consumed_ids`` in the order of the
        sorted ``consumed``: ``order`` lists the delivered positions' indices in that order); the
        sampler's order fields; a pooled epoch's pool position (``pool_cursor``, ``claimed``)."""
        state: dict[str, Any] = {}
        share = self._elastic if self._elastic is not None and self._elastic.epoch == epoch else None
        tail = self.config.shared_tail
        if share is not None:  # sampler positions index the dealt views of the global order
            state.update(views=list(share.views), pool=share.pool, order_world=share.order_world, total=share.total)
            if share.order_tail:
                state["order_tail"] = share.order_tail
        elif type(self.sampler) is DistributedSampler:  # the global order is known: elastic resume possible
            state.update(order_world=self.world_size, total=order_total(self.sampler, self.world_size, tail))
            if tail:
                state["pool_size"] = pool_size(len(self.sampler.dataset), tail)  # type: ignore[arg-type]
        elif isinstance(self.sampler, StreamSampler):  # positions in this rank's stream: same world size only
            state.update(stream_state(self._spec.num_workers))
            kept = len(self._recent) - unconsumed
            state["stream_resume"] = self._recent[kept - 1][2] if kept > 0 else self._stream_point
            if self.sampler.element_id is not None:
                state["consumed_ids"] = [self._consumed_ids[k] for k in order]
                state["element_id"] = self.sampler.element_id
        if isinstance(self.sampler, DistributedSampler):  # what fixes its order: every resume checks it
            state.update(order_fields(self.sampler))
        if tail:  # a pooled epoch's positions: resumable with the pool's position
            state.update(shared_tail=tail, pool_cursor=self._tail.cursor, claimed=list(self._tail.claimed))
        return state

    def _await_epoch_total(self) -> None:
        """Under ``skip_idle`` a rank's loop ends at its last real batch while its peers go on; the
        epoch's end, the step boundary a checkpoint after the loop names, is the count the collate
        process sends once every rank's loop is over (it waits for them: take the state after the
        epoch, on every rank, as with Join). Without it the ranks' states disagreed on ``steps``
        and no end-of-epoch checkpoint resumed (P2)."""
        why = (f"rank {self.rank}: under skip_idle this rank's loop ended before its peers', and a state names the "
               "epoch's end, whose step count its collate process reports once every rank's loop is over")
        advice = ("take state_dict() on every rank after every rank's loop ran to the epoch's end (after the Join), "
                  "or after set_epoch(next epoch) (a break at max_steps leaves the epoch unfinished)")
        if self._proc is None:
            raise LoaderStateError(f"{why}; the loader was closed before it came: {advice}", rank=self.rank)
        patience = min(self.timeout, EPOCH_END_PATIENCE)
        try:
            item = self._receive(patience)
        except _NoMessage:
            raise LoaderStateError(f"{why}; it did not come within {patience:g}s (a peer still training, or one "
                                   f"that left the epoch early): {advice}", rank=self.rank) from None
        if isinstance(item, Failure):
            error = item.error
            if isinstance(error, PeerError):  # a peer left the epoch (a break) and its group stopped gathering
                error = PeerError(f"{why}; the collate group failed first ({error}): {advice}", rank=self.rank,
                                  ranks=error.ranks)
            self._fail(error)
        assert isinstance(item, EpochEnd) and item.steps is not None, f"unexpected message {item!r}"
        self._steps, self._awaiting_total = item.steps, False

    def load_state_dict(self, state: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> None:
        """Resume from :meth:`state_dict` (join mode only).

        ``state`` is this rank's own state_dict (the rank, world size and seed must match), or, to
        resume on another number of ranks, the list of every rank's state_dicts of one step
        boundary or their ``odb_core.elastic.merge_states(...).to_dict()``: this rank then serves
        its share of the views not yet yielded (every one on exactly one rank) and the step count
        continues from the checkpoint's (``steps`` counts the epoch's steps over both runs).
        Elastic resume needs a plain ``DistributedSampler`` (:class:`UnsupportedSettingError`
        otherwise); states that are not one step boundary raise :class:`ResumeStateError`.
        """
        if self.config.mode != "join":
            raise UnsupportedSettingError(f"rank {self.rank}: load_state_dict resumes mid-epoch in join mode only; "
                                          "in non-join mode checkpoint at epoch boundaries", field="mode",
                                          rank=self.rank)
        if self._epoch_open:  # a live iterator would go on yielding, and append to the loaded position
            self._invalidate("load_state_dict() loaded another position")
        with typed_state_errors(self.rank):  # a malformed state: ResumeStateError, never a bare KeyError
            self._load(state)

    def _load(self, state: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> None:
        tail = tail_resume(state, self.config.shared_tail, self.rank, self.world_size)
        if isinstance(self.sampler, StreamSampler):  # same world only (ResumeStateError otherwise)
            self._resume = stream_resume(state, self.rank, self.world_size, self.config.seed,
                                         self._spec.num_workers)
            self._stream_start = check_stream_start(state.get("stream_resume"), self.rank,  # type: ignore[union-attr]
                                                    self._spec.num_workers, self._spec.dataset, self._resume[1])
            self._consumed_ids = check_stream_ids(state, self.rank, self.sampler.element_id)  # type: ignore[arg-type]
            self.epoch = self._resume[0]
            self._hold_resumed_position()
            return
        if isinstance(state, Mapping) and state.get("stream"):  # positions of a stream, not of this sampler
            raise ResumeStateError(f"rank {self.rank}: the state is a stream's (its positions name the stream's "
                                   "elements), this loader reads a map-style dataset through its sampler; resume "
                                   "it with the stream", field="stream", rank=self.rank)
        if isinstance(state, Mapping) and state.get("kind") != "odb-global":
            check_single_state(state, self.rank, self.world_size)  # this world's own, or a typed error
            check_own_state(state, self.rank, self.config.seed)
            check_order(state, self.sampler, self.rank)
            share = rank_share(state)
            check_state_total(state, self.sampler, share, self.rank)
            self.epoch = int(state["epoch"])
            self._resume = (self.epoch, list(state["consumed"]), int(state["steps"]))
            self._tail_resume = tail
            self._order_resume = state.get("order_digest")
        else:
            merged, share = plan_resume(self.sampler, self.rank, self.world_size, self.config.seed, state)
            if not deals_views(merged, self.config.shared_tail):  # a pooled epoch's start: whole, pool cut anew
                share = None
            self.epoch = merged.epoch
            self._resume = (self.epoch, [], merged.steps)
            self._tail_resume = self._order_resume = None  # the order is dealt anew
        if share is not None or self._elastic is not None:
            self.close()  # the collate process holds the sampler it started with
        self._elastic = share
        self._hold_resumed_position()

    def _hold_resumed_position(self) -> None:
        """Until the resumed epoch yields, :meth:`state_dict` is the loaded position (a checkpoint
        taken right after a resume must not forget what the first run consumed)."""
        assert self._resume is not None
        _, consumed, steps = self._resume
        self._consumed, self._steps = list(consumed), steps
        self._awaiting_total = False
        self._tail = self._tail_resume or TailPosition(0, ())
        self._order = self._order_resume
        self._recent.clear()
        self._stream_point = self._stream_start

    def _start(self) -> None:
        sampler = self.sampler if self._elastic is None else ElasticOrder(
            check_sampler(self.sampler, self.rank, self.world_size), self._elastic)
        check_spawnable((self._spec, sampler), self._start_method, inspect.currentframe(), rank=self.rank)
        if self._default_port:  # a port of its own while its collate process runs (freed by close())
            self._slot = take_port_slot()
            self._spec = dataclasses.replace(self._spec, init_method=collate_rendezvous(None, self.world_size,
                                                                                        self._slot))
        # the store's identity: this process's collate groups formed at this address so far
        # (every loader's starts); ranks create and restart their loaders alike, so their counts agree
        _STARTS[self._spec.init_method] = start = _STARTS.get(self._spec.init_method, 0) + 1
        self._spec = dataclasses.replace(self._spec, start=start)
        self._ctrl = self._ctx.Queue()
        self._out = self._ctx.Queue(maxsize=self._queue_size)
        self._rendezvous = Rendezvous(self._ctx)
        self._proc = self._ctx.Process(target=collate_main, name=f"odb-collate-rank{self.rank}", daemon=False,
                                       args=(self._spec, sampler, self._ctrl, self._out, self._rendezvous))
        self._heard = False
        try:
            self._proc.start()
        except (pickle.PicklingError, TypeError, AttributeError) as exc:  # what pickling the objects raises
            self._free_slot()
            if self._start_method == "fork":
                raise
            self._proc = None  # nothing started: the next iter() tries again
            for q in (self._ctrl, self._out):
                q.close()
            raise unpicklable_error(exc, self._start_method, self.rank) from exc
        self._inbox = Inbox(self._out)
        close_at_exit(self)  # never let interpreter exit wait on the (non-daemon) collate process

    def __iter__(self) -> Iterator[Any]:
        """The epoch's batches. One live iterator per loader: a newer ``iter(loader)`` (at once,
        before its first ``next()``) or :meth:`close` makes an older one raise
        :class:`LoaderStateError` on ``next()``, and so does iterating another epoch than the one
        :meth:`load_state_dict` loaded (it would discard it)."""
        self._generation += 1
        self._stale_reason = "it was superseded by a newer iter(loader) (one live iterator per loader)"
        return self._epoch_batches(self._generation)

    def _epoch_batches(self, generation: int) -> Iterator[Any]:
        """:meth:`__iter__`'s iterator, ``generation`` its number (stale once the loader's moves on)."""
        if self._generation != generation:
            raise LoaderStateError(f"rank {self.rank}: next() on a stale loader iterator: {self._stale_reason}; "
                                   "start a new `for batch in loader` loop", rank=self.rank)
        epoch = self.epoch
        check_resumed_epoch(None if self._resume is None else self._resume[0], epoch, self.rank)
        self._warn_repeated_epoch(epoch)
        if self._epoch_open or (self._elastic is not None and self._resume is None) or (
                self.skip_idle and self._proc is not None):
            # the previous iteration was abandoned mid-epoch (break): the collate process
            # is still in that epoch and its queued batches are stale, so restart it; an
            # elastic share was served (or abandoned) once: a later pass runs the plain sampler;
            # under skip_idle every rank restarts at every pass: a rank whose loop ended early
            # cannot break with a peer that leaves the epoch at max_steps, and its collate
            # process would stay in that epoch's group while the peer's starts a new one
            self.close()  # marks every iterator stale: this one takes a new number
            self._elastic = None if self._resume is None else self._elastic
            self._generation += 1
            generation = self._generation
            self._stale_reason = "it was superseded by a newer iter(loader) (one live iterator per loader)"
        self._running = generation
        if self._proc is None:
            self._start()
        elif not self._proc.is_alive():
            raise CollateProcessError(f"rank {self.rank}: the collate process is gone "
                                      f"(exit code {self._proc.exitcode}); create a new loader", rank=self.rank)
        self._start_epoch(epoch)
        pending = (0, 0)  # positions and steps of skipped idle steps, charged to the next yield
        while True:
            item = self._receive()
            if isinstance(item, EpochEnd):
                self._epoch_open, self._completed = False, epoch
                self._awaiting_total = item.steps is None  # skip_idle: the count follows when every rank is done
                return
            if isinstance(item, Failure):
                self._fail(item.error)
            assert isinstance(item, Batch), f"unexpected message {item!r}"
            skipped = item.info.is_idle and self.skip_idle
            batch = self._pinned(item) if self.pin_memory and not skipped else item.batch  # before any state
            self._consumed.extend(item.positions)
            self._order = item.order
            if item.tail is not None:  # a pooled epoch: the pool's position after this step's round
                self._tail = TailPosition(item.tail[0], self._tail.claimed + item.tail[1])
            if isinstance(self.sampler, StreamSampler) and self.sampler.element_id is not None:
                self._consumed_ids.extend(item.info.indices)
            self._steps += 1
            pending = (pending[0] + len(item.positions), pending[1] + 1)
            if skipped:
                continue
            if len(self._recent) == self._recent.maxlen:
                self._stream_point = self._recent[0][2]
            self._recent.append((*pending, item.resume))
            pending = (0, 0)
            self._step_info = item.info
            yield batch
            if self._generation != generation:
                raise LoaderStateError(f"rank {self.rank}: next() on a stale loader iterator: {self._stale_reason}; "
                                       "start a new `for batch in loader` loop", rank=self.rank)

    def _start_epoch(self, epoch: int) -> None:
        """Tell the collate process to run ``epoch`` from the loaded position, if any (then
        released), else from its start; this loader's position restarts there."""
        assert self._ctrl is not None
        if self._resume is not None:
            _, skip, first_step = self._resume
            start, self._stream_point = self._stream_start, self._stream_start
        else:
            skip, first_step, start, self._stream_point = [], 0, None, None
            self._consumed_ids = []
        tail, self._tail = self._tail_resume, self._tail_resume or TailPosition(0, ())
        order, self._order = self._order_resume, None
        self._resume = self._stream_start = self._tail_resume = self._order_resume = None
        self._consumed, self._steps = list(skip), first_step
        self._awaiting_total = False
        self._recent.clear()
        self._ctrl.put(StartEpoch(epoch, tuple(skip), first_step, self._serial, start, tuple(self._consumed_ids),
                                  None if tail is None else (tail.cursor, tail.claimed), order))
        self._serial += 1
        self._epoch_open = True

    def _pinned(self, item: Batch) -> Any:
        """``item``'s batch page-locked; a failure is :class:`PinMemoryError` naming the rank and
        the batch's indices (torch raises an untyped RuntimeError), raised before anything of the
        batch is counted as consumed."""
        try:
            return pin_batch(item.batch)
        except RuntimeError as exc:
            raise PinMemoryError(f"rank {self.rank}: page-locking the batch of dataset indices {list(item.info.indices)} "
                                 f"failed ({type(exc).__name__}: {exc}); pass pin_memory=False, or leave page-locked "
                                 "memory free", rank=self.rank, indices=item.info.indices) from exc

    def _receive(self, patience: float | None = None) -> Reply:
        """The collate process's next message; a typed error if it died or stayed silent
        (``patience``: seconds after which :class:`_NoMessage` is raised instead)."""
        deadline = time.monotonic() + (self.timeout * SILENCE_GRACE if patience is None else patience)
        inbox, proc = self._inbox, self._proc
        while True:
            if inbox is None or proc is None or self._proc is not proc:  # close() from another thread
                raise LoaderStateError(f"rank {self.rank}: the loader was closed while this iterator waited for a "
                                       "batch; start a new `for batch in loader` loop", rank=self.rank)
            try:
                payload = inbox.get(timeout=1.0)
            except (EOFError, OSError) as exc:  # the queue's pipe broke with its sender
                if self._proc is not proc:
                    continue  # closed meanwhile: said above
                proc.join(5.0)
                self._fail(self._death() if not proc.is_alive() else CollateProcessError(
                    f"rank {self.rank}: lost the collate process's queue: {type(exc).__name__}: {exc}",
                    rank=self.rank))
            except queue.Empty:
                if self._proc is not proc:
                    continue
                if not proc.is_alive():
                    self._fail(self._death())
                if time.monotonic() > deadline:
                    if patience is not None:
                        raise _NoMessage from None
                    self._dump_collate_stacks()
                    self._fail(PeerError(
                        f"rank {self.rank}: no batch for {self.timeout * SILENCE_GRACE:.0f}s from a live collate "
                        "process: a peer rank is stalled or gone, or this rank's collate_fn (or, with "
                        "num_workers=0, its __getitem__) is stuck; the collate process's threads' stacks "
                        "are on stderr", rank=self.rank))
                continue
            self._heard = True
            try:
                return decode(payload)
            except Exception as exc:  # a batch's tensors died with their sender, or a bad message
                if self._proc is not proc:
                    continue  # closed meanwhile
                proc.join(1.0)
                if not proc.is_alive():
                    self._fail(self._death())
                self._fail(CollateProcessError(f"rank {self.rank}: a message of the collate process cannot be "
                                               f"unpickled here: {type(exc).__name__}: {exc}", rank=self.rank))

    def _dump_collate_stacks(self) -> None:
        """Ask the live collate process to write its threads' stacks to stderr (it registered
        ``faulthandler`` for :data:`~odb_torch.collate_process.STACK_SIGNAL`); the dump runs in
        its signal handler, before :meth:`close` stops it."""
        if STACK_SIGNAL is None:
            return
        try:
            os.kill(self._proc.pid, STACK_SIGNAL)
        except (OSError, TypeError):  # gone meanwhile, or never started
            pass

    def _death(self) -> CollateProcessError:
        """Why the collate process died, as far as this process can tell."""
        if self._proc is None:  # closed by another thread meanwhile
            return CollateProcessError(f"rank {self.rank}: the loader was closed", rank=self.rank)
        code = self._proc.exitcode
        if code == 1 and not self._heard and self._start_method != "fork":  # died in the spawn bootstrap
            return CollateProcessError(f"rank {self.rank}: " + explain_start_failure(
                (self._spec, self.sampler), self._start_method, code), rank=self.rank)
        how = f"killed by {_signal_name(-code)}" if code is not None and code < 0 else f"exit code {code}"
        return CollateProcessError(f"rank {self.rank}: the collate process died ({how})", rank=self.rank)

    def _fail(self, exc: Exception) -> NoReturn:
        self.close()
        raise exc

    def close(self, timeout: float = 10.0) -> None:
        """Stop the collate process (and its workers); idempotent. An iterator of this loader
        still open raises :class:`LoaderStateError` on its next ``next()``. The collate process
        gets up to ``timeout`` seconds to exit, then is terminated; one still inside its group's
        rendezvous (waiting for a peer) gets :data:`COLLECTIVE_GRACE` (:func:`await_exit`)."""
        proc, self._proc = self._proc, None
        self._epoch_open = False
        self._generation += 1
        self._stale_reason = "the loader was closed"
        if proc is None:
            return
        if proc.is_alive():
            try:
                self._ctrl.put(Stop())
            except Exception:
                pass
            await_exit(proc, self._rendezvous, timeout)
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout)
        if proc.is_alive():
            proc.kill()
            proc.join()
        proc.close()
        if self._inbox is not None:
            if file_system_sharing():
                _release_unread(self._inbox, self._out)
            self._inbox.stop(wake=lambda: _close_writer(self._out))
            self._inbox = None
        for q in (self._ctrl, self._out):
            q.cancel_join_thread()
            q.close()
        self._ctrl = self._out = None
        self._free_slot()

    def _free_slot(self) -> None:
        if self._slot is not None:
            free_port_slot(self._slot)
            self._slot = None

    def __enter__(self) -> ODBDataLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close(timeout=1.0)
        except Exception:
            pass
