"""ODBTrainer with settings users pass to a stock Trainer (W=1, in process): columns its model
does not take are removed before the collator (``remove_unused_columns``), evaluation collates
as training does, callbacks read the epoch ODB trained, and scheduler keywords that count
optimizer steps are refused. Each test failed before its fix (an adapter review's findings)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from odb_core.errors import UnsupportedSettingError

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
pytestmark = pytest.mark.timeout(300)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "docs" / "examples"))
from trl_sft import make_tokenizer, texts  # noqa: E402

from odb_tools.demo.synthetic import TokenDataset  # noqa: E402
from odb_torch.integrations.hf import ODBTrainer  # noqa: E402

ODB = {"buffer_size": 16, "timeout": 60}


def tiny(vocab: int = 128, pad: int | None = None) -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=512, pad_token_id=pad))


def arguments(out: Path, **kw: Any) -> Any:
    base = dict(output_dir=str(out), num_train_epochs=1, learning_rate=1e-3, lr_scheduler_type="constant",
                warmup_steps=0.0, logging_steps=1000, save_strategy="no", use_cpu=True, dataloader_num_workers=0,
                report_to=[], seed=0, disable_tqdm=True)
    return transformers.TrainingArguments(**{**base, **kw})


def test_columns_the_model_does_not_take_are_removed_before_the_collator(tmp_path):
    """The causal-LM recipe: a tokenized datasets.Dataset keeping its text column, collated by
    DataCollatorForLanguageModeling. A stock Trainer prunes the column first; ODBTrainer handed it
    to the collator, which failed on the strings (CollateFnError). The removal is in the collate,
    so a length_fn reads a column the model does not take."""
    tok = make_tokenizer()
    ds = texts(24).map(lambda b: tok(b["text"]), batched=True).map(lambda r: {"tokens": len(r["input_ids"])})
    assert {"text", "tokens"} <= set(ds.column_names)
    collator = transformers.DataCollatorForLanguageModeling(tok, mlm=False)
    result = ODBTrainer(model=tiny(len(tok), tok.pad_token_id), args=arguments(tmp_path), train_dataset=ds,
                        data_collator=collator, token_budget=256,
                        odb_kwargs={**ODB, "length_fn": _tokens}).train()  # measured before the removal
    assert result.global_step > 0


def _tokens(sample: dict[str, Any]) -> int:
    return int(sample["tokens"])


def test_evaluation_collates_as_training_does(tmp_path):
    """Without a data_collator ODBTrainer trains with pad_collate; evaluation used HF's default
    collator, which cannot stack samples of different lengths, so eval_strategy='steps' failed
    mid-training and evaluate() on the training data failed."""
    ds = TokenDataset(24)
    trainer = ODBTrainer(model=tiny(), args=arguments(tmp_path, eval_strategy="steps", eval_steps=2,
                                                      per_device_eval_batch_size=4),
                         train_dataset=ds, eval_dataset=ds, token_budget=256, odb_kwargs=ODB)
    trainer.train()
    assert "eval_loss" in trainer.evaluate()


def test_callbacks_read_the_epoch_odb_trained(tmp_path):
    """Trainer sets state.epoch from its step count over a bound far above the real steps; ODB's
    correction ran after every user callback, which read 0.03 at the end of the first epoch."""
    seen: list[tuple[float, int]] = []

    class Peek(transformers.TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            seen.append((state.epoch, trainer.odb_windows.epochs_completed))

    trainer = ODBTrainer(model=tiny(), args=arguments(tmp_path, num_train_epochs=2, gradient_accumulation_steps=2),
                         train_dataset=TokenDataset(24), token_budget=256, odb_kwargs=ODB, callbacks=[Peek()])
    trainer.train()
    assert seen and all(completed <= epoch <= completed + 1 for epoch, completed in seen), seen
    assert seen[-1][0] == pytest.approx(2.0) and any(epoch == pytest.approx(1.0) for epoch, _ in seen), seen


@pytest.mark.parametrize(("shape", "kwargs"), [("warmup_stable_decay", {"num_decay_steps": 4}),
                                               ("inverse_sqrt", {"timescale": 10})])
def test_scheduler_keywords_that_count_optimizer_steps_are_refused(shape, kwargs, tmp_path):
    """The schedule runs over samples seen: num_decay_steps=4 decayed over the last 4 samples, not
    the last 4 updates (21 of 22 updates at the peak rate), silently."""
    with pytest.raises(UnsupportedSettingError, match=f"{next(iter(kwargs))} count optimizer steps") as err:
        ODBTrainer(model=tiny(), args=arguments(tmp_path, lr_scheduler_type=shape, lr_scheduler_kwargs=kwargs),
                   train_dataset=TokenDataset(24), token_budget=256, odb_kwargs=ODB)
    assert tuple(err.value.fields) == ("lr_scheduler_kwargs",)


class _NoLabels(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.arange(1, 3 + i % 5)}


def test_a_batch_without_labels_names_its_samples_for_the_default_loss(tmp_path):
    """The default loss reads labels: a dataset without them stopped at the first forward with a
    bare KeyError; now an InvalidSampleError names the rank, the samples and the ways out."""
    from odb_core.errors import InvalidSampleError

    trainer = ODBTrainer(model=tiny(), args=arguments(tmp_path, remove_unused_columns=False),
                         train_dataset=_NoLabels(), token_budget=256, odb_kwargs=ODB)
    with pytest.raises(InvalidSampleError, match="has no 'labels'") as err:
        trainer.train()
    assert err.value.rank == 0 and len(err.value.indices) > 0


@pytest.mark.parametrize(("setting", "field"), [
    ({"train_sampling_strategy": "sequential"}, "train_sampling_strategy"),
    ({"train_sampling_strategy": "group_by_length"}, "train_sampling_strategy"),
    ({"dataloader_drop_last": True}, "dataloader_drop_last"),
    ({"include_num_input_tokens_seen": "non_padding"}, "include_num_input_tokens_seen"),
])
def test_settings_that_pick_the_order_drop_samples_or_count_idle_tokens_are_refused(setting, field, tmp_path):
    """Each was accepted and ignored: a 'sequential' run trained a shuffled order, drop_last dropped
    nothing, and the token counter added the zero-weight micro-batches' tokens (16% over)."""
    with pytest.raises(UnsupportedSettingError) as err:
        ODBTrainer(model=tiny(), args=arguments(tmp_path, **setting), train_dataset=TokenDataset(24),
                   token_budget=256, odb_kwargs=ODB)
    assert tuple(err.value.fields) == (field,)


