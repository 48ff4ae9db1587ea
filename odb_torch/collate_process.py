"""The per-rank collate process: thin I/O around :class:`odb_core.epoch.EpochDriver`.

Every protocol decision of an epoch (the handshake, chaining, the quota, stall
detection, the ``skip_idle`` end, the resume skip, the step order) is the driver's;
:class:`CollateServer` only moves data: it loads the positions the driver asks for
through a plain :class:`torch.utils.data.DataLoader` (workers load, measure and pack
chunks of consecutive views, :mod:`odb_torch.sample_packing`), gathers the driver's vectors
over a Gloo group of its own (its own TCPStore and ProcessGroupGloo, never the default
group, so it is isolated from the trainer's NCCL or Gloo group), runs the user's
``collate_fn`` and puts :mod:`odb_torch.messages` on a bounded queue to the trainer.
Errors travel the same way, as the exception objects, so the trainer raises instead of
hanging. With ``ODB_TRACE_DIR`` set, each rank appends the driver's trace events to
``<dir>/<run>-rank<r>.jsonl`` (``model_checks.traces`` replays them with TLC).
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import gc
import json
import math
import os
import queue
import signal
import threading
import time
import traceback
import warnings
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar, cast
from urllib.parse import urlparse

import torch
from torch.distributed import ProcessGroupGloo, TCPStore  # type: ignore[attr-defined]  # public, documented API
from torch.utils.data import DataLoader, Dataset

from odb_core import ODBConfig, ODBError
from odb_core.elastic import epoch_pool, resumed_order
from odb_core.epoch import Delivery, EpochDriver, LoopEnd
from odb_core.errors import (
    CollateFnError,
    CollateProcessError,
    ConfigMismatchError,
    DescriptorLimitError,
    InvalidSampleError,
    PeerError,
    SampleLoadError,
)
from odb_core.tail import TailPosition
from odb_torch.descriptors import ensure_descriptors
from odb_torch.elastic import ElasticOrder
from odb_torch.messages import Batch, EpochEnd, Failure, Reply, StartEpoch, Stop, decode, encode
from odb_torch.ports import await_listener
from odb_torch.process_guard import DieWithParent
from odb_torch.sample_packing import IndexedDataset, PackedChunk, Packer, describe_exception, unpack
from odb_torch.shared_tail import tail_shares
from odb_torch.step_info import StepInfo

T = TypeVar("T")
MAX_CHUNK = 64
"""At most this many consecutive sampler views are loaded and shipped as one packed chunk."""
TRACE_ENV = "ODB_TRACE_DIR"
"""Set to a directory to trace every rank's protocol events there (off by default)."""
STACK_SIGNAL: signal.Signals | None = getattr(signal, "SIGUSR1", None)
"""The trainer sends this to a live collate process that stayed silent past its deadline: the
process writes every thread's stack to stderr (``faulthandler``) before it is stopped, so a
hang says where it was (None where the platform has no SIGUSR1: no such dump)."""
WORKER_CHECK = 5.0
"""Seconds between checks of the DataLoader workers while waiting for a chunk (a dead one is
reported then; a stuck one once ``timeout`` seconds have passed)."""


WORKER_ADVICE = r"This DataLoader will create \d+ worker processes in total\. "
"""The start of torch's warning that a DataLoader's ``num_workers`` exceeds the CPUs
(``DataLoader.check_worker_number_rationality``, at construction and at each ``iter()``)."""


