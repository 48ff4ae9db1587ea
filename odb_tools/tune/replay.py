"""A training-like run at a budget: many admitted shapes back to back, the allocator never emptied.

Each shape's own peak (:mod:`.measure`) starts from an emptied cache. A training run's shape
changes at every step, and a caching allocator (PyTorch's on a GPU, malloc's arenas on a CPU)
keeps the blocks earlier shapes freed, which later shapes may not fit in: on an H100 a budget
whose every worst shape fit 71 GiB ran out of memory at step 8 of training, with 68.8 GB
allocated. The replay runs ``steps`` shapes the budget admits (P3) in a seeded random order,
the worst ones among them, with one optimizer whose state stays resident, and reports what the
process held at its peak: ``torch.cuda.max_memory_reserved`` on a GPU (the allocator's hold on
the device, which is what runs out; the allocator capped at the limit, as on a card of that size),
the forked child's peak RSS on a CPU.
"""

from __future__ import annotations

import random
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from odb_tools.tune.measure import capped_cuda, make_optimizer, peak_in_child, peak_on_cuda
from odb_tools.tune.model import call_loss
from odb_tools.tune.shapes import Shape, worst_shapes


@dataclass(frozen=True)
class Replay:
    """One budget's replay: its shapes in the order run, the peak held (bytes; None on failure)."""

    token_budget: int
    shapes: tuple[Shape, ...]
    peak: int | None
    error: str | None = None


def replay_shapes(budget: str, token_budget: int, cutoff: int, steps: int, seed: int = 0) -> list[Shape]:
    """``steps`` shapes ``token_budget`` admits under ``budget``, in a seeded order: its worst
    (:func:`worst_shapes`, each once, as many as fit in ``steps``) among shapes drawn as training
    meets them. Padded: a length l uniform in 1..cutoff, its group ``[B(l), l]`` (B(l) =
    floor(L_max / l)), or the lone sample ``[1, l]`` when l > L_max. Packed: a row of that sample
    and others, a fraction 1/2..1 of L_max (packed rows are nearly full), or that lone sample. The draws and the order
    depend on the seed, the budget's kind and the cut-off, not on L_max: every budget groups the
    same lengths at the same places, so a larger budget's drawn shapes hold a smaller one's."""
    if steps < 1:
        raise ValueError(f"a replay needs at least one step, got {steps}")
    rng = random.Random(f"{budget}/{cutoff}/{seed}")
    draws = [(rng.randint(1, cutoff), rng.random()) for _ in range(steps)]
    order = list(range(steps))
    rng.shuffle(order)
    worst = worst_shapes(budget, token_budget, cutoff)[:steps]
    chosen = worst + [_drawn(budget, token_budget, cutoff, *d) for d in draws[len(worst):]]
    return [chosen[k] for k in order]


def _drawn(budget: str, token_budget: int, cutoff: int, length: int, fraction: float) -> Shape:
    if length > token_budget:
        return Shape("single", 1, length, cutoff)
    if budget == "packed":
        return Shape("packed", 1, max(length, int(token_budget * (1 + fraction) / 2)), cutoff)
    return Shape("padded", max(token_budget // length, 1), length, cutoff)


def run_steps(model: nn.Module, shapes: list[Shape], vocab_size: int, device: str, optimizer: str) -> None:
    """One training step per shape, in order: forward, backward and (with an optimizer, built
    once, its state resident from the first step on) the optimizer's step."""
    opt = make_optimizer(model, optimizer)
    for shape in shapes:
        call_loss(model, shape.tensors(vocab_size, device)).backward()  # type: ignore[no-untyped-call]
        if opt is not None:
            opt.step()
        model.zero_grad(set_to_none=True)


def replay_cpu(model: nn.Module, token_budget: int, shapes: list[Shape], vocab_size: int,
               optimizer: str = "none") -> Replay:
    """The replay in a forked child: this process's RSS plus the child's growth over every step."""
    like = next((s for s in shapes if s.kind != "single"), shapes[0])  # warmed up on the budget's own kind
    peak, error = peak_in_child(model, lambda: run_steps(model, shapes, vocab_size, "cpu", optimizer), vocab_size,
                                optimizer, like, f"replaying {len(shapes)} shapes at L_max {token_budget}")
    return Replay(token_budget, tuple(shapes), peak, error)


def replay_cuda(model: nn.Module, token_budget: int, shapes: list[Shape], vocab_size: int,
                optimizer: str = "none", limit: int | None = None) -> Replay:
    """The replay in this process, from an emptied cache: ``torch.cuda.max_memory_reserved``;
    ``torch.cuda.OutOfMemoryError`` is a replay that does not fit. With ``limit``, the allocator
    is capped at it (:func:`capped_cuda`), so the replay fits a card of ``limit`` bytes or fails
    as it would there, whatever the card it runs on."""
    device = str(next(model.parameters()).device)
    with capped_cuda(device, limit) if limit is not None else nullcontext():
        peak, error = peak_on_cuda(model, lambda: run_steps(model, shapes, vocab_size, device, optimizer),
                                   torch.cuda.max_memory_reserved)
    return Replay(token_budget, tuple(shapes), peak, error)
