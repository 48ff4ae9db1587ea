"""Reading the collate process's output queue without ever blocking the trainer for good.

``multiprocessing.Queue.get(timeout)`` bounds only the wait for a message's first bytes: the
rest of it is read blocking, and the trainer holds the pipe's write end itself (its copy of
the queue), so the read never sees the end of the pipe. A collate process killed (out of
memory, ``kill -9``) while its queue's feeder thread was writing a batch over the pipe's
64 KiB left the trainer blocked in that read forever (inline batches reach 4 MiB; the
trainer's silence deadline and liveness checks were never reached). :class:`Inbox` reads in
a thread of its own and hands each message over a one-slot in-process queue, on which the
trainer waits with a timeout: it always gets back to checking whether the collate process
lives, and reports its death as a typed error (``ODBDataLoader._receive``). Moving data only.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

POLL = 0.5
"""Seconds the reading thread waits on the source or the slot before it looks at its stop flag."""


@dataclass(frozen=True)
class _Broken:
    """The source's pipe broke (its sender is gone): ``error`` is raised by :meth:`Inbox.get`."""

    error: BaseException


class Inbox:
    """Messages of ``source`` (a ``multiprocessing.Queue`` this process only reads), in order, one
    read ahead at most. The reading thread is a daemon; :meth:`stop` ends it at once when woken
    (the loader closes its write end of the pipe), else within twice :data:`POLL`, and a read
    stuck in a message whose sender died ends only when no process holds a write end any more."""

    def __init__(self, source: Any, poll: float = POLL) -> None:
        self._source, self._poll = source, poll
        self._slot: queue.Queue[Any] = queue.Queue(maxsize=1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._pump, name="odb-inbox", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        while not self._stop.is_set():
            try:
                item = self._source.get(timeout=self._poll)
            except queue.Empty:
                continue
            except Exception as exc:  # a broken pipe (EOFError, OSError), a closed queue, anything: the trainer says it
                self._hand(_Broken(exc))
                return
            if not self._hand(item):
                return

    def _hand(self, item: Any) -> bool:
        """Put ``item`` in the slot once it is free; False if told to stop first."""
        while not self._stop.is_set():
            try:
                self._slot.put(item, timeout=self._poll)
                return True
            except queue.Full:
                continue
        return False

    def get(self, timeout: float) -> Any:
        """The next message; ``queue.Empty`` after ``timeout`` seconds without one; the pipe's
        error (``EOFError``, ``OSError``) once it broke."""
        item = self._slot.get(timeout=timeout)
        if isinstance(item, _Broken):
            self._slot.put(item)  # every later get() says so too
            raise item.error
        return item

    def drain(self, pending: Callable[[], bool], quiet: float = 0.05, timeout: float = 5.0) -> list[Any]:
        """Every message still to come once the sender is gone, in order: until the slot stayed
        empty for ``quiet`` seconds twice in a row while ``pending()`` (bytes left in the source's
        pipe) was false, the pipe broke, or ``timeout`` passed. A message its dead sender left
        half written is abandoned, never waited for (its rest would never come)."""
        out: list[Any] = []
        deadline, idle = time.monotonic() + timeout, 0
        while idle < 2 and time.monotonic() < deadline:
            try:
                item = self._slot.get(timeout=quiet)
            except queue.Empty:
                idle = 0 if pending() else idle + 1  # a read finishing now is handed over within the next wait
                continue
            if isinstance(item, _Broken):
                self._slot.put(item)
                break
            out.append(item)
            idle = 0
        return out

    def stop(self, wake: Callable[[], None] | None = None) -> None:
        """Tell the reading thread to end, wake it, and wait for it (at most twice :data:`POLL`).
        A message in the slot is dropped, so a hand-over waiting for room ends; ``wake`` (the
        loader's: close this process's write end of the source's pipe, its sender gone) ends a
        read waiting for the next message, or stuck in one whose sender died, with the end of the
        pipe at once, where no other process holds a write end."""
        self._stop.set()
        try:
            self._slot.get_nowait()
        except queue.Empty:
            pass
        if wake is not None:
            wake()
        self._thread.join(2 * self._poll + 0.1)
