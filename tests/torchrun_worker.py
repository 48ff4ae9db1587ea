"""A trainer script launched by torchrun in the tests: env:// Gloo group, ODBDataLoader
with its default collate rendezvous (MASTER_ADDR:MASTER_PORT+1), two audited epochs.

    torchrun ... tests/torchrun_worker.py OUT_DIR N
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from torch_support import ToyDataset  # noqa: E402

from odb_torch import ODBDataLoader, pad_collate  # noqa: E402


def main() -> None:
    out_dir, n = sys.argv[1], int(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    loader = ODBDataLoader(ToyDataset(n), token_budget=128, collate_fn=pad_collate, buffer_size=16,
                           num_workers=1, timeout=60)
    epochs = []
    try:
        for epoch in range(2):
            loader.set_epoch(epoch)
            epochs.append([[] if loader.step_info.is_idle else list(loader.step_info.indices) for _ in loader])
    finally:
        loader.close()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(
        {"rank": rank, "world": dist.get_world_size(), "local_rank": int(os.environ["LOCAL_RANK"]),
         "epochs": epochs}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
