"""ODBLightningCallback (docs/examples/lightning_fit.py) under torchrun at W=1 and W=2.

A fit checkpoints every 4 updates and stops after update 6 (a crash); a second fit
resumes from the step-4 checkpoint. Checked: exactly-once coverage per epoch across the
two (P4), equal micro-batches per update on every rank (P2), exact window weights (P7),
and the LR following samples seen.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("lightning", reason="the lightning extra is not installed")

from torch_support import (  # noqa: E402
    check_linear_lr_by_samples,
    check_resume_exactly_once,
    check_windows,
    run_torchrun,
    trained,
)

pytestmark = pytest.mark.timeout(400)

WORKER = Path(__file__).with_name("lightning_worker.py")
N = 96


@pytest.mark.parametrize("world", [1, 2])
def test_lightning_resume_mid_epoch_exactly_once(world, tmp_path):
    run_torchrun(WORKER, [str(tmp_path), "a", "6", "0"], world)
    first = [json.loads((tmp_path / f"a_rank{r}.json").read_text()) for r in range(world)]
    assert first[0]["global_step"] == 6
    run_torchrun(WORKER, [str(tmp_path), "b", "0", "1"], world)
    second = [json.loads((tmp_path / f"b_rank{r}.json").read_text()) for r in range(world)]
    assert second[0]["ckpt"].endswith("step=4.ckpt")
    before = trained([r["records"] for r in first], keep=lambda rec: rec["update"] < 4)
    after = trained([r["records"] for r in second])
    check_resume_exactly_once(before, after, N)
    check_windows([r["records"] for r in first])
    check_windows([r["records"] for r in second])
    total = 2 * second[0]["samples_per_epoch"]
    check_linear_lr_by_samples(second[0]["lrs"], 1e-3, total, round(0.1 * total))
