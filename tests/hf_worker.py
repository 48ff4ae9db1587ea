"""ODBTrainer run by the adapter tests (under torchrun, W = 1 or 2): records what it trained.

    torchrun ... tests/hf_worker.py OUT TAG EPOCHS ACCUM SAVE_STEPS STOP_AT RESUME(0|1) [BUDGET [TAIL [LOGGING_STEPS]]]

Writes OUT/TAG_rank{r}.json: every micro-batch trained (update, epoch, indices, padding,
idle, loss multiplier, local tokens, loss), the LR after every update with the samples seen
then, and the final metrics.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "docs" / "examples"))
from hf_trainer import make_trainer  # noqa: E402

from odb_torch.integrations.hf import ODB_KEY, ODBTrainer  # noqa: E402


class RecordingTrainer(ODBTrainer):
    records: list[dict[str, Any]]

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):  # type: ignore[no-untyped-def]
        mb = inputs.get(ODB_KEY)
        if mb is not None:
            self.records.append({"update": self.state.global_step, "epoch": mb.info.epoch,
                                 "indices": list(mb.info.indices), "padding": mb.is_padding,
                                 "idle": mb.info.is_idle, "multiplier": mb.loss_multiplier,
                                 "local_tokens": mb.info.local_tokens, "row": list(inputs["input_ids"].shape),
                                 "has_positions": "position_ids" in inputs})
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if mb is not None:
            self.records[-1]["loss"] = float(loss)
        return loss


class Watch(TrainerCallback):  # type: ignore[misc]
    def __init__(self, stop_at: int) -> None:
        self.stop_at, self.trainer, self.lrs = stop_at, None, []

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        w = self.trainer.odb_windows
        self.lrs.append({"update": state.global_step, "samples_seen": w.samples_seen,
                         "lr": self.trainer.optimizer.param_groups[0]["lr"]})
        if self.stop_at and state.global_step >= self.stop_at:  # a crash after the checkpoint
            control.should_training_stop = True
        return control


def main() -> None:
    out, tag, epochs, accum, save_steps, stop_at, resume = sys.argv[1:8]
    budget = sys.argv[8] if len(sys.argv) > 8 else "padded"
    tail = float(sys.argv[9]) if len(sys.argv) > 9 else 0.0
    logging_steps = int(sys.argv[10]) if len(sys.argv) > 10 else 1
    watch = Watch(int(stop_at))
    trainer = make_trainer(str(Path(out) / "run"), float(epochs), int(accum), int(save_steps),
                           trainer_cls=RecordingTrainer, callbacks=[watch], budget=budget, shared_tail=tail)
    trainer.records = []
    trainer.args.logging_steps = logging_steps
    watch.trainer = trainer
    result = trainer.train(resume_from_checkpoint=True if resume == "1" else None)
    rank = trainer.args.process_index
    Path(out, f"{tag}_rank{rank}.json").write_text(json.dumps({
        "rank": rank, "world": trainer.args.world_size, "records": trainer.records, "lrs": watch.lrs,
        "metrics": result.metrics, "global_step": result.global_step,
        "total_samples": trainer.odb_total_samples}))


if __name__ == "__main__":
    main()
