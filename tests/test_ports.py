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

from odb_torch.ports import _LOWEST, _accepts, _kernel_port, await_listener, ephemeral_low, free_port


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


def test_await_listener_returns_once_the_server_listens():
    """The collate group's store clients wait for rank 0's server (``await_listener``): nobody
    listens at the first attempt; the refusal starts the server; the next attempt connects."""
    port = free_port()
    server = socket.socket()
    refused = []

    def start_server() -> None:
        refused.append(1)
        if len(refused) == 1:
            server.bind(("127.0.0.1", port))
            server.listen()

    try:
        await_listener("127.0.0.1", port, timeout=60, on_refused=start_server)
        assert len(refused) == 1
    finally:
        server.close()


def test_await_listener_names_the_address_when_nobody_listens():
    port = free_port()
    refused = []
    with pytest.raises(TimeoutError, match=f"127.0.0.1:{port}"):
        await_listener("127.0.0.1", port, timeout=0, on_refused=lambda: refused.append(1))
    assert refused == [1]


def test_a_probe_connected_to_itself_is_no_server():
    """The probe's source port is its target, so with nobody listening it connects to itself
    (the test above shows the same connect succeed); ``_accepts`` must not take that for a
    server (without its check it does: the seeded bug, checked by hand)."""
    target = free_port()
    addresses = socket.getaddrinfo("127.0.0.1", target, type=socket.SOCK_STREAM)
    assert not _accepts(addresses, source=("127.0.0.1", target))