class _Sequential(ODBTrainer):
    def _get_train_sampler(self, train_dataset: Any = None) -> Any:
        return torch.utils.data.SequentialSampler(self.train_dataset)


class _Plain(ODBTrainer):
    pass


def test_a_subclass_overriding_get_train_sampler_is_refused_one_that_does_not_is_not(tmp_path):
    """Trainer's documented hook for the order was never called (0 calls), silently."""
    with pytest.raises(UnsupportedSettingError) as err:
        _Sequential(model=tiny(), args=arguments(tmp_path), train_dataset=TokenDataset(24), token_budget=256,
                    odb_kwargs=ODB)
    assert tuple(err.value.fields) == ("_get_train_sampler",)
    assert _Plain(model=tiny(), args=arguments(tmp_path), train_dataset=TokenDataset(24), token_budget=256,
                  odb_kwargs=ODB).odb_token_budget == 256


@pytest.mark.parametrize(("seeds", "expected"), [({"seed": 5}, 5), ({"seed": 5, "data_seed": 123}, 123)])
def test_the_loader_is_seeded_with_data_seed_when_given(seeds, expected, tmp_path):
    """Trainer seeds its sampler with data_seed when set; ODBTrainer used args.seed, so two runs of
    different data_seed trained the same order."""
    trainer = ODBTrainer(model=tiny(), args=arguments(tmp_path, **seeds), train_dataset=TokenDataset(24),
                         token_budget=256, odb_kwargs=ODB)
    trainer.get_train_dataloader()
    try:
        assert trainer.odb_windows is not None and trainer.odb_windows.loader.config.seed == expected
    finally:
        trainer.odb_windows.loader.close()
