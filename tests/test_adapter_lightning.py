"""ODBLightningCallback (docs/examples/lightning_fit.py) under torchrun at W=1 and W=2.

A fit checkpoints every 4 updates and stops after update 6 (a crash); a second fit
resumes from the step-4 checkpoint. Checked: exactly-once coverage per epoch across the
two (P4), equal micro-batches per update on every rank (P2), exact window weights (P7),
and the LR following samples seen; W=1 under the padded budget (its checkpoint resumed on
2 ranks: elastic resume), W=2 the packed one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightning", reason="the lightning extra is not installed")

from torch_support import (  # noqa: E402
    check_linear_lr_by_samples,
    check_resume_exactly_once,
    check_windows,
    run_torchrun,
    trained,
)

from odb_tools.demo.synthetic import TokenDataset  # noqa: E402

pytestmark = pytest.mark.timeout(400)

WORKER = Path(__file__).with_name("lightning_worker.py")
N = 96
BUDGET = 256  # the guide's token budget


def check_packed_rows(records: list[dict[str, Any]]) -> None:
    """Each real micro-batch one row of its samples' real lengths, within the packed budget
    (a lone longer sample aside), whose loss tokens are the loader's count (P7); some rows
    hold more than the padded budget would allow."""
    lengths = TokenDataset(N).length
    real = [rec for rec in records if not rec["padding"] and not rec["idle"]]
    for rec in real:
        assert rec["row"] == [1, sum(lengths(i) for i in rec["indices"])], rec
        assert len(rec["indices"]) == 1 or rec["row"][1] <= BUDGET, f"P3 (packed): {rec}"
        assert rec["loss_tokens"] == rec["local_tokens"], f"P7: row counts {rec['loss_tokens']}, loader {rec}"
    assert any(len(r["indices"]) * max(map(lengths, r["indices"])) > BUDGET for r in real), "nothing packed"


@pytest.mark.parametrize(("world", "budget", "resumed_world"), [(1, "padded", 2), (2, "packed", 2)])
def test_lightning_resume_mid_epoch_exactly_once(world, budget, resumed_world, tmp_path):
    """At W=2 under the packed budget (padding-free rows): also each row's loss tokens equal
    the loader's count (P7's weights), and rows are packed within the budget. The W=1 run's
    checkpoint resumes on 2 ranks (elastic resume through the callback's merged rank states)."""
    run_torchrun(WORKER, [str(tmp_path), "a", "6", "0", budget], world)
    first = [json.loads((tmp_path / f"a_rank{r}.json").read_text()) for r in range(world)]
    assert first[0]["global_step"] == 6
    run_torchrun(WORKER, [str(tmp_path), "b", "0", "1", budget], resumed_world)
    second = [json.loads((tmp_path / f"b_rank{r}.json").read_text()) for r in range(resumed_world)]
    assert second[0]["ckpt"].endswith("step=4.ckpt")
    before = trained([r["records"] for r in first], keep=lambda rec: rec["update"] < 4)
    after = trained([r["records"] for r in second])
    check_resume_exactly_once(before, after, N)
    check_windows([r["records"] for r in first])
    check_windows([r["records"] for r in second])
    if budget == "packed":
        check_packed_rows([rec for r in first + second for rec in r["records"]])
    total = 2 * second[0]["samples_per_epoch"]
    check_linear_lr_by_samples(second[0]["lrs"], 1e-3, total, round(0.1 * total))


@pytest.mark.parametrize(("accum", "every", "stop"), [(1, 4, 6), (2, 10, 12)])
def test_lightning_resume_when_the_batch_fetched_ahead_is_a_whole_window(accum, every, stop, tmp_path):
    """Lightning fetches a micro-batch ahead of the one it trains. When that batch makes a whole
    window (K=1), or the epoch's last, one-micro-batch window (K=2: epoch 0 has an odd count of
    micro-batches here, and update 10 is its last), a checkpoint taken after the update before it
    must leave it untrained: it used to be counted as trained and was lost on resume (P4)."""
    run_torchrun(WORKER, [str(tmp_path), "a", str(stop), "0", "padded", str(accum), str(every)], 1)
    first = json.loads((tmp_path / "a_rank0.json").read_text())
    run_torchrun(WORKER, [str(tmp_path), "b", "0", "1", "padded", str(accum), str(every)], 1)
    second = json.loads((tmp_path / "b_rank0.json").read_text())
    assert second["ckpt"].endswith(f"step={every}.ckpt")
    ahead = [rec for rec in first["records"] if rec["update"] == every and rec["epoch"] == 0]
    assert len(ahead) == 1, f"the case: update {every} is one micro-batch of epoch 0, a whole window ({ahead})"
    before = trained([first["records"]], keep=lambda rec: rec["update"] < every)
    check_resume_exactly_once(before, trained([second["records"]]), N)


def test_lightning_resume_from_a_checkpoint_taken_inside_a_window_keeps_lightnings_steps(tmp_path):
    """``trainer.save_checkpoint`` after the 7th micro-batch (K=2: inside update 3's window), then
    a resume from it. The state hands the window's first micro-batch back (its gradient was lost);
    Lightning restores its own count and steps after one more micro-batch. The resumed windows
    used to hold K from the handed-back one on, so each of Lightning's updates took the end of one
    window and the start of the next, weighted by neither (P7) for the rest of the epoch."""
    run_torchrun(WORKER, [str(tmp_path), "a", "6", "0", "padded", "2", "10", "7"], 1)
    first = json.loads((tmp_path / "a_rank0.json").read_text())
    run_torchrun(WORKER, [str(tmp_path), "b", "0", "1", "padded", "2", "10"], 1)
    second = json.loads((tmp_path / "b_rank0.json").read_text())
    assert second["ckpt"].endswith("mid.ckpt")
    assert [rec["update"] for rec in first["records"][5:7]] == [2, 3], "the case: the 7th micro-batch opens update 3"
    assert second["records"][0]["update"] == 3 and second["records"][1]["update"] == 4, (
        "Lightning steps after the first micro-batch of the resume")
    check_windows([second["records"]])
    before = trained([first["records"]], keep=lambda rec: rec["update"] < 3)
    check_resume_exactly_once(before, trained([second["records"]]), N)


@pytest.mark.parametrize(("limit", "accumulate"), [(4, 2), (0.5, 2), (1.0, 3)])
def test_a_limited_lightning_epoch_or_another_accumulation_is_refused_naming_the_setting(limit, accumulate, tmp_path):
    """``Trainer(limit_train_batches=...)`` left every epoch early, and the next started the same
    epoch again: the same first batches every epoch, the rest never trained, without a word. A
    Trainer accumulating another count than the callback's windows was a bare ValueError."""
    import lightning.pytorch as pl

    from odb_core.errors import UnsupportedSettingError
    from odb_torch.integrations.lightning import ODBLightningCallback

    sys_path = str(Path(__file__).resolve().parents[1] / "docs" / "examples")
    import sys

    sys.path.insert(0, sys_path)
    try:
        import lightning_fit as guide
    finally:
        sys.path.remove(sys_path)
    odb = ODBLightningCallback(TokenDataset(N), token_budget=BUDGET, num_workers=0, accumulate_grad_batches=2)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=2, limit_train_batches=limit, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         default_root_dir=str(tmp_path), callbacks=[odb], accumulate_grad_batches=accumulate)
    with pytest.raises(UnsupportedSettingError) as err:
        trainer.fit(guide.LitLM(odb, 2), train_dataloaders=odb.train_dataloader())
    if limit != 1.0:
        assert err.value.field == "limit_train_batches" and "max_steps" in str(err.value)
    else:
        assert err.value.field == "accumulate_grad_batches" and "give both the same" in str(err.value)


