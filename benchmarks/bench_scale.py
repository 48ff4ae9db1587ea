"""Cost at scale, in process: one rank's protocol CPU per round, bytes per round and the
simulator's wall time, for W up to 4096 (not a test; prints tables; docs/scale.md).

    .venv/bin/python benchmarks/bench_scale.py             # W = 8 ... 4096 (about 10 min on 2 cores)
    .venv/bin/python benchmarks/bench_scale.py --quick     # W = 8 ... 1024, smaller runs (about 1 min)
    .venv/bin/python benchmarks/bench_scale.py --overhead  # only the alignment overhead vs W (long)
    .venv/bin/python benchmarks/bench_scale.py --overhead --shared-tail 0.05  # the same with a pool

**Protocol CPU per round per rank.** W :class:`~odb_core.epoch.EpochDriver` s (budget 8192,
buffer 1024, every other setting the default), each over its own 2 x buffer samples of the
sharegpt4o fit, every fetched sample arriving at once; rounds 0 (every buffer full) and 1
(refilled). Rank 0 runs ``begin_round``, ``on_headers`` and ``on_steps`` on the raw gathered
vectors, as a collate process does (its own decoding of all W headers and W step vectors,
the target, alignment, T steps built), timed in process CPU time (the median of ``--reps``
copies of rank 0 taken before the round); the other ranks share one decoding, as the
simulator does. The breakdown times the parts alone on the same vectors: decoding the W
headers (:class:`~odb_core.wire.HeaderGather`), the target policy, decoding the W step
vectors (:class:`~odb_core.wire.StepGather`); "rest" is the remainder (grouping, holding,
alignment, encoding, the steps). Bytes: each rank sends 8 x (7 + 2T) per round
(:func:`~odb_core.wire.payload_bytes`) and receives W times that in the two all_gathers.

**Simulator.** :func:`odb_core.simulate` over N sharegpt4o lengths (default 1,000,000), join
mode, the defaults above; wall seconds of the call (lengths drawn beforehand), rounds, steps
per rank and bytes one rank sends per round, on average.

**Alignment overhead** (``--overhead``): ``audit(simulate(...)).alignment_overhead`` with
``--per-rank`` sharegpt4o samples per rank (default 25,000) at each W, as ``odb simulate
--lengths sharegpt4o`` computes it.
"""

from __future__ import annotations

import argparse
import copy
import gc
import math
import statistics
import struct
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from odb_core import ODBConfig, audit, simulate  # noqa: E402
from odb_core.alignment import TARGET_FUNCTIONS  # noqa: E402
from odb_core.distributions import sample_lengths  # noqa: E402
from odb_core.epoch import EpochDriver  # noqa: E402
from odb_core.sampler import permutation  # noqa: E402
from odb_core.schedules import shard  # noqa: E402
from odb_core.wire import HeaderGather, StepGather, payload_bytes  # noqa: E402

POOL = 1 << 20
"""Distinct lengths drawn for the per-rank measurement (rank r's samples cycle through them)."""


def cpu(fn: Callable[[], object], reps: int) -> float:
    """Median process CPU seconds of ``fn()`` over ``reps`` calls."""
    times = []
    for _ in range(reps):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return statistics.median(times)


def protocol_rounds(world: int, buffer: int, budget: int, reps: int, rounds: int) -> list[dict[str, float]]:
    """Rank 0's protocol CPU in each of the first ``rounds`` rounds of a W-rank world (see the module doc)."""
    config = ODBConfig(token_budget=budget, buffer_size=buffer)
    per_rank = 2 * buffer
    pool = sample_lengths("sharegpt4o", min(world * per_rank, POOL))
    drivers = [EpochDriver(config, r, world) for r in range(world)]
    for r, d in enumerate(drivers):
        d.start_iteration(range(r * per_rank, (r + 1) * per_rank))
    out = []
    for _ in range(rounds):
        for d in drivers:
            for pos in d.fetch():
                d.arrive(pos, pool[d.views[pos] % len(pool)])
        copies = [copy.deepcopy(drivers[0]) for _ in range(reps)]
        copies_b = [copy.deepcopy(drivers[0]) for _ in range(reps)]
        proto = drivers[0].protocol
        assert proto is not None
        it, rnd = proto.iteration, proto.round
        vectors = [d.begin_round() for d in drivers]
        headers = HeaderGather.decode(vectors, world, it, rnd)
        plans = [d.on_headers(headers) for d in drivers]
        step_vectors = [p.step_vector or [] for p in plans]
        target = len(step_vectors[0]) // 2
        if target == 0:
            break

        raw = struct.pack(f"<{world * 2 * target}q", *(v for vector in step_vectors for v in vector))

        def rank0_round(copies: list[EpochDriver], gathered: Sequence[Sequence[int]] | bytes) -> None:
            d = copies.pop()
            d.begin_round()
            d.on_headers(vectors)
            d.on_steps(gathered)

        gc.collect()
        gc.freeze()  # the other W - 1 ranks' state is not in rank 0's process: keep it out of its GC
        total, total_bytes = cpu_pair(lambda c=copies: rank0_round(c, step_vectors),
                                      lambda c=copies_b: rank0_round(c, raw), reps)
        decode_headers = cpu(lambda: HeaderGather.decode(vectors, world, it, rnd), reps)
        policy = TARGET_FUNCTIONS[config.target_policy]
        target_s = cpu(lambda: policy(headers.headers), reps)
        decode_steps, decode_bytes = cpu_pair(lambda: StepGather(step_vectors, headers, target),
                                              lambda: StepGather(raw, headers, target), reps)
        tolist, tobytes = adapter_decoding(step_vectors, reps)
        gc.unfreeze()
        steps = StepGather(raw, headers, target)
        for d in drivers:
            d.on_steps(steps)
        sent = payload_bytes(target)
        out.append({"round": rnd, "target": target, "total": total, "total_bytes": total_bytes,
                    "headers": decode_headers, "policy": target_s, "steps": decode_steps, "steps_bytes": decode_bytes,
                    "tolist": tolist, "tobytes": tobytes, "sent": sent, "gathered": world * sent})
        del copies, copies_b
    return out


