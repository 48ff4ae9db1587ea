"""TRL's ``SFTTrainer`` with ODB batches: ``ODBSFTTrainer`` (extra ``odb-verified[trl]``).

``ODBSFTTrainer(ODBTrainer, SFTTrainer)`` is a subclass of both, not a patch. TRL prepares
the dataset as usual (conversational data through the chat template, plain text with EOS,
prompt-completion; tokenization; ``assistant_only_loss`` and ``completion_only_loss``
masks baked into ``labels``; ``max_length`` truncation) and builds its collator; ODB
then batches the prepared samples, and everything of
:class:`~odb_torch.integrations.hf.ODBTrainer` applies: the exact per-token loss over each
accumulation window on every rank (P7), epochs and the LR schedule by samples seen,
checkpoints that resume with every sample once (P4).

The loss is TRL's own per-token loss through TRL's fused LM head (``loss_type="nll"`` or
``"dft"``), *summed* over the micro-batch's loss tokens and scaled by ODB; the token count
must equal the loader's (shifted labels != -100), else ``LossTokenMismatchError``.
``pad_to_multiple_of`` is honoured by measuring each sample at its padded length.

Refused with :class:`~odb_core.errors.UnsupportedSettingError` (``field`` names the
setting), because ODB cannot honour them soundly:

* ``packing``: TRL packs several examples into fixed-length rows while preparing the
  dataset, before any sampler runs: ODB would batch equal-length rows (nothing left to
  balance) and a "sample" would no longer be one example (coverage, loss tokens per
  sample). ODB's token budget is the alternative: it removes most padding itself.
* ``padding_free``: the collator concatenates a batch into one row, which is right only
  with a variable-length attention kernel (FlashAttention) that ODB cannot check; any
  other attention lets tokens attend across examples.
* ``label_smoothing_factor > 0``, a ``compute_loss_func``, a mixture-of-experts auxiliary
  loss (``router_aux_loss_coef``): per-batch means that ODB's summed, window-exact loss
  does not compute (give ``loss_sum_fn=`` for another per-token loss).
* an ``IterableDataset``, or a dataset the trainer leaves untokenized (vision data,
  prepared in the collator): ODB measures each sample's ``input_ids`` before batching.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, cast

import torch
from trl import SFTTrainer
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

from odb_core.errors import UnsupportedSettingError
from odb_torch.integrations.hf import LossSumFn, ODBTrainer, loss_setting_problems, refuse
from odb_torch.padding_free import budget_of

#: the prepared columns TRL's collator reads (TRL's own signature columns)
SFT_COLUMNS = ("input_ids", "labels", "seq_lengths")


def nll_loss_sum(model: torch.nn.Module, inputs: dict[str, Any]) -> tuple[torch.Tensor, int]:
    """TRL's ``loss_type="nll"``, summed: the next-token NLL over labels != -100 (TRL's fused
    LM head, no full logits), and the number of those tokens."""
    out = model(**inputs, use_cache=False, fused_lm_head=True)
    return (-out.log_probs).float().sum(), int(out.label_mask.sum())


def dft_loss_sum(model: torch.nn.Module, inputs: dict[str, Any]) -> tuple[torch.Tensor, int]:
    """TRL's ``loss_type="dft"`` (each token's NLL weighted by its detached probability), summed; and the count."""
    out = model(**inputs, use_cache=False, fused_lm_head=True)
    log_probs = out.log_probs.float()
    return (-log_probs * log_probs.exp().detach()).sum(), int(out.label_mask.sum())


LOSSES: dict[str, LossSumFn] = {"nll": nll_loss_sum, "dft": dft_loss_sum}


class PaddedLength:
    """A sample's length once the collator pads it to a multiple of ``multiple`` (``pad_to_multiple_of``)."""

    def __init__(self, multiple: int) -> None:
        self.multiple = multiple

    def __call__(self, sample: Mapping[str, Any]) -> int:
        return math.ceil(len(sample["input_ids"]) / self.multiple) * self.multiple


