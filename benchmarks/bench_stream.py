"""A streamed epoch vs the same loader over the same data map-style, side by side, W=2.

Writes uneven local JSONL shards (file sizes that differ and a file count W does not divide),
then, in W rank processes, alternates epochs of ``ODBDataLoader`` over
``load_dataset("json", streaming=True)`` (``split_dataset_by_node``, tokenized in the
pipeline with ``.map``) and over the same files loaded map-style (``load_dataset("json")``
tokenized with ``.map``, the default ``DistributedSampler``). Each epoch is timed from
``iter(loader)`` to its end on every rank (the slowest rank counts: collate process start,
reading, protocol); samples/s = records / seconds. Prints each mode's median and the ratio
stream / map-style (target >= 0.9). Every epoch is audited: every record yielded exactly once.

    python benchmarks/bench_stream.py [--records 40000] [--reps 3] [--workers 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as tmp

from odb_torch import ODBDataLoader, pad_collate
from odb_torch.ports import free_port

WORLD = 2


def text_of(i: int) -> str:
    return "abcdefghij"[i % 10] * (8 + (i * 7919) % 500)


def tokenize(record: dict[str, Any]) -> dict[str, Any]:
    return {"input_ids": [ord(c) % 50 for c in record["text"]]}


def collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    batch = pad_collate([{"input_ids": torch.tensor(s["input_ids"])} for s in samples])
    batch["id"] = [int(s["id"]) for s in samples]
    return batch


def write_shards(root: Path, records: int) -> list[str]:
    """5 files of uneven sizes (5 is not divisible by W=2: the per-example split)."""
    weights = [5, 1, 3, 0.5, 2]
    sizes = [int(records * w / sum(weights)) for w in weights]
    sizes[0] += records - sum(sizes)
    paths, start = [], 0
    for k, n in enumerate(sizes):
        path = root / f"part{k}.jsonl"
        path.write_text("".join(json.dumps({"id": start + i, "text": text_of(start + i)}) + "\n" for i in range(n)))
        start += n
        paths.append(str(path))
    return paths


def dataset(mode: str, files: list[str], rank: int) -> Any:
    from datasets import load_dataset
    from datasets.distributed import split_dataset_by_node

    if mode == "stream":
        ds = load_dataset("json", data_files=files, split="train", streaming=True)
        return split_dataset_by_node(ds, rank=rank, world_size=WORLD).map(tokenize, remove_columns=["text"])
    return load_dataset("json", data_files=files, split="train").map(tokenize, remove_columns=["text"])


def rank_main(rank: int, files: list[str], port: int, reps: int, workers: int, out: str) -> None:
    """Alternate stream and map-style epochs; record each epoch's seconds and ids."""
    datasets = {mode: dataset(mode, files, rank) for mode in ("stream", "map")}
    rows = []
    for rep in range(reps):
        for k, mode in enumerate(("stream", "map") if rep % 2 == 0 else ("map", "stream")):
            loader = ODBDataLoader(datasets[mode], token_budget=4096, collate_fn=collate, num_workers=workers,
                                   rank=rank, world_size=WORLD, init_method=f"tcp://127.0.0.1:{port + 2 * rep + k}")
            started = time.perf_counter()
            ids = [i for batch in loader for i in (batch["id"] if not loader.step_info.is_idle else [])]
            seconds = time.perf_counter() - started
            steps = loader.step_info.step + 1
            loader.close()
            rows.append({"mode": mode, "rep": rep, "seconds": seconds, "ids": ids, "steps": steps})
    Path(out, f"rank{rank}.json").write_text(json.dumps(rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=int, default=40000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="odb-bench-stream-") as root:
        files = write_shards(Path(root), args.records)
        port = free_port(2 * args.reps)
        tmp.start_processes(lambda r, *a: rank_main(r, *a), args=(files, port, args.reps, args.workers, root),
                            nprocs=WORLD, start_method="fork")
        ranks = [json.loads(Path(root, f"rank{r}.json").read_text()) for r in range(WORLD)]
    per_mode: dict[str, list[float]] = {"stream": [], "map": []}
    for k, row in enumerate(ranks[0]):
        rows = [rank[k] for rank in ranks]
        ids = sorted(i for r in rows for i in r["ids"])
        assert ids == list(range(args.records)), f"{row['mode']} epoch {row['rep']}: not every record exactly once"
        assert len({r["steps"] for r in rows}) == 1, f"{row['mode']} epoch {row['rep']}: unequal steps"
        seconds = max(r["seconds"] for r in rows)
        per_mode[row["mode"]].append(args.records / seconds)
        print(f"{row['mode']:>6} rep {row['rep']}: {seconds:6.2f} s  {args.records / seconds:9.0f} samples/s  "
              f"{row['steps']} steps, every record once")
    stream, mapped = statistics.median(per_mode["stream"]), statistics.median(per_mode["map"])
    print(f"median samples/s: stream {stream:.0f}, map-style {mapped:.0f}; ratio stream / map-style = "
          f"{stream / mapped:.3f} (target >= 0.9)")


if __name__ == "__main__":
    main()
