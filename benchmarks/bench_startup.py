"""Loader start-up on real processes: time from ``iter(loader)`` to the first batch, with the
collate group's store clients waiting for rank 0's server (``odb_torch.ports.await_listener``,
as shipped) and without (the c10d ``TCPStore`` client's own retries), side by side in one
run (not a test; prints a table).

    .venv/bin/python benchmarks/bench_startup.py [--world 2] [--starts 30]

W spawned trainer ranks (a Gloo trainer group each, as a training script has) start
``--starts`` loaders per arm, the arms alternating start by start so both see the same
machine; each loader reads a 64-sample dataset of cheap samples (one worker, buffer 8), so
the first batch waits on the start-up alone: the collate process, its worker, the collate
group's rendezvous and handshake, and one buffer. The "without" arm replaces
``await_listener`` in the collate process's module by a no-op (this benchmark's own
stand-in for the code before the change; the loader itself has no such switch); the
collate processes are forked (``start_method="fork"``), so they inherit the arm's choice. Printed per
arm: the median, 90th percentile and largest first-batch time over every start of every
rank, and how many starts took over 200 ms.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp
from torch.utils.data import Dataset

import odb_torch.collate_process as collate_process
from odb_torch import ODBDataLoader, pad_collate
from odb_torch.ports import await_listener, free_port

SLOW = 0.2
"""A start slower than this many seconds is counted."""


class Cheap(Dataset):  # type: ignore[type-arg]
    """64 short token rows: loading them costs next to nothing."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.arange(1 + i % 17)}


def first_batch(port: int) -> float:
    """Seconds from ``iter(loader)`` to its first batch (the loader then drained and closed)."""
    loader = ODBDataLoader(Cheap(), token_budget=64, collate_fn=pad_collate, num_workers=1, buffer_size=8,
                           init_method=f"tcp://127.0.0.1:{port}", timeout=60, start_method="fork")
    try:
        started = time.perf_counter()
        batches = iter(loader)
        next(batches)
        took = time.perf_counter() - started
        for _ in batches:
            pass
    finally:
        loader.close()
    return took


def rank_main(rank: int, world: int, port: int, starts: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    times: dict[str, list[float]] = {"with await_listener": [], "without": []}
    for k in range(2 * starts):
        arm = "with await_listener" if k % 2 == 0 else "without"
        collate_process.await_listener = await_listener if k % 2 == 0 else (lambda *a, **kw: None)  # type: ignore[assignment]
        dist.barrier()  # every rank starts its loader together, as a training script's ranks do
        times[arm].append(first_batch(port + 1 + k))
    Path(out, f"{rank}.json").write_text(json.dumps(times))
    dist.destroy_process_group()


def summary(values: list[float]) -> dict[str, Any]:
    ordered = sorted(values)
    return {"median": statistics.median(ordered), "p90": ordered[int(0.9 * (len(ordered) - 1))],
            "max": ordered[-1], "slow": sum(v > SLOW for v in ordered), "starts": len(ordered)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--starts", type=int, default=30, help="loader starts per arm and rank")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as out:
        tmp.spawn(rank_main, args=(a.world, free_port(2 * a.starts + 2), a.starts, out), nprocs=a.world)
        ranks = [json.loads(Path(out, f"{r}.json").read_text()) for r in range(a.world)]
    rows = {arm: summary([t for r in ranks for t in r[arm]]) for arm in ranks[0]}
    print(f"W={a.world}, {a.starts} loader starts per arm and rank, arms alternating; time to the first batch (ms)")
    print("| store clients | median | p90 | max | starts over 200 ms |")
    print("|---|---|---|---|---|")
    for arm, s in rows.items():
        print(f"| {arm} | {1e3 * s['median']:.0f} | {1e3 * s['p90']:.0f} | {1e3 * s['max']:.0f} | "
              f"{s['slow']} of {s['starts']} |")
    w, wo = rows["with await_listener"], rows["without"]
    print(f"without / with: median {wo['median'] / w['median']:.2f}x, p90 {wo['p90'] / w['p90']:.2f}x, "
          f"max {wo['max'] / w['max']:.2f}x")


if __name__ == "__main__":
    main()
