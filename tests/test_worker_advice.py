"""More DataLoader workers than CPUs: the user is told once per loader, by the trainer, as an
``ODBWarning`` naming ``num_workers`` and the CPU count; the collate process's own DataLoaders
(a new one per load, map-style and stream alike) no longer repeat torch's warning on stderr
(twice per rank and load before: at the DataLoader's construction and at its ``iter()``).
Run in a child process limited to one CPU (``sched_setaffinity``), so that 2 workers are too many
on any machine, with ``-W always``: every warning emitted is printed, whatever the registry."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from torch_support import ToyDataset

from odb_core.errors import ODBWarning
from odb_torch import ODBDataLoader
from odb_torch.loader_options import usable_cpus

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs os.sched_setaffinity")]

CHILD = r"""
import os, torch
from torch.utils.data import IterableDataset
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one CPU: 2 workers are more than it
from odb_torch import ODBDataLoader, pad_collate

class Stream(IterableDataset):
    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        k, n = (0, 1) if info is None else (info.id, info.num_workers)
        return ({"input_ids": torch.arange(1 + i % 7)} for i in range(k, 40, n))

data = [{"input_ids": torch.arange(1 + i % 7)} for i in range(40)]
for dataset in (data, Stream()):
    loader = ODBDataLoader(dataset, token_budget=16, collate_fn=pad_collate, num_workers=2, rank=0, world_size=1,
                           timeout=60, start_method="fork")
    with loader:
        for epoch in range(2):  # two epochs: a DataLoader per load in the collate process
            loader.set_epoch(epoch)
            assert sum(len(loader.step_info.indices) for _ in loader) == 40
print("done", flush=True)
"""


def test_too_many_workers_is_said_once_per_loader_by_the_trainer():
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-W", "always", "-c", CHILD], cwd=root, capture_output=True, text=True,
                         timeout=150)
    assert out.returncode == 0 and "done" in out.stdout, out.stderr[-3000:]
    assert "worker processes in total" not in out.stderr, f"torch's warning from the collate process:\n{out.stderr}"
    advice = [line for line in out.stderr.splitlines() if "ODBWarning" in line]
    assert len(advice) == 2, f"one warning per loader expected:\n{out.stderr}"
    for line in advice:
        assert line.startswith("<string>:"), f"the warning names the user's line: {line}"  # its ODBDataLoader(...)
        assert "num_workers=2" in line and "1 CPU" in line, line


def test_the_advice_follows_torchs_rule_at_construction():
    """No process starts here: up to the usable CPUs no warning, one more is one ODBWarning."""
    cpus = usable_cpus()
    assert cpus == len(os.sched_getaffinity(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for workers in (0, cpus):
            ODBDataLoader(ToyDataset(10), token_budget=64, num_workers=workers, rank=0, world_size=1)
    with pytest.warns(ODBWarning, match=rf"rank 1: num_workers={cpus + 1} .* {cpus} CPU") as caught:
        ODBDataLoader(ToyDataset(10), token_budget=64, num_workers=cpus + 1, rank=1, world_size=2)
    assert len(caught) == 1 and caught[0].filename == __file__
