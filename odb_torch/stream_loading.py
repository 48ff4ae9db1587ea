"""``ODBDataLoader`` over an ``IterableDataset``: each rank's collate process reads its own stream.

Each rank iterates its own stream (its shard: ``datasets.distributed.split_dataset_by_node``,
or a dataset that shards itself by rank). Inside the collate process a plain
:class:`torch.utils.data.DataLoader` reads it with workers, sharded across them as torch and
``datasets`` define it (``get_worker_info``; a ``datasets`` stream deals its ``n_shards``
over the workers); the stream is the DataLoader's output order (torch's round robin over the
workers: deterministic for a deterministic dataset), read in chunks of consecutive elements.
No ``len()`` is needed: the core's driver (``EpochDriver(stream=True)``) fetches stream
positions, this module reads them in order and reports the end when a read finds the stream
exhausted; every protocol decision stays the driver's (P1-P6). An element's identity, in
``step_info.indices`` and ``state_dict``, is its position in this rank's stream (with the rank,
it names the element). Resume starts from the dataset's own state where it has one
(``state_dict``/``load_state_dict``, as ``datasets`` streams do): each batch carries the workers'
states at the last round boundary of the stream's order below every position not yet yielded
(:class:`StreamReader`), and the resumed read starts there; otherwise (a plain generator) it
re-reads the stream and passes over the positions consumed.
"""

from __future__ import annotations

import copy
import numbers
import os
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from odb_core import ODBConfig
from odb_core.elastic import check_counts, stream_world_error
from odb_core.epoch import Delivery, EpochDriver, LoopEnd
from odb_core.errors import (
    CollateProcessError,
    InvalidSampleError,
    ODBError,
    ResumeStateError,
    SampleLoadError,
    UnsupportedSettingError,
)
from odb_torch.collate_process import (
    MAX_CHUNK,
    CollateServer,
    CollateSpec,
    LoadStuck,
    Rendezvous,
    _ParentGone,
    check_interval,
    next_loaded,
    quiet_worker_advice,
)
from odb_torch.messages import Batch, EpochEnd, Reply, StartEpoch
from odb_torch.process_guard import DieWithParent
from odb_torch.sample_packing import PackedChunk, Packer, cause_line, describe_exception, pack, unpack

STREAM_CHUNK = 32
"""Consecutive elements a DataLoader worker reads and ships as one packed chunk."""


@dataclass(frozen=True)
class StreamSampler:
    """The loader's ``sampler`` over a stream: the order is the stream's own; the collate process
    it is handed to serves the stream (``server_cls``)."""

    idle_sample: Any = None
    """A sample whose collated batch is the idle batch of a rank that never saw one (an empty stream)."""
    element_id: str | None = None
    """The key of each element's own identity (an int, unique in the epoch), else its stream position."""


def is_stream(dataset: Any) -> bool:
    """The dataset is read as a stream (a torch ``IterableDataset``, ``datasets`` streaming ones included)."""
    return isinstance(dataset, IterableDataset)


def check_stream_config(config: ODBConfig, rank: int, world: int, sampler: Any) -> None:
    """Refuse what cannot hold over a stream, before any process starts: non-join (the quota N is
    unknown; the core's verdict) and a sampler (a stream has no indices to sample):
    :class:`~odb_core.errors.UnsupportedSettingError` naming ``mode`` or ``sampler``."""
    if sampler is not None:
        raise UnsupportedSettingError(f"rank {rank}: sampler= with an IterableDataset: a stream is read in its own "
                                      "order; shard it per rank (datasets.distributed.split_dataset_by_node)",
                                      field="sampler", rank=rank)
    EpochDriver(config, rank, world, quota=0, stream=True)


def stream_state(num_workers: int) -> dict[str, Any]:
    """The fields a stream's ``state_dict`` adds: the mark the core's merge refuses on another world
    size, and ``num_workers``: the stream's order is torch's round robin over the DataLoader
    workers, each reading its shard of the stream, so positions name elements only at that count."""
    return {"stream": True, "num_workers": num_workers}


def resumable(dataset: Any) -> bool:
    """The stream has its own exact resumable state (``state_dict()``/``load_state_dict()``: ``datasets``
    streams; torchdata's convention), taken in each DataLoader worker after each chunk. Not a
    ``datasets`` stream with a shuffle buffer (``.shuffle(buffer_size=...)``): its state leaves the
    buffer's content out (datasets refills it on load), so such a stream resumes by re-reading."""
    if not (callable(getattr(dataset, "state_dict", None)) and callable(getattr(dataset, "load_state_dict", None))):
        return False
    pending = [getattr(dataset, "_ex_iterable", None)]
    while pending:
        node = pending.pop()
        if node is None:
            continue
        if type(node).__name__ == "BufferShuffledExamplesIterable":
            return False
        pending += [getattr(node, "ex_iterable", None), *getattr(node, "ex_iterables", ())]
    return True


