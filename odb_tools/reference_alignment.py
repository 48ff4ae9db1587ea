"""The paper authors' package's alignment overhead, measured live on ``world`` Gloo ranks.

``online-dynamic-batching`` aligns its ranks inside ``odb.grouping.grouping_data``, which
needs a real process group, so this module spawns ``world`` CPU processes and drives
that function the way the package's own collate loop (``odb.collate.collate_loop_odb``)
does: samples arrive in order, a buffer is grouped once it holds ``buffer_size`` fresh
samples, returned overflow is recycled into the next buffer, ``idx_budget`` is the
number of fresh samples, and at the end of the shard the rank calls once with what it
has and then reports finished until every rank has (join mode). The ramp-up of the
first buffers (``no_warmup=False`` in the package) is left out, so both sides are
measured at the full buffer.

Each rank counts its emitted groups (its optimizer steps) and how many groups it would
have formed alone (its emitted views in sampler order, cut into ``buffer_size``
chunks, grouped by the same B(l) rule): overhead = max steps over ranks / mean alone
groups - 1, the same definition as :func:`odb_core.audit` (under join mode the rank
with the most steps sets the number of updates). Samples the package never emitted
(its finished ranks keep recycled overflow without emitting it) are counted too.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from odb_core.grouping import form_groups
from odb_core.sampler import permutation, shard_views


class _Ids(tuple):  # type: ignore[type-arg]  # a tuple whose len() is the sample's token count
    n = 0

    def __len__(self) -> int:
        return self.n


def reference_sample(index: int, length: int, position: int = 0) -> dict[str, Any]:
    """A sample dict as the reference package reads it: ``input_ids`` of ``length``
    (its len() only; no ids are stored), the dataset index and the view position."""
    ids = _Ids()
    ids.n = length
    return {"input_ids": ids, "idx": index, "pos": position}


def _rank(rank: int, world: int, port: int, views: list[list[int]], lengths: list[int], budget: int,
          buffer_size: int, out_dir: str) -> None:
    import json
    import warnings

    import torch.distributed as dist
    from odb.grouping import grouping_data

    from odb_torch.ports import await_listener

    warnings.filterwarnings("ignore", category=FutureWarning)  # the package's all_gather_into_tensor

    if rank:  # rank 0 serves the store: connect once it listens (odb_torch.ports.await_listener)
        await_listener("127.0.0.1", port, 300)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    group = dist.new_group(backend="gloo")
    mine = views[rank]
    idx_buffer: list[int] = []
    data_buffer: list[list[dict[str, Any]]] = []
    emitted: list[int] = []  # view positions, in emission order
    steps = real = padded = biggest = over = 0

    def once(finished: bool) -> bool:
        nonlocal steps, real, padded, biggest, over
        budget_slots = len(idx_buffer)
        grouped, overflow, all_finished, skip = grouping_data(
            data_buffer, budget, group, is_finished=finished, idx_budget=budget_slots, join_mode=True,
            max_groups=buffer_size)
        data_buffer.clear()
        data_buffer.extend([[s] for s in overflow])
        if skip or (finished and budget_slots == 0):
            return bool(all_finished)
        for g in grouped:
            steps += 1
            emitted.extend(s["pos"] for s in g)
            sizes = [lengths[s["idx"]] for s in g]
            real += sum(sizes)
            padded += max(sizes) * len(sizes)
            biggest = max(biggest, max(sizes) * len(sizes))
            over += int(len(sizes) > 1 and max(sizes) * len(sizes) > budget)
        idx_buffer.clear()
        return bool(all_finished)

    all_finished = False
    for k, v in enumerate(mine):
        idx_buffer.append(k)
        data_buffer.append([reference_sample(v, lengths[v], k)])
        if len(idx_buffer) >= buffer_size:
            all_finished = once(False)
    if idx_buffer and not all_finished:
        all_finished = once(False)
    while not all_finished:
        all_finished = once(True)
    in_order = [lengths[mine[p]] for p in sorted(emitted)]  # as odb_core.audit.alone_groups
    alone = sum(len(form_groups(in_order[k:k + buffer_size], budget)) for k in range(0, len(in_order), buffer_size))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"steps": steps, "alone": alone, "emitted": emitted, "real": real, "padded": padded,
                   "biggest": biggest, "over": over}, f)
    dist.destroy_process_group()


def reference_alignment(lengths: Sequence[int], budget: int, world: int, buffer_size: int = 1024,
                        seed: int = 0, timeout: float = 600.0) -> dict[str, Any] | None:
    """Run the reference package's grouping on ``world`` live Gloo ranks over the shards
    :func:`odb_core.simulate` uses (seeded permutation, DistributedSampler striding).

    Returns ``steps`` (max over ranks), ``alone`` (mean), ``alignment_overhead``, the
    emitted groups' ``padding_fraction``, ``samples_per_update``, ``max_padded_tokens``
    and ``over_budget_batches``, and ``unemitted``: views the package never emitted.
    None when the package is not installed. Raises ``TimeoutError`` (after killing the
    ranks) if they run past ``timeout`` seconds.
    """
    try:
        import odb.grouping  # noqa: F401
    except ImportError:
        return None
    import json

    from torch.multiprocessing.spawn import start_processes

    from odb_torch.ports import free_port

    lengths = list(lengths)
    order = permutation(len(lengths), seed, 0)
    views = [shard_views(order, world, r) for r in range(world)]
    with tempfile.TemporaryDirectory(prefix="odb-ref-align-") as out_dir:
        ctx = start_processes(_rank, args=(world, free_port(), views, lengths, budget, buffer_size, out_dir),  # type: ignore[no-untyped-call]
                              nprocs=world, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"reference alignment on {world} ranks ran past {timeout} s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        ranks = []
        for r in range(world):
            with open(os.path.join(out_dir, f"rank{r}.json")) as f:
                ranks.append(json.load(f))
    steps = max(x["steps"] for x in ranks)
    alone = sum(x["alone"] for x in ranks) / world
    expected = sum(len(v) for v in views)
    got = sum(len(x["emitted"]) for x in ranks)
    real = sum(x["real"] for x in ranks)
    padded = sum(x["padded"] for x in ranks)
    return {"steps": steps, "alone": alone, "alignment_overhead": steps / alone - 1 if alone else 0.0,
            "padding_fraction": 1 - real / padded if padded else 0.0,
            "unemitted": expected - got, "steps_per_rank": [x["steps"] for x in ranks],
            "samples_per_update": got / steps if steps else 0.0, "max_padded_tokens": max(x["biggest"] for x in ranks),
            "over_budget_batches": sum(x["over"] for x in ranks)}
