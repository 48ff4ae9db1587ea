"""One demo run: W Gloo ranks (spawn) fine-tune :class:`TinyCausalLM` with one batching method.

Methods, all over the same samples and the same model, optimizer, learning rate and
gradient clipping:

* ``standard``: torch's DataLoader, random fixed-size batches (DistributedSampler);
* ``sorted``: length-grouped fixed-size batches (mega-batches of 50 batches sorted by
  length, as Hugging Face's ``group_by_length``), the batches shuffled and dealt to ranks;
* ``odb``: :class:`~odb_torch.ODBDataLoader` with exact loss scaling (P7), each update
  ``accumulation_steps`` micro-batches of ``token_budget / accumulation_steps`` tokens
  (:class:`~odb_torch.windows.AccumulationWindows`), so an update mixes groups from
  across the length range instead of holding one length-homogeneous group per rank;
* ``odb-packed``: the same loader and windows under the packed budget
  (``ODBConfig(budget="packed")``: the sum of a micro-batch's lengths within its tokens,
  best-fit decreasing over the buffer), each micro-batch one padding-free row
  (:func:`odb_torch.padding_free.packed_collate`) whose attention stays within each
  sequence (:mod:`.model`); micro-batches of the same tokens, fewer per update
  (:func:`odb_tools.demo.packed_accumulation_steps`), so it makes at least ODB's updates.

The fixed batch size is ODB's expected samples per update, so all make about the same
number of updates. Standard and Sorted use DDP's usual loss (each rank's per-token mean,
averaged over ranks); ODB the exact global per-token mean over the update. Every
micro-batch all-reduces the summed loss and token counts for the log, the same for
every method.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, Sampler

from odb_core import ODBConfig
from odb_core.config import BudgetName
from odb_tools.demo.chat_data import ChatDataset
from odb_tools.demo.model import ModelConfig, TinyCausalLM
from odb_tools.progress import bar
from odb_torch.collate import pad_collate
from odb_torch.loader import ODBDataLoader
from odb_torch.losses import shifted_loss_tokens
from odb_torch.padding_free import packed_collate
from odb_torch.ports import await_listener
from odb_torch.windows import AccumulationWindows

METHODS = ("standard", "sorted", "odb", "odb-packed")
ODB_METHODS: dict[str, BudgetName] = {"odb": "padded", "odb-packed": "packed"}  # method -> ODBConfig.budget


@dataclass(frozen=True)
class RunConfig:
    """One method's run."""

    method: str
    batch_size: int
    token_budget: int  # ODB: tokens per rank per update, split over accumulation_steps micro-batches
    buffer_size: int
    lr: float  # peak learning rate (see lr_at)
    model: ModelConfig
    seed: int = 0
    num_workers: int = 1
    progress: bool = True
    regroup_padding: float | None = 0.02  # ODB only (ODBConfig.regroup_padding)
    max_grad_norm: float | None = 1.0  # clip the global gradient norm before each update (None: off)
    accumulation_steps: int = 1  # ODB only: micro-batches per update


class LengthGroupedBatches(Sampler[list[int]]):
    """Fixed-size batches of similar length: shuffle, cut into mega-batches of ``50 * batch_size``,
    sort each by length, chunk into batches, shuffle the batches, deal them round-robin to ranks.
    The batch count is made a multiple of the world size by splitting the largest batches in
    two, so every rank runs the same number of steps and no sample is trained (and counted)
    twice; only batches of one sample each are repeated instead (as DistributedSampler pads).
    """

    def __init__(self, lengths: list[int], batch_size: int, rank: int, world: int, seed: int) -> None:
        rng = random.Random(seed)
        order = list(range(len(lengths)))
        rng.shuffle(order)
        mega = 50 * batch_size
        batches: list[list[int]] = []
        for k in range(0, len(order), mega):
            chunk = sorted(order[k:k + mega], key=lambda i: -lengths[i])
            batches += [chunk[j:j + batch_size] for j in range(0, len(chunk), batch_size)]
        rng.shuffle(batches)
        while len(batches) % world and any(len(b) > 1 for b in batches):
            k = max(range(len(batches)), key=lambda j: len(batches[j]))
            half = len(batches[k]) // 2
            batches[k:k + 1] = [batches[k][:half], batches[k][half:]]
        batches += [batches[j % len(batches)] for j in range((-len(batches)) % world)]
        self.batches = batches[rank::world]

    def __iter__(self) -> Any:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def lr_at(base: float, seen: int, total: int, warmup: float = 0.1) -> float:
    """Learning rate after ``seen`` of ``total`` tokens: linear warmup over the first 10%,
    then cosine decay to zero. It follows tokens seen, not steps or samples, so every
    method gets the same schedule however its batches are shaped (with a per-token loss,
    a batch of 100 greetings is not 100 samples' worth of progress)."""
    frac = min(seen / max(total, 1), 1.0)
    if frac < warmup:
        return base * max(frac, 1.0 / max(total, 1)) / warmup
    return base * 0.5 * (1 + math.cos(math.pi * (frac - warmup) / (1 - warmup)))