def check_stream_start(start: Any, rank: int, num_workers: int, dataset: Any,
                       consumed: Sequence[int] = ()) -> dict[str, Any] | None:
    """A state's ``stream_resume`` (None: re-read), checked: a stream position and one dataset
    state (or None: from the start) per DataLoader worker, for a :func:`resumable` dataset, with
    every position below it among ``consumed`` (the read starts there: an element below it not
    yet trained would be lost) (:class:`ResumeStateError` otherwise)."""
    if start is None:
        return None
    if not resumable(dataset):
        raise ResumeStateError(f"rank {rank}: the state holds a dataset state (stream_resume) but this loader's "
                               "stream has no exact resumable state", field="stream_resume", rank=rank)
    ok = isinstance(start, Mapping) and isinstance(start.get("position"), int) and start["position"] >= 0 and \
        isinstance(start.get("workers"), Sequence) and len(start["workers"]) == max(1, num_workers)
    if not ok:
        raise ResumeStateError(f"rank {rank}: stream_resume must be a stream position and one dataset state per "
                               f"worker ({max(1, num_workers)}), got {str(start)[:120]}", field="stream_resume",
                               rank=rank)
    below = len({p for p in consumed if p < start["position"]})
    if below != start["position"]:
        raise ResumeStateError(f"rank {rank}: stream_resume starts the read at position {start['position']}, but "
                               f"only {below} of the positions below it are consumed: the others would never be "
                               "read (not a state this loader wrote)", field="stream_resume", rank=rank)
    return {"position": start["position"], "workers": list(start["workers"])}


def check_stream_ids(state: Mapping[str, Any], rank: int, element_id: str | None) -> list[int]:
    """A state's ``consumed_ids`` (the ``element_id`` identities of its consumed positions, in
    order), present exactly when ``element_id`` is set and one per position
    (:class:`ResumeStateError`, field ``consumed_ids``, otherwise)."""
    ids = state.get("consumed_ids")
    if element_id is None and ids is None:
        return []
    if element_id is None or not isinstance(ids, Sequence) or len(ids) != len(state["consumed"]):
        raise ResumeStateError(f"rank {rank}: the state's consumed_ids ({'absent' if ids is None else 'present'}) do "
                               f"not match this loader's element_id={element_id!r}: one identity per consumed "
                               "position with element_id, none without", field="consumed_ids", rank=rank)
    if state.get("element_id", element_id) != element_id:
        raise ResumeStateError(f"rank {rank}: the state's identities are under element_id={state['element_id']!r}, "
                               f"this loader's under {element_id!r}", field="element_id", rank=rank)
    bad = [i for i in ids if not isinstance(i, int) or isinstance(i, bool)]
    twice = sorted(i for i, c in Counter(ids).items() if c > 1) if not bad else []
    if bad or twice:
        raise ResumeStateError(f"rank {rank}: the state's consumed_ids hold {'non-integers ' + str(bad[:4]) if bad else ''}"
                               f"{'identities listed twice ' + str(twice[:8]) if twice else ''}: one element's "
                               "identity per consumed position", field="consumed_ids", indices=twice, rank=rank)
    return list(ids)


def element_identity(element: Any, key: str, rank: int, position: int) -> int:
    """The element's own identity ``element[key]``: an integer (a Python or NumPy int, or a
    one-element integer tensor or array, as a stream formatted for torch or NumPy gives it), else
    :class:`InvalidSampleError` naming the rank and the stream position."""
    value = element.get(key) if isinstance(element, Mapping) else None
    item = getattr(value, "item", None)  # a one-element tensor; a 0-d array (NumPy-formatted, after .map())
    if callable(item) and ((isinstance(value, torch.Tensor) and value.numel() == 1) or getattr(value, "ndim", 1) == 0):
        value = item()
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidSampleError(f"rank {rank}: the stream's element at position {position} has no integer "
                                 f"identity under element_id={key!r} (got {type(value).__name__})", rank=rank,
                                 indices=(position,))
    return value


