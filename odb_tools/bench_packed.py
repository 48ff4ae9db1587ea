"""``odb bench batching``'s packed rows: ODB's packed budget online against offline packing.

For one distribution and token budget L_max:

* ``odb packed (target balanced)``: the real protocol (:func:`odb_core.simulate`, ``budget="packed"``,
  in-order delivery, the given buffer, regroup at its default) at each world size W with
  ``target_policy="balanced"``; ``odb packed (target min)``: the same with the packed budget's
  default, ``target_policy="min"``;
  ``odb packed (target min, pool 2%)``: the same with ``shared_tail=0.02``, whose reserve
  fills the ranks' part-full groups at the epoch's end (:mod:`odb_core.tail`);
* ``ffd oracle (offline)``: first-fit decreasing over every length at once (the oracle
  that sees the whole length cache in advance), a sample longer than L_max alone;
* ``ffd per rank (offline, each rank's shard)``: first-fit decreasing over each rank's
  shard on its own (the simulator's sharding of the same epoch), every length of the
  shard in advance: the best a batcher that packs only its own rank's samples does
  with a length cache (every rank's last batch part-full; the efficiency is over all
  ranks' batches, ``updates`` the largest rank's count, ``alignment_overhead`` the
  ranks' batch counts' max / mean - 1: the steps a lockstep run of it idles);
* ``trl pack_dataset bfd (offline)``: TRL's ``pack_dataset(strategy="bfd")`` over a
  ``datasets.Dataset`` with one sequence per sample, as TRL users call it (``map`` in
  its default batches of 1,000 samples, each batch packed on its own) and over the
  whole dataset in one batch (``map_kwargs={"batch_size": None}``). TRL truncates a
  sequence longer than L_max to L_max (its tokens past L_max are discarded: counted in
  ``truncated_samples`` / ``dropped_tokens``) and drops empty sequences
  (``dropped_samples``); ODB and the oracle send a longer sample alone and keep it.

Figures per row: ``packing_efficiency`` (real tokens / L_max per batch, the mean over
batches, batches holding one sample longer than L_max left out, as
``Audit.budget_fill``), ``batches`` per epoch (every rank's, over-long singletons
included), ``updates`` (steps per rank: the offline packers deal their batches
round-robin, ``ceil(batches / W)``), ``alignment_overhead`` (ODB: the extra steps the
aligned ranks run against each rank's unaligned batch count, as the padded rows
define it, ``Audit.alignment_overhead``; offline: none, their counts are fixed in
advance), ``samples`` covered and ``oracle_gap_pp`` (the oracle's efficiency minus the
row's, in percentage points).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from odb_core import ODBConfig, audit, simulate
from odb_core.config import TargetPolicyName
from odb_core.packing import size_of
from odb_core.sampler import permutation
from odb_core.schedules import shard

ORACLE = "ffd oracle (offline)"
RANK_ORACLE = "ffd per rank (offline, each rank's shard)"
TRL = "trl pack_dataset bfd (offline, map batches of 1000)"
TRL_WHOLE = "trl pack_dataset bfd (offline, one batch)"


def first_fit_decreasing(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """First-fit decreasing over every index of ``lengths`` (sizes :func:`~odb_core.packing.size_of`):
    longest first (ties: lower index), each into the first batch it fits in. A length over
    ``budget`` gets a batch of its own."""
    return first_fit_in_order(lengths, sorted(range(len(lengths)), key=lambda k: (-lengths[k], k)), budget)


def first_fit_in_order(lengths: Mapping[int, int] | Sequence[int], order: Sequence[int], budget: int) -> list[list[int]]:
    """First fit of the keys in ``order`` (each into the first batch with room for it), a max
    segment tree over the batches' room (O(n log n))."""
    n = 1
    while n < max(len(order), 1):
        n *= 2
    room = [0] * (2 * n)
    batches: list[list[int]] = []
    for k in order:
        size = size_of(lengths[k])
        if room[1] >= size:
            i = 1
            while i < n:
                i = 2 * i if room[2 * i] >= size else 2 * i + 1
            batches[i - n].append(k)
            room[i] -= size
        else:
            i = n + len(batches)
            batches.append([k])
            room[i] = max(budget - size, 0)
        i //= 2
        while i:
            room[i] = max(room[2 * i], room[2 * i + 1])
            i //= 2
    return batches


def ffd_per_rank(lengths: Sequence[int], budget: int, world: int, seed: int) -> list[list[list[int]]]:
    """Each rank's batches (as lengths) from first-fit decreasing over its own shard alone, the
    shards the simulator deals for ``seed``'s epoch 0 (DistributedSampler sharding)."""
    shards = shard(permutation(len(lengths), seed, 0, True), world, "in_order", seed)
    own = [[lengths[v] for v in views] for views in shards]
    return [[[ls[k] for k in b] for b in first_fit_decreasing(ls, budget)] for ls in own]


def efficiency(batch_lengths: Sequence[Sequence[int]], budget: int) -> float:
    """Mean over batches of real tokens / ``budget``, batches of one sample over ``budget`` left out."""
    within = [sum(b) for b in batch_lengths if b and not (len(b) == 1 and b[0] > budget)]
    return sum(within) / (len(within) * budget) if within else 0.0