@contextlib.contextmanager
def quiet_worker_advice() -> Iterator[None]:
    """Around a DataLoader's construction and ``iter()`` in the collate process: torch's worker
    count warning (:data:`WORKER_ADVICE`) is not shown; the trainer gave that advice once, as an
    ``ODBWarning`` (:func:`odb_torch.loader_options.warn_worker_count`). Other warnings pass."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=WORKER_ADVICE, category=UserWarning,
                                module=r"torch\.utils\.data\.dataloader")
        yield


def check_interval(timeout: float) -> float:
    """A slice of ``timeout`` of at most :data:`WORKER_CHECK` seconds; whole slices add up to it."""
    return timeout / math.ceil(timeout / WORKER_CHECK)


class LoadStuck(Exception):
    """:func:`next_loaded` waited its whole timeout for live DataLoader workers."""


def next_loaded(it: Iterator[T], timeout: float) -> T:
    """``next(it)`` of a DataLoader iterator built with ``timeout=check_interval(timeout)`` (or
    0: loading in this process). At each slice torch checks its workers: a dead one raises
    "DataLoader worker ... exited unexpectedly" then, whether or not its SIGCHLD handler is
    installed here (``collate_main`` resets SIGCHLD); live ones stuck for ``timeout`` seconds
    in all raise :class:`LoadStuck`. ``StopIteration`` and every other error pass through."""
    waited = 0.0
    while True:
        try:
            return next(it)
        except StopIteration:
            raise
        except Exception as exc:
            if not str(exc).startswith("DataLoader timed out"):
                raise
            waited += check_interval(timeout)  # the workers are alive: torch checked
            if waited >= timeout * (1 - 1e-9):
                raise LoadStuck(str(exc)) from None


def worker_death(exc: BaseException | None) -> BaseException | None:
    """The DataLoader's "worker died" error in ``exc``'s chain, if any. torch raises it from
    its SIGCHLD handler wherever the collate process happens to be (inside a gather, a
    ``collate_fn``), so it may reach us wrapped in another error."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, RuntimeError) and str(exc).startswith("DataLoader worker"):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def chunk_size(config: ODBConfig, num_workers: int) -> int:
    """Views per chunk: large enough to amortise the per-chunk transfer, small enough that
    every worker has chunks in flight within the buffer (1..MAX_CHUNK)."""
    return max(1, min(MAX_CHUNK, config.buffer_size // (2 * max(num_workers, 1))))


@dataclass
class CollateSpec:
    """Everything the collate process needs (pickled to it under spawn)."""

    dataset: Dataset[Any]
    collate_fn: Callable[[list[Any]], Any]
    length_fn: Callable[[Any], int] | None
    loss_tokens_fn: Callable[[Any], int] | None
    config: ODBConfig
    rank: int
    world: int
    init_method: str
    timeout: float
    num_workers: int
    prefetch_factor: int | None
    worker_start_method: str | None
    skip_idle: bool = False
    driver_cls: type[EpochDriver] = EpochDriver
    start: int = 0
    """Which collate group this process's trainer forms at ``init_method`` (1, 2, ...: every
    loader's starts there, restarts after a break, a mid-epoch ``load_state_dict`` or ``close()``
    included), the same on every rank: the store's identity (:func:`_join_store`)."""


class Rendezvous:
    """Whether the collate process is inside its collate group's rendezvous, in memory the trainer
    shares: 0 before, 1 inside, 2 after. There it reads no Stop, and a peer that never started
    keeps it there for up to ``timeout`` (300 s by default), so the trainer's ``close()`` does not
    wait long for a process still in it (``odb_torch.loader.await_exit``); after it, every gather
    completes with the peers or fails once one exits. ``ctx``: the trainer's multiprocessing
    context; None: a mark of this process only."""

    def __init__(self, ctx: Any = None) -> None:
        self._mark: Any = ctx.RawValue(ctypes.c_int64, 0) if ctx is not None else ctypes.c_int64(0)

    @property
    def waiting(self) -> bool:
        return int(self._mark.value) == 1

    @contextlib.contextmanager
    def inside(self) -> Iterator[None]:
        """Mark the rendezvous run in this block as entered, then as left (however it ends)."""
        self._mark.value = 1
        try:
            yield
        finally:
            self._mark.value = 2


class _ParentGone(Exception):
    """The trainer process is gone, or told us to stop mid-epoch: exit quietly."""


class _ViewDataset(Dataset):  # type: ignore[type-arg]
    """Position -> (dataset index, sample) of this rank's views (batch_sampler chunks are positions)."""

    def __init__(self, dataset: Dataset[Any], views: list[int]) -> None:
        self.dataset, self.views = dataset, views

    def __len__(self) -> int:
        return len(self.views)

    def __getitem__(self, pos: int) -> tuple[int, Any]:
        return self.views[pos], self.dataset[self.views[pos]]


START_KEY = "odb/start"
"""The store key holding the start it serves (:attr:`CollateSpec.start`), set by rank 0."""
WORLD_KEY = "odb/world"
"""The store key holding rank 0's world size (every rank compares its own: :func:`_check_world`)."""
FAILED_KEY = "odb/failed"
"""The store keys (``odb/failed/<rank>``) where a failing rank reports its error to its peers."""
JOINED_KEY = "odb/joined"
"""The store keys (``odb/joined/<rank>``) each rank sets once it reached the store: a rendezvous
that times out names the ranks that never did."""


def _collate_group(spec: CollateSpec) -> tuple[Any, Any]:
    """The collate group: its own TCPStore and ProcessGroupGloo, never the default group. Rank 0
    serves the store and marks it with this start; the other ranks connect once it listens
    (:func:`await_listener`) and only to the store of their own start (:func:`_join_store`)."""
    url = urlparse(spec.init_method)
    if url.scheme != "tcp" or url.hostname is None or url.port is None:
        raise ValueError(f"init_method must be tcp://host:port, got {spec.init_method!r}")
    timeout = timedelta(seconds=spec.timeout)
    if spec.rank == 0:  # it answers at once (the group's rendezvous below waits for every rank)
        store = TCPStore(url.hostname, url.port, spec.world, True, timeout, wait_for_workers=False)
        store.set(START_KEY, str(spec.start))
        store.set(WORLD_KEY, str(spec.world))
    else:
        store = _join_store(spec, url.hostname, url.port, time.monotonic() + spec.timeout)
        _check_world(spec, store)
    store.set(f"{JOINED_KEY}/{spec.rank}", "1")
    try:
        return store, ProcessGroupGloo(store, spec.rank, spec.world, timeout)
    except Exception as exc:
        reports = store_reports(store, spec.world, spec.rank)
        absent = [] if reports else absent_ranks(store, spec.world)
        if not reports and not absent:
            raise
        why = failures(reports) if reports else (
            f"ranks {absent} never joined it within timeout={spec.timeout:g}s: their loaders were not created or "
            "iterated, or their collate processes failed before; every rank iterates its loader for each epoch")
        raise PeerError(f"rank {spec.rank}: collate group rendezvous at {spec.init_method} failed ({why}): {exc}",
                        rank=spec.rank, ranks=sorted(reports) or absent) from None


def absent_ranks(store: Any, world: int) -> list[int]:
    """The ranks that never set their :data:`JOINED_KEY` in the store (empty if it cannot be read)."""
    try:
        return [r for r in range(world) if not store.check([f"{JOINED_KEY}/{r}"])]
    except Exception:  # the store left with rank 0
        return []


def _check_world(spec: CollateSpec, store: Any) -> None:
    """:class:`ConfigMismatchError` (``field="world_size"``), also reported in the store for rank 0,
    unless rank 0's loader has this rank's world size (a group of mismatched sizes waits out its
    timeout with nothing said)."""
    theirs = int(store.get(WORLD_KEY).decode())
    if theirs != spec.world:
        message = (f"rank {spec.rank}: this loader's world_size is {spec.world}, rank 0's is {theirs}: pass every rank "
                   "the same world_size (or none: the process group's)")
        report_failure(store, spec.rank, ConfigMismatchError(message))
        raise ConfigMismatchError(message, rank=spec.rank, field="world_size", ranks=(0,))


def report_failure(store: Any, rank: int, error: BaseException) -> None:
    """Put ``rank``'s error (its type and first line) in the collate group's store, for the peers
    whose collective then fails (best effort: the store may be gone)."""
    first = (str(error).splitlines() or [""])[0][:300]
    try:
        store.set(f"{FAILED_KEY}/{rank}", f"{type(error).__name__}: {first}")
    except Exception:  # noqa: S110 - rank 0's store gone: the peers say what they saw
        pass


def failures(reports: dict[int, str]) -> str:
    """The peers' reported failures (:func:`store_reports`) as one clause of a ``PeerError``."""
    return "; ".join(f"rank {r} failed: {m}" for r, m in reports.items()) or "a peer rank died or exceeded the timeout"


def store_reports(store: Any, world: int, rank: int) -> dict[int, str]:
    """The failures the other ranks reported in the store (:func:`report_failure`), by rank."""
    found: dict[int, str] = {}
    for r in range(world):
        key = f"{FAILED_KEY}/{r}"
        try:
            if r != rank and store.check([key]):
                found[r] = store.get(key).decode()
        except Exception:  # the store left with rank 0: nothing more to read
            break
    return found


def _join_store(spec: CollateSpec, host: str, port: int, deadline: float) -> Any:
    """A client of rank 0's store of this start. Rank 0's previous start may still listen on the
    port (its trainer has not reached its restart yet, a skew of milliseconds): its store is
    left, and joined again once this start's serves, until ``deadline`` (then ``TimeoutError``
    naming the address and both starts: another ODB loader on the same port, or ranks that
    restarted their loaders a different number of times). A store of a later start than this
    rank's is that mismatch for certain (rank 0's trainer started more collate groups than this rank's): a
    ``ConfigMismatchError`` (``field="start"``) at once, not a wait for the deadline."""
    found = "none (no store answered)"
    listened = False  # something listened on the port: rank 0 came, or another service serves it
    while True:
        try:
            await_listener(host, port, max(deadline - time.monotonic(), 0.0))
        except TimeoutError as exc:
            if listened:  # a store of another start (or no ODB store) answered, then none
                raise TimeoutError(_starts_differ(host, port, found, spec.start)) from None
            raise _rank0_absent(spec, host, port, str(exc)) from None
        listened = True
        try:
            store = TCPStore(host, port, spec.world, False, timedelta(seconds=max(deadline - time.monotonic(), 1.0)))
            found = store.get(START_KEY).decode()
        except RuntimeError:  # c10d's errors: the previous start's store closed as it was asked
            store = None
            found = found if found.isdigit() else "none (something listens there, but no ODB store answered)"
        if store is not None and found == str(spec.start):
            return store
        del store
        if found.isdigit() and int(found) > spec.start:  # rank 0 is at a later start than this rank
            raise ConfigMismatchError(_starts_differ(host, port, found, spec.start), rank=spec.rank, field="start",
                                      ranks=(0,))
        if time.monotonic() >= deadline:
            raise TimeoutError(_starts_differ(host, port, found, spec.start))
        time.sleep(0.05)  # rank 0's previous start is still closing


def _rank0_absent(spec: CollateSpec, host: str, port: int, seen: str) -> PeerError:
    """Rank 0 never served its store (``seen``: what the wait found by the deadline): a ``PeerError`` naming it."""
    return PeerError(f"rank {spec.rank}: rank 0 never served the collate group's store at {host}:{port} within "
                     f"timeout={spec.timeout:g}s ({seen}): its loader was not created or iterated, or its collate "
                     "process failed before; every rank iterates its loader for each epoch", rank=spec.rank,
                     ranks=(0,))


def _starts_differ(host: str, port: int, found: str, start: int) -> str:
    return (f"the store at {host}:{port} serves start {found} of a loader, this rank's loader is at start {start}: "
            "another ODB loader uses this port (give each its own init_method), or the ranks created or restarted "
            "their loaders a different number of times")


def resumed_state(sampler: Any, epoch: int) -> str | None:
    """The digest of the merged state this rank was dealt its views from, in the epoch it
    resumes (an elastic resume); else None. Ranks handed different checkpoints of the same
    epoch and step count would deal different views: some samples twice, some never (P4)."""
    if isinstance(sampler, ElasticOrder) and sampler.dealt(epoch):
        return sampler.share.digest
    return None


def sampler_facts(sampler: Any, dataset: Any) -> dict[str, object]:
    """What every rank's sampler and dataset must agree on (compared by the handshake)."""
    return {"dataset_size": len(dataset), "sampler": type(sampler).__name__,
            "sampler_seed": getattr(sampler, "seed", None), "sampler_shuffle": getattr(sampler, "shuffle", None),
            "sampler_replicas": getattr(sampler, "num_replicas", None),
            "sampler_drop_last": getattr(sampler, "drop_last", None)}


class CollateServer:
    """One rank's collate process: serves epochs until told to stop (or the trainer is gone)."""

    def __init__(self, spec: CollateSpec, sampler: Any, ctrl: Any, out: Any,
                 rendezvous: Rendezvous | None = None) -> None:
        self.spec, self.sampler, self.ctrl, self.out = spec, sampler, ctrl, out
        self.rendezvous = rendezvous or Rendezvous()  # the trainer reads it at close()
        self.parent = os.getppid()
        self.pg: Any = None
        self.store: Any = None  # the collate group's store: a failing rank reports its error there
        self.trace_dir = os.environ.get(TRACE_ENV) or None
        self._trace_file: Any = None
        self._ahead: dict[int, tuple[Any, tuple[int, int]]] = {}  # loaded, not yet fetched (still in R)
        self._template: Any = None  # a sample of this rank, collated for idle items (see _wants_template)
        self._template_length = 0
        self._template_index = 0  # the template's dataset index (named when collate_fn fails on it)
        self._loading: Iterator[Any] | None = None  # the current iteration's loads (owns the workers)
        self._driver: EpochDriver | None = None
        self._prepared: tuple[StartEpoch, EpochDriver] | None = None  # an epoch started before its handshake
        self._order: str | None = None  # the digest of the current iteration's sampler order
        self._expect_order: str | None = None  # a resumed epoch's recorded order digest, until checked
        self._load_state: tuple[list[int], list[list[int]], int] | None = None  # views, chunks, next chunk
        self._scheduled = 0  # positions of the iteration whose loads are started (shared tail: claims later)
        self._claims_sent = 0  # this rank's pool claims reported to the trainer (shared tail)
        self._stashed: deque[Any] = deque()  # commands read while checking for Stop, not yet acted on

    # ---- the process ------------------------------------------------------------------
    def serve(self) -> None:
        """Join the collate group, then run each :class:`StartEpoch` until :class:`Stop`."""
        spec = self.spec
        try:
            ensure_descriptors(spec.world, spec.rank)
        except DescriptorLimitError as exc:
            self.out.put(encode(Failure(exc)))
            return
        # iter(loader) sends the first epoch's command as it starts this process: its
        # DataLoader workers start loading while the collate group forms
        if (cmd := self._next_command()) is None:
            return
        self._prepare(cmd)
        # a worker's death (SIGCHLD) is reported after the rendezvous, as a SampleLoadError
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
        # not past its first handshake by the timeout (at which a peer's gather fails): the
        # threads' stacks go to stderr, so a rank that joined the group but never gathered says where
        _stack_dumps(faulthandler.dump_traceback_later, spec.timeout)
        try:
            with self.rendezvous.inside():
                store, self.pg = _collate_group(spec)
                self.store = store
        except Exception as exc:
            self._close_loading()
            in_use = "EADDRINUSE" in str(exc) or "address already in use" in str(exc).lower()
            hint = ("; another process (or a loader given the same init_method) serves this port: pass the loader "
                    "a free init_method=, or set ODB_COLLATE_PORT to a free base port (the default port is "
                    "MASTER_PORT+1, +2 for a second loader alive at once, and so on)") if in_use else ""
            self.out.put(encode(Failure(self._as_error(exc) if worker_death(exc) else exc if isinstance(
                exc, ConfigMismatchError | PeerError) else PeerError(
                f"rank {spec.rank}: collate group rendezvous at {spec.init_method} failed: {type(exc).__name__}: "
                f"{exc}{hint}", rank=spec.rank))))
            return
        try:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
            while cmd is not None:
                self.run_epoch(cmd)
                cmd = self._next_command()
        except _ParentGone:
            pass
        except BaseException as exc:  # anything reaches the trainer, typed
            self._fail(exc)
        finally:
            self._close_trace()
            self.pg = self.store = None
            del store  # the collate group's store lives exactly as long as the loop
            # the loop ends on Stop or with the trainer gone: nobody reads the queue any more,
            # so this process's exit must not wait for its feeder thread to flush (see collate_main)
            self.out.cancel_join_thread()

    def _next_command(self) -> StartEpoch | None:
        if self._stashed:
            if any(isinstance(c, Stop) for c in self._stashed):  # a Stop behind a stashed StartEpoch: stop
                return None
            return cast(StartEpoch, self._stashed.popleft())
        while True:
            try:
                cmd = self.ctrl.get(timeout=1.0)
            except queue.Empty:
                if os.getppid() != self.parent:
                    return None
                continue
            return None if isinstance(cmd, Stop) else cmd

    def _as_error(self, exc: BaseException) -> ODBError:
        """``exc`` as the typed error the trainer raises (a dead DataLoader worker is a
        :class:`SampleLoadError` naming the views it was loading, whatever it interrupted)."""
        rank = self.spec.rank
        if (death := worker_death(exc)) is not None:
            awaited = self._awaited()
            return SampleLoadError(f"rank {rank}: a DataLoader worker died while loading dataset indices "
                                   f"{awaited}: {death}", rank=rank, indices=awaited)
        if isinstance(exc, ODBError):
            return exc
        return CollateProcessError(f"rank {rank}: collate process crashed: {type(exc).__name__}: {exc}\n"
                                   f"{traceback.format_exc()}", rank=rank)

    def _awaited(self) -> list[int]:
        """The dataset indices of the chunks the DataLoader's workers hold (sent, not yet
        returned: ``prefetch_factor`` per worker): a dead worker was loading one of them."""
        if self._load_state is None:
            return []
        views, chunks, k = self._load_state
        held = (self.spec.prefetch_factor or 2) * max(self.spec.num_workers, 1)
        return sorted(views[p] for chunk in chunks[k:k + held] for p in chunk)

    def _fail(self, exc: BaseException) -> None:
        error = self._as_error(exc)
        if not isinstance(error, PeerError):  # this rank's own failure: its peers' PeerError names it
            self._report_failure(error)
        if exc.__traceback__ is not None:  # drop the frames' locals: the DataLoader iterator among them
            traceback.clear_frames(exc.__traceback__)
        self._close_loading()  # shut the DataLoader workers down now (a stuck one included)
        try:
            # a Stop while the Failure waits for room (the trainer closed without reading
            # on) ends this process at once, as it does a batch's wait
            self._put(Failure(error))
            # Batches already queued share their tensors through this process: stay
            # until the trainer has read the error and says stop (or is gone).
            while self._next_command() is not None:
                pass
        except _ParentGone:
            pass

    # ---- one epoch --------------------------------------------------------------------
    def run_epoch(self, cmd: StartEpoch) -> None:
        """Drive one epoch of the core's driver; every decision is the driver's."""
        spec = self.spec
        self._prepare(cmd)
        driver = self._prepared[1] if self._prepared is not None else self._new_driver(cmd)
        self._prepared = None
        self._driver = driver
        self._open_trace(cmd)
        try:
            facts = {**sampler_facts(self.sampler, spec.dataset), "first_step": cmd.first_step,
                     "resumed_state": resumed_state(self.sampler, cmd.epoch)}
            self._handshake(driver, facts)
            self._rounds(driver)
            self._close_loading()  # the epoch's DataLoader workers end with it, not at the next StartEpoch
        finally:
            self._flush_trace(driver)
        self._put(EpochEnd(cmd.epoch, driver.next_step))  # the count; after an early end (skip_idle), a second one

    def _handshake(self, driver: EpochDriver, facts: dict[str, object]) -> None:
        """The epoch's handshake: a typed error unless every rank runs the same protocol fields
        and ``facts`` (P8). Once gathered, every rank got this far: serve's start-up watchdog ends."""
        vector = driver.hello(facts)
        heads = self._gather(driver.hello_header(vector), "handshake")  # fixed size: lengths may differ
        faulthandler.cancel_dump_traceback_later()
        driver.check_hello_header(heads)
        driver.check_hello(self._gather(vector, "handshake"))

    def _rounds(self, driver: EpochDriver) -> None:
        """The epoch's rounds, to the epoch's end (past this rank's loop's end under ``skip_idle``)."""
        # an iteration _prepare started is under way: its loads are self._loading
        samples: dict[int, Any] = {}  # B: position -> sample
        while not driver.done:
            if self._stop_sent():  # the trainer closed mid-epoch: stop now, not when the queue fills
                raise _ParentGone
            if driver.sampler_epoch is not None:
                self._start_iteration(driver)
                samples = {}
                continue
            self._fill(driver, samples)
            self._round(driver, samples)

    def _new_driver(self, cmd: StartEpoch) -> EpochDriver:
        spec = self.spec
        return spec.driver_cls(spec.config, spec.rank, spec.world, cmd.epoch, quota=len(spec.dataset),  # type: ignore[arg-type]
                               skip=cmd.skip, first_step=cmd.first_step, skip_idle=spec.skip_idle,
                               tail=None if cmd.tail is None else TailPosition(cmd.tail[0], tuple(cmd.tail[1])),
                               trace=[] if self.trace_dir else None)

    def _start_iteration(self, driver: EpochDriver) -> None:
        """The driver's next logical iteration over the sampler's order, and its loads started
        (the DataLoader's workers begin on the first chunks at once)."""
        epoch = driver.sampler_epoch
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)
        spec = self.spec
        dealt = isinstance(self.sampler, ElasticOrder) and self.sampler.dealt(epoch)
        if epoch_pool(spec.config.shared_tail, dealt):  # own views and the pool, from the sampler's global order
            base = self.sampler.sampler if isinstance(self.sampler, ElasticOrder) else self.sampler
            views, pool = tail_shares(base, spec.rank, spec.world, epoch or 0, spec.config.shared_tail)
        else:
            views, pool = [int(i) for i in self.sampler], []
        self._order = resumed_order(self._expect_order, views, pool, driver.skip, spec.rank)
        self._expect_order = None
        driver.start_iteration(views, pool)
        self._close_loading()
        self._scheduled = len(driver.views)  # positions whose loads are started (claims come later)
        self._claims_sent = len(driver.claimed_pool)  # a resumed pooled epoch's earlier claims: the trainer has them
        self._loading = self._loads(list(driver.views), range(self._scheduled))
        next(self._loading)  # runs up to iter(DataLoader): the workers start loading
        self._ahead, self._template, self._template_length = {}, None, 0

    def _prepare(self, cmd: StartEpoch) -> None:
        """Start ``cmd``'s first iteration before its handshake (the first epoch's before the
        collate group forms), so loading overlaps them: the loads run in view order whatever
        the driver fetches, and samples loaded ahead wait in R (P1). Only moves time; an
        error here is left for :meth:`run_epoch` to meet where the protocol meets it."""
        if (self._prepared is not None and self._prepared[0] is cmd) or hasattr(self.sampler, "server_cls"):
            return  # prepared already, or a stream's server, which reads its own way
        self._prepared = None
        self._expect_order = cmd.order  # checked by the epoch's first iteration (join: its only one)
        try:
            driver = self._new_driver(cmd)
            self._start_iteration(driver)
        except Exception:
            self._close_loading()
            return
        self._prepared = (cmd, driver)

    def _close_loading(self) -> None:
        if self._loading is not None:
            self._loading.close()  # type: ignore[attr-defined]
            self._loading = None

    def _round(self, driver: EpochDriver, samples: dict[int, Any]) -> None:
        """One round after this rank's arrivals: gather the headers, then (an emitting round)
        the step vectors, and deliver each output."""
        plan = driver.on_headers(self._gather(driver.begin_round(), "header"))
        steps = driver.on_steps(self._gather_steps(plan.step_vector)) if plan.step_vector is not None else []
        if driver.pool and driver.protocol is not None and len(driver.views) > self._scheduled:
            self._claim_loads(driver)  # claimed pool views start loading now, while the batches train
        for item in steps:
            self._deliver(driver, item, samples)
        self._flush_trace(driver)

    def _fill(self, driver: EpochDriver, samples: dict[int, Any]) -> None:
        """Fetch what the driver allows and hand it every loaded sample it fetched, loading
        more while it needs arrivals. The loads yield views in position order, so samples
        loaded ahead of the fetch wait in ``self._ahead`` (still in R for the driver)."""
        loads = self._loading or iter(())
        while True:
            driver.fetch()
            head = driver.protocol.next_position if driver.protocol is not None else 0
            for pos in sorted(p for p in self._ahead if p < head):
                sample, (length, tokens) = self._ahead.pop(pos)
                driver.arrive(pos, length, tokens)
                samples[pos] = sample
                if self._wants_template(length):  # the rank's first (non-empty) sample: looked up once
                    self._keep_template(sample, length, driver.protocol.views[pos] if driver.protocol is not None else pos)
            if not driver.needs_arrivals():
                return
            chunk = next(loads, None)
            if chunk is None:
                raise CollateProcessError(f"rank {self.spec.rank}: the data loader ended before every "
                                          "fetched view arrived", rank=self.spec.rank)
            for pos, sample, measure in chunk:
                self._ahead[pos] = (sample, measure)

    def _wants_template(self, length: int) -> bool:
        """Whether a sample of ``length`` becomes the idle items' template: the rank's first, or its
        first non-empty one (an idle batch then has the shape of real data, not ``[1, 0]``, which
        many models cannot run; its loss is scaled by 0 either way, P7)."""
        return self._template is None or (self._template_length == 0 and length > 0)

    def _keep_template(self, sample: Any, length: int, identity: int) -> None:
        """``sample`` (dataset index ``identity``) as the idle items' template (:meth:`_wants_template`)."""
        self._template, self._template_length, self._template_index = sample, length, identity

    def _loads(self, views: list[int], positions: range,
               in_process: bool = False) -> Iterator[list[tuple[int, Any, tuple[int, int]]]]:
        """Chunks of loaded (position, sample, (length, tokens)) of ``positions`` of ``views``, in
        position order, after a first empty one once the DataLoader's workers have their first
        chunks to load; ``in_process``: loaded here, without starting workers."""
        spec = self.spec
        size = chunk_size(spec.config, spec.num_workers)
        chunks = [list(positions[k : k + size]) for k in range(0, len(positions), size)]
        if not chunks:
            yield []
            return
        workers = 0 if in_process else spec.num_workers
        with quiet_worker_advice():
            it = iter(DataLoader(
                _ViewDataset(IndexedDataset(spec.dataset, spec.rank), views), batch_sampler=chunks,
                collate_fn=Packer(spec.rank, spec.length_fn, spec.loss_tokens_fn), num_workers=workers,
                prefetch_factor=spec.prefetch_factor if workers else None,
                multiprocessing_context=spec.worker_start_method if workers else None,
                worker_init_fn=DieWithParent(os.getpid()) if workers else None,
                timeout=check_interval(spec.timeout) if workers else 0,
            ))
        self._load_state = (views, chunks, 0)
        yield []
        for k, chunk in enumerate(chunks):
            self._load_state = (views, chunks, k)
            packed = self._next_chunk(it, [views[p] for p in chunk])
            assert packed.measures is not None
            yield list(zip(chunk, unpack(packed), packed.measures))

    def _claim_loads(self, driver: EpochDriver) -> None:
        """Start the loads of the pool views this rank claimed in the round just gathered (P4:
        every claimed view is loaded, after its own views, in position order). Claims are applied
        only inside a round's gathers, so :meth:`_round` calls this after each; a rank claims only
        with every earlier view arrived, so the loads it replaces have nothing left to yield."""
        self._close_loading()
        claimed = range(self._scheduled, len(driver.views))
        self._scheduled = len(driver.views)
        # a claim of at most one chunk (the packed reserve's: one view a round per rank) loads here: starting
        # DataLoader workers for it cost about 60 ms a round (W=2, chat data), loading it ~1.5 ms
        small = len(claimed) <= chunk_size(self.spec.config, self.spec.num_workers)
        self._loading = self._loads(list(driver.views), claimed, in_process=small)
        next(self._loading)

    def _next_chunk(self, it: Iterator[PackedChunk], indices: list[int]) -> PackedChunk:
        """The next loaded chunk, or the typed error of its first bad sample (P4: none is skipped)."""
        rank = self.spec.rank
        try:
            packed = next_loaded(it, self.spec.timeout)
        except (SampleLoadError, InvalidSampleError):
            raise
        except LoadStuck:
            raise SampleLoadError(
                f"rank {rank}: a DataLoader worker spent over {self.spec.timeout:.0f}s (the timeout) loading "
                f"dataset indices {indices} (stuck in the dataset's __getitem__, or length_fn?)",
                rank=rank, indices=indices) from None
        except Exception as exc:
            raise SampleLoadError(f"rank {rank}: loading dataset indices {indices} failed: "
                                  f"{describe_exception(exc)}", rank=rank, indices=indices) from None
        if packed.error is not None:
            raise packed.error
        return packed

    def _deliver(self, driver: EpochDriver, item: Delivery | LoopEnd, samples: dict[int, Any]) -> None:
        """Collate one delivery and put it for the trainer (the loop's end: an :class:`EpochEnd`
        without the count, ``skip_idle``). A Stop the
        trainer sent (it closed mid-epoch) ends this process before the next collate_fn call."""
        spec = self.spec
        if self._stop_sent():
            raise _ParentGone
        if isinstance(item, LoopEnd):
            self._put(EpochEnd(driver.epoch))
            return
        s = item.step
        if s.is_idle:
            if self._template is None:
                self._template, self._template_index = spec.dataset[0], 0
            group = [self._template]
        else:
            group = [samples.pop(p) for p in s.positions]
        try:
            batch = spec.collate_fn(group)
        except Exception as exc:
            named = (self._template_index,) if s.is_idle else s.identities
            what = f"an idle step's template, dataset index {named[0]}" if s.is_idle else f"dataset indices {list(named)}"
            raise CollateFnError(f"rank {spec.rank}: collate_fn failed on {what}: {type(exc).__name__}: {exc}",
                                 rank=spec.rank, indices=named) from None
        info = StepInfo(
            epoch=driver.epoch, step=item.number, round=s.round, is_idle=s.is_idle, local_samples=s.local_samples,
            global_samples=s.global_samples, local_tokens=s.local_tokens, global_tokens=s.global_tokens,
            loss_scale=s.loss_scale, weight_num=s.weight.numerator, weight_den=s.weight.denominator,
            over_budget=s.over_budget, indices=s.identities,
        )
        self._flush_trace(driver)  # the trace covers every batch the trainer may have received
        self._put(Batch(batch, info, item.sampler_positions, tail=self._tail_report(driver), order=self._order))

    def _tail_report(self, driver: EpochDriver) -> tuple[int, tuple[int, ...]] | None:
        """A pooled epoch: the pool's cursor after this round and this rank's claims not yet
        reported to the trainer (every rank reports the claims of the rounds it yields from,
        so the trainers' pool positions agree at every step)."""
        if not driver.pool:
            return None
        new = driver.claims_since(self._claims_sent)
        self._claims_sent += len(new)
        return driver.pool_applied, new

    # ---- I/O helpers ------------------------------------------------------------------
    def _gather(self, values: list[int], what: str) -> list[list[int]]:
        return self._gather_rows(values, what).tolist()

    def _gather_steps(self, values: list[int]) -> bytes:
        """The step gather's raw little-endian int64 bytes, as the core checks and sums them
        without lists (``odb_core.wire.GatheredBytes``; O(W x T) Python ints saved per round)."""
        return self._gather_rows(values, "step").numpy().astype("<i8", copy=False).tobytes()

    def _gather_rows(self, values: list[int], what: str) -> torch.Tensor:
        """Every rank's ``values``, one row per rank, gathered into one contiguous tensor."""
        mine = torch.tensor(values, dtype=torch.int64)
        rows = torch.empty((self.spec.world, len(values)), dtype=torch.int64)
        try:
            self.pg.allgather([list(rows.unbind(0))], [mine]).wait()
        except Exception as exc:  # gloo raises RuntimeError subclasses on peer death and timeouts
            reports = self._peer_reports()
            raise PeerError(f"rank {self.spec.rank}: the {what} all_gather of the collate group failed "
                            f"({failures(reports)}): {exc}", rank=self.spec.rank, ranks=sorted(reports)) from None
        return rows

    def _report_failure(self, error: BaseException) -> None:
        """This rank's own error, for the peers whose gather fails when it leaves (:func:`report_failure`)."""
        if self.store is not None:
            report_failure(self.store, self.spec.rank, error)

    def _peer_reports(self) -> dict[int, str]:
        """The failures the peers reported in the store (:func:`store_reports`), by rank."""
        return {} if self.store is None else store_reports(self.store, self.spec.world, self.spec.rank)

    def _encode(self, item: Reply) -> bytes:
        """``item`` pickled now: a batch that cannot be pickled is a :class:`CollateFnError`
        naming its indices, not a batch lost in the queue's feeder thread (P4)."""
        try:
            return encode(item)
        except Exception as exc:
            rank = self.spec.rank
            if isinstance(item, Batch):
                raise CollateFnError(f"rank {rank}: collate_fn returned a batch that cannot be sent to the trainer "
                                     f"(dataset indices {list(item.info.indices)}): pickling failed with "
                                     f"{type(exc).__name__}: {exc}; return tensors, numbers, strings and "
                                     "containers of them", rank=rank, indices=item.info.indices) from None
            return encode(Failure(CollateProcessError(f"rank {rank}: {type(exc).__name__} pickling {item!r}",
                                                      rank=rank)))

    def _put(self, item: Reply) -> None:
        """Put ``item`` on the bounded output queue, giving up if the trainer is gone or says stop."""
        payload = self._encode(item)
        while True:
            try:
                self.out.put(payload, timeout=0.2)
                return
            except queue.Full:
                if os.getppid() != self.parent or self._stop_sent():
                    release_payload(payload)
                    raise _ParentGone from None

    def _stop_sent(self) -> bool:
        """Whether the trainer sent Stop; the commands read here wait in ``_stashed`` for
        :meth:`_next_command` (a StartEpoch the trainer sent once this rank's loop ended, under
        ``skip_idle``, may be followed by a Stop: both are read, so the Stop is seen)."""
        while True:
            try:
                self._stashed.append(self.ctrl.get_nowait())
            except queue.Empty:
                break
        return any(isinstance(c, Stop) for c in self._stashed)

    def _open_trace(self, cmd: StartEpoch) -> None:
        if self.trace_dir is None:
            return
        self._close_trace()
        run = f"{urlparse(self.spec.init_method).port}-{cmd.serial}"
        self._trace_file = open(Path(self.trace_dir) / f"{run}-rank{self.spec.rank}.jsonl", "w")

    def _flush_trace(self, driver: EpochDriver) -> None:
        if self._trace_file is None or not driver.trace:
            return
        self._trace_file.write("".join(json.dumps(ev) + "\n" for ev in driver.trace))
        self._trace_file.flush()
        driver.trace.clear()

    def _close_trace(self) -> None:
        if self._trace_file is not None:
            self._trace_file.close()
            self._trace_file = None


def file_system_sharing() -> bool:
    """Whether torch shares tensors between processes by file name (``file_system``), not by descriptor."""
    return bool(torch.multiprocessing.get_sharing_strategy() == "file_system")  # type: ignore[no-untyped-call]


def release_payload(payload: bytes) -> None:
    """Give back what pickling ``payload`` took, now that nobody will read it (a message never
    put, or put and never read): under torch's ``file_system`` sharing strategy the pickling
    counted a reference to each shared segment that only unpickling returns, so the segment
    stayed in ``/dev/shm`` until every process of the job exited. Under ``file_descriptor`` (the
    default) nothing is held. A payload that cannot be decoded any more holds nothing to return."""
    if not file_system_sharing():
        return
    try:
        decode(payload)
    except Exception:
        pass


def _stack_dumps(arm: Callable[..., None], *args: Any, **kwargs: Any) -> None:
    """Arm a ``faulthandler`` stack dump to file descriptor 2, this process's stderr whatever
    ``sys.stderr`` is (a notebook's or pytest's has no descriptor, and faulthandler then
    raises); a diagnostic that cannot be armed is skipped, never an error."""
    try:
        arm(*args, file=2, **kwargs)
    except (OSError, ValueError, RuntimeError):
        pass


def _exit_with_trainer(parent: int) -> None:
    """End this process as soon as its trainer (``parent``) is gone, whatever it is doing: a
    daemon thread waits on the parent's sentinel (``multiprocessing.parent_process``) and checks
    the parent's pid twice a second. The main thread may be blocked in C++ for up to the timeout
    (the store's rendezvous, a gather waiting for a peer), where no check of its own runs: a
    killed trainer's collate process lived on for the whole timeout (300 s by default), holding
    the trainer's stdout (a launcher reading it waited) and its rendezvous port. Its DataLoader
    workers die with it (the kernel signals them)."""
    import multiprocessing.connection

    origin = multiprocessing.parent_process()
    sentinel = None if origin is None else origin.sentinel

    def watch() -> None:
        while True:
            if sentinel is not None:
                gone = bool(multiprocessing.connection.wait([sentinel], timeout=0.5))
            else:
                time.sleep(0.5)
                gone = False
            if gone or os.getppid() != parent:
                os._exit(0)

    threading.Thread(target=watch, name="odb-trainer-watch", daemon=True).start()


def collate_main(spec: CollateSpec, sampler: Any, ctrl: Any, out: Any, rendezvous: Rendezvous | None = None) -> None:
    """Process entry point: serve epochs until told to stop (:class:`CollateServer`).

    Ctrl-C reaches the whole process group; the trainer reacts to it (its loader stops
    this process), so here SIGINT is ignored rather than a second traceback. A forked
    child inherits the trainer's Python signal handlers (a framework's SIGTERM handler
    that only sets a flag, torch's SIGCHLD handler for the trainer's own DataLoader
    workers): SIGTERM and SIGCHLD go back to their defaults, so ``terminate()`` ends it.
    A sampler with a ``server_cls`` (a stream's, :mod:`odb_torch.stream_loading`) names the server.
    ``rendezvous``: where it marks its group's rendezvous for the trainer (:class:`Rendezvous`).

    If the trainer is gone when serving ends (killed, or ``os._exit``), nobody will read the
    output queue: a batch the queue's feeder thread is still writing (over the pipe's 64 KiB:
    inline batches reach 4 MiB) would block it forever, and with it this process's exit,
    which joins the feeder (an orphan holding the trainer's stdout: a launcher waiting on
    it hangs). So the join is cancelled then (``Queue.cancel_join_thread``), as it is after a
    Stop (:meth:`CollateServer.serve`): a Failure sent before either was read already.

    Torch runs one intra-op thread here, as in a ``DataLoader`` worker (torch sets the same
    there): the batches' tensors are small, and on cores the workers keep busy a second
    thread's wake-up cost more than the copy it shares (``pack_batch``'s copies took about
    110 us per sample of the chat data on 2 cores, and too little to profile with one thread).

    Every object present when this process starts (under ``fork``, the trainer's whole heap)
    is frozen out of the garbage collector (``gc.freeze``, as Python's documentation advises
    for forked children): a collection would otherwise walk the trainer's heap and write to
    each object's header, copying every page of it on write (``perf``: copy-on-write page
    copies and the collector took about 30% of this process's CPU on the chat data, 14 of 77
    us per sample). They stay reachable from the trainer's frames the fork copied, so never
    collecting them here loses nothing. The collector is on here whatever the trainer chose
    for itself (a trainer that disabled it would otherwise leave this process's own cycles
    uncollected): what this process allocates is collected as usual."""
    gc.freeze()
    gc.enable()
    _exit_with_trainer(os.getppid())
    if STACK_SIGNAL is not None:
        _stack_dumps(faulthandler.register, STACK_SIGNAL, all_threads=True)
    torch.set_num_threads(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    parent = os.getppid()
    try:
        getattr(sampler, "server_cls", CollateServer)(spec, sampler, ctrl, out, rendezvous).serve()
    finally:
        if os.getppid() != parent:
            out.cancel_join_thread()