def refuse_unsupported(args: Any, kwargs: Mapping[str, Any]) -> None:
    """Raise :class:`UnsupportedSettingError` naming every setting of ``args`` (an ``SFTConfig``
    or ``TrainingArguments``) and trainer keyword ODB cannot honour (see the module doc)."""
    problems = []
    if getattr(args, "packing", False):
        problems.append(("packing", "TRL packs examples into fixed-length rows before sampling; ODB's token "
                                    "budget removes padding instead: set packing=False"))
    if getattr(args, "padding_free", False):
        problems.append(("padding_free", "one concatenated row per batch is right only with a varlen attention "
                                         "kernel ODB cannot check: set padding_free=False"))
    problems += loss_setting_problems(args, kwargs)
    dataset = kwargs.get("train_dataset")
    streaming = dataset is not None and not hasattr(dataset, "__len__")
    if isinstance(dataset, torch.utils.data.IterableDataset) or streaming:
        problems.append(("train_dataset", "an IterableDataset: ODBSFTTrainer takes map-style datasets (TRL "
                                          "tokenizes them with map); for a stream, use ODBDataLoader(stream, ...) "
                                          "in your own loop (README: Streaming)"))
    refuse("ODBSFTTrainer", problems)


class ODBSFTTrainer(ODBTrainer, SFTTrainer):  # type: ignore[misc]
    """TRL's ``SFTTrainer`` that trains on ODB batches with the exact per-token loss.

    Arguments as :class:`~odb_torch.integrations.hf.ODBTrainer` (``token_budget``,
    ``odb_kwargs``, ``loss_sum_fn``, ``warmup_samples``) plus ``SFTTrainer``'s
    (``processing_class``, ``formatting_func``, ``peft_config``, ...). Defaults differing
    from ``ODBTrainer``'s: ``loss_sum_fn`` is TRL's ``loss_type`` summed (:data:`LOSSES`),
    ``collate_fn`` TRL's collator (an explicit ``data_collator`` or ``odb_kwargs["collate_fn"]``
    is kept), ``length_fn`` the padded length under ``pad_to_multiple_of``. Refused settings
    raise :class:`UnsupportedSettingError` before the dataset is prepared (the
    mixture-of-experts and vision-data ones right after).
    """

    def __init__(self, model: Any = None, args: Any = None, *, token_budget: int,
                 odb_kwargs: dict[str, Any] | None = None, loss_sum_fn: LossSumFn | None = None,
                 warmup_samples: int | None = None, **kwargs: Any) -> None:
        if args is None:
            raise ValueError("ODBSFTTrainer needs an SFTConfig (args=...)")
        if budget_of(odb_kwargs or {}) == "packed":
            raise UnsupportedSettingError("ODBSFTTrainer cannot honour: budget='packed': TRL's collator pads each "
                                          "group, so a packed group's padded batch may exceed the budget; use "
                                          "ODBTrainer with packed_collate (docs/packing.md)", field="budget")
        refuse_unsupported(args, kwargs)
        super().__init__(model, args, token_budget=token_budget, odb_kwargs=odb_kwargs, loss_sum_fn=loss_sum_fn,
                         warmup_samples=warmup_samples, **kwargs)
        if self.aux_loss_enabled:
            raise UnsupportedSettingError("ODBSFTTrainer cannot honour: router_aux_loss_coef: the mixture-of-experts "
                                          "auxiliary loss is a per-batch mean; set router_aux_loss_coef=0",
                                          field="router_aux_loss_coef")
        sft_args, dataset = cast(Any, self.args), cast(Any, self.train_dataset)  # an SFTConfig, a datasets.Dataset
        columns = list(getattr(dataset, "column_names", None) or [])
        if "input_ids" not in columns:
            raise UnsupportedSettingError(f"ODBSFTTrainer cannot honour: train_dataset: its prepared columns {columns} "
                                          "hold no input_ids (vision data is prepared in the collator); ODB measures "
                                          "each sample before batching", field="train_dataset")
        if loss_sum_fn is None:
            self.odb_loss_sum_fn = LOSSES[sft_args.loss_type]
        if kwargs.get("data_collator") is None and "collate_fn" not in (odb_kwargs or {}):
            self.odb_collate = self.data_collator  # TRL's collator, unless the caller gave one
        multiple = sft_args.pad_to_multiple_of
        if isinstance(multiple, int) and multiple > 1:
            self.odb_kwargs.setdefault("length_fn", PaddedLength(multiple))
        if sft_args.remove_unused_columns and isinstance(self.data_collator, DataCollatorForLanguageModeling):
            self.train_dataset = dataset.select_columns([c for c in SFT_COLUMNS if c in columns])
