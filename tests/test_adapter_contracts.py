"""Adapter contracts that need no multi-process run: no global patching, argument checks,
and a loss that counts different tokens than the loader is a named error (P7)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("transformers", reason="the hf extra is not installed")
pytest.importorskip("lightning", reason="the lightning extra is not installed")

pytestmark = pytest.mark.timeout(300)


def test_adapters_patch_nothing_global(tmp_path):
    """Importing every adapter and building an ODBTrainer leaves torch's DataLoader, HF's Trainer,
    Accelerate's Accelerator and Lightning's Trainer classes exactly as they were."""
    script = textwrap.dedent(f"""
        import torch.utils.data as tud, transformers, accelerate, lightning.pytorch as pl
        classes = [tud.DataLoader, tud.DistributedSampler, transformers.Trainer, accelerate.Accelerator, pl.Trainer]
        before = [dict(vars(c)) for c in classes]
        import odb_torch.integrations.hf, odb_torch.integrations.accelerate, odb_torch.integrations.lightning
        import sys; sys.path.insert(0, "docs/examples")
        from hf_trainer import make_trainer
        make_trainer({str(tmp_path)!r})
        after = [dict(vars(c)) for c in classes]
        changed = [c.__name__ for c, b, a in zip(classes, before, after) if b != a]
        assert not changed, f"patched: {{changed}}"
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


@pytest.fixture
def tiny():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256))


def make_args(tmp_path, **kw):
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], disable_tqdm=True, **kw)


@pytest.mark.parametrize("setting, message", [
    ({"max_steps": 10}, "unset max_steps"),
    ({"warmup_steps": 5}, "schedules by samples seen"),
])
def test_hf_trainer_refuses_step_counted_settings(tiny, tmp_path, setting, message):
    from odb_tools.demo.synthetic import TokenDataset
    from odb_torch.integrations.hf import ODBTrainer

    with pytest.raises(ValueError, match=message):
        ODBTrainer(model=tiny, args=make_args(tmp_path, **setting), train_dataset=TokenDataset(8), token_budget=64)


def test_hf_trainer_loss_token_mismatch_is_named(tiny, tmp_path):
    """A loader counting other tokens than the loss sums over: LossTokenMismatchError, not silently wrong weights."""
    from torch_support import every_token_counts

    from odb_core.errors import LossTokenMismatchError
    from odb_tools.demo.synthetic import TokenDataset
    from odb_torch.integrations.hf import ODBTrainer

    trainer = ODBTrainer(model=tiny, args=make_args(tmp_path, num_train_epochs=1, save_strategy="no"),
                         train_dataset=TokenDataset(16), token_budget=128,
                         odb_kwargs={"loss_tokens_fn": every_token_counts, "num_workers": 0, "buffer_size": 8, "timeout": 60})
    with pytest.raises(LossTokenMismatchError, match="dataset indices") as caught:
        trainer.train()
    assert caught.value.rank == 0 and caught.value.indices, "the error carries its rank and indices"


@pytest.mark.parametrize("idle,padding,tokens,raises", [
    (False, False, 7, False), (False, False, None, False), (False, False, 6, True),
    (True, False, 0, False), (False, True, 0, False)])
def test_accelerate_backward_checks_the_loss_token_count_when_given(idle, padding, tokens, raises):
    """``backward(..., tokens=n)``: a count other than the loader's for a real micro-batch is a
    LossTokenMismatchError with the rank and indices (the weights would be silently wrong, P7);
    idle and padding micro-batches (weight 0) and an omitted count are not checked."""
    import torch

    from odb_core.errors import LossTokenMismatchError
    from odb_torch.integrations.accelerate import backward
    from odb_torch.step_info import StepInfo
    from odb_torch.windows import MicroBatch

    class Accel:
        process_index, seen = 1, []

        def backward(self, loss):
            self.seen.append(float(loss))

    info = StepInfo(epoch=0, step=3, round=1, is_idle=idle, local_samples=0 if idle else 2, global_samples=4,
                    local_tokens=0 if idle else 7, global_tokens=14, loss_scale=1.0, weight_num=1, weight_den=2,
                    over_budget=0, indices=() if idle else (11, 12))
    micro = MicroBatch(None, info, 0.5, 14, padding, True)
    accel = Accel()
    if raises:
        with pytest.raises(LossTokenMismatchError, match="6 tokens") as caught:
            backward(accel, torch.tensor(3.0), micro, tokens=tokens)
        assert (caught.value.rank, caught.value.indices) == (1, (11, 12)) and not accel.seen
    else:
        assert float(backward(accel, torch.tensor(3.0), micro, tokens=tokens)) == 1.5 and accel.seen == [1.5]


