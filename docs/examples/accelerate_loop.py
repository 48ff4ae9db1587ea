"""A custom Accelerate training loop over ODB batches, with gradient accumulation and a
mid-epoch checkpoint (CPU, a tiny causal LM built from a config, synthetic token data).

    python docs/examples/accelerate_loop.py
    torchrun --nproc-per-node 2 docs/examples/accelerate_loop.py
    torchrun --nproc-per-node 2 docs/examples/accelerate_loop.py --join   # torch Join instead of lockstep

Needs ``pip install "odb-verified[accelerate]"``.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import send_to_device

from odb_tools.demo.model import ModelConfig, TinyCausalLM
from odb_tools.demo.synthetic import TokenDataset
from odb_torch.integrations.accelerate import (
    backward,
    join_uneven_inputs,
    load_odb_state,
    odb_loader,
    prepare,
    save_odb_state,
    step_multiplier,
    sync_context,
)

Hook = Callable[..., None]


def build(accelerator: Accelerator) -> tuple[TinyCausalLM, torch.optim.Optimizer, TokenDataset]:
    model = TinyCausalLM(ModelConfig(vocab_size=128, max_length=256, d_model=32, n_layers=2, n_heads=2))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3), TokenDataset(96)


def train_lockstep(out_dir: str, epochs: int = 2, accum: int = 2, save_at: int = 0, resume: bool = False,
                   on_micro: Hook | None = None, before_step: Hook | None = None, budget: str = "padded") -> int:
    """Lockstep loop; saves a checkpoint after update ``save_at`` (0: never); returns the updates made.
    ``budget="packed"``: padding-free rows (``packed_collate``, docs/packing.md)."""
    accelerator = Accelerator(cpu=True)
    model, optimizer, dataset = build(accelerator)
    model, optimizer, windows = prepare(accelerator, model, optimizer, dataset, token_budget=256, budget=budget,
                                        accumulation_steps=accum, buffer_size=32, num_workers=1, timeout=120)
    ckpt = os.path.join(out_dir, "checkpoint")
    if resume:
        accelerator.load_state(ckpt)   # model, optimizer, RNG
        load_odb_state(windows, ckpt)  # this rank's ODB position
    updates = 0
    try:
        while windows.epochs_completed < epochs:
            for micro in windows:
                batch = send_to_device(micro.batch, accelerator.device)
                with sync_context(accelerator, model, micro):
                    loss_sum, count = model(batch["input_ids"], batch["labels"])
                    backward(accelerator, loss_sum, micro, tokens=count)  # count checked against the loader's
                if on_micro:
                    on_micro(micro, windows.updates - micro.last_in_window)
                if micro.last_in_window:
                    if before_step:
                        before_step(model, micro)
                    optimizer.step()
                    optimizer.zero_grad()
                    updates += 1
                    if windows.updates == save_at:
                        accelerator.save_state(ckpt)
                        save_odb_state(windows, ckpt)
                        return updates  # stop here, as a crash would
    finally:
        windows.loader.close()
    if accelerator.is_main_process:
        print(f"{windows.samples_seen} samples, {windows.tokens_seen} loss tokens, {windows.updates} updates")
    return updates


def train_join(epochs: int = 2, on_batch: Hook | None = None) -> None:
    """torch Join: a rank with nothing left joins instead of training on idle batches.

    Unshuffled shards of a dataset whose even samples are long give rank 0 far more
    batches than rank 1, which then runs out early and joins.
    """
    accelerator = Accelerator(cpu=True)
    model, optimizer, _ = build(accelerator)
    model, optimizer = accelerator.prepare(model, optimizer)
    loader = odb_loader(accelerator, TokenDataset(96, long_every=2), token_budget=256, skip_idle=True,
                        shuffle=False, buffer_size=32, num_workers=1, timeout=120)
    try:
        for epoch in range(epochs):
            loader.set_epoch(epoch)
            with join_uneven_inputs(accelerator, model):
                for batch in loader:
                    info = loader.step_info
                    batch = send_to_device(batch, accelerator.device)
                    loss_sum, _ = model(batch["input_ids"], batch["labels"])
                    accelerator.backward(loss_sum * step_multiplier(info, accelerator.num_processes))
                    optimizer.step()
                    optimizer.zero_grad()
                    if on_batch:
                        on_batch(info)
    finally:
        loader.close()


def main(argv: Any = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/accelerate_example")
    parser.add_argument("--join", action="store_true")
    a = parser.parse_args(argv)
    if a.join:
        train_join()
        return
    train_lockstep(a.out, save_at=5)               # runs 5 updates, checkpoints, stops
    train_lockstep(a.out, resume=True)             # resumes mid-epoch and finishes 2 epochs


if __name__ == "__main__":
    main()
