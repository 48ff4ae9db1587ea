"""Free local TCP ports for rendezvous (the collate group, spawned demo and benchmark ranks).

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
from pathlib import Path

_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 10000  # never hand out ports below this (well-known and registered services)
_TRIES = 200


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