def cpu_pair(old: Callable[[], object], new: Callable[[], object], reps: int) -> tuple[float, float]:
    """Median process CPU seconds of ``old()`` and of ``new()``, timed alternately (same load)."""
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(reps):
        for fn, into in ((old, times[0]), (new, times[1])):
            t0 = time.process_time()
            fn()
            into.append(time.process_time() - t0)
    return statistics.median(times[0]), statistics.median(times[1])


def adapter_decoding(step_vectors: list[list[int]], reps: int) -> tuple[float, float]:
    """The collate process's decoding of the step gather, before (``tolist()`` of each of the W
    gathered tensors) and now (the one W x 2T tensor's bytes); NaN without torch."""
    try:
        import torch
    except ImportError:
        return math.nan, math.nan
    tensors = [torch.tensor(v, dtype=torch.int64) for v in step_vectors]
    rows = torch.tensor(step_vectors, dtype=torch.int64)
    return cpu_pair(lambda: [t.tolist() for t in tensors],
                    lambda: rows.numpy().astype("<i8", copy=False).tobytes(), reps)


def simulator_seconds(world: int, lengths: Sequence[int], buffer: int, budget: int) -> dict[str, float]:
    """Wall seconds and figures of one simulated epoch."""
    config = ODBConfig(token_budget=budget, buffer_size=buffer)
    gc.collect()
    t0 = time.perf_counter()
    result = simulate(lengths, world, config)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "rounds": result.rounds, "steps": len(result.steps[0]),
            "sent": result.payload_bytes / result.rounds}


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="W up to 1024, one round, 100,000 simulated samples")
    ap.add_argument("--worlds", default=None, help="comma-separated W (default 8,64,256,1024,4096)")
    ap.add_argument("--buffer", type=int, default=1024)
    ap.add_argument("--budget", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=None, help="timed copies of rank 0 per round (default 5; quick 3)")
    ap.add_argument("--samples", type=int, default=None, help="simulated samples (default 1,000,000; quick 100,000)")
    ap.add_argument("--overhead", action="store_true", help="only the alignment overhead vs W")
    ap.add_argument("--tail", action="store_true", help="only the alignment overhead's tail estimate vs W")
    ap.add_argument("--per-rank", default="25000", help="--overhead/--tail: comma-separated samples per rank")
    ap.add_argument("--shared-tail", type=float, default=0.0,
                    help="--overhead: the shared tail's pool fraction (ODBConfig.shared_tail; default 0, none)")
    ap.add_argument("--seeds", default="0", help="--overhead: comma-separated seeds (lengths and sampler)")
    args = ap.parse_args()
    default_worlds = "8,64,256,1024" if args.quick else "8,64,256,1024,4096"
    worlds = [int(w) for w in (args.worlds or default_worlds).split(",")]

    if args.tail:
        tail_bound(worlds if args.worlds else [8, 64, 256, 1024], [int(n) for n in args.per_rank.split(",")],
                   [int(s) for s in args.seeds.split(",")], args.buffer, args.budget)
        return
    if args.overhead:
        overhead(worlds if args.worlds else [8, 64, 256, 1024], [int(n) for n in args.per_rank.split(",")],
                 [int(s) for s in args.seeds.split(",")], args.buffer, args.budget, args.shared_tail)
        return

    reps = args.reps or (3 if args.quick else 5)
    rounds = 1 if args.quick else 2
    print(f"## Protocol CPU of one rank per round (budget {args.budget}, buffer {args.buffer}, sharegpt4o; "
          f"median of {reps}, process CPU ms)\n")
    print("Old: the collate process turns the W step tensors into lists (tolist) and the core reads the lists;")
    print("new: it hands the core the gather's bytes. Each pair timed alternately in one run.\n")
    print("| W | round | T | old: tolist + round | new: bytes + round | new/old | round on lists | round on bytes "
          "| tolist | tobytes | decode W headers | target | W step vectors: lists | bytes | rest (bytes) "
          "| sent B/rank | gathered B/rank |")
    print("|---" * 17 + "|")
    for world in worlds:
        for row in protocol_rounds(world, args.buffer, args.budget, reps, rounds):
            old, new = row["total"] + row["tolist"], row["total_bytes"] + row["tobytes"]
            rest = row["total_bytes"] - row["headers"] - row["policy"] - row["steps_bytes"]
            print(f"| {world} | {row['round']} | {row['target']} | {ms(old)} | {ms(new)} | {new / old:.2f} | "
                  f"{ms(row['total'])} | {ms(row['total_bytes'])} | {ms(row['tolist'])} | {ms(row['tobytes'])} | "
                  f"{ms(row['headers'])} | {ms(row['policy'])} | {ms(row['steps'])} | {ms(row['steps_bytes'])} | "
                  f"{ms(rest)} | {row['sent']:,} | {row['gathered']:,} |", flush=True)

    n = args.samples or (100_000 if args.quick else 1_000_000)
    lengths = sample_lengths("sharegpt4o", n)
    print(f"\n## Simulator: one epoch of {n:,} sharegpt4o samples (join, budget {args.budget}, "
          f"buffer {args.buffer})\n")
    print("| W | samples/rank | seconds | rounds | steps/rank | sent B/rank/round (mean) |")
    print("|---|---|---|---|---|---|")
    for world in worlds:
        row = simulator_seconds(world, lengths, args.buffer, args.budget)
        print(f"| {world} | {n // world:,} | {row['seconds']:.1f} | {row['rounds']} | {row['steps']} | "
              f"{row['sent']:,.0f} |", flush=True)


