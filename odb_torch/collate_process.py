"""The per-rank collate process: drives :class:`odb_core.RankProtocol` over a Gloo group.

It owns a Gloo process group of its own (its own TCPStore and ProcessGroupGloo, never
the default group, so it is isolated from the trainer's NCCL or Gloo group),
a plain :class:`torch.utils.data.DataLoader` whose workers load, measure and pack
chunks of consecutive sampler views (:mod:`odb_torch.transport`), and the user's
``collate_fn``. Batches and their :class:`StepInfo` go
to the trainer process through a bounded queue; errors go the same way as a typed
record, so the trainer raises instead of hanging.
"""

from __future__ import annotations

import os
import queue
import traceback
from urllib.parse import urlparse
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from torch.distributed import ProcessGroupGloo, TCPStore  # type: ignore[attr-defined]  # public, documented API
from torch.utils.data import DataLoader, Dataset

from odb_core import ODBConfig, ODBError, RankProtocol
from odb_core.quota import QuotaTracker
from odb_core.errors import CollateFnError, InvalidSampleError, NonJoinStalledError, PeerError, SampleLoadError
from odb_torch.step_info import StepInfo
from odb_torch.transport import IndexedDataset, Packer, unpack


MAX_CHUNK = 64
"""At most this many consecutive sampler views are loaded and shipped as one packed chunk."""


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


class _ParentGone(Exception):
    """The trainer process is gone, or told us to stop mid-epoch: exit quietly."""


def _put(out: Any, item: Any, parent: int, ctrl: Any = None) -> None:
    """Put ``item`` on the bounded output queue, giving up if the trainer is gone or says stop."""
    while True:
        try:
            out.put(item, timeout=0.2)
            return
        except queue.Full:
            if os.getppid() != parent:
                raise _ParentGone from None
            if ctrl is not None:
                try:
                    if ctrl.get_nowait()[0] == "stop":
                        raise _ParentGone from None
                except queue.Empty:
                    pass


def _await_stop(ctrl: Any, parent: int) -> None:
    while True:
        try:
            if ctrl.get(timeout=1.0)[0] == "stop":
                return
        except queue.Empty:
            if os.getppid() != parent:
                return


class _ViewDataset(Dataset):  # type: ignore[type-arg]
    """Position -> (dataset index, sample) of this rank's views (batch_sampler chunks are positions)."""

    def __init__(self, dataset: Dataset[Any], views: list[int]) -> None:
        self.dataset, self.views = dataset, views

    def __len__(self) -> int:
        return len(self.views)

    def __getitem__(self, pos: int) -> tuple[int, Any]:
        return self.views[pos], self.dataset[self.views[pos]]


def _views(spec: CollateSpec, sampler: Any, epoch: int) -> list[int]:
    if hasattr(sampler, "set_epoch"):
        sampler.set_epoch(epoch)
    return [int(i) for i in sampler]


def _collate_group(spec: CollateSpec) -> tuple[Any, Any]:
    """The collate group: its own TCPStore and ProcessGroupGloo, never the default group.

    So it is isolated from the trainer's group under every start method (under fork
    the child inherits the trainer's default group, which it must not touch).
    """
    url = urlparse(spec.init_method)
    if url.scheme != "tcp" or url.hostname is None or url.port is None:
        raise ValueError(f"init_method must be tcp://host:port, got {spec.init_method!r}")
    timeout = timedelta(seconds=spec.timeout)
    store = TCPStore(url.hostname, url.port, spec.world, spec.rank == 0, timeout)
    return store, ProcessGroupGloo(store, spec.rank, spec.world, timeout)


def _all_gather(pg: Any, values: list[int], world: int, what: str, rank: int) -> list[list[int]]:
    mine = torch.tensor(values, dtype=torch.int64)
    out = [torch.empty_like(mine) for _ in range(world)]
    try:
        pg.allgather([out], [mine]).wait()
    except Exception as exc:  # gloo raises RuntimeError subclasses on peer death and timeouts
        raise PeerError(f"rank {rank}: the {what} all_gather of the collate group failed "
                        f"(a peer rank died or exceeded the timeout): {exc}") from None
    return [t.tolist() for t in out]


