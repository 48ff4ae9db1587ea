"""The collate group's rendezvous (``odb_torch.collate_process._collate_group``): every rank but
rank 0 waits for rank 0's store server to listen before its own store client connects
(``odb_torch.ports.await_listener``; the c10d client's own retries back off for hundreds of
milliseconds, ``benchmarks/bench_startup.py``), and the group still forms."""

from __future__ import annotations

import threading
from typing import Any

import torch

import odb_torch.collate_process as collate_process
from odb_core import ODBConfig
from odb_torch.ports import await_listener, free_port


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
