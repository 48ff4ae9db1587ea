"""Module-level helpers for tests/test_from_dataloader.py (spawned ranks import them)."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler
from torch_support import ToyDataset, finish_rank, init_gloo, record_error

from odb_torch import from_dataloader, pad_collate


class WorkerTaggedDataset(ToyDataset):
    """ToyDataset whose samples carry the id of the DataLoader worker that loaded them (-1: none)."""

    def __getitem__(self, i: int) -> dict[str, Any]:
        sample = super().__getitem__(i)
        info = torch.utils.data.get_worker_info()
        sample["worker"] = -1 if info is None else info.id
        return sample


class TaggedBatch(dict):  # type: ignore[type-arg]
    """What :func:`tagged_collate` returns: a dict that says which collate_fn built it."""


def tagged_collate(samples: list[dict[str, Any]]) -> TaggedBatch:
    """pad_collate's batch as a :class:`TaggedBatch` (so a test can tell this collate_fn ran)."""
    return TaggedBatch(pad_collate(samples))


def framework_dataloader(task: dict[str, Any], rank: int, world: int) -> DataLoader[Any]:
    """The DataLoader "a framework built": fixed batches of 4, a worker, the tagged collate_fn."""
    dataset = WorkerTaggedDataset(task["n"])
    if task["sampler"] == "distributed":
        sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=task["seed"])
        return DataLoader(dataset, batch_size=4, sampler=sampler, num_workers=1, collate_fn=tagged_collate)
    return DataLoader(dataset, batch_size=4, shuffle=True, num_workers=1, collate_fn=tagged_collate)


def convert_rank_main(rank: int, world: int, port: int, out_dir: str, task: dict[str, Any]) -> None:
    """One rank: a Gloo group, the framework's DataLoader converted by ``from_dataloader``, ``task["epochs"]``
    epochs; writes per epoch each batch's indices, type and loading workers (and a DistributedSampler's views)."""
    result: dict[str, Any] = {"rank": rank}
    try:
        init_gloo(rank, world, port)
        dl = framework_dataloader(task, rank, world)
        loader = from_dataloader(dl, token_budget=128, buffer_size=16, timeout=60,
                                 init_method=f"tcp://127.0.0.1:{port + 1}")
        result["sampler_kept"] = loader.sampler is dl.sampler
        result["epochs"], result["views"] = [], []
        try:
            for epoch in range(task["epochs"]):
                loader.set_epoch(epoch)
                steps = []
                for batch in loader:
                    info = loader.step_info
                    steps.append({"ids": [] if info.is_idle else batch["idx"].tolist(), "idle": info.is_idle,
                                  "type": type(batch).__name__, "workers": sorted(set(batch["worker"].tolist()))})
                result["epochs"].append(steps)
                if isinstance(dl.sampler, DistributedSampler):  # the views the kept sampler gives this epoch
                    dl.sampler.set_epoch(epoch)
                    result["views"].append([int(i) for i in dl.sampler])
        finally:
            loader.close()
    except Exception as exc:
        record_error(result, exc)
    finish_rank(result, out_dir, rank)
