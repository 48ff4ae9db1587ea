"""``odb bench batching``: batch shapes of ODB against the paper's baselines and peers.

For each length distribution (the fitted ``ultrachat``, ``llava`` and ``sharegpt4o``,
and the real chit-chat conversations when ``chitchat-dataset`` is installed), token
budget and world size: padding, samples per update (global), updates per rank, the
largest padded batch, multi-sample batches over the budget, ODB's alignment overhead,
and the time to form an epoch's batches per 100,000 samples. ODB runs the real
protocol (:func:`odb_core.simulate`, in-order delivery, buffer 1024 by default); its
formation time is that of :func:`odb_core.grouping.group_buffer` (what the protocol
runs each round) over every buffer, the same work the paper authors' package's
``grouping_data`` does per buffer (both
measured on the same buffers when that package is installed: ``pip install -e .[bench]``;
its grouping is timed single-rank; its alignment runs live on Gloo ranks at the
``reference_worlds`` sizes, :mod:`odb_tools.reference_alignment`). With the bench
extra, lhotse's ``DynamicBucketingSampler`` (30 buckets, ``max_duration`` = the budget in
tokens) adds a single-rank row. With ``budget_kinds`` including ``"packed"``, the packed
rows of :mod:`odb_tools.bench_packed` follow (ODB's packed budget against offline packing).
ODB's side imports no torch unless the chat data is used.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence
from typing import Any

from odb_core import ODBConfig, audit, simulate
from odb_core.distributions import sample_lengths
from odb_core.grouping import form_groups, group_buffer
from odb_tools import baselines
from odb_tools.progress import bar
from odb_tools.reference_alignment import reference_alignment, reference_sample

FITTED = ("ultrachat", "llava", "sharegpt4o")
REFERENCE = "reference (online-dynamic-batching 0.1.2)"
FORMATION_REPEATS = 7  # best of 7 for the formation race (ODB against the reference package)


def shape(batches: Sequence[Sequence[int]], lengths: Sequence[int], budget: int, world: int) -> dict[str, Any]:
    """Padding, samples/update, updates, largest padded batch and over-budget multi-sample batches."""
    real = padded = biggest = over = samples = 0
    for b in batches:
        if not b:
            continue
        longest = max(lengths[i] for i in b)
        area = longest * len(b)
        real += sum(lengths[i] for i in b)
        padded += area
        biggest = max(biggest, area)
        over += int(len(b) > 1 and area > budget)
        samples += len(b)
    updates = -(-len(batches) // world)
    return {"padding_fraction": 1 - real / max(padded, 1), "samples_per_update": samples / max(updates, 1),
            "updates": updates, "max_padded_tokens": biggest, "over_budget_batches": over}


def _timed(fn: Callable[[], Any], repeats: int = 3) -> tuple[Any, float]:
    """``fn()``'s result and its best time over ``repeats`` calls, with the garbage
    collector paused while timing (as :mod:`timeit` does, for every batcher alike: a
    collection's cost depends on everything else the process holds, not on the batcher)."""
    best = float("inf")
    out: Any = None
    for _ in range(repeats):
        out = None
        gc.collect()
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            t = time.perf_counter()
            out = fn()
            best = min(best, time.perf_counter() - t)
        finally:
            if was_enabled:
                gc.enable()
    return out, best


def odb_formation(lengths: Sequence[int], budget: int, buffer_size: int) -> float:
    """Seconds to group every buffer of ``lengths`` as the protocol does each round
    (:func:`odb_core.grouping.group_buffer`; lengths were validated on arrival)."""
    buffers = [dict(enumerate(lengths[k:k + buffer_size])) for k in range(0, len(lengths), buffer_size)]
    _, seconds = _timed(lambda: [group_buffer(b, budget) for b in buffers], repeats=FORMATION_REPEATS)
    return seconds


def reference_groups(lengths: Sequence[int], budget: int, buffer_size: int) -> tuple[list[list[int]], float] | None:
    """The paper authors' package's single-rank grouping of the same buffers, and its time; None if absent."""
    try:
        from odb.grouping import grouping_data
    except ImportError:
        return None

    samples = [reference_sample(i, n) for i, n in enumerate(lengths)]

    def run() -> list[list[int]]:
        groups: list[list[int]] = []
        for k in range(0, len(samples), buffer_size):
            buf = [[s] for s in samples[k:k + buffer_size]]
            out = grouping_data(buf, budget, None, is_finished=False, idx_budget=buffer_size,
                                max_groups=buffer_size)
            groups.extend([[s["idx"] for s in g] for g in out[0]])
        return groups

    return _timed(run, repeats=FORMATION_REPEATS)


def lhotse_groups(lengths: Sequence[int], budget: int, seed: int = 0) -> tuple[list[list[int]], float] | None:
    """lhotse's DynamicBucketingSampler over the same lengths (one rank), and its time; None if absent
    or given fewer than 2 lengths (its buckets need 2).

    Each sample is a cut whose duration is its token count and ``max_duration`` is the
    budget: lhotse bounds the *sum* of a batch's lengths, not its padded area, so its
    batches can exceed the budget once padded (counted in ``over_budget_batches``).
    """
    try:
        import warnings

        from lhotse import CutSet, MonoCut
        from lhotse.dataset import DynamicBucketingSampler
    except ImportError:
        return None
    if len(lengths) < 2:  # its bucketing needs 2 buckets, so 2 samples at least (an AssertionError otherwise)
        return None
    cuts = CutSet.from_cuts(MonoCut(id=str(i), start=0.0, duration=float(max(n, 1)), channel=0)
                            for i, n in enumerate(lengths))

    def run() -> list[list[int]]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sampler = DynamicBucketingSampler(cuts, max_duration=float(budget), shuffle=True, seed=seed,
                                              num_buckets=min(30, len(cuts)), world_size=1, rank=0)
            return [[int(c.id) for c in batch] for batch in sampler]

    return _timed(run, repeats=1)


def chat_lengths(max_length: int = 16384) -> list[int] | None:
    """Every chit-chat conversation's templated Qwen length (None without the demo extra)."""
    try:
        from odb_tools.demo.chat_data import ChatDataset

        return ChatDataset(max_length=max_length).lengths()
    except ImportError:
        return None


def rows_for(name: str, lengths: list[int], budget: int, worlds: Sequence[int], buffer_size: int,
             seed: int = 0, reference_worlds: Sequence[int] = (),
             tick: Callable[[str], None] = lambda _: None) -> list[dict[str, Any]]:
    """Every batcher's row for one distribution and budget; ``reference_worlds``: world
    sizes at which the reference package runs live on Gloo ranks (when installed).
    ``tick(stage)`` is called after each of its ``2 + len(worlds)`` stages (progress)."""
    n = len(lengths)
    per = 1e5 / n
    bs = baselines.survival_batch_size(lengths, budget)
    rows: list[dict[str, Any]] = []

    def row(batcher: str, world: int, figures: dict[str, Any], overhead: float | None, seconds: float) -> None:
        rows.append({"batcher": batcher, "distribution": name, "token_budget": budget, "world": world,
                     **figures, "alignment_overhead": overhead, "formation_seconds_per_1e5": seconds * per,
                     "fixed_batch_size": bs if batcher in ("standard", "sorted", "hfg-oracle") else None})

    odb_seconds = odb_formation(lengths, budget, buffer_size)
    tick("formation")
    for world in worlds:
        fixed: dict[str, Callable[[], list[list[int]]]] = {
            "standard": lambda: baselines.standard(lengths, bs, world, seed),
            "sorted": lambda: baselines.sorted_online(lengths, bs, world, buffer_size, seed),
            "hfg-oracle": lambda: baselines.hfg(lengths, bs, world, seed),
            "gmt-oracle": lambda: baselines.gmt(lengths, budget, world, seed),
            "bmt-oracle": lambda: baselines.bmt(lengths, budget, world, seed),
        }
        for batcher, make in fixed.items():
            batches, seconds = _timed(make)
            row(batcher, world, shape(batches, lengths, budget, world), None, seconds)
        result = simulate(lengths, world, ODBConfig(token_budget=budget, buffer_size=buffer_size, seed=seed))
        a = audit(result)
        steps = [[list(s.lengths) for s in rank if not s.is_idle] for rank in result.steps]
        flat_lengths: list[int] = []
        batches = []
        for rank in steps:
            for ls in rank:
                batches.append(list(range(len(flat_lengths), len(flat_lengths) + len(ls))))
                flat_lengths += ls
        figures = shape(batches, flat_lengths, budget, world)
        figures["updates"] = a.steps_per_rank[0]
        figures["samples_per_update"] = sum(a.emitted_per_rank) / max(a.steps_per_rank[0], 1)
        row("odb", world, figures, a.alignment_overhead, odb_seconds)
        tick(f"W={world}")
    ref = reference_groups(lengths, budget, buffer_size)
    if ref is not None:
        groups, seconds = ref
        for world in reference_worlds:
            live = reference_alignment(lengths, budget, world, buffer_size, seed)
            assert live is not None
            figures = {k: live[k] for k in ("padding_fraction", "samples_per_update", "max_padded_tokens",
                                             "over_budget_batches")}
            row(REFERENCE, world, {**figures, "updates": live["steps"], "unemitted": live["unemitted"]},
                live["alignment_overhead"], seconds)
        row(f"{REFERENCE[:-1]}, 1 rank)", 1, shape(groups, lengths, budget, 1), None, seconds)
        rows.append({**rows[-1], "batcher": "odb grouping only (1 rank, same buffers, no regroup)",
                     "formation_seconds_per_1e5": odb_seconds * per,
                     **shape([[k + off for k in g] for off, gs in _buffers(lengths, budget, buffer_size) for g in gs],
                             lengths, budget, 1), "alignment_overhead": None})
    lhotse = lhotse_groups(lengths, budget, seed)
    if lhotse is not None:
        groups, seconds = lhotse
        row("lhotse DynamicBucketingSampler (1 rank)", 1, shape(groups, lengths, budget, 1), None, seconds)
    tick("peers")
    return rows


def _buffers(lengths: Sequence[int], budget: int, buffer_size: int) -> list[tuple[int, list[list[int]]]]:
    return [(k, form_groups(lengths[k:k + buffer_size], budget)) for k in range(0, len(lengths), buffer_size)]


def run(samples: int = 100_000, budgets: Sequence[int] = (8192, 16384), worlds: Sequence[int] = (1, 2, 4, 8),
        buffer_size: int = 1024, distributions: Sequence[str] = (*FITTED, "chat"), seed: int = 0,
        reference_worlds: Sequence[int] = (8,), progress: bool = False,
        budget_kinds: Sequence[str] = ("padded", "packed")) -> list[dict[str, Any]]:
    """Every row of the benchmark; ``progress``: a bar on stderr (when it is a terminal);
    ``budget_kinds``: the padded rows (:func:`rows_for`), the packed rows
    (:func:`odb_tools.bench_packed.packed_rows`, ``budget_kind`` "packed"), or both."""
    from odb_tools.bench_packed import ODB_PACKED, packed_rows

    rows: list[dict[str, Any]] = []
    packed_stages = 1 + len(ODB_PACKED) * len(worlds)
    per_budget = (2 + len(worlds)) * ("padded" in budget_kinds) + packed_stages * ("packed" in budget_kinds)
    with bar(len(distributions) * len(budgets) * per_budget, "bench batching", "stages", progress) as b:
        for name in distributions:
            b.set_description_str(name)
            if name == "chat":
                lengths = chat_lengths()
                if lengths is None:
                    b.update(len(budgets) * per_budget)
                    continue
            else:
                lengths = sample_lengths(name, samples, seed)
            for budget in budgets:
                if "padded" in budget_kinds:
                    rows += rows_for(name, lengths, budget, worlds, buffer_size, seed, reference_worlds,
                                     _ticker(b, budget))
                if "packed" in budget_kinds:
                    rows += packed_rows(name, lengths, budget, worlds, buffer_size, seed, _ticker(b, budget))
    return rows


def _ticker(b: Any, budget: int) -> Callable[[str], None]:
    """A ``rows_for`` tick that advances the bar ``b`` by one stage."""
    def tick(stage: str) -> None:
        b.set_postfix_str(f"budget {budget}, {stage} done", refresh=False)
        b.update()
    return tick


def markdown(rows: list[dict[str, Any]]) -> str:
    """The padded rows as one Markdown table, then the packed rows as another."""
    from odb_tools import bench_packed

    packed = [r for r in rows if r.get("budget_kind") == "packed"]
    rows = [r for r in rows if r.get("budget_kind") != "packed"]
    tables = ([padded_markdown(rows)] if rows else []) + ([bench_packed.markdown(packed)] if packed else [])
    return "\n\n".join(tables)


def padded_markdown(rows: list[dict[str, Any]]) -> str:
    """The padded rows as one Markdown table."""
    out = ["| distribution | budget | W | batcher | padding | samples/update | updates | max padded tokens | "
           "over-budget batches | alignment overhead | formation s/1e5 |", "|" + "---|" * 11]
    for r in rows:
        overhead = "" if r["alignment_overhead"] is None else f"{r['alignment_overhead']:.2%}"
        out.append(f"| {r['distribution']} | {r['token_budget']} | {r['world']} | {r['batcher']} | "
                   f"{r['padding_fraction']:.2%} | {r['samples_per_update']:.1f} | {r['updates']} | "
                   f"{r['max_padded_tokens']} | {r['over_budget_batches']} | {overhead} | "
                   f"{r['formation_seconds_per_1e5']:.3f} |")
    return "\n".join(out)
