"""The collate group's rendezvous (``odb_torch.collate_process._collate_group``): every rank but
rank 0 waits for rank 0's store server to listen before its own store client connects
(``odb_torch.ports.await_listener``; the c10d client's own retries back off for hundreds of
milliseconds, ``benchmarks/bench_startup.py``), and the group still forms."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch_support import leftover_processes

import odb_torch.collate_process as collate_process
from odb_core import ODBConfig
from odb_torch.ports import await_listener, free_port

pytestmark = pytest.mark.timeout(120)


def _spec(rank: int, port: int) -> collate_process.CollateSpec:
    return collate_process.CollateSpec(
        dataset=[], collate_fn=list, length_fn=None, loss_tokens_fn=None, config=ODBConfig(token_budget=64),
        rank=rank, world=2, init_method=f"tcp://127.0.0.1:{port}", timeout=60, num_workers=0,
        prefetch_factor=None, worker_start_method=None)


def test_rank_1_waits_for_rank_0s_store_then_the_group_forms(monkeypatch):
    port = free_port()
    waited: list[tuple[str, int]] = []

    def recording(host: str, port: int, timeout: float, **kw: Any) -> None:
        waited.append((host, port))
        await_listener(host, port, timeout, **kw)

    monkeypatch.setattr(collate_process, "await_listener", recording)
    groups: dict[int, Any] = {}

    def join(rank: int) -> None:
        groups[rank] = collate_process._collate_group(_spec(rank, port))

    ranks = [threading.Thread(target=join, args=(r,)) for r in (1, 0)]  # rank 1 first: no server yet
    for t in ranks:
        t.start()
    for t in ranks:
        t.join(60)
    assert sorted(groups) == [0, 1], "the collate group did not form"
    assert waited == [("127.0.0.1", port)]  # rank 1 waited for rank 0's server; rank 0 serves it
    works = []
    for rank in (0, 1):  # a gather over the group: it really is one group of two
        mine = [torch.tensor([10 + rank])]
        outs = [[torch.empty(1, dtype=torch.int64) for _ in range(2)]]
        works.append((groups[rank][1].allgather(outs, mine), outs))
    for work, outs in works:
        work.wait()
        assert [int(t) for t in outs[0]] == [10, 11]


def _old_store(port: int, start: str, stop: Any) -> None:
    """Rank 0's previous collate process: a store of another start on ``port``, served until ``stop``."""
    from datetime import timedelta

    store = collate_process.TCPStore("127.0.0.1", port, 2, True, timedelta(seconds=30), wait_for_workers=False)
    store.set(collate_process.START_KEY, start)
    stop.wait(60)


