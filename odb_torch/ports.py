"""Free local TCP ports for rendezvous (the collate group, spawned demo and benchmark ranks),
and waiting for a rendezvous server to listen (:func:`await_listener`).

Ports are drawn *below* the kernel's ephemeral range. A port the kernel handed out by
``bind(0)`` lies inside that range, so any outgoing connection made before the server
listens may be given it as its source port: a client retrying ``connect`` to that port
can then connect to itself (TCP self-connect) and read its own bytes back, which c10d
reports as "Ping failed, invalid value returned from server". Below the range no
outgoing connection ever takes the port.
"""

from __future__ import annotations

import random
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 10000  # never hand out ports below this (well-known and registered services)
_TRIES = 200
PROBE_PAUSE = 0.002
"""Seconds between the first two connection attempts of :func:`await_listener`."""
MAX_PAUSE = 0.02
"""The longest pause between two of its attempts (the pause grows 1.5x per attempt)."""


def ephemeral_low() -> int | None:
    """The first port of the kernel's ephemeral range, or None where it cannot be read."""
    try:
        return int(_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _all_free(port: int, span: int) -> bool:
    try:
        for k in range(span):
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + k))
    except OSError:
        return False
    return True


def _kernel_port(span: int) -> int:
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if _all_free(port + 1, span - 1):
            return port


def free_port(span: int = 1) -> int:
    """A local port p such that p .. p + span - 1 were all free when checked, drawn below the
    ephemeral range where it can be read (so no outgoing connection can take it), else from
    the kernel."""
    low = ephemeral_low()
    if low is None or low - span <= _LOWEST:
        return _kernel_port(span)
    draw = random.SystemRandom()
    for _ in range(_TRIES):
        port = draw.randrange(_LOWEST, low - span + 1)
        if _all_free(port, span):
            return port
    return _kernel_port(span)


def _accepts(addresses: list[Any], source: tuple[str, int] | None = None, wait: float = 1.0) -> bool:
    """Whether a server at one of ``addresses`` (``getaddrinfo``'s) accepts a TCP connection
    within ``wait`` seconds (closed at once). A connection to itself (TCP self-connect: the
    kernel gave the probe the target port as its source port, or ``source`` is the target) is
    no server."""
    for family, kind, proto, _, address in addresses:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.settimeout(max(wait, 0.001))
                if source is not None:
                    probe.bind(source)
                probe.connect(address)
                if probe.getsockname() != probe.getpeername():
                    return True
        except OSError:
            continue
    return False


def await_listener(host: str, port: int, timeout: float, pause: float = PROBE_PAUSE,
                   on_refused: Callable[[], None] | None = None) -> None:
    """Return once a server at ``host:port`` accepts connections; ``TimeoutError`` naming it
    if none does within ``timeout`` seconds (each attempt waits at most 1 s, and never past
    the deadline). ``on_refused`` runs after each failed attempt (refused, or timed out);
    the pause between attempts grows from ``pause`` to :data:`MAX_PAUSE`. A host name that
    does not resolve, or is not a valid name, returns at once (the store's own connect then
    reports it).

    A c10d ``TCPStore`` client that finds no server yet retries on a backoff of its own:
    a collate process that reached the rendezvous before rank 0's had started its server
    waited 0.3-0.8 s more than needed (``benchmarks/bench_startup.py``: 14-26 of 60 loader
    starts over 200 ms at W=2, 44-52 of 80 at W=4; none with this wait). Probing first lets
    the store connect at once."""
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return
    deadline = time.monotonic() + timeout
    while not _accepts(addresses, wait=min(1.0, deadline - time.monotonic())):
        if on_refused is not None:
            on_refused()
        if time.monotonic() >= deadline:
            raise TimeoutError(f"no server accepted connections at {host}:{port} within {timeout:g}s")
        time.sleep(min(pause, max(deadline - time.monotonic(), 0.0)))
        pause = min(pause * 1.5, MAX_PAUSE)
