"""Hugging Face ``Trainer`` with ODB batches: ``ODBTrainer`` (extra ``odb-verified[hf]``).

A subclass, not a patch: it overrides only ``Trainer``'s documented extension points
(``get_train_dataloader``, ``compute_loss``, ``create_scheduler``, ``log``, ``train``) and
adds two callbacks. Nothing global is changed; other DataLoaders and Trainers in the
process are untouched.

What changes against a stock ``Trainer``:

* batches come from an :class:`~odb_torch.ODBDataLoader` (token budget, P2-P4), read in
  gradient-accumulation windows (:class:`~odb_torch.windows.AccumulationWindows`);
* the loss is the exact per-token mean over every token of a window on every rank (P7):
  each micro-batch's summed token loss times ``W / window_tokens``;
* epochs end when the data does; ``num_train_epochs`` counts real epochs, the progress bar
  counts samples, the LR schedule follows samples seen (``warmup_steps`` < 1 is a
  fraction of all samples), ``train_samples_per_second`` counts real samples (HF's multiplies a
  fixed batch size), logs carry ``odb_samples_seen`` and ``odb_tokens_seen``;
* checkpoints hold each rank's loader position (``odb_state_rank{r}.json``); resuming
  from one emits nothing twice and loses nothing (P4).
"""

from __future__ import annotations

import copy
import inspect
import math
import os
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any, cast

import torch
from torch.optim.lr_scheduler import LambdaLR
from transformers import Trainer, TrainerCallback, get_scheduler
from transformers.trainer_callback import ProgressCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from odb_torch.loader import ODBDataLoader
from odb_torch.losses import causal_lm_loss_sum, check_loss_tokens, logits_of, shifted_loss_tokens
from odb_torch.padding_free import VARLEN_KEYS, adapter_defaults, budget_of, check_packed_attention
from odb_torch.schedule import ProgressLR
from odb_torch.windows import AccumulationWindows, MicroBatch, load_windows_state, save_windows_state

#: the key under which each batch carries its :class:`MicroBatch` through ``Trainer``
ODB_KEY = "odb_micro_batch"

LossSumFn = Callable[[torch.nn.Module, dict[str, Any]], tuple[torch.Tensor, int]]


class _Batches:
    """What ``Trainer`` iterates: the windows' batches as dicts carrying their :class:`MicroBatch`."""

    def __init__(self, windows: AccumulationWindows) -> None:
        self.windows = windows

    def set_epoch(self, epoch: int) -> None:
        self.windows.set_epoch(epoch)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for mb in self.windows:
            if not isinstance(mb.batch, Mapping):
                raise TypeError(f"ODBTrainer needs the data collator to return a dict of tensors, got "
                                f"{type(mb.batch).__name__} (dataset indices {list(mb.info.indices)})")
            yield {**mb.batch, ODB_KEY: mb}


class _ODBControl(TrainerCallback):
    """Ends epochs when the data does and training after ``num_train_epochs``; saves the loader state."""

    def __init__(self, trainer: ODBTrainer) -> None:
        self.trainer = trainer

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        w = self.trainer.odb_windows
        if w is None:
            return control
        state.epoch = w.epochs_completed + w.samples_in_epoch / max(w.samples_per_epoch(), 1)
        if w.at_epoch_end:
            control.should_epoch_stop = True
        if w.samples_seen >= self.trainer.odb_total_samples:
            control.should_training_stop = True
            control.should_epoch_stop = True
        return control

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        w = self.trainer.odb_windows
        if w is None:
            return control
        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        save_windows_state(w, folder)
        return control


