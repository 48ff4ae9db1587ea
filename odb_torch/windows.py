"""Gradient-accumulation windows over an :class:`ODBDataLoader`, shared by the trainer adapters.

A window is ``K`` consecutive steps of the loader; the optimizer steps once per window.
Exact loss scaling (P7) over a window needs the window's global loss tokens before its
first backward, so :class:`AccumulationWindows` reads a window ahead, plus one batch to
know whether the epoch ends with it. Every rank sees the same steps (P2), hence the same
windows, the same padding and the same number of optimizer steps.
"""

from __future__ import annotations

import glob
import json
import os
import re
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from odb_core.elastic import global_state_from
from odb_core.errors import (
    CheckpointStateError,
    ConfigMismatchError,
    ODBError,
    ResumeStateError,
    UnsupportedSettingError,
)
from odb_core.sampler import epoch_views
from odb_torch.step_info import StepInfo

if TYPE_CHECKING:
    from odb_torch.loader import ODBDataLoader


@dataclass(frozen=True)
class MicroBatch:
    """One step of a window: the collated batch and how to weight its loss."""

    batch: Any
    info: StepInfo
    loss_multiplier: float
    """Multiply this rank's **summed** per-token loss by it, then backward. After DDP averages
    gradients over the W ranks, the update is the per-token mean over every token of the
    window on every rank (P7). 0 for idle steps and padding."""
    window_tokens: int
    """Global loss tokens of the whole window (every rank, every step)."""
    is_padding: bool
    """A zero-weight repeat of the epoch's last batch that fills its last window to K steps."""
    last_in_window: bool
    """The optimizer steps after this micro-batch."""


