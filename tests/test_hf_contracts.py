"""ODBTrainer's contracts with Hugging Face ``Trainer`` (and ODBSFTTrainer's collate), each a
reviewer's reproduced defect: every rank ends on the same update with the same LR schedule under
a sampler of uneven shares (W=2); an elastic resume (W=1 -> 2) trains exactly ``num_train_epochs``;
a run resumed at its end trains nothing; the final update saves and evaluates under ``"steps"``
strategies; ``save_only_model`` checkpoints every rank's state at W=2; fractional step intervals
and the loss settings ODB would drop are refused naming the field; a PEFT-like ``**kwargs`` wrapper
gets ``position_ids``; an explicit ``collate_fn`` is kept by ODBSFTTrainer.

The W=2 runs go through torchrun over Gloo with this file as the worker (``python
tests/test_hf_contracts.py OUT SCENARIO``); each rank writes OUT/SCENARIO_rank{r}.json.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers", reason="the hf extra is not installed")

import torch  # noqa: E402
from torch_support import ShardSampler  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback, TrainingArguments  # noqa: E402

from odb_core.errors import UnsupportedSettingError  # noqa: E402
from odb_tools.demo.synthetic import TokenDataset  # noqa: E402
from odb_torch.integrations.hf import ODB_KEY, ODBTrainer  # noqa: E402

pytestmark = pytest.mark.timeout(300)

N = 97  # odd: at W=2 the default sampler pads one view, at W=1 none; uneven r::2 shares (49, 48)


def tiny() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256))


def make_args(out: Path | str, **kw: Any) -> TrainingArguments:
    base = {"num_train_epochs": 1, "learning_rate": 1e-3, "warmup_steps": 0.1, "lr_scheduler_type": "linear",
            "logging_steps": 1000, "save_strategy": "no", "use_cpu": True, "dataloader_num_workers": 0,
            "report_to": [], "seed": 0, "disable_tqdm": True}
    return TrainingArguments(output_dir=str(out), **{**base, **kw})


class Recorder(ODBTrainer):
    """Records every real micro-batch trained (update, epoch, dataset indices)."""

    records: list[dict[str, Any]]

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):  # type: ignore[no-untyped-def]
        mb = inputs.get(ODB_KEY)
        if mb is not None and not mb.is_padding and not mb.info.is_idle:
            self.records.append({"update": self.state.global_step, "epoch": mb.info.epoch,
                                 "indices": list(mb.info.indices)})
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


class Watch(TrainerCallback):  # type: ignore[misc]
    """The LR after every update; stops training at update ``stop_at`` (a crash after a checkpoint)."""

    def __init__(self, trainer: ODBTrainer, stop_at: int = 0) -> None:
        self.trainer, self.stop_at, self.lrs = trainer, stop_at, []

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        self.lrs.append([state.global_step, self.trainer.optimizer.param_groups[0]["lr"]])
        if self.stop_at and state.global_step >= self.stop_at:
            control.should_training_stop = True
        return control


def build(out: Path | str, n: int = N, odb: dict[str, Any] | None = None, stop_at: int = 0,
          **args: Any) -> tuple[Recorder, Watch]:
    trainer = Recorder(model=tiny(), args=make_args(out, **args), train_dataset=TokenDataset(n), token_budget=256,
                       odb_kwargs={"buffer_size": 32, "timeout": 30, **(odb or {})})
    trainer.records = []
    watch = Watch(trainer, stop_at)
    trainer.add_callback(watch)
    return trainer, watch


def per_epoch(records: list[dict[str, Any]]) -> dict[int, Counter[int]]:
    """How many times each index was trained, per epoch."""
    out: dict[int, Counter[int]] = {}
    for rec in records:
        out.setdefault(rec["epoch"], Counter()).update(rec["indices"])
    return out


# -- the torchrun worker ------------------------------------------------------------------------
def worker(out: str, scenario: str) -> None:
    """One rank of a scenario: ``uneven`` (W=2, shares of 49 and 48, ``save_only_model`` checkpoints
    every 3 updates), ``elastic`` (W=2, resumes the W=1 checkpoint in OUT/run, 2 epochs)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if scenario == "uneven":
        trainer, watch = build(Path(out) / "run", odb={"sampler": ShardSampler(list(range(rank, N, world)))},
                               save_strategy="steps", save_steps=3, save_only_model=True)
        result = trainer.train()
    else:
        trainer, watch = build(Path(out) / "run", num_train_epochs=2)
        result = trainer.train(resume_from_checkpoint=True)
    Path(out, f"{scenario}_rank{rank}.json").write_text(json.dumps({
        "records": trainer.records, "lrs": watch.lrs, "global_step": result.global_step}))


