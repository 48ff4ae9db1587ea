"""The Lightning guide's fit run by the adapter tests under torchrun (W = 1 or 2).

    torchrun ... tests/lightning_worker.py OUT TAG STOP_AT RESUME(0|1) [BUDGET] [K] [EVERY] [MID]

MID > 0: a checkpoint ``mid.ckpt`` saved after the MID-th micro-batch (inside a window when K > 1).

Writes OUT/TAG_rank{r}.json: every micro-batch trained (update, epoch, indices, padding,
idle, multiplier, local tokens), the LR after each update with the samples seen then.
"""

from __future__ import annotations

import glob
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "docs" / "examples"))
import lightning.pytorch as pl  # noqa: E402
import lightning_fit as guide  # noqa: E402


class RecordingLM(guide.LitLM):
    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.records: list[dict[str, Any]] = []
        self.lrs: list[dict[str, Any]] = []

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        self.records.append({"update": self.trainer.global_step, "epoch": batch["odb_epoch"],
                             "indices": list(batch["odb_indices"]), "padding": batch["odb_is_padding"],
                             "idle": batch["odb_is_idle"], "multiplier": batch["odb_loss_multiplier"],
                             "local_tokens": batch["odb_local_tokens"], "row": list(batch["input_ids"].shape),
                             "loss_tokens": int((batch["labels"][:, 1:] != -100).sum())})
        return super().training_step(batch, batch_idx)

    def on_train_batch_end(self, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
        if batch["odb_last_in_window"]:
            self.lrs.append({"update": self.trainer.global_step, "samples_seen": self.odb.windows().samples_seen,
                             "lr": self.trainer.optimizers[0].param_groups[0]["lr"]})


class SaveAfter(pl.Callback):
    """``trainer.save_checkpoint`` after the ``n``-th micro-batch, as a user's call or a signal's would."""

    def __init__(self, n: int, path: str) -> None:
        self.n, self.path, self.seen = n, path, 0

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        self.seen += 1
        if self.seen == self.n:
            trainer.save_checkpoint(self.path)


def main() -> None:
    out, tag, stop_at, resume = sys.argv[1:5]
    budget = sys.argv[5] if len(sys.argv) > 5 else "padded"
    accum = int(sys.argv[6]) if len(sys.argv) > 6 else 2  # K; and a checkpoint every this many updates:
    every = int(sys.argv[7]) if len(sys.argv) > 7 else 4
    mid = int(sys.argv[8]) if len(sys.argv) > 8 else 0
    trainer, module, odb = guide.make(str(Path(out) / "run"), stop_at=int(stop_at), module_cls=RecordingLM,
                                      budget=budget, accum=accum, checkpoint_every=every)
    if mid and resume == "0":
        trainer.callbacks.append(SaveAfter(mid, os.path.join(out, "run", "ckpt", "mid.ckpt")))
    ckpt = None
    if resume == "1":
        ckpt = max(glob.glob(os.path.join(out, "run", "ckpt", "*.ckpt")), key=os.path.getmtime)
    trainer.fit(module, train_dataloaders=odb.train_dataloader(), ckpt_path=ckpt)
    Path(out, f"{tag}_rank{trainer.global_rank}.json").write_text(json.dumps({
        "records": module.records, "lrs": module.lrs, "global_step": trainer.global_step,
        "samples_per_epoch": odb.windows().samples_per_epoch(), "ckpt": ckpt}))


if __name__ == "__main__":
    main()