CHAIN_STRIDE = 1 << 20
"""Non-join: chained iteration k of epoch e reads the sampler's permutation of epoch e + k x CHAIN_STRIDE."""


def run_epoch(
    spec: CollateSpec, pg: Any, sampler: Any, epoch: int, out: Any, parent: int, ctrl: Any,
    skip: frozenset[int] = frozenset(), first_step: int = 0,
) -> bool:
    """One epoch of the protocol; puts ("step", batch, StepInfo, positions) items on ``out``.
    Returns True if it already put the epoch's ("end", epoch) (see :func:`_run_iteration`).

    Join mode: one logical iteration over this rank's sampler views (P4). ``skip``
    holds the sampler positions already consumed before a restart: they are left out,
    so a resumed epoch emits exactly the rest (nothing lost, nothing twice).

    Non-join mode: a logical iteration ends as soon as any rank finishes; iterations
    are chained (each over a fresh permutation, see CHAIN_STRIDE) and the epoch ends at
    the first step whose cumulative global sample count reaches N = len(dataset), on
    every rank at the same step (P5, P2). Samples fetched but not emitted when an
    iteration ends are not yielded; that is non-join's contract.
    """
    if spec.config.mode == "join":
        order = _views(spec, sampler, epoch)
        kept = [pos for pos in range(len(order)) if pos not in skip]
        return _run_iteration(spec, pg, [order[pos] for pos in kept], kept, epoch, epoch, out, parent, ctrl,
                              first_step, None) < 0
    quota = QuotaTracker(len(spec.dataset))  # type: ignore[arg-type]
    step, k = first_step, 0
    while not quota.reached:
        order = _views(spec, sampler, epoch + k * CHAIN_STRIDE)
        before = quota.emitted
        step = _run_iteration(spec, pg, order, list(range(len(order))), epoch, epoch + k * CHAIN_STRIDE, out, parent,
                              ctrl, step, quota)
        if not quota.reached and quota.emitted == before:
            raise NonJoinStalledError(f"rank {spec.rank}: non-join iteration {k} of epoch {epoch} emitted nothing "
                                      "before a rank finished (a rank has no data?)")
        k += 1
    return False