def stream_resume(state: Mapping[str, Any] | Sequence[Mapping[str, Any]], rank: int, world: int,
                  seed: int, num_workers: int) -> tuple[int, list[int], int]:
    """(epoch, consumed stream positions, steps) of this rank's stream ``state_dict``.

    A stream resumes on the same ranks only: each rank's stream is its shard at W, and at another W
    the shards differ, so one rank's consumed positions say nothing about another's elements
    (:class:`ResumeStateError`, field ``world_size``; resume such a run at an epoch boundary).
    Likewise ``num_workers``: another worker count deals the stream's shards otherwise, so the
    same positions are other elements (field ``num_workers``; a state without it is refused)."""
    if not isinstance(state, Mapping) and not (isinstance(state, (list, tuple)) and all(
            isinstance(s, Mapping) for s in state)):
        raise ResumeStateError(f"rank {rank}: a {type(state).__name__} is not a loader state (a state_dict, or a "
                               "list of every rank's)", field="state", rank=rank)
    if not isinstance(state, Mapping) and len(state) == world and all(s.get("world_size") == world for s in state):
        raise ResumeStateError(f"rank {rank}: got a list of every rank's states; a stream loader resumes from its "
                               f"own rank's state_dict (pass states[{rank}]): each rank's positions are its own "
                               "stream's", field="state", rank=rank)
    if isinstance(state, Mapping) and not state.get("stream") and ("total" in state or "order_digest" in state):
        raise ResumeStateError(f"rank {rank}: the state is a map-style loader's (its positions name a sampler's "
                               "views), this loader reads a stream; resume it with the map-style dataset",
                               field="stream", rank=rank)
    if isinstance(state, Mapping) and state.get("stream") and _epoch_start(state):  # names no element: any W, workers
        if state.get("seed") != seed:
            raise ResumeStateError(f"rank {rank}: stream state_dict seed={state.get('seed')!r} does not match this "
                                   f"loader's {seed!r}", field="seed", rank=rank)
        return int(state["epoch"]), [], 0
    if not isinstance(state, Mapping) or state.get("kind") == "odb-global" or state.get("world_size") != world:
        got = (f"a checkpoint of world size {state.get('world_size')}" if isinstance(state, Mapping)
               else f"a list of {len(state)} rank states (an elastic resume)")
        raise stream_world_error(f"rank {rank}: got {got}, this run has world size {world}", rank=rank)
    for key, mine in (("rank", rank), ("seed", seed), ("num_workers", num_workers)):
        if state.get(key) != mine:
            raise ResumeStateError(f"rank {rank}: stream state_dict {key}={state.get(key)!r} does not match this "
                                   f"loader's {mine!r} (the stream's positions name other elements)",
                                   field=key, rank=rank)
    consumed = check_counts(state, rank)
    return int(state["epoch"]), consumed, int(state["steps"])


def _epoch_start(state: Mapping[str, Any]) -> bool:
    """A stream state of an epoch's start (nothing consumed, no step taken, no position to resume
    from): it names no element, so it fits any world size and worker count."""
    epoch = state.get("epoch")
    return (isinstance(epoch, int) and not isinstance(epoch, bool) and epoch >= 0 and state.get("consumed") == []
            and state.get("steps") == 0 and state.get("stream_resume") is None and not state.get("consumed_ids"))


class _Chunker:
    """The stream DataLoader's ``collate_fn``: (chunk, worker id, the dataset's state after the
    chunk or None). ``dataset``: the one read in-process (``num_workers=0``); a worker's is its copy."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __call__(self, samples: list[Any]) -> tuple[Any, int, Any]:
        info = get_worker_info()
        dataset: Any = info.dataset if info is not None else self.dataset
        return _chunk(samples), info.id if info is not None else 0, \
            dataset.state_dict() if dataset is not None and resumable(dataset) else None


@dataclass(frozen=True)
class _WorkerStart:
    """A stream worker's ``worker_init_fn``: :class:`DieWithParent`, then the worker's dataset state
    of the resume point loaded into its copy of the dataset (None: the worker starts afresh)."""

    parent: int
    states: tuple[Any, ...] | None

    def __call__(self, worker_id: int) -> None:
        DieWithParent(self.parent)(worker_id)
        info = get_worker_info()
        if self.states is not None and self.states[worker_id] is not None and info is not None:
            dataset: Any = info.dataset
            dataset.load_state_dict(self.states[worker_id])


def _chunk(samples: list[Any]) -> Any:
    """A worker's chunk of consecutive elements: packed (:func:`~odb_torch.sample_packing.pack`:
    columns for uniform dicts, else one buffer per dtype) when they hold tensors, else the list
    itself (plain values pickle faster than a walk over every leaf)."""
    first = samples[0] if samples else None
    if isinstance(first, dict) and any(isinstance(v, torch.Tensor) for v in first.values()):
        return pack(samples)
    return samples


END: Any = object()
"""What :meth:`StreamReader.read` returns past the stream's end (``None`` may be an element)."""


