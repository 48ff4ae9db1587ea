"""Module-level helpers for the multi-process stream tests (spawn needs them importable).

Data is written locally (JSONL, Parquet) and streamed with Hugging Face ``datasets``
(``load_dataset(..., streaming=True)``, no hub), sharded per rank with
``split_dataset_by_node`` and tokenized in the pipeline (``.map``); or a plain
``IterableDataset`` generator that shards itself by rank and by DataLoader worker.
"""

from __future__ import annotations

import json
import traceback
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from odb_torch import ODBDataLoader, pad_collate

BUDGET = 96


def text_of(i: int) -> str:
    """Record i's text: 1..~150 characters, heavy-tailed (some longer than the budget)."""
    return "abcdefghij"[i % 10] * (1 + (i * 7919) % 61 if i % 13 else 100 + (i * 31) % 50)


def write_files(root: Path, fmt: str, sizes: list[int]) -> list[str]:
    """Files of ``sizes`` records each ({"id", "text"}), ids numbered across the files."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    paths, start = [], 0
    for k, n in enumerate(sizes):
        rows = [{"id": start + i, "text": text_of(start + i)} for i in range(n)]
        start += n
        path = root / f"part{k}.{fmt}"
        if fmt == "jsonl":
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        else:
            pq.write_table(pa.Table.from_pylist(rows, schema=pa.schema([("id", pa.int64()), ("text", pa.string())])),
                           path)
        paths.append(str(path))
    return paths


def tokenize(record: dict[str, Any]) -> dict[str, Any]:
    """A character tokenizer run in the stream's pipeline (``.map``)."""
    ids = [ord(c) % 50 for c in record["text"]]
    return {"input_ids": ids, "labels": ids}


def hf_stream(files: list[str], fmt: str, rank: int, world: int) -> Any:
    """This rank's shard of the streamed files, tokenized in the pipeline."""
    from datasets import load_dataset
    from datasets.distributed import split_dataset_by_node

    ds = load_dataset("json" if fmt == "jsonl" else "parquet", data_files=files, split="train", streaming=True)
    return split_dataset_by_node(ds, rank=rank, world_size=world).map(tokenize, remove_columns=["text"])


class RankStream(IterableDataset):  # type: ignore[type-arg]
    """A user-written generator: rank r's records are ``ids[r]``, dealt over the DataLoader workers."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids
        self.epoch = -1

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Any:
        info = get_worker_info()
        k, w = (info.id, info.num_workers) if info is not None else (0, 1)
        for i in self.ids[k::w]:
            yield tokenize({"id": i, "text": text_of(i)}) | {"id": i, "epoch": self.epoch}


def collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    batch = pad_collate([{"input_ids": torch.tensor(s["input_ids"]), "labels": torch.tensor(s["labels"])}
                         for s in samples])
    batch["id"] = [int(s["id"]) for s in samples]
    batch["epoch"] = sorted({s.get("epoch", -1) for s in samples})
    return batch


def run_loader(loader: ODBDataLoader, stop: int | None = None) -> list[dict[str, Any]]:
    """Each step's ids, stream positions, size and padded tokens; ``stop``: leave after that many steps."""
    steps = []
    for batch in loader:
        info = loader.step_info
        ids = [] if info.is_idle else batch["id"]
        steps.append({"ids": ids, "positions": [] if info.is_idle else list(info.indices), "step": info.step,
                      "idle": info.is_idle, "tokens": int(batch["input_ids"].numel()), "over": info.over_budget,
                      "epoch": batch["epoch"]})
        if stop is not None and len(steps) == stop:
            break
    return steps


def make_loader(dataset: Any, rank: int, world: int, port: int, **kw: Any) -> ODBDataLoader:
    return ODBDataLoader(dataset, token_budget=BUDGET, collate_fn=collate, buffer_size=kw.pop("buffer", 12),
                         rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}", timeout=60, **kw)


def stream_rank_main(rank: int, world: int, port: int, out_dir: str, task: dict[str, Any]) -> None:
    """One rank: each of the task's runs over its stream (run k uses ports task["port"] + 2k, + 2k + 1)."""
    result: dict[str, Any] = {"rank": rank, "runs": {}}
    try:
        for k, run in enumerate(task["runs"]):
            result["runs"][run["name"]] = one_run(run, rank, world, task["port"] + 2 * k)
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        result["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def one_run(run: dict[str, Any], rank: int, world: int, port: int) -> dict[str, Any]:
    """One loader over this rank's stream; with ``resume_after``, a checkpoint then a new loader."""
    if run["source"] == "generator":
        dataset: Any = RankStream(run["ids"][rank])
    else:
        dataset = hf_stream(run["files"], run["source"], rank, world)
    kw = {"num_workers": run.get("workers", 0), "idle_sample": run.get("idle_sample"), "element_id": run.get("element_id")}
    loader = make_loader(dataset, rank, world, port, **kw)
    out: dict[str, Any] = {}
    with loader:
        loader.set_epoch(run.get("epoch", 0))
        out["steps"] = run_loader(loader, run.get("resume_after"))
        if "resume_after" in run:
            out["state"] = loader.state_dict()
    if "resume_after" in run:
        if "resumed_ids" in run:  # the resume reads another stream (a checkpoint of the wrong data)
            dataset = RankStream(run["resumed_ids"][rank])
        with make_loader(dataset, rank, world, port + 1, **kw) as resumed:
            resumed.load_state_dict(out["state"])
            out["resumed"] = run_loader(resumed)
    return out
