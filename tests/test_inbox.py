"""The trainer's reading of the collate process's queue (``odb_torch.inbox``): a collate process
killed in the middle of writing a batch larger than the pipe (64 KiB) is a typed
``CollateProcessError`` within seconds, not a trainer blocked forever in the middle of a read
(``multiprocessing.Queue.get(timeout)`` bounds only the wait for a message's first bytes)."""

from __future__ import annotations

import array
import fcntl
import os
import queue
import signal
import termios
import time
from typing import Any

import pytest
import torch

from odb_core.errors import CollateProcessError
from odb_torch import ODBDataLoader, pad_collate
from odb_torch.inbox import Inbox

pytestmark = pytest.mark.timeout(120)


def test_the_inbox_hands_messages_over_in_order_one_ahead_and_reports_a_broken_pipe():
    source: queue.Queue[Any] = queue.Queue()
    for k in range(3):
        source.put(k)
    inbox = Inbox(source, poll=0.05)
    try:
        assert [inbox.get(timeout=5) for _ in range(3)] == [0, 1, 2]
        with pytest.raises(queue.Empty):
            inbox.get(timeout=0.1)

        class Broken:
            def get(self, timeout: float) -> Any:
                raise EOFError("the sender is gone")

        broken = Inbox(Broken(), poll=0.05)
        for _ in range(2):  # and every later get() too
            with pytest.raises(EOFError):
                broken.get(timeout=5)
        broken.stop()
    finally:
        inbox.stop()


