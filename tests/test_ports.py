"""Rendezvous ports (``odb_torch.ports``): drawn below the kernel's ephemeral range.

The CI failure this guards against: a collate-group client retried ``connect`` to a port
that ``bind(0)`` had handed out, so inside the ephemeral range; the kernel gave one retry
that very port as its source port, the socket connected to itself, and c10d read its own
bytes back ("Ping failed, invalid value returned from server"). The hazard is reproduced
here, and so is the old way of drawing ports failing the property.
"""

from __future__ import annotations

import socket

import pytest

from odb_torch.ports import _LOWEST, _kernel_port, ephemeral_low, free_port


def test_the_ephemeral_range_is_readable_here():
    low = ephemeral_low()
    assert low is not None and _LOWEST < low <= 65535, low


@pytest.mark.parametrize("span", [1, 3, 16])
def test_free_ports_lie_below_the_ephemeral_range_and_are_bindable(span):
    low = ephemeral_low()
    assert low is not None
    for _ in range(25):
        port = free_port(span)
        assert _LOWEST <= port and port + span - 1 < low, (port, span, low)
        for k in range(span):
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + k))


def test_the_kernel_draw_the_property_rejects_lies_inside_the_ephemeral_range():
    """The seeded bug: ports drawn the old way (``bind(0)``) fail the property above."""
    low = ephemeral_low()
    assert low is not None
    assert _kernel_port(1) >= low


def test_a_client_whose_source_port_is_its_target_connects_to_itself():
    """Why the range matters: with nobody listening on P, a connect from source port P to
    P succeeds (TCP simultaneous open) and the client reads back what it sent."""
    target = _kernel_port(1)
    with socket.socket() as c:
        c.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        c.bind(("127.0.0.1", target))
        c.settimeout(5)
        c.connect(("127.0.0.1", target))
        c.sendall(b"ping 22939")
        assert c.recv(64) == b"ping 22939"
