"""ODBTrainer (Hugging Face Trainer adapter) under torchrun at W=1 and W=2 over Gloo.

Each run records every micro-batch it trained. Checked: exactly-once coverage per epoch
(P4), also across a crash and a resume from a mid-epoch checkpoint; exact loss weights
over each accumulation window and every rank (P7); the same number of micro-batches per
update on every rank (P2); the LR schedule following samples seen; real samples/s. The W=1
run trains under the packed budget (padding-free rows), the W=2 runs under the padded one.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers", reason="the hf extra is not installed")

from torch_support import (  # noqa: E402
    check_linear_lr_by_samples,
    check_resume_exactly_once,
    check_windows,
    run_torchrun,
    trained,
)

from odb_tools.demo.synthetic import TokenDataset  # noqa: E402

pytestmark = pytest.mark.timeout(400)

WORKER = Path(__file__).with_name("hf_worker.py")
N = 96  # TokenDataset size in docs/examples/hf_trainer.py
TAIL = 0.25  # the resume test's pool fraction
BUDGET = 256  # its token budget
LR, WARMUP = 1e-3, 0.1


def run(tmp: Path, tag: str, world: int, epochs: int, accum: int, save_steps: int = 0, stop_at: int = 0,
        resume: bool = False, budget: str = "padded", tail: float = 0.0, logging_steps: int = 1) -> list[dict[str, Any]]:
    run_torchrun(WORKER, [str(tmp), tag, str(epochs), str(accum), str(save_steps), str(stop_at),
                          "1" if resume else "0", budget, str(tail), str(logging_steps)], world)
    return [json.loads((tmp / f"{tag}_rank{r}.json").read_text()) for r in range(world)]


def check_lr_follows_samples(ranks: list[dict[str, Any]]) -> None:
    total = ranks[0]["total_samples"]
    check_linear_lr_by_samples(ranks[0]["lrs"], LR, total, math.ceil(total * WARMUP))


def check_train_loss(ranks: list[dict[str, Any]], first_update: int) -> None:
    """``train_loss`` is the mean over the run's updates of the window's loss, the same on every
    rank: each update's loss is the mean over ranks of their ODB losses (P7), here summed from
    every micro-batch's recorded loss."""
    updates = ranks[0]["global_step"] - first_update
    expected = sum(rec["loss"] for r in ranks for rec in r["records"]) / len(ranks) / updates
    got = [r["metrics"]["train_loss"] for r in ranks]
    assert all(abs(x - expected) <= 1e-5 * abs(expected) for x in got), f"train_loss {got} on the ranks, not {expected}"


def check_packed_rows(records: list[dict[str, Any]]) -> None:
    """Each micro-batch one padding-free row with position ids, its real lengths within the
    packed budget (a lone longer sample aside), some beyond what the padded budget allows."""
    lengths = TokenDataset(N).length
    real = [rec for rec in records if not rec["padding"] and not rec["idle"]]
    for rec in real:
        assert rec["row"] == [1, sum(lengths(i) for i in rec["indices"])] and rec["has_positions"], rec
        assert len(rec["indices"]) == 1 or rec["row"][1] <= BUDGET, f"P3 (packed): {rec}"
    assert any(len(r["indices"]) * max(map(lengths, r["indices"])) > BUDGET for r in real), "nothing packed"


def test_hf_trainer_w1_packed_epochs_weights_schedule_throughput(tmp_path):
    """The packed budget end to end (packed_collate, the attention check, the loss counted over
    the row equal to the loader's count, else LossTokenMismatchError); the padded path runs in
    the W=2 test."""
    ranks = run(tmp_path, "w1", world=1, epochs=2, accum=2, budget="packed")
    check_packed_rows(ranks[0]["records"])
    per_epoch = trained([r["records"] for r in ranks])
    assert sorted(per_epoch) == [0, 1]
    for epoch, ids in per_epoch.items():
        assert sorted(ids) == list(range(N)), f"P4: epoch {epoch} trained {len(ids)} views, not each of {N} once"
    check_windows([r["records"] for r in ranks], accum=2)
    check_lr_follows_samples(ranks)
    check_train_loss(ranks, first_update=0)
    m = ranks[0]["metrics"]
    assert abs(m["train_samples_per_second"] * m["train_runtime"] - 2 * N) < 1.0, (
        f"train_samples_per_second {m['train_samples_per_second']} x runtime {m['train_runtime']} "
        f"is not the {2 * N} samples trained")
    assert ranks[0]["global_step"] == len({rec["update"] for rec in ranks[0]["records"]})


def test_hf_trainer_w2_resume_mid_epoch_loses_nothing_repeats_nothing_on_2_and_on_1_rank(tmp_path):
    lengths = [TokenDataset(N).length(i) for i in range(N)]
    assert max(lengths) > 2 * min(lengths)  # variable-size batches, so ranks form different counts
    # run A: checkpoint every 4 updates, "crash" at update 6 (its updates 5-6 are lost with it);
    # with a shared tail of 25% (N - 24 = 72 views shard evenly): the pooled position resumes
    # logged only at the end (the checkpoint's TrainerState carries logging_steps to runs B and C):
    # train_loss is then all the "loss since the last log" that Trainer adds up
    first = run(tmp_path, "a", world=2, epochs=2, accum=2, save_steps=4, stop_at=6, tail=TAIL, logging_steps=1000)
    check_train_loss(first, first_update=0)
    assert first[0]["global_step"] == 6
    assert (tmp_path / "run" / "checkpoint-4" / "odb_state_rank1.json").is_file()
    states = [json.loads((tmp_path / "run" / "checkpoint-4" / f"odb_state_rank{r}.json").read_text())["loader"]
              for r in range(2)]
    own = (N - int(N * TAIL)) // 2  # each rank's own views; claimed pool view j is position own + j
    assert all(s["pool_size"] == int(N * TAIL) for s in states) and any(
        own + j not in s["consumed"] for s in states for j in s["claimed"]), \
        "the checkpoint lies inside a pooled epoch, after claims not yet yielded: its resume serves them again"
    # run B: resume from the last checkpoint (checkpoint-4) and finish both epochs
    (tmp_path / "run" / "checkpoint-6").exists() and pytest.fail("no checkpoint was due at update 6")
    elastic = tmp_path / "elastic"  # the same checkpoint, for run C on another world size
    shutil.copytree(tmp_path / "run", elastic / "run")
    second = run(tmp_path, "b", world=2, epochs=2, accum=2, save_steps=4, resume=True, tail=TAIL)
    assert min(rec["update"] for r in second for rec in r["records"]) == 4
    before = trained([r["records"] for r in first], keep=lambda rec: rec["update"] < 4)
    after = trained([r["records"] for r in second])
    check_resume_exactly_once(before, after, N)
    check_windows([r["records"] for r in first], accum=2)
    check_windows([r["records"] for r in second], accum=2)
    check_lr_follows_samples(second)
    check_train_loss(second, first_update=4)
    m = second[0]["metrics"]
    resumed_samples = sum(len(ids) for ids in after.values())
    assert abs(m["train_samples_per_second"] * m["train_runtime"] - resumed_samples) < 1.0
    # run C: checkpoint-4 of the 2-rank run resumed on 1 rank (elastic, W=2 -> 1): the rest of
    # each epoch is every index not trained before the checkpoint, once
    third = run(elastic, "c", world=1, epochs=2, accum=2, resume=True, tail=TAIL)
    assert min(rec["update"] for rec in third[0]["records"]) == 4
    check_resume_exactly_once(before, trained([third[0]["records"]]), N)
    check_windows([third[0]["records"]], accum=2)
    check_lr_follows_samples(third)