def run_w2(tmp: Path, scenario: str) -> list[dict[str, Any]]:
    from torch_support import run_torchrun

    run_torchrun(Path(__file__), [str(tmp), scenario], 2, timeout=200)
    return [json.loads((tmp / f"{scenario}_rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def uneven_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("uneven")
    return tmp, run_w2(tmp, "uneven")


# -- F1, F6: uneven shares, save_only_model at W=2 ------------------------------------------------
def test_ranks_agree_on_lr_and_stop_under_uneven_sampler_shares(uneven_run):
    """Shares of 49 and 48 views: the total is the all-reduced epoch (97), not one rank's share x W,
    so every rank has the same LR at every update, stops at the same update and trains every index once."""
    _, ranks = uneven_run
    assert ranks[0]["lrs"] == ranks[1]["lrs"], "the ranks' LR schedules differ"
    assert ranks[0]["global_step"] == ranks[1]["global_step"] == len(ranks[0]["lrs"])
    assert ranks[0]["lrs"][-1][1] == 0.0, "the linear schedule ends at 0 on the last update"
    counts = per_epoch(ranks[0]["records"] + ranks[1]["records"])
    assert list(counts) == [0] and counts[0] == Counter(range(N)), "P4: each index once, in one epoch"


def test_save_only_model_checkpoints_hold_every_ranks_state(uneven_run):
    """Under ``save_only_model`` only rank 0 writes the model; rank 1's ODB state still lands in each
    checkpoint folder (it did not exist on rank 1: CheckpointStateError), the final one included."""
    tmp, ranks = uneven_run
    final = ranks[0]["global_step"]
    folders = sorted(p.name for p in (tmp / "run").glob("checkpoint-*"))
    expected = {f"checkpoint-{s}" for s in range(3, final + 1, 3)} | {f"checkpoint-{final}"}
    assert set(folders) == expected, folders
    for name in folders:
        assert all((tmp / "run" / name / f"odb_state_rank{r}.json").is_file() for r in range(2)), name


# -- F2: an elastic resume trains num_train_epochs exactly ----------------------------------------
def test_elastic_resume_trains_exactly_num_train_epochs(tmp_path):
    """A W=1 checkpoint (97 views an epoch) resumed on W=2 (98: one padded view): the resumed epoch
    and the next are each trained once, every view once, and nothing of a third epoch (the total by
    samples, 2 x 98, ran 2 views into it); the LR reaches 0 on the last update of each rank."""
    first, _ = build(tmp_path / "run", num_train_epochs=2, save_strategy="steps", save_steps=4, stop_at=4)
    assert first.train().global_step == 4
    before = [rec for rec in first.records if rec["update"] < 4]
    ranks = run_w2(tmp_path, "elastic")
    assert min(rec["update"] for r in ranks for rec in r["records"]) == 4
    counts = per_epoch(before + ranks[0]["records"] + ranks[1]["records"])
    assert sorted(counts) == [0, 1], f"epochs trained: {sorted(counts)}"
    assert counts[0] == Counter(range(N)), "P4: the resumed epoch trains each index once"
    assert set(counts[1]) == set(range(N)) and sum(counts[1].values()) == N + 1, "an epoch of 2 x 49 views"
    assert ranks[0]["lrs"] == ranks[1]["lrs"] and ranks[0]["lrs"][-1][1] == 0.0


# -- F3, F5: the end of a run ---------------------------------------------------------------------
def test_resume_from_the_final_checkpoint_trains_nothing(tmp_path):
    """As a stock Trainer: resumed from the checkpoint of its last update, nothing is trained and no
    checkpoint is written again (it trained the next epoch's first window)."""
    trainer, _ = build(tmp_path, n=24, save_strategy="epoch")
    done = trainer.train().global_step
    assert [p.name for p in tmp_path.glob("checkpoint-*")] == [f"checkpoint-{done}"]
    saved = (tmp_path / f"checkpoint-{done}" / "odb_state_rank0.json").stat().st_mtime_ns
    again, _ = build(tmp_path, n=24, save_strategy="epoch")
    assert again.train(resume_from_checkpoint=True).global_step == done
    assert again.records == [], f"trained {again.records}"
    assert (tmp_path / f"checkpoint-{done}" / "odb_state_rank0.json").stat().st_mtime_ns == saved


def model_collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """``pad_collate`` without the dataset index (evaluation passes every key to the model)."""
    from odb_torch import pad_collate

    return {k: v for k, v in pad_collate(samples).items() if k != "idx"}


def test_last_update_saves_and_evaluates_under_steps_strategies(tmp_path):
    """HF saves and evaluates at ``max_steps`` under ``"steps"`` strategies; ODB ends training
    before it, so it requests both itself on its last update."""
    trainer = ODBTrainer(model=tiny(), args=make_args(tmp_path, save_strategy="steps", save_steps=1000,
                                                      eval_strategy="steps", eval_steps=1000),
                         train_dataset=TokenDataset(24), eval_dataset=TokenDataset(4), token_budget=256,
                         data_collator=model_collate, odb_kwargs={"buffer_size": 32, "timeout": 30})
    done = trainer.train().global_step
    assert [p.name for p in tmp_path.glob("checkpoint-*")] == [f"checkpoint-{done}"]
    assert (tmp_path / f"checkpoint-{done}" / "odb_state_rank0.json").is_file()
    assert [e["step"] for e in trainer.state.log_history if "eval_loss" in e] == [done]


# -- F4, F8: settings ODB would silently drop -----------------------------------------------------
@pytest.mark.parametrize("setting, field", [
    ({"logging_steps": 0.25}, "logging_steps"),
    ({"save_strategy": "steps", "save_steps": 0.5}, "save_steps"),
    ({"eval_strategy": "steps", "eval_steps": 0.5, "logging_steps": 5}, "eval_steps"),
    ({"label_smoothing_factor": 0.1}, "label_smoothing_factor"),
])
def test_settings_odb_cannot_honour_are_refused(tmp_path, setting, field):
    """Fractions of ``max_steps`` (an upper bound ODB never reaches: no logs, no checkpoints) and
    label smoothing (a per-batch mean) raise UnsupportedSettingError naming the field."""
    with pytest.raises(UnsupportedSettingError) as caught:
        ODBTrainer(model=tiny(), args=make_args(tmp_path, **setting), train_dataset=TokenDataset(8),
                   eval_dataset=TokenDataset(4), token_budget=256)
    assert caught.value.fields == (field,), str(caught.value)


def test_compute_loss_func_is_refused(tmp_path):
    with pytest.raises(UnsupportedSettingError) as caught:
        ODBTrainer(model=tiny(), args=make_args(tmp_path), train_dataset=TokenDataset(8), token_budget=256,
                   compute_loss_func=lambda outputs, labels, num_items_in_batch=None: 0)
    assert caught.value.field == "compute_loss_func", str(caught.value)


def test_whole_step_intervals_are_accepted(tmp_path):
    ODBTrainer(model=tiny(), args=make_args(tmp_path, logging_steps=1, save_strategy="steps", save_steps=2),
               train_dataset=TokenDataset(8), token_budget=256)


# -- F7: a **kwargs wrapper keeps packed rows apart -----------------------------------------------
class PeftLike(torch.nn.Module):
    """``peft.PeftModelForCausalLM``'s forward signature: no ``position_ids``, a ``**kwargs``."""

    def __init__(self, base: torch.nn.Module) -> None:
        super().__init__()
        self.base_model = base

    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, labels=None,  # type: ignore[no-untyped-def]
                output_attentions=None, output_hidden_states=None, return_dict=None, task_ids=None, **kwargs):
        return self.base_model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, **kwargs)


def test_kwargs_wrapper_gets_position_ids_so_packed_sequences_stay_apart():
    """The packed loss through the wrapper equals the sum of each sequence's own loss (dropping
    ``position_ids`` let the second sequence attend to the first)."""
    from odb_torch import packed_collate
    from odb_torch.integrations.hf import causal_lm_loss, forward_inputs
    from odb_torch.losses import causal_lm_loss_sum

    base = tiny()
    base.config.use_cache = False
    base.eval()
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 128, (n,), generator=gen) for n in (20, 30)]
    batch = packed_collate([{"input_ids": s.tolist()} for s in seqs])
    model = PeftLike(base)
    inputs = forward_inputs(model, batch)
    assert "position_ids" in inputs and "cu_seq_lens_q" in inputs, sorted(inputs)
    with torch.no_grad():
        packed, count = causal_lm_loss(model, inputs)
        alone = sum(causal_lm_loss_sum(base(input_ids=s[None]).logits, s[None])[0] for s in seqs)
    assert count == sum(len(s) - 1 for s in seqs)
    assert torch.allclose(packed, alone, rtol=1e-5), (float(packed), float(alone))


