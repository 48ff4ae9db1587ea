"""Lightning adapter: :class:`ODBLightningCallback` (extra ``odb-verified[lightning]``).

One callback owns the ODB loader and gives Lightning an iterable of batches::

    odb = ODBLightningCallback(dataset, token_budget=8192, accumulate_grad_batches=4)
    trainer = L.Trainer(callbacks=[odb], accumulate_grad_batches=4, ...)
    trainer.fit(module, train_dataloaders=odb.train_dataloader())

    # in the LightningModule
    def training_step(self, batch, batch_idx):
        loss_sum, _ = self.model(batch["input_ids"], batch["labels"])   # summed token loss
        return ODBLightningCallback.loss(loss_sum, batch)               # exact over the window (P7)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": odb.lr_scheduler(opt), "interval": "step"}}

Each batch is the collate_fn's dict plus plain ``odb_*`` fields (loss multiplier,
accumulation steps, epoch, dataset indices...). Every rank yields the same number of
batches (P2), so Lightning's DDP never hangs on uneven data; epochs end when the data
does. Checkpoints carry every rank's loader position (gathered into the callback's
state), so ``fit(ckpt_path=...)`` resumes mid-epoch with nothing trained twice or lost
(P4). The LR schedule follows samples seen. Nothing in Lightning or torch is patched.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback

from odb_core.errors import CheckpointStateError, UnsupportedSettingError
from odb_torch.loader import ODBDataLoader
from odb_torch.losses import check_loss_tokens, shifted_loss_tokens
from odb_torch.padding_free import adapter_defaults
from odb_torch.schedule import ProgressLR, warmup_cosine, warmup_linear
from odb_torch.windows import (
    AccumulationWindows,
    MicroBatch,
    agree_on_loading,
    global_epoch_samples,
    load_windows_states,
    loading_state,
)


def odb_fields(mb: MicroBatch) -> dict[str, Any]:
    """The plain ``odb_*`` fields a batch carries (plain types, so Lightning's device transfer keeps them)."""
    return {"odb_loss_multiplier": mb.loss_multiplier, "odb_epoch": mb.info.epoch, "odb_step": mb.info.step,
            "odb_indices": list(mb.info.indices), "odb_is_idle": mb.info.is_idle, "odb_is_padding": mb.is_padding,
            "odb_last_in_window": mb.last_in_window, "odb_local_tokens": mb.info.local_tokens,
            "odb_global_samples": mb.info.global_samples}


class _TrainBatches:
    """The iterable handed to Lightning: one epoch of window micro-batches per ``iter()``."""

    def __init__(self, owner: ODBLightningCallback) -> None:
        self.owner = owner

    def __iter__(self) -> Iterator[dict[str, Any]]:
        k = self.owner.accumulate_grad_batches
        self.owner._yielded = self.owner._started = 0  # Lightning fetches ahead within an epoch only
        for mb in self.owner.windows():
            if not isinstance(mb.batch, dict):
                raise TypeError(f"ODBLightningCallback needs collate_fn to return a dict, got "
                                f"{type(mb.batch).__name__} (dataset indices {list(mb.info.indices)})")
            self.owner._yielded += 1
            yield {**mb.batch, **odb_fields(mb), "odb_accumulation": k}


class ODBLightningCallback(Callback):
    """Owns an :class:`~odb_torch.ODBDataLoader` for a Lightning run (join mode, lockstep).

    Args:
        dataset: map-style dataset.
        token_budget: L_max per micro-batch.
        accumulate_grad_batches: must equal the Trainer's (checked at fit start).
        loader_kwargs: further ODBDataLoader keywords; ``collate_fn`` defaults to
            :func:`~odb_torch.pad_collate` (:func:`~odb_torch.packed_collate` under
            ``budget="packed"``, and the LightningModule's model is checked at fit start:
            :func:`~odb_torch.check_packed_attention`), ``loss_tokens_fn`` to shifted labels.
    """

    def __init__(self, dataset: Any, *, token_budget: int, accumulate_grad_batches: int = 1,
                 **loader_kwargs: Any) -> None:
        if loader_kwargs.get("mode", "join") != "join" or loader_kwargs.get("skip_idle"):
            raise ValueError("ODBLightningCallback needs join mode without skip_idle (lockstep, resumable)")
        adapter_defaults(None, loader_kwargs)
        loader_kwargs.setdefault("loss_tokens_fn", shifted_loss_tokens)
        self.dataset, self.token_budget, self.loader_kwargs = dataset, token_budget, loader_kwargs
        self.accumulate_grad_batches = accumulate_grad_batches
        self._windows: AccumulationWindows | None = None
        self._pending: dict[str, Any] | None = None  # a restored state, applied when the windows exist
        self._t0 = time.monotonic()
        self._samples0 = 0
        # micro-batches of this epoch handed to Lightning, and those whose training step began: Lightning
        # fetches ahead, so a checkpoint leaves the difference untrained (AccumulationWindows.state_dict(ahead))
        self._yielded = self._started = 0

    # -- data -------------------------------------------------------------------------------
    def train_dataloader(self) -> _TrainBatches:
        """The iterable to pass as ``train_dataloaders`` (or return from ``train_dataloader()``)."""
        return _TrainBatches(self)

    def windows(self) -> AccumulationWindows:
        """The windows over the loader, built on first use (after Lightning set up the process group)."""
        if self._windows is None:
            loader = ODBDataLoader(self.dataset, token_budget=self.token_budget, **self.loader_kwargs)
            # Lightning restores its count of micro-batches on resume and steps where it says
            self._windows = AccumulationWindows(loader, self.accumulate_grad_batches, pad_last_window=False,
                                                keep_phase=True)
        if self._pending is not None:
            states, self._pending = self._pending["ranks"], None
            loader = self._windows.loader
            error: BaseException | None = None
            try:  # every rank must reach the agreement, whatever failed
                self._load(states, loader.rank, loader.world_size)
            except Exception as exc:
                error = exc
            agree_on_loading(error, loader.rank, "the checkpoint's ODBLightningCallback state", loader.world_size)
        return self._windows

    def _load(self, states: list[dict[str, Any]], rank: int, world: int) -> None:
        assert self._windows is not None
        with loading_state("the checkpoint's ODBLightningCallback state", rank):
            if len(states) != world:  # resume on another world size: merge them
                load_windows_states(self._windows, states)
                return
            self._windows.load_state_dict(states[rank])
            if states[rank].get("loader") is not None:
                self._windows.loader.load_state_dict(states[rank]["loader"])

    @staticmethod
    def loss(loss_sum: torch.Tensor, batch: dict[str, Any], tokens: int | torch.Tensor | None = None) -> torch.Tensor:
        """``loss_sum x W / window_tokens x K``: Lightning divides by K, DDP averages over W (P7).

        ``tokens``: the number of tokens ``loss_sum`` summed over. Given, it must equal the
        loader's count for the batch (``loss_tokens_fn``; shifted labels by default), else
        :class:`~odb_core.errors.LossTokenMismatchError` naming the rank and dataset indices:
        the weights are exact only when both count the same tokens."""
        if tokens is not None:
            check_loss_tokens(tokens, batch["odb_local_tokens"], batch["odb_indices"],
                              dist.get_rank() if dist.is_available() and dist.is_initialized() else 0,
                              weighted=not (batch["odb_is_idle"] or batch["odb_is_padding"]))
        scaled: torch.Tensor = loss_sum * (batch["odb_loss_multiplier"] * batch["odb_accumulation"])
        return scaled

    def lr_scheduler(self, optimizer: torch.optim.Optimizer, *, epochs: int, warmup: float = 0.0,
                     shape: str = "cosine") -> ProgressLR:
        """A ``shape`` schedule ("cosine" or "linear") over ``epochs`` epochs of samples seen;
        ``warmup`` is a fraction of them. Step it every optimizer step (``"interval": "step"``).
        Call it on every rank (``configure_optimizers`` is): an epoch's samples are all-reduced."""
        w = self.windows()
        # over every rank, the same on each: a custom sampler's shares may differ (each rank scheduled its own)
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        total = epochs * global_epoch_samples(w, device)
        warm = int(round(warmup * total))
        factor = warmup_cosine(warm, total) if shape == "cosine" else warmup_linear(warm, total)
        return ProgressLR(optimizer, factor, lambda: self.windows().samples_seen)

    # -- Lightning hooks ----------------------------------------------------------------------
    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        adapter_defaults(pl_module, dict(self.loader_kwargs))
        limit = trainer.limit_train_batches
        if not (isinstance(limit, float) and limit == 1.0):
            raise UnsupportedSettingError(
                f"Trainer(limit_train_batches={limit!r}) (fast_dev_run sets it too): ODB's epochs end when the "
                "data does; a limited epoch "
                "would start the same epoch (the same samples) again each time, as the loader's windows count "
                "epochs by their end. Use max_steps to end a run early, or a smaller dataset (torch.utils.data."
                "Subset) for a short epoch", field="limit_train_batches")
        self._check_accumulation(trainer)

    def _check_accumulation(self, trainer: Any) -> None:
        """:class:`UnsupportedSettingError` unless the Trainer accumulates as many micro-batches
        per update as the windows do (P7): at fit start and at every batch, since a
        ``GradientAccumulationScheduler`` changes the Trainer's count during the run."""
        if trainer.accumulate_grad_batches != self.accumulate_grad_batches:
            raise UnsupportedSettingError(
                f"rank {trainer.global_rank}: Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) "
                "differs from "
                f"ODBLightningCallback(accumulate_grad_batches={self.accumulate_grad_batches}): the windows' exact "
                "weights (P7) hold only when both count the same micro-batches per update; give both the same",
                field="accumulate_grad_batches", rank=trainer.global_rank)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._t0, self._samples0 = time.monotonic(), self.windows().samples_seen

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._check_accumulation(trainer)
        self._started += 1

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not batch.get("odb_last_in_window"):
            return
        w = self.windows()
        elapsed = max(time.monotonic() - self._t0, 1e-9)
        pl_module.log_dict({"odb_samples_seen": float(w.samples_seen), "odb_tokens_seen": float(w.tokens_seen),
                            "odb_samples_per_second": (w.samples_seen - self._samples0) / elapsed},
                           on_step=True, on_epoch=False, rank_zero_only=True, batch_size=1)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self._windows is not None:
            self._windows.loader.close()

    # -- checkpoints --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Every rank's position, gathered (Lightning writes the checkpoint from rank 0 only): before
        the micro-batches Lightning fetched ahead and has not begun to train (P4: a resume trains
        them, once, whether they start a window, make whole ones, or end the epoch)."""
        mine = self.windows().state_dict(ahead=max(self._yielded - self._started, 0))
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            ranks: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, mine)
        else:
            ranks = [mine]
        return {"version": 1, "ranks": ranks}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "ranks" not in state_dict:
            raise CheckpointStateError("the checkpoint's ODBLightningCallback state has no 'ranks'")
        self._pending = state_dict