def _serving(port: int, start: str) -> tuple[Any, Any]:
    """A process serving :func:`_old_store`, once it listens, and the event that ends it."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    stop = ctx.Event()
    proc = ctx.Process(target=_old_store, args=(port, start, stop), daemon=True)
    proc.start()
    await_listener("127.0.0.1", port, 30)
    return proc, stop


def test_a_rank_leaves_the_previous_starts_store_and_joins_its_own(monkeypatch):
    """Rank 0's previous collate process may still serve the port when rank 1's next one arrives
    (its trainer reaches the restart after a break a little later): rank 1 sees the old store's
    start, leaves it, and joins the store of its own start once rank 0 serves it. It used to join
    the old store: a 'connection reset' on rank 1 and, on rank 0, a rendezvous timeout."""
    port = free_port()
    old, stop = _serving(port, "1")  # rank 0's first start, still serving
    seen = threading.Event()
    real = collate_process.TCPStore

    class Recording:  # notes a client that found the old store (asking it as _join_store does)
        def __new__(cls, host: str, p: int, world: int, master: bool, *args: Any, **kw: Any) -> Any:
            store = real(host, p, world, master, *args, **kw)
            if not master and store.get(collate_process.START_KEY) == b"1":
                seen.set()
            return store

    monkeypatch.setattr(collate_process, "TCPStore", Recording)
    groups: dict[int, Any] = {}

    def join(rank: int) -> None:
        spec = _spec(rank, port)
        spec.start = 2
        groups[rank] = collate_process._collate_group(spec)

    second = threading.Thread(target=join, args=(1,))
    second.start()
    try:
        assert seen.wait(30), "rank 1 never reached the old store"
    finally:
        stop.set()  # rank 0's trainer stops its first collate process, then starts the second
        old.join(30)
    first = threading.Thread(target=join, args=(0,))
    first.start()
    for t in (first, second):
        t.join(60)
    assert sorted(groups) == [0, 1], "the second start's group did not form"
    works = []
    for rank in (0, 1):
        outs = [[torch.empty(1, dtype=torch.int64) for _ in range(2)]]
        works.append((groups[rank][1].allgather(outs, [torch.tensor([20 + rank])]), outs))
    for work, outs in works:
        work.wait()
        assert [int(t) for t in outs[0]] == [20, 21]


def test_a_store_of_an_earlier_start_is_a_timeout_naming_both_starts():
    """Rank 0 at an earlier start may be closing it (a skew of milliseconds), so rank 1 waits for
    its own start until the deadline, then names the address and both starts."""
    port = free_port()
    old, stop = _serving(port, "1")
    spec = _spec(1, port)
    spec.start, spec.timeout = 3, 2
    try:
        collate_process._collate_group(spec)
        raise AssertionError("rank 1 joined the store of another start")
    except TimeoutError as exc:
        assert f"127.0.0.1:{port}" in str(exc) and "start 1" in str(exc) and "start 3" in str(exc), exc
    finally:
        stop.set()
        old.join(30)


def test_a_store_of_a_later_start_is_a_config_mismatch_at_once():
    """Rank 0 at a later start than rank 1 can only mean the ranks created or restarted their
    loaders a different number of times: rank 1 says so at once (its deadline here is 600 s,
    past this file's 120 s test timeout), typed, naming the field and rank 0. It used to wait
    for the deadline (300 s by default) and raise a TimeoutError."""
    from odb_core.errors import ConfigMismatchError

    port = free_port()
    old, stop = _serving(port, "3")
    spec = _spec(1, port)
    spec.start, spec.timeout = 1, 600
    try:
        with pytest.raises(ConfigMismatchError) as caught:
            collate_process._collate_group(spec)
        exc = caught.value
        assert (exc.field, exc.ranks, exc.rank) == ("start", (0,), 1)
        assert f"127.0.0.1:{port}" in str(exc) and "start 3" in str(exc) and "start 1" in str(exc), exc
    finally:
        stop.set()
        old.join(30)


TRAINER = r"""
import os, signal, sys, threading, torch
from odb_torch import ODBDataLoader, pad_collate
loader = ODBDataLoader([{"input_ids": torch.arange(3)}] * 8, token_budget=16, collate_fn=pad_collate, num_workers=1,
                       rank=0, world_size=2, timeout=60, init_method="tcp://127.0.0.1:" + sys.argv[1])
threading.Thread(target=lambda: next(iter(loader)), daemon=True).start()  # rank 1 never comes: it waits
while loader._proc is None or loader._proc.pid is None:
    pass
print(loader._proc.pid, flush=True)
signal.pause()
"""


def _alive(pid: int) -> bool:
    try:
        state = Path("/proc", str(pid), "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_killed_trainers_collate_process_ends_at_once_even_in_the_rendezvous():
    """The trainer is SIGKILLed while its collate process waits in the store's rendezvous (rank 1
    never comes; timeout 60 s): the collate process ends within seconds. It used to live on for
    the whole timeout (300 s by default), holding the trainer's stdout and the port."""
    import subprocess
    import sys
    import time

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", TRAINER, str(port)], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parents[1], start_new_session=True)
    try:
        assert proc.stdout is not None
        collate = int(proc.stdout.readline())
        await_listener("127.0.0.1", port, 30)  # the store serves: the collate process waits for rank 1 in C++
        proc.kill()
        proc.wait(30)
        killed = time.monotonic()
        while _alive(collate) and time.monotonic() - killed < 30:
            pass
        assert not _alive(collate), "the collate process outlived its trainer"
        assert time.monotonic() - killed < 10, f"the collate process lived {time.monotonic() - killed:.1f}s on"
        while leftover_processes("", frozenset({proc.pid})) and time.monotonic() - killed < 30:
            pass  # its DataLoader worker ends with it
        assert not leftover_processes("", frozenset({proc.pid})), "a process of the trainer's session is left"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_successive_loaders_on_one_address_form_groups_of_distinct_starts():
    """The store's identity counts every collate group this process formed at the address, not one
    loader's: a second loader on the default port (an evaluation loader, a second train()) is told
    apart from a first one whose rank 0 still serves it (each loader counting from 1 was not)."""
    from odb_torch import ODBDataLoader, pad_collate

    address = f"tcp://127.0.0.1:{free_port()}"
    data = [{"input_ids": torch.arange(1 + i % 5)} for i in range(16)]
    starts = []
    for _ in range(2):
        loader = ODBDataLoader(data, token_budget=16, collate_fn=pad_collate, num_workers=0, rank=0, world_size=1,
                               timeout=30, init_method=address)
        with loader:
            assert sum(len(loader.step_info.indices) for _ in loader) == 16
            starts.append(loader._spec.start)
    assert starts[1] == starts[0] + 1, starts


