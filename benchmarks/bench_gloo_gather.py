"""The collate group on real processes: all_gather latency and open file descriptors per
process at small W on one machine (not a test; prints a table; docs/scale.md).

    .venv/bin/python benchmarks/bench_gloo_gather.py [--worlds 2,3,4] [--iters 300] [--target 220]

W spawned processes each build the collate group as ``odb_torch.collate_process`` does (a
TCPStore and a ProcessGroupGloo of their own, on localhost) and run ``--iters`` rounds of
the two gathers of an emitting round, the way ``CollateServer._gather`` does them: an int64
tensor of 7 values (the header), then one of 2 x T values (the step vector), each
``allgather(...).wait()`` then ``tolist()``. Reported per W: the median and 90th percentile
wall time of each gather on rank 0, and the open descriptors of each process (``/proc/self/fd``)
before the group, with it, and the difference, so the per-peer cost can be read off W = 2..4.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from datetime import timedelta
from typing import Any

import torch
import torch.multiprocessing as mp
from torch.distributed import ProcessGroupGloo, TCPStore  # type: ignore[attr-defined]

from odb_torch.ports import free_port


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def gather(pg: Any, values: list[int], world: int) -> list[list[int]]:
    mine = torch.tensor(values, dtype=torch.int64)
    out = [torch.empty_like(mine) for _ in range(world)]
    pg.allgather([out], [mine]).wait()
    return [t.tolist() for t in out]


def worker(rank: int, world: int, port: int, iters: int, target: int, results: Any) -> None:
    torch.set_num_threads(1)
    before = fds()
    store = TCPStore("127.0.0.1", port, world, rank == 0, timedelta(seconds=60))
    pg = ProcessGroupGloo(store, rank, world, timedelta(seconds=60))
    gather(pg, [0] * 7, world)  # the connections are up after the first collective
    with_group = fds()
    header, steps = [rank] * 7, [rank] * (2 * target)
    times_h, times_s = [], []
    for _ in range(iters):
        t0 = time.perf_counter()
        gather(pg, header, world)
        t1 = time.perf_counter()
        gather(pg, steps, world)
        t2 = time.perf_counter()
        times_h.append(t1 - t0)
        times_s.append(t2 - t1)
    gather(pg, header, world)  # nobody leaves while a peer still gathers
    results.put((rank, before, with_group, times_h, times_s))


def pct(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))] * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", default="2,3,4")
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--target", type=int, default=220, help="T: the step vector holds 2T int64")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    print(f"## Collate-group gathers on one machine ({os.cpu_count()} CPUs), {args.iters} rounds, T = {args.target}\n")
    print("| W | header gather us (median / p90) | step gather us (median / p90) | fds before | fds with group "
          "(rank 0 / others) | added (rank 0 / others) |")
    print("|---|---|---|---|---|---|")
    for world in (int(w) for w in args.worlds.split(",")):
        results = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=worker, args=(r, world, port, args.iters, args.target, results))
                 for r in range(world)]
        for p in procs:
            p.start()
        rows = sorted(results.get(timeout=600) for _ in procs)
        for p in procs:
            p.join()
        _, before, with_group, th, ts = rows[0]
        others = sorted({w for _, _, w, _, _ in rows[1:]})
        added = sorted({w - b for _, b, w, _, _ in rows[1:]})
        print(f"| {world} | {statistics.median(th) * 1e6:.0f} / {pct(th, 0.9):.0f} | "
              f"{statistics.median(ts) * 1e6:.0f} / {pct(ts, 0.9):.0f} | {before} | "
              f"{with_group} / {', '.join(map(str, others))} | {with_group - before} / "
              f"{', '.join(map(str, added))} |", flush=True)


if __name__ == "__main__":
    main()
