"""ODBSFTTrainer (TRL SFTTrainer adapter): in process, and under torchrun at W=1 and W=2 over Gloo.

In process: the refused settings are typed errors naming the field, before the dataset is
prepared; the loss (TRL's fused LM head, summed) equals the per-token NLL / DFT computed
from the model's logits and counts exactly the tokens the loader measures, for data
TRL tokenized from conversations (assistant-only loss) and from plain text;
``pad_to_multiple_of`` is measured as the padded length.

Under torchrun (docs/examples/trl_sft.py through tests/trl_worker.py): every prepared
sample trained exactly once per epoch (P4), also across a crash and a resume from a
mid-epoch checkpoint; exact loss weights over each window and every rank (P7); the same
micro-batches per update on every rank (P2); the LR following samples seen; real
samples/s; no class of torch, transformers or TRL modified.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl", reason="the trl extra is not installed")

from torch_support import (  # noqa: E402
    check_linear_lr_by_samples,
    check_resume_exactly_once,
    check_windows,
    run_torchrun,
    trained,
)

pytestmark = pytest.mark.timeout(400)

WORKER = Path(__file__).with_name("trl_worker.py")
N = 64  # samples in docs/examples/trl_sft.py
LR, WARMUP = 1e-3, 0.1


@pytest.fixture(scope="module")
def example() -> Any:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "docs" / "examples"))
    import trl_sft

    return trl_sft


def shm_left_behind(before: set[str], grace: float = 10.0) -> list[str]:
    """/dev/shm entries created since ``before`` that are still there after up to ``grace`` seconds
    (a launcher's resource tracker unlinks what it tracked just after the ranks exit)."""
    deadline = time.monotonic() + grace
    while True:
        left = sorted(set(os.listdir("/dev/shm")) - before)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def run(tmp: Path, world: int, data: str, save_steps: int = 0, stop_at: int = 0) -> dict[str, list[dict[str, Any]]]:
    """Run "a" (2 epochs, accumulation 2); with ``stop_at``, run "b" resuming it in the same processes.
    Fails unless torchrun exits 0 in time and leaves no process (run_torchrun) and no /dev/shm entry."""
    before = set(os.listdir("/dev/shm"))
    run_torchrun(WORKER, [str(tmp), data, "2", "2", str(save_steps), str(stop_at)], world)
    left = shm_left_behind(before)
    assert not left, f"shared memory left behind: {left}"
    tags = ("a", "b") if stop_at else ("a",)
    return {tag: [json.loads((tmp / f"{tag}_rank{r}.json").read_text()) for r in range(world)] for tag in tags}


# -- in process -----------------------------------------------------------------------------

@pytest.mark.parametrize("sft_args, field", [
    ({"packing": True}, "packing"),
    ({"padding_free": True}, "padding_free"),
    ({"label_smoothing_factor": 0.1}, "label_smoothing_factor"),
    # accepted and ignored before (ODBTrainer's own refusals, which ODBSFTTrainer runs too)
    ({"train_sampling_strategy": "group_by_length"}, "train_sampling_strategy"),
    ({"dataloader_drop_last": True}, "dataloader_drop_last"),
])
def test_refused_sft_settings_name_the_field(example, tmp_path, sft_args, field):
    from odb_core.errors import UnsupportedSettingError

    with pytest.raises(UnsupportedSettingError, match=field) as info:
        example.make_trainer(str(tmp_path), samples=8, sft_args=sft_args)
    assert info.value.field == field and info.value.fields == (field,)


def test_refused_trainer_arguments_name_every_field(example, tmp_path):
    from odb_core.errors import UnsupportedSettingError

    tokenizer = example.make_tokenizer()
    stream = example.texts(8).to_iterable_dataset()
    args = example.SFTConfig(str(tmp_path), packing=True, use_cpu=True, bf16=False)
    with pytest.raises(UnsupportedSettingError) as info:
        example.ODBSFTTrainer(model=example.tiny_llama(tokenizer), args=args,
                              train_dataset=stream, processing_class=tokenizer, token_budget=64,
                              compute_loss_func=lambda outputs, labels, num_items_in_batch=None: 0)
    assert info.value.fields == ("packing", "compute_loss_func", "train_dataset"), str(info.value)


def test_mixture_of_experts_auxiliary_loss_is_refused(example, tmp_path):
    from transformers import MixtralConfig, MixtralForCausalLM

    from odb_core.errors import UnsupportedSettingError

    tokenizer = example.make_tokenizer()
    moe = MixtralForCausalLM(MixtralConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32,
                                           num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                                           num_local_experts=2, num_experts_per_tok=1, router_aux_loss_coef=0.01))
    with pytest.raises(UnsupportedSettingError, match="router_aux_loss_coef") as info:
        example.make_trainer(str(tmp_path), samples=8, model=moe)
    assert info.value.field == "router_aux_loss_coef"


