"""How full a packed epoch's tail can be: ODB's packed budget on the chat data, with and without
a shared tail (whose reserve fills part-full groups by room, ``odb_core.tail``), against the
bound a tail that moves measured samples between ranks could reach (issue 16's W=8 chat gap).

    .venv/bin/python benchmarks/bench_tail_fill.py [--world 8] [--seeds 0 1 2 3 4] [--pools 0.02 0.05]

Per seed (the simulator's shards of epoch 0, L_max 8,192, buffer 1,024, all 7,168 chit-chat
conversations) it prints batches per epoch and packing efficiency (real tokens / L_max per
batch, as ``odb bench batching``) for:

* ``oracle``: first-fit decreasing over every length at once (offline);
* ``per-rank FFD``: first-fit decreasing over each rank's own shard (offline): the best any
  batcher that packs only its own rank's samples can do;
* ``odb min`` and ``odb min, pool f``: the real protocol (``budget="packed"``, ``min`` target),
  without and with ``shared_tail=f`` (2026-11-27, seeds 0-4: 441-442 without, 438 with 0.02);
* ``ideal pool f``: *not a protocol*: the last f x N views of the order are kept out of the
  shards, each rank packs its shard by FFD, then each pool view, its length known, goes to the
  part-full batch on any rank with the least room that holds it (a new batch on the rank with
  the fewest if none does). ``reloads``: the pool views that would have to be loaded a second
  time were each first measured by rank (pool index mod W) and trained where it is placed.

Not a test: the figures go in notes.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from odb_core import ODBConfig, audit, simulate
from odb_core.sampler import permutation
from odb_core.schedules import shard
from odb_tools.bench_batching import chat_lengths
from odb_tools.bench_packed import efficiency, first_fit_decreasing

BUDGET, BUFFER = 8192, 1024


def ideal_pool(lengths: Sequence[int], world: int, seed: int, fraction: float) -> tuple[list[list[int]], int]:
    """The idealized tail's batches (as lengths) and its reload count (see the module)."""
    order = permutation(len(lengths), seed, 0, True)
    cut = len(order) - int(fraction * len(order))
    owner: list[int] = []
    batches: list[list[int]] = []
    for rank, views in enumerate(shard(order[:cut], world, "in_order", seed)):
        own = [lengths[v] for v in views]
        for b in first_fit_decreasing(own, BUDGET):
            batches.append([own[k] for k in b])
            owner.append(rank)
    reloads = 0
    for j, view in enumerate(order[cut:]):
        length = lengths[view]
        fits = [k for k, b in enumerate(batches) if BUDGET - sum(b) >= length]
        if fits:
            k = min(fits, key=lambda k: BUDGET - sum(batches[k]))
            batches[k].append(length)
        else:
            counts = [owner.count(r) for r in range(world)]
            k = len(batches)
            batches.append([length])
            owner.append(min(range(world), key=counts.__getitem__))
        reloads += owner[k] != j % world
    return batches, reloads


def odb_row(lengths: list[int], world: int, seed: int, fraction: float) -> tuple[int, float]:
    config = ODBConfig(token_budget=BUDGET, budget="packed", buffer_size=BUFFER, seed=seed, target_policy="min",
                       shared_tail=fraction)
    a = audit(simulate(lengths, world, config, "in_order"))
    return sum(a.steps_per_rank) - sum(a.idle_steps_per_rank), a.budget_fill


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--pools", type=float, nargs="+", default=[0.02, 0.05])
    args = parser.parse_args()
    lengths = chat_lengths()
    if lengths is None:
        raise SystemExit("needs the demo data: pip install -e .[dev]")
    oracle = first_fit_decreasing(lengths, BUDGET)
    print(f"oracle: {len(oracle)} batches, {efficiency([[lengths[k] for k in b] for b in oracle], BUDGET):.2%}")
    print("| seed | row | batches | efficiency | reloads |\n|---|---|---|---|---|")
    for seed in args.seeds:
        order = permutation(len(lengths), seed, 0, True)
        per_rank = [[[lengths[views[k]] for k in b] for b in first_fit_decreasing([lengths[v] for v in views], BUDGET)]
                    for views in shard(order, args.world, "in_order", seed)]
        flat = [b for bs in per_rank for b in bs]
        print(f"| {seed} | per-rank FFD | {len(flat)} | {efficiency(flat, BUDGET):.2%} | |")
        for fraction in (0.0, *args.pools):
            batches, fill = odb_row(lengths, args.world, seed, fraction)
            label = f"odb min, pool {fraction:g}" if fraction else "odb min"
            print(f"| {seed} | {label} | {batches} | {fill:.2%} | |")
        for fraction in args.pools:
            ideal, reloads = ideal_pool(lengths, args.world, seed, fraction)
            print(f"| {seed} | ideal pool {fraction:g} | {len(ideal)} | {efficiency(ideal, BUDGET):.2%} | "
                  f"{reloads} ({reloads / len(lengths):.2%}) |")


if __name__ == "__main__":
    main()