def _loader(cfg: RunConfig, data: ChatDataset, rank: int, world: int, port: int) -> tuple[Any, int]:
    """The method's loader and its number of steps per rank (ODB: unknown, -1; its collate group on ``port``)."""
    if cfg.method in ODB_METHODS:
        packed = ODB_METHODS[cfg.method] == "packed"
        config = ODBConfig(token_budget=cfg.token_budget // cfg.accumulation_steps, budget=ODB_METHODS[cfg.method],
                           buffer_size=cfg.buffer_size, seed=cfg.seed, regroup_padding=cfg.regroup_padding)
        odb = ODBDataLoader(data, config=config, collate_fn=packed_collate if packed else pad_collate,
                            num_workers=cfg.num_workers, loss_tokens_fn=shifted_loss_tokens,
                            init_method=f"tcp://127.0.0.1:{port}")
        return odb, -1
    if cfg.method == "sorted":
        sampler = LengthGroupedBatches(data.lengths(), cfg.batch_size, rank, world, cfg.seed)
        return DataLoader(data, batch_sampler=sampler, collate_fn=pad_collate, num_workers=cfg.num_workers,
                          multiprocessing_context="spawn"), len(sampler)
    dist_sampler: DistributedSampler[Any] = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=cfg.seed)
    plain = DataLoader(data, batch_size=cfg.batch_size, sampler=dist_sampler, collate_fn=pad_collate,
                       num_workers=cfg.num_workers, multiprocessing_context="spawn")
    return plain, len(plain)


@torch.no_grad()
def evaluate(model: TinyCausalLM, data: ChatDataset, rank: int, world: int) -> float:
    """Per-token loss of ``model`` over all of ``data`` (ranks split it; batches of 8)."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64)
    mine = list(range(rank, len(data), world))
    for k in range(0, len(mine), 8):
        batch = pad_collate([data[i] for i in mine[k:k + 8]])
        loss, tokens = model(batch["input_ids"], batch["labels"])
        total += torch.tensor([float(loss), tokens], dtype=torch.float64)
    dist.all_reduce(total)
    model.train()
    return float(total[0]) / max(float(total[1]), 1.0)


def _micro_batches(cfg: RunConfig, loader: Any) -> Iterator[tuple[Any, float | None, int, bool]]:
    """(batch, loss multiplier or None for the rank's own per-token mean, local samples, last of its update).

    ODB runs through :class:`~odb_torch.windows.AccumulationWindows`: its multiplier makes the
    update the exact per-token mean over every token of the window on every rank (P7)."""
    if cfg.method in ODB_METHODS:
        for mb in AccumulationWindows(loader, cfg.accumulation_steps):
            local = 0 if mb.info.is_idle or mb.is_padding else mb.info.local_samples
            yield mb.batch, mb.loss_multiplier, local, mb.last_in_window
    else:
        for batch in loader:
            yield batch, None, int(batch["input_ids"].shape[0]), True


def run_ranks(rank: int, world: int, port: int, runs: list[tuple[RunConfig, str, int]], data: ChatDataset,
              probe: ChatDataset | None = None) -> None:
    """Each of ``runs`` (config, log file, ODB collate port) in turn in one process group on
    ``port``: one spawn of W ranks for every method (each run builds its model afresh and
    times only its own epoch, :func:`train`)."""
    torch.set_num_threads(1)
    if rank:  # rank 0 serves the store: connect once it listens (odb_torch.ports.await_listener)
        await_listener("127.0.0.1", port, 600)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))
    try:
        for cfg, out, collate_port in runs:
            train(rank, world, cfg, data, out, probe, collate_port)
    finally:
        dist.destroy_process_group()


def train(rank: int, world: int, cfg: RunConfig, data: ChatDataset, out: str, probe: ChatDataset | None,
          collate_port: int) -> None:
    """Train one epoch of ``data`` with ``cfg.method`` in the initialised process group; rank 0
    writes the run's log to ``out``. The clock starts after a barrier, before the loader starts."""
    model = torch.nn.parallel.DistributedDataParallel(TinyCausalLM(cfg.model))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    dist.barrier()
    started = time.perf_counter()
    loader, _ = _loader(cfg, data, rank, world, collate_port)
    log: list[dict[str, float]] = []
    seen = real = padded = 0
    update = torch.zeros(3, dtype=torch.float64)  # this update's summed loss, loss tokens, samples (every rank)
    total_tokens = sum(data.lengths())
    progress = bar(len(data), f"{cfg.method:>8}", "samples", enabled=rank == 0 and cfg.progress)
    try:
        for batch, multiplier, local, last in _micro_batches(cfg, loader):
            ids, labels = batch["input_ids"], batch["labels"]
            for group in opt.param_groups:
                group["lr"] = lr_at(cfg.lr, real, total_tokens)
            with contextlib.nullcontext() if last else model.no_sync():
                loss_sum, tokens = model(ids, labels, batch.get("position_ids"), batch.get("cu_seq_lens_q"))
                # ODB: exact global per-token mean (P7); the others: DDP's usual mean of per-rank means
                (loss_sum * (multiplier if multiplier is not None else 1.0 / max(tokens, 1))).backward()
            if last:
                if cfg.max_grad_norm is not None:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
                opt.step()
                opt.zero_grad(set_to_none=True)
            lengths = int((ids != 0).sum()) if local else 0
            stats = torch.tensor([float(loss_sum.detach()) if local else 0.0, tokens if local else 0, local,
                                  lengths, ids.numel() if local else 0], dtype=torch.float64)
            dist.all_reduce(stats)
            seen += int(stats[2])
            real += int(stats[3])
            padded += int(stats[4])
            update += stats[:3]
            if last:
                log.append({"samples": seen, "loss": float(update[0]) / max(float(update[1]), 1.0),
                            "tokens": float(update[1]), "step_samples": float(update[2]),
                            "seconds": time.perf_counter() - started})
                update.zero_()
            progress.update(int(stats[2]))
    finally:
        progress.close()
        if cfg.method in ODB_METHODS:
            loader.close()
    seconds = time.perf_counter() - started
    final = evaluate(model.module, probe, rank, world) if probe is not None else float("nan")
    if rank == 0:
        Path(out).write_text(json.dumps({"config": asdict(cfg), "seconds": seconds, "samples": seen, "final_loss": final,
                                         "real_tokens": real, "padded_tokens": padded, "log": log}))