def _run_iteration(
    spec: CollateSpec, pg: Any, views: list[int], kept: list[int], epoch: int, iteration: int, out: Any,
    parent: int, ctrl: Any, step: int, quota: QuotaTracker | None,
) -> int:
    """One logical iteration over ``views``; returns the next step number. With a quota
    (non-join), stops right after the step that reaches it.

    Join mode with ``skip_idle``: once this rank is finished (R, Q, B empty), every later
    item of the iteration is idle, so it puts ("end", epoch) at once and keeps taking
    part in the rounds without putting anything, returning -1: the trainer's loop ends
    and it can join (torch ``Join``) instead of waiting in a collective for peers whose
    batches cannot come while its own loop waits for the epoch's end."""
    proto = RankProtocol(spec.config, spec.rank, spec.world, views, iteration=iteration)
    size = chunk_size(spec.config, spec.num_workers)
    chunks = [list(range(k, min(k + size, len(views)))) for k in range(0, len(views), size)]
    loader = DataLoader(
        _ViewDataset(IndexedDataset(spec.dataset, spec.rank), views), batch_sampler=chunks,
        collate_fn=Packer(spec.rank, spec.length_fn, spec.loss_tokens_fn),
        num_workers=spec.num_workers,
        prefetch_factor=spec.prefetch_factor if spec.num_workers else None,
        multiprocessing_context=spec.worker_start_method if spec.num_workers else None,
    )
    it = iter(loader)
    samples: dict[int, Any] = {}  # B: position -> sample
    held: dict[int, tuple[Any, tuple[int, int]]] = {}  # loaded ahead of the core's fetch (still in R)
    received = 0
    template: Any = None
    ended = False  # ("end", epoch) already put (join mode, skip_idle, this rank finished)

    def admit() -> None:
        """Fetch what the depth allows, then hand the core every loaded sample now in Q."""
        nonlocal template
        proto.fetch()
        for pos in sorted(p for p in held if p < proto.next_position):
            sample, (length, tokens) = held.pop(pos)
            proto.arrive(pos, length, tokens)
            samples[pos] = sample
            template = sample if template is None else template

    while True:
        admit()
        # after admit(), every held sample lies beyond R's head: received < next_position
        # means some fetched view has not arrived yet
        while proto.buffer_fill < spec.config.buffer_size and received < proto.next_position:
            try:
                packed = next(it)
            except (SampleLoadError, InvalidSampleError):
                raise
            except Exception as exc:
                raise SampleLoadError(f"rank {spec.rank}: loading dataset indices {views[received:received + size]} "
                                      f"failed: {type(exc).__name__}: {exc}") from None
            assert packed.measures is not None
            for sample, measure in zip(unpack(packed), packed.measures):
                held[received] = (sample, measure)
                received += 1
            admit()
        plan = proto.on_headers(_all_gather(pg, proto.begin_round(), spec.world, "header", spec.rank))
        if plan.done:
            return -1 if ended else step
        if plan.step_vector is None:
            continue
        steps = proto.on_steps(_all_gather(pg, plan.step_vector, spec.world, "step", spec.rank))
        for s in steps:
            if ended:  # only idle items are left for this rank: nothing to deliver
                continue
            if s.is_idle:
                if template is None:
                    template = spec.dataset[0]
                group = [template]
            else:
                group = [samples.pop(p) for p in s.positions]
            try:
                batch = spec.collate_fn(group)
            except Exception as exc:
                raise CollateFnError(f"rank {spec.rank}: collate_fn failed on dataset indices "
                                     f"{list(s.identities)}: {type(exc).__name__}: {exc}") from None
            info = StepInfo(
                epoch=epoch, step=step, round=s.round, is_idle=s.is_idle, local_samples=s.local_samples,
                global_samples=s.global_samples, local_tokens=s.local_tokens, global_tokens=s.global_tokens,
                loss_scale=s.loss_scale, weight_num=s.weight.numerator, weight_den=s.weight.denominator,
                over_budget=s.over_budget, indices=s.identities,
            )
            _put(out, ("step", batch, info, tuple(kept[p] for p in s.positions)), parent, ctrl)
            step += 1
            if quota is not None:
                quota.add(s.global_samples)
                if quota.reached:
                    return step
        if quota is None and spec.skip_idle and proto.finished and not ended:
            _put(out, ("end", epoch), parent, ctrl)
            ended = True


def collate_main(spec: CollateSpec, sampler: Any, ctrl: Any, out: Any) -> None:
    """Process entry point: join the collate group, then serve epochs until told to stop.

    Exits when told to stop, on any error (after reporting it on ``out``), or when
    its parent (the trainer process) is gone.
    """
    parent = os.getppid()
    try:
        store, pg = _collate_group(spec)
    except Exception as exc:
        out.put(("error", "PeerError", f"rank {spec.rank}: collate group rendezvous at {spec.init_method} "
                 f"failed: {type(exc).__name__}: {exc}"))
        return
    try:
        while True:
            try:
                cmd = ctrl.get(timeout=1.0)
            except queue.Empty:
                if os.getppid() != parent:
                    break
                continue
            if cmd[0] == "stop":
                break
            _, epoch, skip, first_step = cmd
            if not run_epoch(spec, pg, sampler, epoch, out, parent, ctrl, frozenset(skip), first_step):
                _put(out, ("end", epoch), parent, ctrl)
    except _ParentGone:
        pass
    except BaseException as exc:  # anything reaches the trainer, typed
        if isinstance(exc, ODBError):
            record = ("error", type(exc).__name__, str(exc))
        else:
            record = ("error", "CollateProcessError",
                      f"rank {spec.rank}: collate process crashed: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        try:
            _put(out, record, parent)
            # Batches already queued share their tensors through this process: stay
            # until the trainer has read the error and says stop (or is gone).
            _await_stop(ctrl, parent)
        except _ParentGone:
            pass
    finally:
        del pg, store
