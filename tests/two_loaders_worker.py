"""Loaders as training scripts build them, on the default rendezvous, run under torchrun (W=2).

    torchrun ... tests/two_loaders_worker.py OUT train_val|rebuild|uneven_history

train_val: a training and an evaluation loader alive at once, each iterated every epoch (2 epochs).
rebuild: a new loader built inside the epoch loop, rebinding the same name (3 epochs).
uneven_history: ranks whose pasts differ before two loaders in a row (gc off, ODB_COLLATE_PORT
set): rank 0 alone runs a one-rank loader first, and collects the first loader (kept in a
reference cycle, closed) before the second; rank 1 does neither.
Writes OUT/<mode>_rank{r}.json: per loader and epoch, the dataset indices and the step count.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch_support import ToyDataset

from odb_torch import ODBDataLoader, pad_collate

N_TRAIN, N_VAL = 60, 24


def epoch_of(loader: ODBDataLoader) -> dict[str, Any]:
    indices: list[int] = []
    steps = 0
    for _ in loader:
        steps += 1
        indices += list(loader.step_info.indices)
    return {"indices": indices, "steps": steps, "init_method": loader._spec.init_method}


def uneven_history(options: dict[str, Any], result: dict[str, list[dict[str, Any]]]) -> None:
    gc.disable()
    os.environ["ODB_COLLATE_PORT"] = str(int(os.environ["MASTER_PORT"]) + 1)
    if dist.get_rank() == 0:
        with ODBDataLoader(ToyDataset(10), rank=0, world_size=1, **options) as lone:
            epoch_of(lone)
    first = ODBDataLoader(ToyDataset(N_TRAIN), **options)
    first.cycle = [first]  # type: ignore[attr-defined]  # collected by gc only
    result["train"].append(epoch_of(first))
    first.close()
    del first
    if dist.get_rank() == 0:
        gc.collect()
    with ODBDataLoader(ToyDataset(N_VAL), **options) as second:
        result["val"].append(epoch_of(second))


def main() -> None:
    out, mode = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    options = dict(token_budget=256, collate_fn=pad_collate, num_workers=0, buffer_size=16, timeout=60)
    result: dict[str, list[dict[str, Any]]] = {"train": [], "val": []}
    if mode == "train_val":
        with ODBDataLoader(ToyDataset(N_TRAIN), **options) as train, \
                ODBDataLoader(ToyDataset(N_VAL), shuffle=False, **options) as val:
            for epoch in range(2):
                train.set_epoch(epoch)
                result["train"].append(epoch_of(train))
                result["val"].append(epoch_of(val))
    elif mode == "uneven_history":
        uneven_history(options, result)
    else:
        for epoch in range(3):
            loader = ODBDataLoader(ToyDataset(N_TRAIN), **options)
            loader.set_epoch(epoch)
            result["train"].append(epoch_of(loader))
        loader.close()
    Path(out, f"{mode}_rank{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