def test_hf_trainer_missing_checkpoint_state_is_named(tiny, tmp_path):
    from odb_core.errors import CheckpointStateError
    from odb_tools.demo.synthetic import TokenDataset
    from odb_torch.integrations.hf import ODBTrainer

    trainer = ODBTrainer(model=tiny, args=make_args(tmp_path, num_train_epochs=1, save_strategy="no"),
                         train_dataset=TokenDataset(16), token_budget=128,
                         odb_kwargs={"num_workers": 0, "buffer_size": 8, "timeout": 60})
    from transformers import TrainerState

    tiny.save_pretrained(tmp_path / "checkpoint-3")  # a checkpoint with weights but without ODB's state
    TrainerState(global_step=3).save_to_json(str(tmp_path / "checkpoint-3" / "trainer_state.json"))
    with pytest.raises(CheckpointStateError, match="odb_state_rank0.json is missing"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-3"))


def test_accelerate_refuses_an_accelerator_that_accumulates_itself():
    """``Accelerator(gradient_accumulation_steps=k)`` divides every loss by k in its ``backward``,
    on top of ODB's exact window weights (P7): every gradient k times too small, silently. Both
    ``prepare`` and ``backward`` refuse it, naming the field and the rank; at 1 they proceed."""
    import torch

    from odb_core.errors import UnsupportedSettingError
    from odb_torch.integrations.accelerate import backward, prepare
    from odb_torch.step_info import StepInfo
    from odb_torch.windows import MicroBatch

    accelerate = pytest.importorskip("accelerate")
    info = StepInfo(epoch=0, step=0, round=0, is_idle=False, local_samples=1, global_samples=1, local_tokens=4,
                    global_tokens=4, loss_scale=1.0, weight_num=1, weight_den=1, over_budget=0, indices=(3,))
    micro = MicroBatch(None, info, 0.25, 4, False, True)
    weight = torch.nn.Parameter(torch.ones(4))
    accelerator = accelerate.Accelerator(gradient_accumulation_steps=4, cpu=True)
    with pytest.raises(UnsupportedSettingError) as err:
        backward(accelerator, (weight * 1.0).sum(), micro, tokens=4)
    assert err.value.field == "gradient_accumulation_steps" and err.value.rank == 0 and weight.grad is None
    with pytest.raises(UnsupportedSettingError) as err:
        prepare(accelerator, torch.nn.Linear(2, 2), torch.optim.SGD([weight], lr=0.1), [], token_budget=64)
    assert err.value.field == "gradient_accumulation_steps"
    ones = accelerate.Accelerator(gradient_accumulation_steps=1, cpu=True)
    backward(ones, (weight * 1.0).sum(), micro, tokens=4)
    assert weight.grad is not None and torch.equal(weight.grad, torch.full((4,), 0.25))  # the exact mean


@pytest.mark.parametrize(("idle", "padding", "tokens", "raises"), [
    (False, False, 7, False), (False, False, 6, True), (False, False, None, False),
    (True, False, 6, False), (False, True, 6, False),
])
def test_lightning_loss_checks_the_loss_token_count_when_given(idle, padding, tokens, raises):
    """``ODBLightningCallback.loss(..., tokens=n)``: a count other than the loader's for a real
    micro-batch is a LossTokenMismatchError with the rank and indices (P7's weights would be
    silently wrong), as the HF and Accelerate adapters check; idle, padding and an omitted count
    are not checked."""
    pytest.importorskip("lightning")
    import torch

    from odb_core.errors import LossTokenMismatchError
    from odb_torch.integrations.lightning import ODBLightningCallback

    batch = {"odb_loss_multiplier": 0.5, "odb_accumulation": 2, "odb_local_tokens": 7, "odb_indices": [11, 12],
             "odb_is_idle": idle, "odb_is_padding": padding}
    if raises:
        with pytest.raises(LossTokenMismatchError, match="6 tokens") as err:
            ODBLightningCallback.loss(torch.tensor(3.0), batch, tokens=tokens)
        assert (err.value.rank, err.value.indices) == (0, (11, 12))
    else:
        assert float(ODBLightningCallback.loss(torch.tensor(3.0), batch, tokens=tokens)) == 3.0