class StreamReader:
    """This rank's stream in order: :meth:`read` returns the element at a stream position
    (positions passed over are discarded: a resume's consumed ones), or :data:`END` past the end.

    For a :func:`resumable` dataset it keeps the resume points: stream positions at a round
    boundary of torch's round robin (every live worker has shipped the same number of chunks, so
    a DataLoader restarted from the workers' states there yields the rest in the same order) with
    those states; :meth:`point` gives the last one at or below a position. ``start``: such a
    point; the read starts there instead of at position 0."""

    def __init__(self, spec: CollateSpec, start: Mapping[str, Any] | None = None) -> None:
        workers, self.rank, self.timeout = spec.num_workers, spec.rank, spec.timeout
        states = tuple(start["workers"]) if start is not None else None
        dataset: Any = spec.dataset
        if states is not None and not workers and states[0] is not None:
            dataset = copy.deepcopy(dataset)  # read in-process: the state goes to a copy, not the next epoch's
            dataset.load_state_dict(states[0])
        with quiet_worker_advice():  # the trainer gave torch's worker count advice once
            self._it: Any = iter(DataLoader(
                dataset, batch_size=max(1, min(STREAM_CHUNK, MAX_CHUNK)), num_workers=workers,
                collate_fn=_Chunker(None if workers else dataset),
                prefetch_factor=spec.prefetch_factor if workers else None,
                multiprocessing_context=spec.worker_start_method if workers else None,
                worker_init_fn=_WorkerStart(os.getpid(), states) if workers else None,
                timeout=check_interval(spec.timeout) if workers else 0))  # slices: a dead worker is found in each
        self._buffer: deque[Any] = deque()
        self.position = int(start["position"]) if start is not None else 0  # the stream position of self._buffer[0]
        self.count: int | None = None  # the stream's length, once a read found its end
        self.first: Any = END  # the stream's first element, read or passed over (a resumed rank's idle template)
        self._states: list[Any] = list(states) if states is not None else [None] * max(1, workers)
        self._chunks = [0] * max(1, workers)  # chunks each worker shipped (since the start)
        self._round = -1  # the round (a worker's chunk count) of the last chunk
        self.expect: dict[int, int] = {}  # element_id: consumed stream position -> the checkpoint's identity
        self.key: str | None = None  # element_id
        self._points: deque[dict[str, Any]] = deque()
        if resumable(spec.dataset):
            self._points.append({"position": self.position, "workers": list(self._states)})

    def point(self, low: int) -> dict[str, Any] | None:
        """The last resume point at or below stream position ``low`` (increasing across calls:
        earlier points are dropped), or None (not a resumable dataset)."""
        while len(self._points) > 1 and self._points[1]["position"] <= low:
            self._points.popleft()
        return self._points[0] if self._points and self._points[0]["position"] <= low else None

    def _note(self, worker: int, state: Any, start: int) -> None:
        """A chunk of ``worker`` starting at stream position ``start``, the worker's state after it:
        a chunk of a later round than the last one starts a round boundary."""
        if state is None:
            return
        if self._chunks[worker] > self._round and self._points[-1]["position"] != start:
            self._points.append({"position": start, "workers": list(self._states)})
        self._round = self._chunks[worker]
        self._chunks[worker] += 1
        self._states[worker] = state

    def read(self, s: int) -> Any:
        """The element at stream position ``s`` (increasing across calls), or :data:`END` past the
        end. Positions passed over are dropped chunk by chunk (a resume re-reads the consumed
        prefix without holding it); a ``None`` element is an :class:`InvalidSampleError`."""
        while self.count is None and (self.position + len(self._buffer) <= s):
            self._refill(s)
            self._drop_before(s)
        self._drop_before(s)
        if not self._buffer:
            return END
        self.position += 1
        element = self._buffer.popleft()
        if element is None:
            raise InvalidSampleError(f"rank {self.rank}: the stream's element at position {s} is None (a stream "
                                     "element must be a sample)", rank=self.rank, indices=(s,))
        return element

    def _drop_before(self, s: int) -> None:
        """Pass over the positions below ``s`` (a resume's consumed ones); with ``element_id``,
        each consumed element must be the one the checkpoint recorded there, else the stream is
        another than the checkpoint's (:class:`ResumeStateError`, ``indices``: the position), whose
        elements at those positions would silently never be trained (P4)."""
        while self._buffer and self.position < s:
            element = self._buffer.popleft()
            expected = self.expect.get(self.position)
            if expected is not None and self.key is not None:
                found = element_identity(element, self.key, self.rank, self.position)
                if found != expected:
                    raise ResumeStateError(
                        f"rank {self.rank}: stream position {self.position} holds element_id {found}, the checkpoint "
                        f"consumed element_id {expected} there: this stream is not the one the checkpoint read",
                        field="consumed_ids", indices=(self.position,), rank=self.rank)
            self.position += 1

    @property
    def _unread(self) -> int:
        """The first stream position not read yet (the buffer holds those before it)."""
        return self.position + len(self._buffer)

    def _refill(self, s: int) -> None:
        try:
            chunk = next_loaded(self._it, self.timeout)
        except StopIteration:
            self.count = self.position + len(self._buffer)
            if self._points:
                self._points.append({"position": self.count, "workers": list(self._states)})
            self.close()
            return
        except LoadStuck:
            raise SampleLoadError(f"rank {self.rank}: a DataLoader worker spent over {self.timeout:.0f}s (the "
                                  f"timeout) reading the stream from position {self._unread} on (stuck in the "
                                  "dataset's __iter__?)", rank=self.rank, indices=(self._unread,)) from None
        except Exception as exc:
            raise SampleLoadError(f"rank {self.rank}: reading the stream failed at an element at or after position "
                                  f"{self._unread} (the first not read; elements arrive in chunks of up to "
                                  f"{STREAM_CHUNK}): {cause_line(exc)}\n{describe_exception(exc)}",
                                  rank=self.rank,
                                  indices=(self._unread,)) from None
        chunk, worker, state = chunk
        self._note(worker, state, self.position + len(self._buffer))
        elements = unpack(chunk) if isinstance(chunk, PackedChunk) else chunk
        if self.first is END and elements:
            self.first = elements[0]
        self._buffer.extend(elements)

    def close(self) -> None:
        """Release the DataLoader iterator (its workers shut down)."""
        self._it = iter(())