@pytest.mark.parametrize("data, loss_type", [("conversational", "nll"), ("text", "nll"), ("conversational", "dft")])
def test_loss_is_the_summed_per_token_loss_over_the_tokens_the_loader_counts(example, tmp_path, data, loss_type):
    import torch

    from odb_torch.integrations.hf import forward_inputs
    from odb_torch.losses import causal_lm_loss_sum, shifted_loss_tokens

    trainer = example.make_trainer(str(tmp_path), data, samples=12, sft_args={"loss_type": loss_type})
    dataset = trainer.train_dataset
    assert dataset.column_names == ["input_ids", "labels"]  # what TRL's collator reads
    samples = [dataset[i] for i in range(len(dataset))]
    batch = trainer.odb_collate(samples)
    model = trainer.model
    loss_sum, count = trainer.odb_loss_sum_fn(model, forward_inputs(model, batch))
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    if loss_type == "nll":
        reference, ref_count = causal_lm_loss_sum(logits, batch["labels"])
    else:  # DFT: each token's NLL weighted by its (detached) probability
        labels = batch["labels"][:, 1:]
        logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
        reference, ref_count = (-logp * logp.exp() * (labels != -100)).sum(), int((labels != -100).sum())
    assert count == ref_count == sum(shifted_loss_tokens(s) for s in samples)
    assert math.isclose(loss_sum.item(), reference.item(), rel_tol=1e-5), (loss_sum.item(), reference.item())
    every = sum(len(s["input_ids"]) - 1 for s in samples)
    if data == "conversational":  # assistant-only loss: the users' turns carry no loss token
        assert 0 < count < every
    else:
        assert count == every


def test_pad_to_multiple_of_is_measured_as_the_padded_length(example, tmp_path):
    from odb_torch.integrations.trl import PaddedLength

    trainer = example.make_trainer(str(tmp_path), "text", samples=12, sft_args={"pad_to_multiple_of": 8})
    length_fn = trainer.odb_kwargs["length_fn"]
    assert isinstance(length_fn, PaddedLength)
    samples = [trainer.train_dataset[i] for i in range(len(trainer.train_dataset))]
    for group in (samples[:3], samples[3:4], samples[4:]):
        width = trainer.odb_collate(group)["input_ids"].shape[1]
        assert width == max(length_fn(s) for s in group) and width % 8 == 0


# -- under torchrun ---------------------------------------------------------------------------

def check_prepared(ranks: list[dict[str, Any]], data: str) -> None:
    for r in ranks:
        assert r["dataset_size"] == N and r["columns"] == ["input_ids", "labels"]
        assert r["patched"] == [], f"classes modified: {r['patched']}"
    lengths = ranks[0]["lengths"]
    assert max(lengths) > 3 * min(lengths)  # variable-size batches, so ranks form different counts
    if data == "conversational":
        assert all(0 < t < n - 1 for t, n in zip(ranks[0]["loss_tokens"], lengths)), "assistant-only loss"


def test_trl_sft_w1_plain_text_epochs_weights_schedule_throughput(tmp_path):
    ranks = run(tmp_path, world=1, data="text")["a"]
    check_prepared(ranks, "text")
    per_epoch = trained([r["records"] for r in ranks])
    assert sorted(per_epoch) == [0, 1]
    for epoch, ids in per_epoch.items():
        assert sorted(ids) == list(range(N)), f"P4: epoch {epoch} trained {len(ids)} views, not each of {N} once"
    check_windows([r["records"] for r in ranks], accum=2)
    total = ranks[0]["total_samples"]
    check_linear_lr_by_samples(ranks[0]["lrs"], LR, total, math.ceil(total * WARMUP))
    m = ranks[0]["metrics"]
    assert abs(m["train_samples_per_second"] * m["train_runtime"] - 2 * N) < 1.0
    assert ranks[0]["global_step"] == len({rec["update"] for rec in ranks[0]["records"]})


def test_trl_sft_w2_conversational_resume_mid_epoch_loses_nothing_repeats_nothing(tmp_path):
    # run a: checkpoint every 4 updates, "crash" at update 6 (its updates 5-6 are lost with it);
    # run b: a new trainer resumes from the last checkpoint (checkpoint-4) and finishes both epochs
    runs = run(tmp_path, world=2, data="conversational", save_steps=4, stop_at=6)
    first, second = runs["a"], runs["b"]
    check_prepared(first, "conversational")
    assert first[0]["global_step"] == 6
    assert (tmp_path / "run" / "checkpoint-4" / "odb_state_rank1.json").is_file()
    assert not (tmp_path / "run" / "checkpoint-6").exists(), "no checkpoint was due at update 6"
    assert min(rec["update"] for r in second for rec in r["records"]) == 4
    before = trained([r["records"] for r in first], keep=lambda rec: rec["update"] < 4)
    after = trained([r["records"] for r in second])
    check_resume_exactly_once(before, after, N)
    check_windows([r["records"] for r in first], accum=2)
    check_windows([r["records"] for r in second], accum=2)
    total = second[0]["total_samples"]
    check_linear_lr_by_samples(second[0]["lrs"], LR, total, math.ceil(total * WARMUP))
    m = second[0]["metrics"]
    assert abs(m["train_samples_per_second"] * m["train_runtime"] - sum(len(ids) for ids in after.values())) < 1.0


def test_a_dataset_prepared_in_the_collator_is_refused_naming_train_dataset(example, tmp_path):
    """Data TRL leaves unprepared (``skip_prepare_dataset``, as for vision data tokenized in the
    collator) has no ``input_ids`` column to measure before batching: refused, naming the field."""
    from odb_core.errors import UnsupportedSettingError

    with pytest.raises(UnsupportedSettingError, match="input_ids") as info:
        example.make_trainer(str(tmp_path), samples=8, sft_args={"dataset_kwargs": {"skip_prepare_dataset": True}})
    assert info.value.field == "train_dataset"
