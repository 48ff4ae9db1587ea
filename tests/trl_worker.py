"""ODBSFTTrainer run by the TRL adapter tests (under torchrun, W = 1 or 2): records what it trained.

    torchrun ... tests/trl_worker.py OUT DATA EPOCHS ACCUM SAVE_STEPS STOP_AT

Run "a" trains; with STOP_AT > 0 it stops after update STOP_AT (a crash after the last
checkpoint), and run "b", a new trainer in the same processes (a new loader, new collate
processes, its own collate group), resumes from the last checkpoint and finishes.
Writes OUT/{a,b}_rank{r}.json: every micro-batch trained (update, epoch, indices, padding,
idle, loss multiplier, local tokens), the LR after every
update with the samples seen then, the final metrics, the prepared dataset's size and
loss tokens, and the classes of torch, transformers and TRL that changed while the
adapter was imported and trained (none may).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")  # read when huggingface_hub is imported: no network here
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch.utils.data as tud  # noqa: E402
import transformers  # noqa: E402
import trl  # noqa: E402
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling  # noqa: E402

CLASSES = [tud.DataLoader, tud.DistributedSampler, transformers.Trainer, trl.SFTTrainer, trl.SFTConfig,
           DataCollatorForLanguageModeling]


def attributes(cls: type) -> dict[str, Any]:
    """A class's own attributes, less ``__slotnames__``: the cache ``copyreg`` adds to any class
    whose instances are copied or pickled (ODBTrainer deep-copies the SFTConfig)."""
    return {k: v for k, v in vars(cls).items() if k != "__slotnames__"}


BEFORE = [attributes(c) for c in CLASSES]

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "docs" / "examples"))
from trl_sft import make_trainer  # noqa: E402

from odb_torch.integrations.hf import ODB_KEY  # noqa: E402
from odb_torch.integrations.trl import ODBSFTTrainer  # noqa: E402
from odb_torch.losses import shifted_loss_tokens  # noqa: E402


class RecordingTrainer(ODBSFTTrainer):
    records: list[dict[str, Any]]

    def compute_loss(self, model, inputs, return_outputs=False,  # type: ignore[no-untyped-def]
                     num_items_in_batch=None):
        mb = inputs.get(ODB_KEY)
        if mb is not None:
            self.records.append({"update": self.state.global_step, "epoch": mb.info.epoch,
                                 "indices": list(mb.info.indices), "padding": mb.is_padding,
                                 "idle": mb.info.is_idle, "multiplier": mb.loss_multiplier,
                                 "local_tokens": mb.info.local_tokens})
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


class Watch(transformers.TrainerCallback):  # type: ignore[misc]
    def __init__(self, stop_at: int) -> None:
        self.stop_at, self.trainer, self.lrs = stop_at, None, []

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        w = self.trainer.odb_windows
        self.lrs.append({"update": state.global_step, "samples_seen": w.samples_seen,
                         "lr": self.trainer.optimizer.param_groups[0]["lr"]})
        if self.stop_at and state.global_step >= self.stop_at:  # a crash after the checkpoint
            control.should_training_stop = True
        return control


def run(out: str, tag: str, data: str, epochs: str, accum: str, save_steps: str, stop_at: int,
        resume: bool) -> None:
    """One training run; writes OUT/TAG_rank{r}.json."""
    watch = Watch(stop_at)
    trainer = make_trainer(str(Path(out) / "run"), data, float(epochs), int(accum), int(save_steps),
                           trainer_cls=RecordingTrainer, callbacks=[watch])
    trainer.records = []
    watch.trainer = trainer
    result = trainer.train(resume_from_checkpoint=True if resume else None)
    rank = trainer.args.process_index
    dataset = trainer.train_dataset
    Path(out, f"{tag}_rank{rank}.json").write_text(json.dumps({
        "rank": rank, "world": trainer.args.world_size, "records": trainer.records, "lrs": watch.lrs,
        "metrics": result.metrics, "global_step": result.global_step, "total_samples": trainer.odb_total_samples,
        "dataset_size": len(dataset), "columns": dataset.column_names,
        "loss_tokens": [shifted_loss_tokens(dataset[i]) for i in range(len(dataset))],
        "lengths": [len(dataset[i]["input_ids"]) for i in range(len(dataset))],
        "patched": [c.__name__ for c, b in zip(CLASSES, BEFORE) if attributes(c) != b]}))


def main() -> None:
    out, data, epochs, accum, save_steps, stop_at = sys.argv[1:7]
    run(out, "a", data, epochs, accum, save_steps, int(stop_at), resume=False)
    if int(stop_at):
        # the resumed loader's collate group on a port of its own (torchrun's MASTER_PORT + 2 is free too)
        os.environ["ODB_COLLATE_PORT"] = str(int(os.environ["MASTER_PORT"]) + 2)
        run(out, "b", data, epochs, accum, save_steps, 0, resume=True)


if __name__ == "__main__":
    main()