class StreamServer(CollateServer):
    """A rank's collate process over a stream: :class:`CollateServer` with the stream's reads."""

    def __init__(self, spec: CollateSpec, options: StreamSampler, ctrl: Any, out: Any,
                 rendezvous: Rendezvous | None = None) -> None:
        super().__init__(spec, options, ctrl, out, rendezvous)
        self.options = options
        self._packer = Packer(spec.rank, spec.length_fn, spec.loss_tokens_fn)
        self._reader: StreamReader | None = None
        self._start: dict[str, Any] | None = None  # the epoch's resume point (StartEpoch.resume)
        self._low = 0  # the lowest stream position not yet delivered (nor consumed before a resume)
        self._done: set[int] = set()  # delivered (or consumed) stream positions at or above _low
        self._point: dict[str, Any] | None = None  # the resume point the last batch carried
        self._ids: dict[int, int] = {}  # element_id: stream position -> identity, read and not yet delivered
        self._seen: dict[int, int] = {}  # element_id: identity -> stream position, this epoch (the resumed too)

    def run_epoch(self, cmd: StartEpoch) -> None:
        """Drive one epoch of the driver over this rank's stream (``set_epoch`` forwarded to it)."""
        spec = self.spec
        driver = spec.driver_cls(spec.config, spec.rank, spec.world, cmd.epoch, skip=cmd.skip,
                                 first_step=cmd.first_step, skip_idle=spec.skip_idle,
                                 trace=[] if self.trace_dir else None, stream=True)
        self._driver = driver
        self._start = cmd.resume
        self._low = cmd.resume["position"] if cmd.resume is not None else 0
        self._done, self._point = {p for p in cmd.skip if p >= self._low}, cmd.resume
        self._ids, self._seen = {}, dict(zip(cmd.consumed_ids, cmd.skip))
        self._open_trace(cmd)
        try:
            # num_workers: a per-example split (datasets' split_dataset_by_node) keeps one element in W of each
            # worker's stream, so ranks of other worker counts would lose some elements and repeat others (P4)
            self._handshake(driver, {"stream": True, "first_step": cmd.first_step,
                                     "num_workers": self.spec.num_workers})
            self._stream_rounds(driver)
        finally:
            self._flush_trace(driver)
            self._close_reader()
        self._put(EpochEnd(cmd.epoch, driver.next_step))  # the count; after an early end (skip_idle), a second one

    def _stream_rounds(self, driver: EpochDriver) -> None:
        samples: dict[int, Any] = {}
        while not driver.done:
            if self._stop_sent():  # the trainer closed mid-epoch: stop now, not when the queue fills
                raise _ParentGone
            if driver.sampler_epoch is not None:
                if hasattr(self.spec.dataset, "set_epoch"):
                    self.spec.dataset.set_epoch(driver.epoch)
                driver.start_iteration(())
                self._close_reader()
                self._reader = StreamReader(self.spec, self._start)
                if self.options.element_id is not None:  # the consumed prefix is checked as it is passed over
                    self._reader.key = str(self.options.element_id)
                    self._reader.expect = {pos: ident for ident, pos in self._seen.items()}
                self._template, self._template_length = None, 0
                continue
            self._read(driver, samples)
            self._round(driver, samples)

    def _read(self, driver: EpochDriver, samples: dict[int, Any]) -> None:
        """Read every position the driver fetches; a read past the end reports it (P4)."""
        reader = self._reader
        assert reader is not None
        fetched = driver.fetch()
        for pos, s in zip(fetched, driver.stream_positions(fetched)):
            sample = reader.read(s)
            if sample is END:
                if reader.count is None:
                    raise CollateProcessError(f"rank {self.spec.rank}: the stream reader ended at position {s} "
                                              "without finding the stream's end", rank=self.spec.rank)
                if self._template is None and reader.first is END and self._start is not None:
                    self._template = _first_element(self.spec)
                if self._template is None and reader.first is not END:
                    self._template = reader.first  # a resumed rank whose elements were all consumed before
                driver.end_stream(reader.count)
                return
            if self.options.element_id is not None:
                self._identify(sample, s)
            length, tokens = self._packer.measure(sample, s)
            driver.arrive(pos, length, tokens)
            samples[pos] = sample
            if self._wants_template(length):
                self._keep_template(sample, length, s)

    def _deliver(self, driver: EpochDriver, item: Delivery | LoopEnd, samples: dict[int, Any]) -> None:
        if isinstance(item, Delivery) and item.step.is_idle and self._template is None:
            if self.options.idle_sample is None:
                raise CollateProcessError(
                    f"rank {self.spec.rank}: this rank's stream gave no element to build its idle batches from "
                    "(an empty stream): pass ODBDataLoader(idle_sample=...), a sample whose collated batch is "
                    "the idle batch (its loss is scaled by 0)", rank=self.spec.rank)
            self._template = self.options.idle_sample
        super()._deliver(driver, item, samples)

    def _identify(self, sample: Any, s: int) -> None:
        """Record the element's own identity; one seen before in the epoch (before the checkpoint
        included) is an :class:`InvalidSampleError` naming it and both stream positions."""
        ident = element_identity(sample, str(self.options.element_id), self.spec.rank, s)
        if ident in self._seen:
            raise InvalidSampleError(f"rank {self.spec.rank}: element_id {ident} at stream position {s} was already "
                                     f"at position {self._seen[ident]} this epoch (identities must be unique)",
                                     rank=self.spec.rank, indices=(ident,))
        self._seen[ident] = s
        self._ids[s] = ident

    def _put(self, item: Reply) -> None:
        """A batch carries the resume point below every stream position not yet delivered: a
        checkpoint after it restarts the dataset there (positions delivered above it are skipped)."""
        if isinstance(item, Batch):
            self._done.update(item.positions)
            while self._low in self._done:
                self._done.discard(self._low)
                self._low += 1
            if self._reader is not None:
                self._point = self._reader.point(self._low)
            item = replace(item, resume=self._point)
            if self.options.element_id is not None and not item.info.is_idle:
                item = replace(item, info=replace(item.info, indices=tuple(self._ids.pop(p) for p in item.positions)))
        super()._put(item)

    def _as_error(self, exc: BaseException) -> ODBError:
        self._close_reader()
        return super()._as_error(exc)

    def _close_reader(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None


def _first_element(spec: CollateSpec) -> Any:
    """The stream's first element, read afresh (the idle template of a rank resumed from a dataset
    state past its whole stream), or None for an empty stream."""
    reader = StreamReader(spec)
    try:
        element = reader.read(0)
    finally:
        reader.close()
    return None if element is END else element


StreamSampler.server_cls = StreamServer  # type: ignore[attr-defined]