def overhead(worlds: list[int], per_rank: list[int], seeds: list[int], buffer: int, budget: int,
             shared_tail: float = 0.0) -> None:
    """Alignment overhead (and what drives it) vs W at equal samples per rank."""
    print(f"## Alignment overhead vs W (sharegpt4o, join, budget {budget}, buffer {buffer}, shared tail "
          f"{shared_tail:g}, defaults)\n")
    print("| W | samples/rank | seed | alignment overhead | steps/rank | idle steps (all ranks) | rounds | skip rounds "
          "| padding | sim s | audit s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for n, seed, world in ((n, seed, world) for n in per_rank for seed in seeds for world in worlds):
        config = ODBConfig(token_budget=budget, buffer_size=buffer, seed=seed, shared_tail=shared_tail)
        lengths = sample_lengths("sharegpt4o", n * world, seed)
        t0 = time.perf_counter()
        result = simulate(lengths, world, config)
        t1 = time.perf_counter()
        report = audit(result)
        t2 = time.perf_counter()
        del result
        print(f"| {world} | {n:,} | {seed} | {report.alignment_overhead * 100:.2f}% | {report.steps_per_rank[0]:,} | "
              f"{sum(report.idle_steps_per_rank):,} | {report.rounds} | {report.skip_rounds} | "
              f"{report.padding_fraction * 100:.2f}% | {t1 - t0:.0f} | {t2 - t1:.0f} |", flush=True)
        del report
        gc.collect()

def tail_bound(worlds: list[int], per_rank: list[int], seeds: list[int], buffer: int, budget: int) -> None:
    """The join-mode tail of the alignment overhead, estimated: max_r alone_r / mean_r alone_r - 1,
    alone_r the groups rank r forms grouping its own shard alone (as ``audit`` counts "alone":
    the protocol on one rank, regroup included). Not a lower bound: under alignment, overflowed
    groups regroup with later arrivals, so a rank can form fewer groups than alone (the ``min``
    target ends a few steps below it). No protocol run of the W ranks: each rank's shard (the
    simulator's permutation and schedule) is simulated on its own."""
    print(f"## Tail estimate of the alignment overhead (sharegpt4o, join, budget {budget}, buffer {buffer})\n")
    print("| W | samples/rank | seed | mean alone steps | max alone steps | tail estimate (max/mean - 1) | seconds |")
    print("|---|---|---|---|---|---|---|")
    for n, seed, world in ((n, seed, world) for n in per_rank for seed in seeds for world in worlds):
        config = ODBConfig(token_budget=budget, buffer_size=buffer, seed=seed)
        lengths = sample_lengths("sharegpt4o", n * world, seed)
        t0 = time.perf_counter()
        shards = shard(permutation(len(lengths), seed, 0, True), world, "in_order", seed)
        alone = [len(simulate([lengths[v] for v in views], 1, config, "in_order", shuffle=False).steps[0])
                 for views in shards]
        mean = sum(alone) / world
        print(f"| {world} | {n:,} | {seed} | {mean:,.1f} | {max(alone):,} | {(max(alone) / mean - 1) * 100:.2f}% | "
              f"{time.perf_counter() - t0:.0f} |", flush=True)


if __name__ == "__main__":
    main()