def test_a_lightning_rank_whose_peer_cannot_load_its_state_stops_naming_that_rank(tmp_path):
    """Rank 1's state in the checkpoint is of another seed: rank 1 refuses it (ResumeStateError,
    field seed) and rank 0, whose state fits, used to fail on a Gloo 'Connection closed by peer'
    once rank 1's process was gone (or wait for it, had it lived on); both ranks now agree on the
    outcome first, and rank 0 raises CheckpointStateError naming rank 1."""
    import torch

    run_torchrun(WORKER, [str(tmp_path), "a", "6", "0", "padded"], 2)
    path = tmp_path / "run" / "ckpt" / "epoch=0-step=4.ckpt"
    ckpt = torch.load(path, weights_only=False)
    states = [v for v in ckpt["callbacks"].values() if isinstance(v, dict) and "ranks" in v]
    assert len(states) == 1, ckpt["callbacks"].keys()
    states[0]["ranks"][1]["loader"]["seed"] += 1
    torch.save(ckpt, path)
    for later in (tmp_path / "run" / "ckpt").glob("*.ckpt"):
        if later != path:
            later.unlink()
    log = run_torchrun(WORKER, [str(tmp_path), "b", "0", "1", "padded"], 2, fails=True)
    assert "rank 0: ranks [1] could not load ODB's state" in log and "ResumeStateError" in log, log[-4000:]