def _blob_collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A padded batch plus 128 KiB per sample: every batch is larger than the pipe."""
    return {**pad_collate([{"input_ids": s["input_ids"]} for s in samples]),
            "blob": torch.stack([s["blob"] for s in samples])}


def _pipe_bytes(fd: int) -> int:
    held = array.array("i", [0])
    fcntl.ioctl(fd, termios.FIONREAD, held)
    return held[0]


def test_a_collate_process_killed_in_the_middle_of_a_large_batch_is_a_typed_error_within_seconds():
    data = [{"input_ids": torch.arange(1 + i % 7), "blob": torch.zeros(1 << 15)} for i in range(64)]
    loader = ODBDataLoader(data, token_budget=16, collate_fn=_blob_collate, num_workers=0, rank=0, world_size=1,
                           timeout=5, queue_size=2, start_method="fork")
    try:
        batches = iter(loader)
        next(batches)  # then a long training step: the collate process writes ahead into the pipe
        fd, waited = loader._out._reader.fileno(), time.monotonic()
        while _pipe_bytes(fd) < 32768:  # a batch over 64 KiB half in the pipe: its writer is mid-message
            assert time.monotonic() - waited < 60, "the collate process never wrote ahead"
        os.kill(loader._proc.pid, signal.SIGKILL)  # as an out-of-memory kill would
        killed = time.monotonic()
        with pytest.raises(CollateProcessError, match="SIGKILL") as err:
            for _ in batches:
                pass
        assert err.value.rank == 0
        assert time.monotonic() - killed < 30, "the trainer was blocked in the middle of a read"
    finally:
        loader.close()


def test_a_signal_without_a_name_still_names_the_collate_process_death():
    """A collate process killed by a real-time signal (no ``signal.Signals`` member) is still
    described, not a ValueError raised while reporting its death."""
    from odb_torch.loader import _signal_name

    assert _signal_name(signal.SIGKILL) == "SIGKILL" and _signal_name(40) == "signal 40"


@pytest.mark.parametrize("slot_full", [False, True])
def test_stop_wakes_the_reading_thread_at_once(slot_full):
    """``stop`` ends a thread waiting for a message (an idle queue) or for room in the slot (a
    message nobody took) at once, not after its poll interval (``close()`` used to wait it out:
    0.5 s a loader): the slot is emptied and the loader's wake-up closes this process's write end
    of the pipe. With a poll of 30 s, a thread that was not woken would hold ``stop`` for 30 s."""
    import multiprocessing

    from odb_torch.loader import _close_writer

    source = multiprocessing.get_context("fork").Queue()
    inbox = Inbox(source, poll=30)
    try:
        if slot_full:
            source.put("a")
            source.put("b")  # "a" waits in the slot, the thread holds "b" waiting for room
            waited = time.monotonic()
            while not source.empty():
                assert time.monotonic() - waited < 30, "the thread never read the queue"
        started = time.monotonic()
        inbox.stop(wake=lambda: _close_writer(source))
        assert not inbox._thread.is_alive() and time.monotonic() - started < 5, "stop waited out the poll"
    finally:
        source.cancel_join_thread()
        source.close()


class _FailsAfter:
    """A collate_fn that pads its first ``good`` batches, then touches ``marker`` and raises."""

    def __init__(self, good: int, marker: str) -> None:
        self.calls, self.good, self.marker = 0, good, marker

    def __call__(self, samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        self.calls += 1
        if self.calls > self.good:
            open(self.marker, "w").close()
            raise ValueError("a collate_fn bug")
        return pad_collate(samples)


def test_close_is_prompt_when_the_collate_process_failed_with_the_queue_full(tmp_path):
    """A collate process whose collate_fn failed while the trainer was not reading (the queue
    full: its Failure waits for room) stops at the trainer's ``close()`` at once. It used to
    ignore the Stop while its Failure waited, so ``close`` waited out its whole timeout and
    then terminated it (with the timeout of 30 s here, 30 s)."""
    data = [{"input_ids": torch.arange(1 + i % 7)} for i in range(256)]
    marker = tmp_path / "failed"
    loader = ODBDataLoader(data, token_budget=16, collate_fn=_FailsAfter(5, str(marker)), num_workers=0, rank=0,
                           world_size=1, timeout=30, queue_size=2, start_method="fork")
    try:
        next(iter(loader))  # then a long step: the collate process fills the queue and fails
        waited = time.monotonic()
        while not marker.exists():
            assert time.monotonic() - waited < 60, "the collate_fn never failed"
        started = time.monotonic()
        loader.close(timeout=30)
        assert time.monotonic() - started < 5, "close() waited for a collate process blocked on its Failure"
    finally:
        loader.close()


def _slow_collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    time.sleep(0.3)  # a collate_fn doing 0.3 s of work per batch
    return pad_collate(samples)


def test_close_after_a_break_waits_for_one_collate_call_not_for_the_queue_to_fill():
    """After a break the collate process sees the trainer's Stop before its next collate_fn
    call; it used to see it only once the queue was full (8 batches here: 2.4 s and more of
    collate_fn work, up to close()'s 10 s and a terminate with slower ones)."""
    data = [{"input_ids": torch.arange(1 + i % 7)} for i in range(256)]
    loader = ODBDataLoader(data, token_budget=16, collate_fn=_slow_collate, num_workers=0, rank=0, world_size=1,
                           timeout=30, queue_size=8, start_method="fork")
    try:
        for _ in loader:
            break
        started = time.monotonic()
        loader.close(timeout=30)
        assert time.monotonic() - started < 1.5, f"close() took {time.monotonic() - started:.1f}s"
    finally:
        loader.close()


class _SlowAfterFirst:
    """A collate_fn whose first batch is quick and every later one takes 1.5 s of work."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        self.calls += 1
        if self.calls > 1:
            time.sleep(1.5)
        return pad_collate(samples)


def _waiting_in_receive(thread_id: int) -> bool:
    import sys
    import traceback as tb

    frame = sys._current_frames().get(thread_id)
    names = [f.name for f in tb.extract_stack(frame)] if frame is not None else []
    return "_receive" in names and names[-1] == "wait"  # blocked on the empty slot


def test_close_from_another_thread_is_a_loader_state_error_in_the_waiting_loop():
    """A watchdog thread closes the loader while the training thread waits for a batch: the
    loop raises LoaderStateError naming the rank (it raised AttributeError on the closed loader's
    None process)."""
    import threading

    from odb_core.errors import LoaderStateError

    data = [{"input_ids": torch.arange(1 + i % 7)} for i in range(64)]
    loader = ODBDataLoader(data, token_budget=16, collate_fn=_SlowAfterFirst(), num_workers=0, rank=0, world_size=1,
                           timeout=30, queue_size=1, start_method="fork")
    main = threading.get_ident()

    def close_when_waiting() -> None:
        waited = time.monotonic()
        while not _waiting_in_receive(main) and time.monotonic() - waited < 30:
            pass
        loader.close()

    try:
        with pytest.raises(LoaderStateError) as err:
            for _ in loader:
                threading.Thread(target=close_when_waiting, daemon=True).start()
        assert err.value.rank == 0
    finally:
        loader.close()
