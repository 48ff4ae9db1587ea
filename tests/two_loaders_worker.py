"""Loaders as training scripts build them, on the default rendezvous, run under torchrun (W=2).

    torchrun ... tests/two_loaders_worker.py OUT train_val|rebuild

train_val: a training and an evaluation loader alive at once, each iterated every epoch (2 epochs).
rebuild: a new loader built inside the epoch loop, rebinding the same name (3 epochs).
Writes OUT/<mode>_rank{r}.json: per loader and epoch, the dataset indices and the step count.
"""

from __future__ import annotations

import json
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
