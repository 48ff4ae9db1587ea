"""Under torch's ``file_system`` sharing strategy, a loop abandoned mid-epoch leaves no
``/dev/shm`` segment behind once the loader is closed, while the trainer lives on: the batches
the collate process queued and nobody read, and the one it was waiting to put, are given back
(their pickling counted a reference only unpickling returns). Before, 7 segments per abandoned
loop stayed until every process of the job exited. Run in a child process: the strategy is
process-wide."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(180)

CHILD = r"""
import glob, json, sys, torch
torch.multiprocessing.set_sharing_strategy("file_system")
from odb_torch import ODBDataLoader, pad_collate

def collate(samples):
    batch = pad_collate([{"input_ids": s["input_ids"]} for s in samples])
    batch["blob"] = torch.zeros(len(samples), 1 << 20)  # 4 MiB a sample: over the inline limit, shared
    return batch

data = [{"input_ids": torch.arange(1 + i % 7)} for i in range(64)]
left = []
for workers in (0, 1):
    loader = ODBDataLoader(data, token_budget=16, collate_fn=collate, num_workers=workers, rank=0, world_size=1,
                           timeout=30, queue_size=4, start_method="fork")
    batches = iter(loader)
    held = [next(batches) for _ in range(2)]  # then break: the rest of the epoch is queued, unread
    pid = loader._proc.pid
    del held, batches
    loader.close()
    left.append(len(glob.glob(f"/dev/shm/torch_{pid}_*")))
print(json.dumps(left))
"""


def test_an_abandoned_loop_leaves_no_shared_memory_under_the_file_system_strategy():
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", CHILD], cwd=root, capture_output=True, text=True, timeout=150)
    assert out.returncode == 0, out.stderr[-3000:]
    left = json.loads(out.stdout.strip().splitlines()[-1])
    assert left == [0, 0], f"/dev/shm segments left after close, per loop (0 and 1 workers): {left}"
