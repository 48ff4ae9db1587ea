"""Helpers for a custom Hugging Face Accelerate loop over ODB batches (extra ``odb-verified[accelerate]``).

Two ways to keep DDP ranks in step:

* **lockstep** (default, recommended): every rank yields the same number of micro-batches
  (P2; idle ranks get zero-weight batches), read in gradient-accumulation windows::

      model, optimizer, windows = prepare(accelerator, model, optimizer, dataset,
                                          token_budget=8192, accumulation_steps=4)
      for epoch in range(epochs):
          for micro in windows:
              batch = send_to_device(micro.batch, accelerator.device)
              with sync_context(accelerator, model, micro):
                  loss_sum, count = causal_lm_loss_sum(logits_of(model(**batch)), batch["labels"])
                  backward(accelerator, loss_sum, micro, tokens=count)  # exact over the window (P7)
              if micro.last_in_window:
                  optimizer.step(); optimizer.zero_grad()

* **join**: ``odb_loader(..., skip_idle=True)`` inside :func:`join_uneven_inputs`, for
  code built around torch's ``Join``; the multiplier is :func:`step_multiplier`, one
  optimizer step per batch.

Checkpoints: :func:`save_odb_state` / :func:`load_odb_state` next to ``accelerator.save_state``
/ ``load_state`` (ODB's state is per rank; Accelerate's custom-object checkpointing writes
only the main process's). Nothing here patches Accelerate or torch.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel

from odb_core.errors import UnsupportedSettingError
from odb_torch.loader import ODBDataLoader
from odb_torch.losses import check_loss_tokens, shifted_loss_tokens
from odb_torch.padding_free import adapter_defaults
from odb_torch.step_info import StepInfo
from odb_torch.windows import AccumulationWindows, MicroBatch, load_windows_state, save_windows_state


def odb_loader(accelerator: Any, dataset: Any, *, token_budget: int, **loader_kwargs: Any) -> ODBDataLoader:
    """An :class:`~odb_torch.ODBDataLoader` for this process (rank and world size from ``accelerator``).

    Do not pass it to ``accelerator.prepare``: Accelerate would re-shard it. ``loss_tokens_fn``
    defaults to :func:`~odb_torch.losses.shifted_loss_tokens` (causal LMs), ``collate_fn`` to
    :func:`~odb_torch.pad_collate` (:func:`~odb_torch.packed_collate` under ``budget="packed"``).
    An ``accelerator`` that counts another number of processes than the job has is refused
    (:func:`check_accelerator_world`).
    """
    check_accelerator_world(accelerator)
    loader_kwargs.setdefault("loss_tokens_fn", shifted_loss_tokens)
    adapter_defaults(None, loader_kwargs)
    loader_kwargs.setdefault("rank", accelerator.process_index)
    loader_kwargs.setdefault("world_size", accelerator.num_processes)
    return ODBDataLoader(dataset, token_budget=token_budget, **loader_kwargs)


def prepare(accelerator: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer, dataset: Any, *,
            token_budget: int, accumulation_steps: int = 1, pad_last_window: bool = False,
            **loader_kwargs: Any) -> tuple[Any, Any, AccumulationWindows]:
    """``accelerator.prepare(model, optimizer)`` plus ODB windows over ``dataset`` (lockstep mode).

    Under ``budget="packed"`` a model that would let packed sequences attend to each other is
    refused first (:class:`~odb_core.errors.PackedAttentionError`), and so is an ``Accelerator``
    with its own ``gradient_accumulation_steps`` (:func:`check_own_accumulation`)."""
    check_own_accumulation(accelerator)
    adapter_defaults(model, loader_kwargs, accelerator.device)
    model, optimizer = accelerator.prepare(model, optimizer)
    windows = AccumulationWindows(odb_loader(accelerator, dataset, token_budget=token_budget, **loader_kwargs),
                                  accumulation_steps, pad_last_window=pad_last_window)
    return model, optimizer, windows


def check_accelerator_world(accelerator: Any) -> None:
    """:class:`~odb_core.errors.UnsupportedSettingError` (field ``num_processes``) when the job has
    another number of processes than ``accelerator`` counts (``torch.distributed``'s world, else
    the launcher's ``WORLD_SIZE``). On a machine without GPUs, ``Accelerator()`` under torchrun counts one
    process on every rank (``DistributedType.NO``) while torch.distributed holds them all: each
    rank would then train the whole dataset alone, an undivided model on each (P4 across ranks).
    ``Accelerator(cpu=True)`` counts them."""
    counted = int(accelerator.num_processes)
    if dist.is_available() and dist.is_initialized():
        world, rank = dist.get_world_size(), dist.get_rank()
    else:
        world, rank = int(os.environ.get("WORLD_SIZE") or 1), int(os.environ.get("RANK") or 0)
    if world != counted:
        raise UnsupportedSettingError(
            f"rank {rank}: the Accelerator counts {counted} process(es) (distributed type "
            f"{getattr(accelerator, 'distributed_type', '?')}) but this job has {world}: every rank would train the "
            "whole dataset alone; on a machine without GPUs build Accelerator(cpu=True)", field="num_processes",
            rank=rank)


def check_own_accumulation(accelerator: Any) -> None:
    """:class:`~odb_core.errors.UnsupportedSettingError` (field ``gradient_accumulation_steps``)
    for an ``Accelerator`` that accumulates itself: its ``backward`` divides every loss by its
    count, on top of the windows' exact weights (P7), so every gradient would be that many times
    too small. ODB's windows do the accumulation (``accumulation_steps``)."""
    steps = getattr(accelerator, "gradient_accumulation_steps", 1)
    if steps != 1:
        rank = int(accelerator.process_index)
        raise UnsupportedSettingError(
            f"rank {rank}: Accelerator(gradient_accumulation_steps={steps}): its backward() would divide each loss "
            f"by {steps} on top of ODB's exact window weights; leave the Accelerator's at 1 and pass "
            "accumulation_steps to odb_torch.integrations.accelerate.prepare", field="gradient_accumulation_steps",
            rank=rank)


def sync_context(accelerator: Any, model: Any, micro: MicroBatch) -> contextlib.AbstractContextManager[Any]:
    """``accelerator.no_sync(model)`` inside a window, a plain context on its last micro-batch (all-reduce once)."""
    return contextlib.nullcontext() if micro.last_in_window else accelerator.no_sync(model)


def backward(accelerator: Any, loss_sum: torch.Tensor, micro: MicroBatch,
             tokens: int | torch.Tensor | None = None) -> torch.Tensor:
    """Backward of ``loss_sum x micro.loss_multiplier``; returns the scaled loss (P7).

    ``tokens``: the number of tokens ``loss_sum`` summed over. Given, it must equal the
    loader's count for the batch (``loss_tokens_fn``; shifted labels by default), else
    :class:`~odb_core.errors.LossTokenMismatchError` naming the rank and dataset indices:
    the weights are exact only when both count the same tokens."""
    info = micro.info
    if tokens is not None:
        check_loss_tokens(tokens, info.local_tokens, info.indices, int(accelerator.process_index),
                          weighted=not (info.is_idle or micro.is_padding))
    check_own_accumulation(accelerator)
    loss = loss_sum * micro.loss_multiplier
    accelerator.backward(loss)
    return loss


def step_multiplier(info: StepInfo, world_size: int) -> float:
    """The summed-loss multiplier of one step without accumulation: ``W / global_tokens`` (0 when idle)."""
    return 0.0 if info.is_idle or info.global_tokens == 0 else world_size / info.global_tokens


@contextlib.contextmanager
def join_uneven_inputs(accelerator: Any, model: Any) -> Iterator[None]:
    """torch ``Join`` over a DDP ``model``, for loaders with ``skip_idle=True`` (a no-op for one process).

    A rank that runs out joins; its shadow all-reduces contribute zero gradients and DDP
    still divides by the initial world size, so :func:`step_multiplier` stays exact (P7).
    torch's ``Join`` is used directly: Accelerate's ``join_uneven_inputs`` does nothing on CPU.
    """
    if isinstance(model, DistributedDataParallel):
        with Join([model], throw_on_early_termination=False):
            yield
    else:
        yield


def save_odb_state(windows: AccumulationWindows, folder: str) -> str:
    """This rank's ODB position into ``folder`` (e.g. the one ``accelerator.save_state`` wrote); every rank calls it."""
    return save_windows_state(windows, folder)


def load_odb_state(windows: AccumulationWindows, folder: str) -> None:
    """Restore this rank's ODB position from ``folder`` before the next ``iter(windows)``."""
    load_windows_state(windows, folder)
