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
* epochs end when the data does; ``num_train_epochs`` counts real epochs (whole ones by epochs
  completed, at any world size; every rank stops on the same update), the progress bar counts
  samples, the LR schedule follows samples seen (``warmup_steps`` < 1 is a fraction of all
  samples), ``train_samples_per_second`` counts real samples (HF's multiplies a fixed batch
  size), logs carry ``odb_samples_seen`` and ``odb_tokens_seen``;
* checkpoints hold each rank's loader position (``odb_state_rank{r}.json``); resuming
  from one emits nothing twice and loses nothing (P4).
"""

from __future__ import annotations

import copy
import difflib
import inspect
import math
import os
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any, cast

import torch
from torch.optim.lr_scheduler import LambdaLR
from transformers import DataCollatorWithPadding, Trainer, TrainerCallback, default_data_collator, get_scheduler
from transformers.trainer_callback import ProgressCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from odb_core.errors import InvalidSampleError, PackedAttentionError, UnsupportedSettingError
from odb_torch.loader import ODBDataLoader
from odb_torch.losses import causal_lm_loss_sum, check_loss_tokens, logits_of, shifted_loss_tokens
from odb_torch.padding_free import VARLEN_KEYS, adapter_defaults, budget_of, check_packed_attention
from odb_torch.schedule import ProgressLR
from odb_torch.windows import (
    AccumulationWindows,
    MicroBatch,
    global_epoch_samples,
    load_windows_state,
    save_windows_state,
)

#: the key under which each batch carries its :class:`MicroBatch` through ``Trainer``
ODB_KEY = "odb_micro_batch"

LossSumFn = Callable[[torch.nn.Module, dict[str, Any]], tuple[torch.Tensor, int]]


class _Batches:
    """What ``Trainer`` iterates: the windows' batches as dicts carrying their :class:`MicroBatch`;
    nothing once ``finished()`` (a run resumed at its end trains nothing, as a stock Trainer)."""

    def __init__(self, windows: AccumulationWindows, finished: Callable[[], bool]) -> None:
        self.windows = windows
        self.finished = finished

    def set_epoch(self, epoch: int) -> None:
        self.windows.set_epoch(epoch)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if self.finished():
            return
        for mb in self.windows:
            if not isinstance(mb.batch, Mapping):
                raise TypeError(f"ODBTrainer needs the data collator to return a dict of tensors, got "
                                f"{type(mb.batch).__name__} (dataset indices {list(mb.info.indices)})")
            yield {**mb.batch, ODB_KEY: mb}


class _ODBEpoch(TrainerCallback):
    """Sets ``state.epoch`` from samples seen at each step's end, first of all callbacks: Trainer
    sets it from its step count over a bound that ODB's varying steps leave far too large, and
    every callback after this one (the user's too) reads it."""

    def __init__(self, trainer: ODBTrainer) -> None:
        self.trainer = trainer

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self.trainer.odb_windows is not None:
            state.epoch = self.trainer.odb_progress() / max(self.trainer.odb_epoch_samples, 1)
        return control


class _ODBControl(TrainerCallback):
    """Ends epochs when the data does and training after ``num_train_epochs`` (with the final
    save and evaluation HF's ``DefaultFlowCallback`` makes at ``max_steps``); saves the loader state."""

    def __init__(self, trainer: ODBTrainer) -> None:
        self.trainer = trainer
        self.idle_epoch = False  # the run was already at its end when this epoch began

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        self.idle_epoch = self.trainer.odb_windows is not None and self.trainer.odb_finished()
        if self.idle_epoch:
            control.should_training_stop = True
        return control

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        w = self.trainer.odb_windows
        if w is None:
            return control
        if w.at_epoch_end:
            control.should_epoch_stop = True
        if self.trainer.odb_finished():
            control.should_training_stop = True
            control.should_epoch_stop = True
            if args.save_strategy == "steps":
                control.should_save = True
            if args.eval_strategy == "steps" and args.eval_delay <= state.global_step:
                control.should_evaluate = True
        return control

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self.idle_epoch:  # nothing trained: no log, checkpoint or evaluation (a stock Trainer runs no epoch)
            control.should_log = control.should_save = control.should_evaluate = False
        return control

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        w = self.trainer.odb_windows
        if w is None:
            return control
        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        os.makedirs(folder, exist_ok=True)  # only the writer rank creates it under save_only_model
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

            self.bar = tqdm(total=self.trainer.odb_total_samples, initial=self.trainer.odb_progress(),
                            unit="samples", dynamic_ncols=True)
        return control

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self.bar is not None:
            self.bar.update(self.trainer.odb_progress() - self.bar.n)
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


def _named_parameters(forward: Callable[..., Any]) -> tuple[set[str], bool]:
    """The parameter names of ``forward`` (``*args``/``**kwargs`` aside) and whether it takes ``**kwargs``."""
    params = inspect.signature(forward).parameters
    named = {n for n, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    return named, any(p.kind == p.VAR_KEYWORD for p in params.values())


def forward_inputs(model: torch.nn.Module, inputs: Mapping[str, Any]) -> dict[str, Any]:
    """The batch fields ``model.forward`` names explicitly, plus ``labels`` (as HF's column pruning
    keeps). When it takes ``**kwargs`` (a wrapper such as PEFT's), also what the wrapped model's
    forward names (``get_base_model()``, as HF's pruning inspects), ``position_ids`` and a packed
    row's varlen keywords (``cu_seq_lens_q``, ...): without them packed sequences attend to each other."""
    named, var_keyword = _named_parameters(model.forward)
    if not named:
        return dict(inputs)
    if var_keyword:
        named.update(VARLEN_KEYS, ("position_ids",))
        base = getattr(model, "get_base_model", None)
        if callable(base) and callable(getattr(base(), "forward", None)):
            named.update(_named_parameters(base().forward)[0])
    return {k: v for k, v in inputs.items() if k in named or k == "labels"}


def check_packed_forward(model: torch.nn.Module) -> None:
    """:class:`~odb_core.errors.PackedAttentionError` if ``model.forward`` names its arguments,
    takes no ``**kwargs`` and no ``position_ids``: :func:`forward_inputs` would drop the packed
    row's positions (and boundaries), so its sequences would attend to each other."""
    named, var_keyword = _named_parameters(model.forward)
    if named and not var_keyword and "position_ids" not in named:
        name = type(model).__name__
        raise PackedAttentionError(
            f"{name}.forward({', '.join(sorted(named))}) takes no position_ids (nor **kwargs): a packed row would "
            "reach the model as one sequence; pass position_ids (and **kwargs for the varlen keywords) through to "
            "the model, or use budget='padded'", model_class=name,
            attn_implementation=str(getattr(getattr(model, "config", None), "_attn_implementation", "")))


def loss_setting_problems(args: Any, kwargs: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``(field, why)`` for each loss setting ODB's summed, window-exact loss cannot honour:
    ``label_smoothing_factor > 0`` and a ``compute_loss_func`` (per-batch means)."""
    problems = []
    if getattr(args, "label_smoothing_factor", 0.0) > 0:
        problems.append(("label_smoothing_factor", "label smoothing is a per-batch mean ODB's summed loss does "
                                                   "not compute: set it to 0 (a smoothed loss: loss_sum_fn=)"))
    if kwargs.get("compute_loss_func") is not None:
        problems.append(("compute_loss_func", "ODB needs a summed loss and its token count: give "
                                              "loss_sum_fn=(model, inputs) -> (sum, count) instead"))
    return problems


#: step-counted intervals and the strategy that uses each
STEP_INTERVALS = (("logging_steps", "logging_strategy"), ("save_steps", "save_strategy"),
                  ("eval_steps", "eval_strategy"))


def step_fraction_problems(args: Any) -> list[tuple[str, str]]:
    """``(field, why)`` for each interval given as a fraction (< 1) of the run under a ``"steps"``
    strategy: Trainer multiplies it by ``max_steps``, which ODB cannot know (its step sizes vary)."""
    problems = []
    for field, strategy in STEP_INTERVALS:
        value = getattr(args, field, None)
        if value is not None and 0 < value < 1 and getattr(args, strategy, None) == "steps":
            problems.append((field, f"{field}={value} is a fraction of max_steps, which ODB's varying step sizes "
                                    "leave unknown: give a whole number of updates"))
    return problems


#: ``lr_scheduler_kwargs`` that count optimizer steps (``warmup_stable_decay``, ``inverse_sqrt``): ODBTrainer
#: runs its schedule over samples seen, so a step count would silently mean that many samples
STEP_COUNTED_SCHEDULER_KWARGS = ("num_decay_steps", "num_stable_steps", "timescale")


def scheduler_kwargs_problems(args: Any) -> list[tuple[str, str]]:
    """``(field, why)`` for an ``lr_scheduler_kwargs`` entry that counts optimizer steps."""
    given = getattr(args, "lr_scheduler_kwargs", None) or {}
    counted = [k for k in STEP_COUNTED_SCHEDULER_KWARGS if given.get(k) is not None]
    if not counted:
        return []
    return [("lr_scheduler_kwargs", f"{', '.join(counted)} count optimizer steps, and ODBTrainer's schedule runs "
                                    "over samples seen (its steps vary in size): a step count would silently mean "
                                    "that many samples; use a shape without them (linear, cosine, constant...)")]


def sampling_problems(args: Any, trainer_cls: type, odb_cls: type) -> list[tuple[str, str]]:
    """``(field, why)`` for each ``TrainingArguments`` setting, and ``Trainer`` hook, that picks
    the training order or drops samples, which ODB decides instead (P4: every sample once): they
    were accepted and ignored. ``trainer_cls``: the trainer's class; ``odb_cls``: the ODB class it
    derives from (a user's ``_get_train_sampler`` override was never called)."""
    problems = []
    strategy = getattr(args, "train_sampling_strategy", "random")
    if strategy != "random":
        problems.append(("train_sampling_strategy", f"train_sampling_strategy={strategy!r}: ODB forms its batches "
                         "from a shuffled DistributedSampler order by token budget; for another order pass "
                         "odb_kwargs={'sampler': ...}"))
    if getattr(args, "dataloader_drop_last", False):
        problems.append(("dataloader_drop_last", "dataloader_drop_last=True: ODB trains every sample once per epoch "
                         "(no partial batch to drop); set it False"))
    if getattr(args, "include_num_input_tokens_seen", "no") not in ("no", False, None):
        problems.append(("include_num_input_tokens_seen", "Trainer would count the tokens of ODB's zero-weight "
                         "(idle and padding) micro-batches too; the logs' odb_tokens_seen counts those trained"))
    if getattr(trainer_cls, "_get_train_sampler", None) is not getattr(odb_cls, "_get_train_sampler", None):
        problems.append(("_get_train_sampler", f"{trainer_cls.__name__} overrides _get_train_sampler, which "
                         "ODB's loader never calls; pass the sampler as odb_kwargs={'sampler': ...}"))
    return problems


def refuse(who: str, problems: list[tuple[str, str]]) -> None:
    """Raise :class:`UnsupportedSettingError` naming every field of ``problems``, if any."""
    if problems:
        raise UnsupportedSettingError(f"{who} cannot honour: " + "; ".join(f"{f}: {why}" for f, why in problems),
                                      fields=[f for f, _ in problems])


def check_loader_keywords(who: str, odb_kwargs: Mapping[str, Any]) -> None:
    """:class:`UnsupportedSettingError` (``fields``: the unknown ones) at construction for an
    ``odb_kwargs`` key :class:`~odb_torch.ODBDataLoader` does not take (``dataset`` and
    ``token_budget`` are the trainer's own arguments); it surfaced at ``train()``, as a bare
    ``TypeError``."""
    taken = set(inspect.signature(ODBDataLoader.__init__).parameters) - {"self", "dataset", "token_budget"}
    unknown = sorted(k for k in odb_kwargs if k not in taken)
    if unknown:
        hints = {k: difflib.get_close_matches(k, sorted(taken), n=1) for k in unknown}
        named = ", ".join(f"{k!r}" + (f" (did you mean {h[0]!r}?)" if h else "") for k, h in hints.items())
        raise UnsupportedSettingError(f"{who}(odb_kwargs=...): {named} not an ODBDataLoader keyword (dataset and "
                                      "token_budget are the trainer's own arguments)", field=unknown[0], fields=unknown)


def check_arguments(who: str, args: Any, warmup_samples: int | None, odb_kwargs: Mapping[str, Any],
                    kwargs: Mapping[str, Any], classes: tuple[type, type]) -> None:
    """Refuse what ODBTrainer cannot run: ``ValueError`` for missing or step-counted arguments,
    :class:`UnsupportedSettingError` naming the fields for settings it would silently drop.
    ``classes``: the trainer's class and the ODB class it derives from (:func:`sampling_problems`)."""
    if args is None:
        raise ValueError(f"{who} needs TrainingArguments (args=...)")
    if args.max_steps > 0:
        raise ValueError(f"{who} runs num_train_epochs of data; unset max_steps (got max_steps={args.max_steps})")
    if warmup_samples is None and args.warmup_steps >= 1:
        raise ValueError(f"{who} schedules by samples seen: give warmup as a fraction (warmup_steps < 1) or "
                         f"warmup_samples=..., not warmup_steps={args.warmup_steps}")
    if odb_kwargs.get("mode", "join") != "join" or odb_kwargs.get("skip_idle"):
        raise ValueError(f"{who} needs join mode without skip_idle (resumable, aligned windows)")
    if kwargs.get("train_dataset") is None:
        raise ValueError(f"{who} needs a train_dataset (keyword)")
    check_loader_keywords(who, odb_kwargs)
    refuse(who, loss_setting_problems(args, kwargs) + step_fraction_problems(args) + scheduler_kwargs_problems(args)
           + sampling_problems(args, *classes))


class ODBTrainer(Trainer):
    """``transformers.Trainer`` that trains on ODB batches with exact loss scaling.

    Args:
        token_budget: L_max, padded tokens per micro-batch.
        odb_kwargs: further :class:`~odb_torch.ODBDataLoader` keywords (``buffer_size``,
            ``length_fn``, ``timeout``, ...). ``num_workers`` defaults to
            ``args.dataloader_num_workers``, ``pin_memory`` to ``args.dataloader_pin_memory``,
            ``seed`` to ``args.data_seed`` (else ``args.seed``), as Trainer seeds its sampler, ``loss_tokens_fn`` to
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
    own position instead of replaying batches). Join mode only. Refused with
    :class:`~odb_core.errors.UnsupportedSettingError` naming the fields: ``label_smoothing_factor``
    > 0 and ``compute_loss_func`` (per-batch means, not ODB's summed loss), settings that pick the order or
    drop samples (``train_sampling_strategy`` other than ``"random"``, ``dataloader_drop_last``, an
    override of ``_get_train_sampler``), ``include_num_input_tokens_seen`` (it would count the
    zero-weight micro-batches' tokens), and a ``logging_steps``,
    ``save_steps`` or ``eval_steps`` < 1 under a ``"steps"`` strategy (a fraction of an unknown
    step count). Training ends after ``num_train_epochs`` on every rank alike, with a checkpoint
    and an evaluation when their strategy is ``"steps"`` (HF's at ``max_steps``); resumed at its end
    it trains nothing.
    """

    def __init__(self, model: Any = None, args: Any = None, *, token_budget: int,
                 odb_kwargs: dict[str, Any] | None = None, loss_sum_fn: LossSumFn | None = None,
                 warmup_samples: int | None = None, **kwargs: Any) -> None:
        training_args = args
        odb_kwargs = dict(odb_kwargs or {})
        odb_cls = next(c for c in type(self).__mro__ if c.__module__.startswith("odb_torch."))
        check_arguments(type(self).__name__, training_args, warmup_samples, odb_kwargs, kwargs, (type(self), odb_cls))
        train_dataset = kwargs["train_dataset"]
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

        self.odb_epochs = float(training_args.num_train_epochs)
        world = max(training_args.world_size, 1)
        # estimates until get_train_dataloader knows the sampler's epoch over every rank
        self.odb_epoch_samples: int = math.ceil(len(train_dataset) / world) * world
        self.odb_total_samples = self._odb_plan()[2]
        run_args = copy.deepcopy(training_args)
        run_args.ignore_data_skip = True
        run_args.max_steps = self._odb_step_bound()
        super().__init__(model, run_args, **kwargs)
        if model is not None:  # a model_init's models are checked as they are made (call_model_init)
            self._odb_check_packed(model)
        if collator is None and (self.data_collator is default_data_collator
                                 or isinstance(self.data_collator, DataCollatorWithPadding)):
            self.data_collator = self.odb_collate  # evaluation collates as training does, not by Trainer's default
        self.loss_is_scaled_for_ga = True  # compute_loss already normalises over the window
        self.remove_callback(ProgressCallback)
        if not run_args.disable_tqdm:
            self.add_callback(_SampleProgress(self))
        self.add_callback(_ODBControl(self))
        self.callback_handler.callbacks.insert(0, _ODBEpoch(self))  # before any callback reads state.epoch

    def call_model_init(self, trial: Any = None) -> torch.nn.Module:
        """The model ``model_init`` makes (in ``__init__`` and each ``train()``), checked as ``model`` is."""
        model = super().call_model_init(trial)
        self._odb_check_packed(model)
        return model

    def _odb_check_packed(self, model: torch.nn.Module) -> None:
        """Under the packed budget: refused if ``model`` would let packed sequences attend to each
        other (:func:`check_packed_attention`; a cost warning on a GPU) or if its ``forward`` takes
        no ``position_ids`` (:func:`check_packed_forward`)."""
        if budget_of(self.odb_kwargs) == "packed":
            check_packed_attention(model, self.args.device)
            check_packed_forward(model)

    # -- data -------------------------------------------------------------------------------
    def get_train_dataloader(self) -> Any:
        """ODB batches in windows of ``gradient_accumulation_steps`` (the loader is built once per ``train()``)."""
        if self.odb_windows is None:
            seed = self.args.seed if self.args.data_seed is None else self.args.data_seed  # Trainer's sampler seed
            kw: dict[str, Any] = {"num_workers": self.args.dataloader_num_workers, "seed": seed,
                                  "pin_memory": self.args.dataloader_pin_memory,
                                  "loss_tokens_fn": shifted_loss_tokens, "collate_fn": self.odb_collate,
                                  **self.odb_kwargs}
            if kw["num_workers"] == 0:
                kw["prefetch_factor"] = None
            # Trainer's removal of the fields forward does not take (remove_unused_columns), as it prunes its own
            # before collating, here inside the collate: after the loader measured each sample (any length_fn field)
            kw["collate_fn"] = self._get_collator_with_removed_columns(kw["collate_fn"], description="training")
            loader = ODBDataLoader(cast(Any, self.train_dataset), token_budget=self.odb_token_budget, **kw)
            self.odb_windows = AccumulationWindows(loader, self.args.gradient_accumulation_steps)
            # the sampler's real epoch size over every rank (a custom sampler may differ from the estimate)
            self.odb_epoch_samples = global_epoch_samples(self.odb_windows, self.args.device)
            self.odb_total_samples = self._odb_plan()[2]
            self.args.max_steps = max(self.args.max_steps, self._odb_step_bound())  # read by Trainer after this
        if self._odb_resume is not None:
            load_windows_state(self.odb_windows, self._odb_resume)
            self._odb_resume = None
        w = self.odb_windows
        self._odb_run_start = (w.samples_seen, w.updates, time.time())
        return _Batches(w, self.odb_finished)

    def _odb_plan(self) -> tuple[int, int, int]:
        """``num_train_epochs`` as (whole epochs, samples of a fractional last epoch, total samples)."""
        whole, fraction = divmod(self.odb_epochs, 1.0)
        last = math.ceil(fraction * self.odb_epoch_samples)
        return int(whole), last, int(whole) * self.odb_epoch_samples + last

    def _odb_step_bound(self) -> int:
        """An upper bound on optimizer steps (every step trains >= 1 sample; twice the samples, as a
        resumed epoch may count another world size's padding), so that Trainer's step-count stop
        never fires before the data ends; :class:`_ODBControl` stops training."""
        return 2 * self.odb_total_samples + math.ceil(self.odb_epochs) + 1

    def odb_finished(self) -> bool:
        """Whether ``num_train_epochs`` are trained: whole epochs count by ``epochs_completed`` (every
        view of every rank once each, at any world size: an elastic resume's epoch too), only a
        fractional last epoch by its samples. Global counters: the same answer on every rank."""
        w = self.odb_windows
        if w is None:
            return False
        whole, last, _ = self._odb_plan()
        if w.epochs_completed != whole:
            return w.epochs_completed > whole
        return last == 0 or w.samples_in_epoch >= last

    def odb_progress(self) -> int:
        """Samples of the run so far by epochs (what the LR schedule, ``state.epoch`` and the progress bar
        follow): ``samples_seen`` except after an elastic resume, whose epoch counts another world's padding."""
        w = self.odb_windows
        if w is None:
            return 0
        return w.epochs_completed * self.odb_epoch_samples + min(w.samples_in_epoch, self.odb_epoch_samples)

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
        if self.odb_loss_sum_fn is causal_lm_loss and "labels" not in inputs:
            raise InvalidSampleError(
                f"rank {self.args.process_index}: the batch of dataset indices {list(mb.info.indices)} has no "
                "'labels', which the default loss (causal_lm_loss) needs: give the samples labels (or a "
                "data_collator that adds them, e.g. DataCollatorForLanguageModeling(tok, mlm=False)), or pass "
                "loss_sum_fn=", rank=self.args.process_index, indices=mb.info.indices)
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
            self.lr_scheduler = cast(Any, ProgressLR(opt, list(base.lr_lambdas), self.odb_progress))
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