class _SampleProgress(TrainerCallback):
    """A progress bar over samples seen (every rank's), on the main process."""

    def __init__(self, trainer: ODBTrainer) -> None:
        self.trainer = trainer
        self.bar: Any = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if state.is_world_process_zero:
            from tqdm.auto import tqdm

            w = self.trainer.odb_windows
            self.bar = tqdm(total=self.trainer.odb_total_samples, initial=w.samples_seen if w else 0,
                            unit="samples", dynamic_ncols=True)
        return control

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        w = self.trainer.odb_windows
        if self.bar is not None and w is not None:
            self.bar.update(w.samples_seen - self.bar.n)
        return control

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> Any:
        if self.bar is not None and logs:
            self.bar.write(str({k: v for k, v in logs.items() if k != "total_flos"}))
        return control

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        return control


def causal_lm_loss(model: torch.nn.Module, inputs: dict[str, Any]) -> tuple[torch.Tensor, int]:
    """Default ``loss_sum_fn``: forward without labels, then the shifted next-token loss sum and count."""
    model_inputs = {k: v for k, v in inputs.items() if k != "labels"}
    return causal_lm_loss_sum(logits_of(model(**model_inputs)), inputs["labels"])


def forward_inputs(model: torch.nn.Module, inputs: Mapping[str, Any]) -> dict[str, Any]:
    """The batch fields ``model.forward`` names explicitly, plus ``labels`` (as HF's column pruning
    keeps) and, when it takes ``**kwargs``, a packed row's varlen keywords (``cu_seq_lens_q``, ...)."""
    params = inspect.signature(model.forward).parameters
    named = {n for n, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    if not named:
        return dict(inputs)
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        named.update(VARLEN_KEYS)
    return {k: v for k, v in inputs.items() if k in named or k == "labels"}


class ODBTrainer(Trainer):
    """``transformers.Trainer`` that trains on ODB batches with exact loss scaling.

    Args:
        token_budget: L_max, padded tokens per micro-batch.
        odb_kwargs: further :class:`~odb_torch.ODBDataLoader` keywords (``buffer_size``,
            ``length_fn``, ``timeout``, ...). ``num_workers`` defaults to
            ``args.dataloader_num_workers``, ``pin_memory`` to ``args.dataloader_pin_memory``,
            ``seed`` to ``args.seed``, ``loss_tokens_fn`` to
            :func:`~odb_torch.losses.shifted_loss_tokens`, ``collate_fn`` to the
            ``data_collator`` (default :func:`~odb_torch.pad_collate`; under ``budget="packed"``
            :func:`~odb_torch.packed_collate`, and a model that would let packed sequences attend
            to each other is refused: :func:`~odb_torch.check_packed_attention`, run once
            ``Trainer`` has applied ``args.use_cache``, default False, and knows the device).
        loss_sum_fn: ``(model, inputs) -> (summed token loss, token count)``; the count must
            equal the loader's ``loss_tokens_fn`` summed over the batch, else
            :class:`~odb_core.errors.LossTokenMismatchError`. Default: causal-LM shifted
            cross-entropy.
        warmup_samples: LR warmup in samples seen (else ``args.warmup_steps`` < 1, a
            fraction of all samples). An integer ``warmup_steps`` is refused:
            ODB's step sizes vary, so a step count is not a fixed amount of data.

    ``args.max_steps`` must be unset (the run length is ``num_train_epochs`` of data);
    ``args.ignore_data_skip`` is forced on in a private copy of ``args`` (ODB resumes its
    own position instead of replaying batches). Join mode only.
    """

    def __init__(self, model: Any = None, args: Any = None, *, token_budget: int,
                 odb_kwargs: dict[str, Any] | None = None, loss_sum_fn: LossSumFn | None = None,
                 warmup_samples: int | None = None, **kwargs: Any) -> None:
        training_args = args
        if training_args is None:
            raise ValueError("ODBTrainer needs TrainingArguments (args=...)")
        if training_args.max_steps > 0:
            raise ValueError("ODBTrainer runs num_train_epochs of data; unset max_steps "
                             f"(got max_steps={training_args.max_steps})")
        if warmup_samples is None and training_args.warmup_steps >= 1:
            raise ValueError("ODBTrainer schedules by samples seen: give warmup as a fraction "
                             "(warmup_steps < 1) or warmup_samples=..., not "
                             f"warmup_steps={training_args.warmup_steps}")
        odb_kwargs = dict(odb_kwargs or {})
        if odb_kwargs.get("mode", "join") != "join" or odb_kwargs.get("skip_idle"):
            raise ValueError("ODBTrainer needs join mode without skip_idle (resumable, aligned windows)")
        train_dataset = kwargs.get("train_dataset")
        if train_dataset is None:
            raise ValueError("ODBTrainer needs a train_dataset (keyword)")
        collator = kwargs.get("data_collator")
        self.odb_token_budget = token_budget
        self.odb_kwargs = odb_kwargs
        if collator is not None:
            odb_kwargs.setdefault("collate_fn", collator)
        adapter_defaults(None, odb_kwargs)  # the collate; the model is checked once its device is known
        self.odb_collate = odb_kwargs.pop("collate_fn")
        self.odb_loss_sum_fn: LossSumFn = loss_sum_fn or causal_lm_loss
        self.odb_warmup_samples = warmup_samples
        self.odb_windows: AccumulationWindows | None = None
        self._odb_resume: str | None = None
        self._odb_run_start = (0, 0, 0.0)  # samples, updates, time at the start of train()

        world = max(training_args.world_size, 1)
        per_rank = math.ceil(len(train_dataset) / world)
        self.odb_total_samples = math.ceil(training_args.num_train_epochs * per_rank * world)
        run_args = copy.deepcopy(training_args)
        run_args.ignore_data_skip = True
        # an upper bound on optimizer steps (every step trains >= 1 sample), so that Trainer's
        # step-count stop never fires before the data ends; the callback stops training
        run_args.max_steps = self.odb_total_samples + math.ceil(training_args.num_train_epochs) + 1
        super().__init__(model, run_args, **kwargs)
        if budget_of(odb_kwargs) == "packed" and model is not None:  # refused, or warned of its cost on a GPU
            check_packed_attention(model, self.args.device)
        self.loss_is_scaled_for_ga = True  # compute_loss already normalises over the window
        self.remove_callback(ProgressCallback)
        if not run_args.disable_tqdm:
            self.add_callback(_SampleProgress(self))
        self.add_callback(_ODBControl(self))

    # -- data -------------------------------------------------------------------------------
    def get_train_dataloader(self) -> Any:
        """ODB batches in windows of ``gradient_accumulation_steps`` (the loader is built once per ``train()``)."""
        if self.odb_windows is None:
            kw: dict[str, Any] = {"num_workers": self.args.dataloader_num_workers, "seed": self.args.seed,
                                  "pin_memory": self.args.dataloader_pin_memory,
                                  "loss_tokens_fn": shifted_loss_tokens, "collate_fn": self.odb_collate,
                                  **self.odb_kwargs}
            if kw["num_workers"] == 0:
                kw["prefetch_factor"] = None
            loader = ODBDataLoader(cast(Any, self.train_dataset), token_budget=self.odb_token_budget, **kw)
            self.odb_windows = AccumulationWindows(loader, self.args.gradient_accumulation_steps)
            # the sampler's real epoch size (a custom sampler may differ from the estimate at init)
            self.odb_total_samples = math.ceil(self.args.num_train_epochs * self.odb_windows.samples_per_epoch())
        if self._odb_resume is not None:
            load_windows_state(self.odb_windows, self._odb_resume)
            self._odb_resume = None
        w = self.odb_windows
        self._odb_run_start = (w.samples_seen, w.updates, time.time())
        return _Batches(w)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``; resuming also restores each rank's ODB loader position."""
        if resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)  # type: ignore[no-untyped-call]
            if resume_from_checkpoint is None:
                raise ValueError(f"no valid checkpoint found in output directory ({self.args.output_dir})")
        self._odb_resume = resume_from_checkpoint if isinstance(resume_from_checkpoint, str) else None
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            if self.odb_windows is not None:
                self.odb_windows.loader.close()
                self.odb_windows = None

    # -- loss -------------------------------------------------------------------------------
    def compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        """Summed token loss x ``W / window_tokens`` (P7); DDP's mean over ranks gives the window's per-token mean."""
        mb = inputs.pop(ODB_KEY, None)
        if not isinstance(mb, MicroBatch):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)  # evaluation batches
        loss_sum, count = self.odb_loss_sum_fn(model, forward_inputs(self.accelerator.unwrap_model(model), inputs))
        check_loss_tokens(count, mb.info.local_tokens, mb.info.indices, self.args.process_index,
                          weighted=not (mb.info.is_idle or mb.is_padding), what="loss_sum_fn")
        loss = loss_sum * mb.loss_multiplier
        return (loss, None) if return_outputs else loss

    # -- schedule and reporting ---------------------------------------------------------------
    def _finalize_training(self, *args: Any, **kwargs: Any) -> Any:
        """``Trainer._finalize_training`` with the loss since the last log averaged over the ranks
        first. Trainer adds that remainder to ``train_loss`` unreduced (the logged losses are
        gathered); a rank's ODB loss, its summed token loss x ``W / window_tokens`` (P7), is the
        window's loss only as the mean over ranks, so ``train_loss`` was wrong and differed per rank."""
        pending = getattr(self, "_tr_loss", None)
        if self.args.world_size > 1:
            if isinstance(pending, torch.Tensor):
                self._tr_loss = self.accelerator.reduce(pending.detach().clone(), reduction="mean")
            else:
                warnings.warn("ODBTrainer: this transformers version keeps no Trainer._tr_loss tensor, so train_loss "
                              "is this rank's own (ODB-scaled) loss; the logged losses are averaged over ranks",
                              RuntimeWarning, stacklevel=2)
        return super()._finalize_training(*args, **kwargs)  # type: ignore[no-untyped-call]

    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None) -> Any:
        """The ``args.lr_scheduler_type`` shape over samples seen (:class:`~odb_torch.schedule.ProgressLR`)."""
        if self.lr_scheduler is None:
            total = self.odb_total_samples
            warmup = (self.odb_warmup_samples if self.odb_warmup_samples is not None
                      else self.args.get_warmup_steps(total))
            opt = optimizer or self.optimizer
            assert opt is not None, "create_scheduler runs after create_optimizer"
            base = get_scheduler(self.args.lr_scheduler_type, optimizer=opt,
                                 num_warmup_steps=warmup, num_training_steps=total,
                                 scheduler_specific_kwargs=cast(Any, self.args.lr_scheduler_kwargs))
            if not isinstance(base, LambdaLR):
                raise ValueError(f"lr_scheduler_type={self.args.lr_scheduler_type!r} is not a LambdaLR schedule; "
                                 "ODBTrainer follows samples seen with LambdaLR shapes (linear, cosine, constant...)")
            self.lr_scheduler = cast(Any, ProgressLR(
                opt, list(base.lr_lambdas), lambda: self.odb_windows.samples_seen if self.odb_windows else 0))
            self._created_lr_scheduler = True
        return self.lr_scheduler

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Adds ``odb_samples_seen``/``odb_tokens_seen``; real samples/s and updates/s in the final metrics."""
        w = self.odb_windows
        if w is not None:
            logs["odb_samples_seen"] = w.samples_seen
            logs["odb_tokens_seen"] = w.tokens_seen
            samples0, updates0, t0 = self._odb_run_start
            runtime = logs.get("train_runtime", time.time() - t0)
            if "train_samples_per_second" in logs and runtime > 0:
                logs["train_samples_per_second"] = round((w.samples_seen - samples0) / runtime, 3)
                logs["train_steps_per_second"] = round((w.updates - updates0) / runtime, 3)
        super().log(logs, start_time)
