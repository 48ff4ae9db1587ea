"""Free local TCP ports for rendezvous (the collate group, spawned demo and benchmark ranks)."""

from __future__ import annotations

import socket


def free_port(span: int = 1) -> int:
    """A local port p such that p .. p + span - 1 were all free when checked."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        try:
            for k in range(1, span):
                with socket.socket() as b:
                    b.bind(("127.0.0.1", port + k))
            return port
        except OSError:
            continue
