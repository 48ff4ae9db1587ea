"""ODBLightningCallback under settings that change during a run or differ per rank (an adapter
review's findings; each test failed before its fix): a GradientAccumulationScheduler that changes
the Trainer's accumulation mid-run is refused (P7's window weights assume the callback's count),
and the learning-rate schedule spans the epoch over every rank, the same on each, when a custom
sampler gives the ranks shares of different lengths."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from odb_core.errors import UnsupportedSettingError

pl = pytest.importorskip("lightning.pytorch")
pytestmark = pytest.mark.timeout(300)


def test_an_accumulation_scheduler_that_changes_the_count_mid_run_is_refused(tmp_path):
    """The scheduler sets the Trainer's accumulate_grad_batches after fit start: Lightning stepped
    every 2 micro-batches while ODB's windows ended after each, so updates were a mean of
    per-micro-batch means (0.53 from the exact per-token gradient), silently."""
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    from odb_tools.demo.model import ModelConfig, TinyCausalLM
    from odb_tools.demo.synthetic import TokenDataset
    from odb_torch.integrations.lightning import ODBLightningCallback

    class Lit(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.model = TinyCausalLM(ModelConfig(vocab_size=128, max_length=256, d_model=16, n_layers=1, n_heads=2))

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            loss_sum, tokens = self.model(batch["input_ids"], batch["labels"])
            return ODBLightningCallback.loss(loss_sum, batch, tokens=tokens)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    odb = ODBLightningCallback(TokenDataset(24), token_budget=200, accumulate_grad_batches=1, buffer_size=16,
                               num_workers=0, prefetch_factor=None, timeout=60)
    trainer = pl.Trainer(accelerator="cpu", max_epochs=1, default_root_dir=str(tmp_path), logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         callbacks=[odb, GradientAccumulationScheduler({0: 2})])
    with pytest.raises(UnsupportedSettingError, match="accumulate_grad_batches=2") as err:
        trainer.fit(Lit(), train_dataloaders=odb.train_dataloader())
    assert err.value.field == "accumulate_grad_batches"


def _schedule_rank(rank: int, port: int, out: str) -> None:
    """One rank of a W=2 Gloo group: a 49/48 split of 97 samples by a custom sampler; the
    learning rate its schedule gives a quarter of the way in (linear, half the epoch warm-up)."""
    import torch.distributed as dist
    from torch_support import ToyDataset, init_gloo

    from odb_torch.integrations.lightning import ODBLightningCallback

    init_gloo(rank, 2, port)
    share = list(range(49)) if rank == 0 else list(range(49, 97))
    odb = ODBLightningCallback(ToyDataset(97), token_budget=256, sampler=share, rank=rank, world_size=2,
                               num_workers=0, init_method="tcp://127.0.0.1:1")
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    lr = odb.lr_scheduler(opt, epochs=1, warmup=0.5, shape="linear").lrs_at(24)[0]
    Path(out, f"rank{rank}.json").write_text(json.dumps(lr))
    dist.destroy_process_group()


def test_the_schedule_spans_the_epoch_over_every_rank_when_shares_differ(tmp_path):
    """Each rank scheduled over its own share times W (98 and 96 samples): different learning
    rates at every update, so the DDP replicas drifted apart. Now every rank schedules over the
    97 samples of the epoch: warm-up round(0.5 x 97) = 48, so 24 samples in gives 0.5."""
    from torch_support import fork_two_ranks

    lrs = fork_two_ranks(_schedule_rank, tmp_path)
    assert lrs == [pytest.approx(0.5)] * 2, lrs