def trl_bfd(lengths: Sequence[int], budget: int, batch_size: int | None = 1000) -> dict[str, Any] | None:
    """TRL's ``pack_dataset(strategy="bfd")`` over one ``input_ids`` sequence per length
    (``map`` batches of ``batch_size``; None: one batch): each batch's sequence lengths and
    what TRL dropped or truncated. None when trl or datasets is not installed."""
    try:
        import datasets  # type: ignore[import-untyped]
        import numpy as np
        import pyarrow as pa  # type: ignore[import-untyped]
        from trl.data_utils import pack_dataset
    except ImportError:
        return None
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(np.asarray(lengths, dtype=np.int64), out=offsets[1:])
    column = pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(np.zeros(int(offsets[-1]), dtype=np.int8)))
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        packed = pack_dataset(datasets.Dataset(pa.table({"input_ids": column})), budget, strategy="bfd",
                              map_kwargs={"batch_size": batch_size})
    finally:
        if bars:
            datasets.enable_progress_bars()
    batches = [list(map(int, s)) for s in packed.with_format(None)["seq_lengths"]]
    longer = [x for x in lengths if x > budget]
    # each truncated sequence fills a batch alone ([budget]): marked as over L_max, as the other rows leave it out
    marked = 0
    for batch in batches:
        if marked < len(longer) and batch == [budget]:
            batch[0], marked = budget + 1, marked + 1
    return {"batches": batches, "truncated_samples": len(longer), "dropped_tokens": sum(longer) - budget * len(longer),
            "dropped_samples": sum(1 for x in lengths if x == 0)}


#: the ODB rows: (batcher label, target policy, shared tail); each label names its target
ODB_PACKED: tuple[tuple[str, TargetPolicyName, float], ...] = (
    ("odb packed (target balanced)", "balanced", 0.0), ("odb packed (target min)", "min", 0.0),
    ("odb packed (target min, pool 2%)", "min", 0.02))


def packed_rows(name: str, lengths: list[int], budget: int, worlds: Sequence[int], buffer_size: int,
                seed: int = 0, tick: Callable[[str], None] = lambda _: None) -> list[dict[str, Any]]:
    """The packed rows for one distribution and budget (see the module); ``tick(stage)``
    after each of its ``1 + len(ODB_PACKED) * len(worlds)`` stages."""
    rows: list[dict[str, Any]] = []

    def row(batcher: str, world: int, eff: float, batches: int, updates: int, overhead: float | None,
            samples: int, **extra: Any) -> None:
        rows.append({"batcher": batcher, "budget_kind": "packed", "distribution": name, "token_budget": budget,
                     "world": world, "packing_efficiency": eff, "batches": batches, "updates": updates,
                     "alignment_overhead": overhead, "samples": samples, **extra})

    oracle = first_fit_decreasing(lengths, budget)
    oracle_eff = efficiency([[lengths[k] for k in b] for b in oracle], budget)
    over = sum(1 for n in lengths if n > budget)  # first-fit decreasing sends each alone, as ODB does
    offline: list[tuple[str, list[list[int]], dict[str, Any]]] = [
        (ORACLE, [[lengths[k] for k in b] for b in oracle], {"over_budget_singletons": over})]
    for label, size in ((TRL, 1000), (TRL_WHOLE, None)):
        trl = trl_bfd(lengths, budget, size)
        if trl is not None:
            offline.append((label, trl.pop("batches"), trl))
    for label, batches, extra in offline:
        for world in worlds:
            row(label, world, efficiency(batches, budget), len(batches), -(-len(batches) // world), None,
                sum(map(len, batches)), **extra)
    for world in worlds:
        per_rank = ffd_per_rank(lengths, budget, world, seed)
        counts = [len(bs) for bs in per_rank]
        row(RANK_ORACLE, world, efficiency([b for bs in per_rank for b in bs], budget), sum(counts), max(counts),
            max(counts) * world / sum(counts) - 1 if sum(counts) else 0.0, sum(len(b) for bs in per_rank for b in bs),
            over_budget_singletons=sum(1 for bs in per_rank for b in bs if len(b) == 1 and b[0] > budget))
    tick("offline packing")
    for label, policy, tail in ODB_PACKED:
        for world in worlds:
            config = ODBConfig(token_budget=budget, budget="packed", buffer_size=buffer_size, seed=seed,
                               target_policy=policy, shared_tail=tail)
            a = audit(simulate(lengths, world, config, "in_order"))
            row(label, world, a.budget_fill, sum(a.steps_per_rank) - sum(a.idle_steps_per_rank),
                a.steps_per_rank[0], a.alignment_overhead, a.unique_identities,
                over_budget_singletons=a.over_budget_singletons, coverage_exact=a.coverage_exact)
            tick(f"{label} W={world}")
    for r in rows:
        r["oracle_gap_pp"] = 100 * (oracle_eff - r["packing_efficiency"])
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    """The packed rows as one Markdown table."""
    out = ["| distribution | budget | W | batcher | packing efficiency | oracle - row (pp) | batches | updates/rank | "
           "alignment overhead | samples | longer than L_max |", "|" + "---|" * 11]
    for r in rows:
        overhead = "" if r["alignment_overhead"] is None else f"{r['alignment_overhead']:.2%}"
        if "truncated_samples" in r:
            longer = f"{r['truncated_samples']} truncated ({r['dropped_tokens']} tokens dropped)"
        else:
            longer = f"{r['over_budget_singletons']} alone, kept"
        out.append(f"| {r['distribution']} | {r['token_budget']} | {r['world']} | {r['batcher']} | "
                   f"{r['packing_efficiency']:.2%} | {r['oracle_gap_pp']:+.2f} | {r['batches']} | {r['updates']} | "
                   f"{overhead} | {r['samples']} | {longer} |")
    return "\n".join(out)