# -- F9: ODBSFTTrainer keeps the caller's collate_fn ----------------------------------------------
def test_sft_trainer_keeps_an_explicit_collate_fn(tmp_path):
    pytest.importorskip("trl", reason="the trl extra is not installed")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "docs" / "examples"))
    import trl_sft

    from odb_torch import pad_collate

    def my_collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
        return pad_collate(samples)

    tok = trl_sft.make_tokenizer()
    args = trl_sft.SFTConfig(str(tmp_path), use_cpu=True, bf16=False, report_to=[], warmup_steps=0.1)
    trainer = trl_sft.ODBSFTTrainer(model=trl_sft.tiny_llama(tok), args=args, train_dataset=trl_sft.texts(8),
                                    processing_class=tok, token_budget=256, odb_kwargs={"collate_fn": my_collate})
    assert trainer.odb_collate is my_collate


if __name__ == "__main__":
    worker(*sys.argv[1:3])


def _epoch_size_rank(rank: int, port: int, out: str) -> None:
    """One rank of a W=2 Gloo group asking for the epoch's size, rank 1 with a shared tail."""
    import json as json_

    import torch.distributed as dist_
    from torch_support import ToyDataset, init_gloo

    from odb_core.errors import ConfigMismatchError
    from odb_torch import ODBDataLoader, pad_collate
    from odb_torch.windows import AccumulationWindows, global_epoch_samples

    init_gloo(rank, 2, port)
    loader = ODBDataLoader(ToyDataset(40), token_budget=256, collate_fn=pad_collate, num_workers=0, rank=rank,
                           world_size=2, init_method="tcp://127.0.0.1:1", shared_tail=0.3 if rank else 0.0)
    try:
        outcome = f"size {global_epoch_samples(AccumulationWindows(loader, 1), 'cpu')}"
    except ConfigMismatchError as exc:
        outcome = f"ConfigMismatchError {exc.field}"
    Path(out, f"rank{rank}.json").write_text(json_.dumps(outcome))
    dist_.destroy_process_group()