def test_a_stop_behind_a_start_epoch_is_seen():
    """Under skip_idle the trainer may send the next epoch's StartEpoch while this rank's rounds
    still run, then close (Stop): the check reads both, so the Stop is heeded now and the epoch is
    never started (a check that kept only the first command missed the Stop behind it)."""
    import queue as queue_

    from odb_torch.messages import StartEpoch, Stop

    ctrl: queue_.Queue[Any] = queue_.Queue()
    server = collate_process.CollateServer(_spec(0, free_port()), sampler=None, ctrl=ctrl, out=queue_.Queue())
    assert not server._stop_sent()
    ctrl.put(StartEpoch(1, (), 0, 1))
    ctrl.put(Stop())
    assert server._stop_sent()
    assert server._next_command() is None
    server2 = collate_process.CollateServer(_spec(0, free_port()), sampler=None, ctrl=ctrl, out=queue_.Queue())
    ctrl.put(StartEpoch(2, (), 0, 2))
    assert not server2._stop_sent()
    assert server2._next_command() == StartEpoch(2, (), 0, 2)  # a command read by the check is kept


def _children(pid: int) -> list[int]:
    """The live children of ``pid`` (its DataLoader workers), from /proc."""
    try:
        return [int(c) for c in Path("/proc", str(pid), "task", str(pid), "children").read_text().split()]
    except OSError:
        return []


@pytest.mark.parametrize("rank", [0, 1])
def test_close_is_prompt_while_the_collate_process_waits_for_an_absent_peer(rank):
    """The collate process waits in its group's rendezvous for a peer that never comes (timeout
    60 s): rank 0's store for rank 1, rank 1's store client for an answer from "rank 0" (a socket
    that listens and never answers). It reads no Stop there, and close() waited its whole timeout
    for it (10 s; 5 s at exit after a Ctrl-C) before terminating it: now it stops waiting once the
    process stayed in that one call for COLLECTIVE_GRACE. Nothing is left: the collate process and
    its DataLoader worker end, the waiting iterator says the loader was closed."""
    import socket
    import time

    from odb_core.errors import LoaderStateError
    from odb_torch import ODBDataLoader, pad_collate

    port = free_port()
    peer = socket.create_server(("127.0.0.1", port)) if rank == 1 else None  # rank 0 that never answers
    loader = ODBDataLoader([{"input_ids": torch.arange(3)}] * 8, token_budget=16, collate_fn=pad_collate,
                           num_workers=1, rank=rank, world_size=2, timeout=60, start_method="fork",
                           init_method=f"tcp://127.0.0.1:{port}")
    raised: list[BaseException] = []

    def iterate() -> None:
        try:
            next(iter(loader))
        except BaseException as exc:
            raised.append(exc)

    waiting = threading.Thread(target=iterate, daemon=True)
    try:
        waiting.start()
        if peer is None:
            await_listener("127.0.0.1", port, 30)  # rank 0's store serves: it waits for rank 1 in C++
        else:
            peer.settimeout(30)
            peer.accept()[0].close()  # rank 1's probe of the port: its store client connects next
        collate = loader._proc.pid
        workers = _children(collate)
        started = time.monotonic()
        loader.close()
        took = time.monotonic() - started
        waiting.join(30)
        assert took < 1.0, f"close() took {took:.1f}s"
        assert not _alive(collate), "the collate process outlived close()"
        while any(_alive(w) for w in workers) and time.monotonic() - started < 30:
            pass  # its DataLoader worker is killed with it (PR_SET_PDEATHSIG)
        assert workers and not any(_alive(w) for w in workers), f"workers {workers} outlived the collate process"
        assert len(raised) == 1 and isinstance(raised[0], LoaderStateError), raised
    finally:
        loader.close()
        if peer is not None:
            peer.close()


class _Running:
    """A collate process that never exits, on a fake clock: each ``join(t)`` advances it by ``t``
    and moves its rendezvous mark to the next of ``marks`` (0 before, 1 inside, 2 after)."""

    def __init__(self, marks: Any) -> None:
        self.exitcode, self._marks, self.mark, self.now = None, marks, 0, 0.0

    @property
    def waiting(self) -> bool:
        return self.mark == 1

    def join(self, timeout: float) -> None:
        self.now += timeout
        self.mark = next(self._marks)

    def clock(self) -> float:
        return self.now


@pytest.mark.parametrize(("marks", "waited"), [
    ([0], "timeout"),  # starting: it reads the Stop once it looks
    ([1], "grace"),  # in the group's rendezvous: a peer may never come, and it reads nothing there
    ([2], "timeout"),  # past it (loading, collating, in a gather): its peers joined, it will read the Stop
    ([0, 1], "grace"),  # a look before, then the rendezvous: the grace counts from there
    ([1, 2], "timeout"),  # its peers came during the grace: it is waited for again
])
def test_close_gives_up_early_only_on_a_process_waiting_in_its_rendezvous(marks, waited):
    import itertools

    from odb_torch.loader import await_exit

    proc = _Running(itertools.chain(marks[:-1], itertools.repeat(marks[-1])))
    await_exit(proc, proc, timeout=1.0, grace=0.1, clock=proc.clock)  # type: ignore[arg-type]  # duck-typed
    assert proc.now < 0.2 if waited == "grace" else proc.now >= 1.0, f"waited {proc.now:.2f}s"
