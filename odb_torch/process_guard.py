"""Processes that never outlive the process that needs them.

Two guards, each closing a way a run could hang or leave processes behind:

* :func:`close_at_exit`: the collate process is not a daemon (daemons cannot have
  DataLoader workers), so at interpreter exit multiprocessing joins it, which waits
  forever if nobody told it to stop: a loader still referenced at the end of a script,
  or any uncaught exception (Ctrl-C included). Loaders registered here are closed by a
  multiprocessing exit finalizer, which runs just before that join, in a script's main
  process (at ``atexit``) and in a trainer that is itself a multiprocessing child
  (``torch.multiprocessing.spawn``, whose children skip ``atexit``) alike.
* :class:`DieWithParent`: a DataLoader worker of the collate process asks the kernel
  (Linux ``PR_SET_PDEATHSIG``) to be killed when the collate process dies, however it
  dies (SIGKILL, terminate): else an orphaned worker stays blocked writing to a pipe
  nobody reads, and, forked after the collate group existed, keeps its sockets open,
  so the peers wait out the timeout instead of seeing the connection close.
"""

from __future__ import annotations

import ctypes
import multiprocessing.util
import os
import signal
import sys
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Protocol

PR_SET_PDEATHSIG = 1


class Closable(Protocol):
    """Anything with an idempotent ``close(timeout=...)``."""

    def close(self, timeout: float = ...) -> None: ...


_live: weakref.WeakSet[Any] = weakref.WeakSet()
_registered = False
_owner = os.getpid()  # a forked child inherits _live but owns none of its processes
_lock = threading.Lock()


def _close_live(timeout: float = 5.0) -> None:
    if os.getpid() != _owner:
        return
    for obj in list(_live):
        try:
            obj.close(timeout=timeout)
        except Exception:  # at exit, one loader's failure must not keep the others open
            pass


def close_at_exit(obj: Closable) -> None:
    """Close ``obj`` at interpreter exit if it is still alive then (weakly referenced),
    before multiprocessing joins the non-daemon children (an exit finalizer of priority
    >= 0 runs first)."""
    global _registered, _owner
    with _lock:
        if _owner != os.getpid():  # a forked child: the inherited loaders are not its own
            _live.clear()
            _owner, _registered = os.getpid(), False
        if not _registered:
            multiprocessing.util.Finalize(None, _close_live, exitpriority=100)
            _registered = True
        _live.add(obj)


@dataclass(frozen=True)
class DieWithParent:
    """A DataLoader ``worker_init_fn``: the worker is SIGKILLed when ``parent`` exits (Linux;
    elsewhere a no-op, and torch's own watchdog applies)."""

    parent: int

    def __call__(self, worker_id: int) -> None:
        if not sys.platform.startswith("linux"):
            return
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != self.parent:  # the parent died before the request took effect
            os._exit(0)