def test_ranks_that_disagree_on_the_shared_tail_get_a_typed_error_not_a_hang(tmp_path):
    """The epoch's size is all-reduced by every rank, whatever its settings: a rank with a shared
    tail skipped the collective before, leaving the others waiting in it (under NCCL, until its
    timeout); now both ranks raise ConfigMismatchError naming shared_tail."""
    from torch_support import fork_two_ranks

    outcomes = fork_two_ranks(_epoch_size_rank, tmp_path, timeout=60)
    assert outcomes == ["ConfigMismatchError shared_tail"] * 2, outcomes


def test_an_odb_kwargs_key_the_loader_does_not_take_is_refused_at_construction(tmp_path):
    """A misspelt ``odb_kwargs`` key surfaced only at ``train()``, as a bare TypeError from the
    loader's constructor; it is now an UnsupportedSettingError naming it (and the near keyword)
    when the trainer is built."""
    with pytest.raises(UnsupportedSettingError, match="'bufer_size' \\(did you mean 'buffer_size'\\?\\)") as err:
        ODBTrainer(model=tiny(), args=make_args(tmp_path), train_dataset=TokenDataset(8), token_budget=256,
                   odb_kwargs={"bufer_size": 8, "buffer_size": 8})
    assert err.value.fields == ("bufer_size",)
