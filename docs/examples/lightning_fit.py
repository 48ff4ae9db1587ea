"""Lightning fit with ODBLightningCallback: a tiny causal LM (built from a config), synthetic
token data, gradient accumulation, step checkpoints and a mid-epoch resume, on CPU.

    python docs/examples/lightning_fit.py
    torchrun --nproc-per-node 2 docs/examples/lightning_fit.py                  # DDP over Gloo
    torchrun --nproc-per-node 2 docs/examples/lightning_fit.py --stop-at 6     # "crash" after update 6
    torchrun --nproc-per-node 2 docs/examples/lightning_fit.py --resume        # from the last checkpoint

Needs ``pip install "odb-verified[lightning]"``.
"""

from __future__ import annotations

import argparse
import glob
import os
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from odb_tools.demo.model import ModelConfig, TinyCausalLM
from odb_tools.demo.synthetic import TokenDataset
from odb_torch.integrations.lightning import ODBLightningCallback


class LitLM(pl.LightningModule):
    def __init__(self, odb: ODBLightningCallback, epochs: int) -> None:
        super().__init__()
        self.model = TinyCausalLM(ModelConfig(vocab_size=128, max_length=256, d_model=32, n_layers=2, n_heads=2))
        self.odb, self.epochs = odb, epochs

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        loss_sum, count = self.model(batch["input_ids"], batch["labels"])
        return ODBLightningCallback.loss(loss_sum, batch, tokens=count)   # exact per-token mean over the window

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
        sched = self.odb.lr_scheduler(opt, epochs=self.epochs, warmup=0.1, shape="linear")
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class StopAt(pl.Callback):
    """Stops training after update ``n``, as a crash would."""

    def __init__(self, n: int) -> None:
        self.n = n

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if self.n and trainer.global_step >= self.n:
            trainer.should_stop = True


def make(out_dir: str, epochs: int = 2, accum: int = 2, stop_at: int = 0, module_cls: type[LitLM] = LitLM,
         budget: str = "padded", checkpoint_every: int = 4) -> tuple[pl.Trainer, LitLM, ODBLightningCallback]:
    torch.manual_seed(0)
    odb = ODBLightningCallback(TokenDataset(96), token_budget=256, accumulate_grad_batches=accum,
                               buffer_size=32, num_workers=1, timeout=120, budget=budget)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    trainer = pl.Trainer(
        accelerator="cpu", devices=world, strategy="ddp" if world > 1 else "auto", max_epochs=epochs,
        accumulate_grad_batches=accum, default_root_dir=out_dir, logger=False, enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[odb, StopAt(stop_at),
                   ModelCheckpoint(dirpath=os.path.join(out_dir, "ckpt"), every_n_train_steps=checkpoint_every,
                                   save_top_k=-1)],
    )
    return trainer, module_cls(odb, epochs), odb


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/lightning_example")
    parser.add_argument("--stop-at", type=int, default=0)
    parser.add_argument("--resume", action="store_true")
    a = parser.parse_args()
    trainer, module, odb = make(a.out, stop_at=a.stop_at)
    ckpt = None
    if a.resume:
        ckpts = glob.glob(os.path.join(a.out, "ckpt", "*.ckpt"))
        ckpt = max(ckpts, key=os.path.getmtime) if ckpts else None
    trainer.fit(module, train_dataloaders=odb.train_dataloader(), ckpt_path=ckpt)
    if trainer.is_global_zero:
        w = odb.windows()
        print(f"{w.samples_seen} samples, {w.tokens_seen} loss tokens, {trainer.global_step} updates")


if __name__ == "__main__":
    main()