class AccumulationWindows:
    """Iterate epochs of ``loader`` as windows of ``accumulation_steps`` micro-batches.

    Each ``iter()`` runs one epoch (the next one after a completed epoch), so it can be
    handed to a trainer that calls ``iter()`` once per epoch. ``pad_last_window`` fills
    the epoch's last window with zero-weight repeats so every window has exactly K
    micro-batches (trainers that count micro-batches to decide when to step need this);
    without it the last window is shorter, on every rank alike. ``keep_phase``: for a trainer
    that restores its own count of micro-batches on resume and steps where that count says
    (Lightning): a state taken inside a window hands its micro-batches back (their gradients
    were lost), and the first window after the resume holds the K - h micro-batches the
    trainer still counts to its step (its count past its last step, ``phase`` in the state:
    h handed back, plus any it counted before an earlier such resume), so later windows end where it steps,
    each weighted exactly over its own tokens (P7).

    :meth:`state_dict` (at the start of the current window), restored with :meth:`load_state_dict` before
    the next ``iter()``, resumes mid-epoch with nothing emitted twice and nothing lost (P4),
    including the batch read ahead. Counters (``samples_seen``, ``tokens_seen``,
    ``updates``, ``epochs_completed``) count real samples and loss tokens of every rank.
    """

    def __init__(self, loader: ODBDataLoader, accumulation_steps: int = 1, pad_last_window: bool = True,
                 keep_phase: bool = False) -> None:
        if not 1 <= accumulation_steps <= 63:
            raise ValueError(f"accumulation_steps must be in 1..63 (the loader hands back at most 64 read-ahead "
                             f"batches), got {accumulation_steps}")
        if loader.skip_idle:
            raise ValueError("AccumulationWindows needs the loader's idle steps (skip_idle=False): windows "
                             "must hold the same steps on every rank")
        if loader.config.mode != "join":
            raise ValueError("AccumulationWindows supports join mode (every view once per epoch, resumable)")
        self.loader = loader
        self.accumulation_steps = accumulation_steps
        self.pad_last_window = pad_last_window
        self.keep_phase = keep_phase
        self._first_window = 0  # after a keep_phase resume inside a window: the first window's size
        self._phase0 = 0  # the trainer's count past its last step when the current window began (keep_phase)
        self.epoch = 0
        self.epochs_completed = 0
        self.samples_seen = 0
        self.tokens_seen = 0
        self.updates = 0
        self.samples_in_epoch = 0
        self.at_epoch_end = False
        """True once the last micro-batch of an epoch has been handed out (until the next ``iter()``)."""
        self._read_ahead = 0  # batches pulled from the loader and not yet handed out
        self._pulled = 0  # batches pulled from the loader this epoch
        self._mid_window = False
        self._window = [0, 0, 0]
        self._resume: dict[str, Any] | None = None
        # the counters as they were before each of this epoch's last micro-batches was handed out
        self._before: deque[dict[str, Any]] = deque(maxlen=64)

    @property
    def world_size(self) -> int:
        return self.loader.world_size

    def samples_per_epoch(self) -> int:
        """Global samples of one epoch: the sampler's views over every rank (join mode), the
        shared tail's pool counted once (:func:`odb_core.sampler.epoch_views`)."""
        loader = self.loader
        if not hasattr(loader.sampler, "__len__"):  # a stream: its size is known only once read
            raise UnsupportedSettingError(f"rank {loader.rank}: samples_per_epoch needs a dataset of known size; "
                                          f"this loader's sampler ({type(loader.sampler).__name__}, a stream's or a "
                                          "custom one) has no length: give a schedule by steps instead",
                                          field="dataset", rank=loader.rank)
        if loader.config.shared_tail:  # the default DistributedSampler (checked at construction)
            return epoch_views(len(loader.sampler.dataset), loader.world_size, loader.config.shared_tail)
        return len(loader.sampler) * loader.world_size

    def set_epoch(self, epoch: int) -> None:
        """Ignored: the windows count epochs themselves (a resumed trainer may restart its count)."""

    def __iter__(self) -> Iterator[MicroBatch]:
        loader = self.loader
        if self._resume is not None and self._resume.get("loader") is not None:
            loader.load_state_dict(self._resume["loader"])
        else:
            loader.set_epoch(self.epoch)
        self._resume = None
        first, self._first_window = self._first_window, 0
        self.at_epoch_end = False
        self._before.clear()
        self._pulled = 0
        it = iter(loader)

        def pull() -> tuple[Any, StepInfo] | None:
            try:
                batch = next(it)
            except StopIteration:
                return None
            self._pulled += 1
            return batch, loader.step_info

        nxt = pull()
        self._read_ahead = 0 if nxt is None else 1
        if nxt is None:
            self._close_epoch()
            return
        k = self.accumulation_steps
        while nxt is not None:
            size, first = first or k, 0
            self._phase0 = k - size  # a shortened first window: the trainer counted the rest before the resume
            window: list[tuple[Any, StepInfo]] = []
            while nxt is not None and len(window) < size:
                window.append(nxt)
                nxt = pull()
            self._read_ahead = len(window) + (nxt is not None)
            tokens = sum(info.global_tokens for _, info in window)
            scale = self.world_size / tokens if tokens else 0.0
            items = [MicroBatch(batch, info, 0.0 if info.is_idle else scale, tokens, False, False)
                     for batch, info in window]
            if nxt is None and self.pad_last_window and len(items) < size:
                last = items[-1]
                items += [MicroBatch(last.batch, last.info, 0.0, tokens, True, False)] * (size - len(items))
            items[-1] = MicroBatch(items[-1].batch, items[-1].info, items[-1].loss_multiplier, tokens,
                                   items[-1].is_padding, True)
            self._window = [0, 0, 0]  # real micro-batches, samples and tokens handed out of this window
            for item in items:
                self._before.append(self._counters())
                if not item.is_padding:
                    self._read_ahead -= 1
                    self._count(item.info.global_samples, item.info.global_tokens)
                self._mid_window = not item.last_in_window
                if item.last_in_window:
                    self._phase0 = 0  # the trainer steps here: its count starts again
                    self.updates += 1
                    self._window = [0, 0, 0]
                    if nxt is None:
                        self._close_epoch()
                yield item

    def _count(self, samples: int, tokens: int) -> None:
        """Count a real micro-batch as handed out (for the run and for the current window)."""
        self.samples_seen += samples
        self.samples_in_epoch += samples
        self.tokens_seen += tokens
        w = self._window
        w[0], w[1], w[2] = w[0] + 1, w[1] + samples, w[2] + tokens

    def _close_epoch(self) -> None:
        self.epoch += 1
        self.epochs_completed += 1
        self.samples_in_epoch = 0
        self.at_epoch_end = True

    def _counters(self) -> dict[str, Any]:
        """What :meth:`state_dict` reads, as it is now."""
        return {"epoch": self.epoch, "epochs_completed": self.epochs_completed, "samples_seen": self.samples_seen,
                "tokens_seen": self.tokens_seen, "updates": self.updates, "samples_in_epoch": self.samples_in_epoch,
                "at_epoch_end": self.at_epoch_end, "mid_window": self._mid_window, "window": tuple(self._window),
                "phase0": self._phase0,
                "read_ahead": self._read_ahead, "pulled": self._pulled}

    def state_dict(self, ahead: int = 0) -> dict[str, Any]:
        """The position at the start of the current window (call on every rank at the same update).

        Taken between windows (after an optimizer step) it is exactly the current position.
        Taken inside a window (e.g. a trainer that fetched the next window's first batch
        ahead), the window's micro-batches handed out so far are handed back: their gradients
        never reached the optimizer, so a resume trains them again, once (P4). ``ahead``: the
        last micro-batches handed out that the trainer holds untrained (fetched ahead, as
        Lightning does): the position is taken as before them, even when they make whole
        windows or end the epoch (at most 64, of the current epoch).
        """
        if not 0 <= ahead <= len(self._before):
            raise ValueError(f"ahead={ahead}: only the last {len(self._before)} micro-batches of this epoch can be "
                             "handed back")
        c = self._before[-ahead] if ahead else self._counters()
        handed, samples, tokens = c["window"] if c["mid_window"] else (0, 0, 0)
        phase = c["phase0"] + handed  # phase0 is 0 past a window's end (the trainer stepped)
        # unconsumed: what was pulled and not handed out then, its window's micro-batches handed out
        # before it (mid-window), and every batch pulled since (later windows' reads)
        unconsumed = c["read_ahead"] + handed + self._pulled - c["pulled"]
        loader_state = None if c["at_epoch_end"] else self.loader.state_dict(unconsumed=unconsumed)
        if self._resume is not None:  # restored and not iterated since: hand the same state on
            loader_state, phase = self._resume.get("loader"), int(self._resume.get("phase", 0))
        return {"version": 1, "epoch": c["epoch"], "epochs_completed": c["epochs_completed"],
                "samples_seen": c["samples_seen"] - samples, "tokens_seen": c["tokens_seen"] - tokens,
                "updates": c["updates"], "samples_in_epoch": c["samples_in_epoch"] - samples,
                "accumulation_steps": self.accumulation_steps, "loader": loader_state, "phase": phase}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`; the next ``iter()`` continues that epoch."""
        if state.get("accumulation_steps") != self.accumulation_steps:
            raise ResumeStateError(f"state was taken with accumulation_steps={state.get('accumulation_steps')}, "
                                   f"these windows use {self.accumulation_steps}", field="accumulation_steps",
                                   rank=self.loader.rank)
        phase = state.get("phase", 0)  # the trainer's count past its last step (keep_phase)
        if not isinstance(phase, int) or not 0 <= phase < self.accumulation_steps:
            raise ResumeStateError(f"state's phase={phase!r} (micro-batches past the last step) is not in "
                                   f"0..{self.accumulation_steps - 1}", field="phase", rank=self.loader.rank)
        self.epoch = int(state["epoch"])
        self.epochs_completed = int(state["epochs_completed"])
        self.samples_seen = int(state["samples_seen"])
        self.tokens_seen = int(state["tokens_seen"])
        self.updates = int(state["updates"])
        self.samples_in_epoch = int(state["samples_in_epoch"])
        self.at_epoch_end = False
        self._mid_window = False
        self._window = [0, 0, 0]
        self._read_ahead = 0
        self._before.clear()
        self._resume = dict(state)
        self._first_window = self.accumulation_steps - phase if self.keep_phase and phase else 0


def state_file(folder: str, rank: int) -> str:
    """Where rank ``rank``'s window and loader position lives inside a checkpoint folder."""
    return os.path.join(folder, f"odb_state_rank{rank}.json")


def save_windows_state(windows: AccumulationWindows, folder: str) -> str:
    """Write this rank's :meth:`AccumulationWindows.state_dict` into ``folder`` (atomically); returns the path.

    Call it on every rank at the same update: each rank holds different views, so
    unlike model weights the state is per rank.
    """
    if not os.path.isdir(folder):
        raise CheckpointStateError(f"checkpoint folder {folder} does not exist; cannot store ODB's loader state")
    path = state_file(folder, windows.loader.rank)
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(windows.state_dict(), fh)
    os.replace(tmp, path)
    return path


COUNTERS = ("epoch", "epochs_completed", "samples_seen", "tokens_seen", "updates", "samples_in_epoch",
            "accumulation_steps", "phase")
"""Window state fields that count over every rank, hence equal in every rank's state."""


def _world_of(state: dict[str, Any]) -> int | None:
    """The world size a rank's window state was taken on (None: at an epoch end, or a merged state)."""
    loader = state.get("loader")
    return None if loader is None or loader.get("kind") == "odb-global" else int(loader["world_size"])


def load_windows_states(windows: AccumulationWindows, states: Sequence[dict[str, Any]]) -> None:
    """Resume from every rank's window state of one update, on any number of ranks (join mode).

    The counters are global (the same in every state, else :class:`ResumeStateError` naming the
    field); the loader states are merged (:func:`odb_core.elastic.merge_states`) and this rank
    serves its share of the views not yet yielded (P4 across the change of world size).
    """
    for key in COUNTERS:
        differ = [r for r, s in enumerate(states) if s.get(key) != states[0].get(key)]
        if differ:
            raise ResumeStateError(f"window states {differ} have another {key} than state 0", field=key,
                                   ranks=differ)
    loaders: list[dict[str, Any]] = [s["loader"] for s in states if s.get("loader") is not None]
    windows.load_state_dict(states[0])
    if not loaders:
        return
    if len(loaders) != len(states):
        raise ResumeStateError("some ranks' states are at an epoch end and others are not", field="loader")
    merged = global_state_from(loaders[0] if loaders[0].get("kind") == "odb-global" else loaders).to_dict()
    windows.loader.load_state_dict(merged)
    assert windows._resume is not None
    windows._resume["loader"] = merged  # what the next iter() restores and an unstarted state_dict() hands on


def load_windows_state(windows: AccumulationWindows, folder: str) -> None:
    """Restore this rank's state from ``folder``; the next ``iter(windows)`` continues where it was saved.

    A checkpoint of another world size (join mode): every rank's file in ``folder`` is read and
    merged (:func:`load_windows_states`). Raises :class:`~odb_core.errors.CheckpointStateError`
    naming the file when it is missing or malformed; a state that does not fit this run raises
    the loader's typed error (:class:`~odb_core.errors.ResumeStateError`, a CheckpointStateError,
    naming the field; :class:`~odb_core.errors.UnsupportedSettingError`), noted with the file.
    Call it on every rank: when ``torch.distributed`` is initialised, the ranks agree on the
    outcome (:func:`agree_on_loading`), so a rank whose peer failed raises at once rather than
    waiting for that peer at the loader's rendezvous until its timeout.
    """
    error: BaseException | None = None
    try:
        _load_rank_state(windows, folder)
    except Exception as exc:  # every rank must reach the agreement, whatever failed
        error = exc
    agree_on_loading(error, windows.loader.rank, folder, windows.loader.world_size)


def _load_rank_state(windows: AccumulationWindows, folder: str) -> None:
    rank, world = windows.loader.rank, windows.loader.world_size
    found = {int(m.group(1)): p for p in glob.glob(os.path.join(glob.escape(folder), "odb_state_rank*.json"))
             if (m := re.search(r"odb_state_rank(\d+)\.json$", p))}
    states = {r: _read(p, rank, r) for r, p in sorted(found.items())}
    path = state_file(folder, rank)
    with loading_state(folder, rank):
        of_world = {r: _world_of(s) for r, s in states.items()}
    if rank not in states and world in of_world.values():  # this world's, one lost
        missing = sorted(set(range(world)) - set(states))
        raise CheckpointStateError(f"rank {rank}: {path} is missing: checkpoint {folder} holds this world size's "
                                   f"ODB states but none for ranks {missing}", rank=rank, ranks=missing)
    if all(of_world.get(r, -1) in (None, world) for r in range(world)):  # this world's whole set: any other
        states = {r: states[r] for r in range(world)}  # file is left from an earlier run on more ranks
        of_world = {r: of_world[r] for r in range(world)}
    elif len({w for w in of_world.values() if w is not None}) > 1:
        by_world = {w: [r for r, v in of_world.items() if v == w] for w in set(of_world.values()) - {None}}
        raise CheckpointStateError(f"rank {rank}: checkpoint {folder} holds ODB states of several world sizes "
                                   f"(ranks by world size: {by_world}), so of several runs: resume from a folder "
                                   "holding one save's states", rank=rank, ranks=sorted(of_world))
    worlds = set(of_world.values()) - {None, world}
    if worlds or (states and rank not in states and len(states) != world):
        with loading_state(f"{folder} (resuming {len(states)} ranks' states on {world})", rank):
            load_windows_states(windows, list(states.values()))
        return
    if rank not in states:
        raise CheckpointStateError(f"rank {rank}: {path} is missing: checkpoint {folder} holds no ODB state for "
                                   f"rank {rank}", rank=rank)
    state = states[rank]
    with loading_state(path, rank):
        windows.load_state_dict(state)
        if state.get("loader") is not None:
            windows.loader.load_state_dict(state["loader"])  # validates rank, world size and seed


def global_epoch_samples(windows: AccumulationWindows, device: Any) -> int:
    """Samples of one epoch over every rank, the same on every rank: join mode yields every view of
    every rank once, so the sum of the ranks' sampler lengths (all-reduced: a custom sampler's
    shares may differ in length), or with a shared tail its count (:meth:`AccumulationWindows.samples_per_epoch`).
    Every rank of a default group as wide as the loader's world joins the all-reduce, whatever
    its settings: ranks that disagree on ``shared_tail`` get :class:`ConfigMismatchError` (one
    skipping the collective would leave the others waiting in it)."""
    import torch
    import torch.distributed as dist

    loader = windows.loader
    if loader.world_size == 1 or not (dist.is_available() and dist.is_initialized()) or (
            dist.get_world_size() != loader.world_size):
        return windows.samples_per_epoch()
    on = "cpu" if "gloo" in str(dist.get_backend()) else device
    pooled = 1 if loader.config.shared_tail else 0
    total = torch.tensor([len(loader.sampler), pooled], dtype=torch.int64, device=on)
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    agreeing = int(total[1].item())
    if agreeing not in (0, loader.world_size):
        raise ConfigMismatchError(f"rank {loader.rank}: {agreeing} of {loader.world_size} ranks have a shared_tail; "
                                  "every rank must build its loader with the same shared_tail", rank=loader.rank,
                                  field="shared_tail")
    return windows.samples_per_epoch() if pooled else int(total[0].item())


def agree_on_loading(error: BaseException | None, rank: int, where: str, world: int) -> None:
    """Raise ``error`` if this rank failed to load its state, or :class:`CheckpointStateError`
    naming the ranks that did, when ``torch.distributed``'s default group is the loader's
    ``world`` of more than one rank (every rank must call this: one ``all_gather_object`` of the
    outcomes over the default group); otherwise just ``error``. Nothing starts on a rank whose
    peers cannot resume."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or world < 2 or dist.get_world_size() != world:
        if error is not None:
            raise error
        return
    outcomes: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    failed = [r for r, outcome in enumerate(outcomes) if outcome is not None]
    if failed:
        raise CheckpointStateError(f"rank {rank}: ranks {failed} could not load ODB's state from {where} (rank "
                                   f"{failed[0]}: {outcomes[failed[0]]}); this rank stops too", rank=rank,
                                   ranks=failed)


@contextmanager
def loading_state(where: str, rank: int) -> Iterator[None]:
    """Errors loading the state at ``where``: ODB's typed ones go on as they are (their ``field``,
    ``ranks`` and ``indices`` kept), with a note naming ``where``; a malformed state's (a missing
    key, a wrong type) become :class:`CheckpointStateError` naming ``where`` and this ``rank``."""
    try:
        yield
    except ODBError as exc:
        exc.add_note(f"rank {rank}: loading ODB's state from {where}")
        raise
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointStateError(f"rank {rank}: {where}: {type(exc).__name__}: {exc}", rank=rank) from exc


def _read(path: str, rank: int, of: int) -> dict[str, Any]:
    """Rank ``of``'s window state at ``path``, read on ``rank``: a file that cannot be read, is not
    JSON, or is not a window state (an object whose ``loader`` is an object or null) is a
    :class:`CheckpointStateError` naming the file and ``of``."""
    try:
        with open(path) as fh:
            state = json.load(fh)
    except (OSError, ValueError) as exc:  # json's JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CheckpointStateError(f"rank {rank}: {path}, rank {of}'s ODB state, cannot be read: "
                                   f"{type(exc).__name__}: {exc}", rank=rank, ranks=(of,)) from exc
    if not isinstance(state, dict) or not isinstance(state.get("loader", {}), (dict, type(None))):
        raise CheckpointStateError(f"rank {rank}: {path}, rank {of}'s ODB state, is not a window state (an object "
                                   f"whose 'loader' is an object or null): {str(state)[:80]}", rank=rank, ranks=(of,))
    return state
