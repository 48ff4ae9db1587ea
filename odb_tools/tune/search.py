"""``odb tune``: the largest token budget L_max whose worst admitted shapes fit a memory limit.

Budgets are multiples of ``step``. From ``start`` the budget doubles until one does not fit
(or passes ``max_budget``), then bisection between the last that fits and the first that
does not ends with two measured neighbours: the reported budget fits, budget + step does not.
A budget fits when every shape :func:`~odb_tools.tune.shapes.worst_shapes` gives it peaks at
most ``limit`` bytes; shapes are measured likely-worst first, a budget stops at its first
that does not fit, and a shape is measured once per run (the lone sample at the cut-off recurs).
The budget found is then replayed (:mod:`~odb_tools.tune.replay`: ``replay_steps`` admitted
shapes back to back, as training meets them) and lowered until its replay fits too.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import asdict
from functools import partial
from typing import Any

from torch import nn

from odb_tools.tune.measure import Measurement, baseline_bytes, measure_cpu, measure_cuda, warm_up
from odb_tools.tune.replay import Replay, replay_cpu, replay_cuda, replay_shapes
from odb_tools.tune.shapes import Shape, worst_shapes

Measure = Callable[[nn.Module, Shape, int, str], Measurement]
ReplayRun = Callable[[nn.Module, int, list[Shape], int, str], Replay]
REPLAY_STEPS = 16
"""Shapes a GPU replay runs by default. On a CPU a process's RSS keeps growing step after step
(``tests/tune_support.py``'s tiny model at L_max 512: one step 23 MiB over its baseline, replays of
8, 16 and 64 steps 52, 92 and 183; one shape 64 times, 55), so a CPU replay's figure depends on its
length, and it is off there unless asked for."""
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


UNITS_ACCEPTED = "B, K or KB, M or MB, G or GB, T or TB (powers of 1000), KiB, MiB, GiB, TiB (powers of 1024)"
"""The units :func:`parse_bytes` takes (any case), as its error lists them."""


def parse_bytes(text: str) -> int:
    """``"24GiB"``, ``"1.5G"``, ``"800MB"``, ``"123456"`` -> bytes (decimal units, binary with i)."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"memory size {text!r}: expected a number with an optional unit: {UNITS_ACCEPTED}")
    size = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if size <= 0:
        raise ValueError(f"memory size {text!r}: must be more than 0 bytes")
    return size


def vocab_of(model: nn.Module) -> int:
    """The vocabulary size: the model's config's, else its first embedding's rows."""
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(size, int):
        return size
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            return int(module.num_embeddings)
    raise ValueError("cannot tell the model's vocabulary size: no config.vocab_size and no nn.Embedding")


class Search:
    """One run's measurements (cached per shape) and each measured budget's verdict."""

    def __init__(self, model: nn.Module, limit: int, budget: str, cutoff: int, device: str, optimizer: str,
                 max_shapes: int | None, measure: Measure | None = None, *, replay_steps: int = 0, seed: int = 0,
                 replay: ReplayRun | None = None) -> None:
        self.model, self.limit, self.budget, self.cutoff = model, limit, budget, cutoff
        self.device, self.optimizer, self.max_shapes = device, optimizer, max_shapes
        self.vocab = vocab_of(model)
        self.measure = measure or (measure_cpu if device == "cpu" else measure_cuda)
        self.replay = replay or (replay_cpu if device == "cpu" else partial(replay_cuda, limit=limit))
        self.replay_steps, self.seed = replay_steps, seed
        self.shapes: dict[Shape, Measurement] = {}
        self.budgets: dict[int, dict[str, Any]] = {}
        self.replays: dict[int, Replay] = {}

    def replay_fits(self, token_budget: int) -> bool:
        """Whether ``token_budget``'s replay (:func:`replay_shapes`) peaks within the limit (recorded)."""
        if token_budget not in self.replays:
            shapes = replay_shapes(self.budget, token_budget, self.cutoff, self.replay_steps, self.seed)
            self.replays[token_budget] = self.replay(self.model, token_budget, shapes, self.vocab, self.optimizer)
        peak = self.replays[token_budget].peak
        return peak is not None and peak <= self.limit

    def fits(self, token_budget: int) -> bool:
        """Whether every worst shape of ``token_budget`` peaks within the limit (recorded)."""
        if token_budget not in self.budgets:
            worst: Measurement | None = None
            for shape in worst_shapes(self.budget, token_budget, self.cutoff, self.max_shapes):
                if shape not in self.shapes:
                    self.shapes[shape] = self.measure(self.model, shape, self.vocab, self.optimizer)
                m = self.shapes[shape]
                if worst is None or m.peak is None or (worst.peak is not None and m.peak > worst.peak):
                    worst = m
                if m.peak is None or m.peak > self.limit:
                    break
            assert worst is not None
            ok = worst.peak is not None and worst.peak <= self.limit
            self.budgets[token_budget] = {"token_budget": token_budget, "fits": ok, "worst_shape": worst.shape.label(),
                                          "peak_bytes": worst.peak, "error": worst.error}
        return bool(self.budgets[token_budget]["fits"])


def find_budget(search: Search, step: int, start: int, max_budget: int) -> tuple[int | None, int | None]:
    """(largest fitting multiple of ``step``, the smallest measured one that does not fit);
    None for the first when ``start`` does not fit, None for the second when ``max_budget`` fits."""
    lo: int | None = None
    hi: int | None = None
    budget = max(step, start // step * step)
    while budget <= max_budget:
        if not search.fits(budget):
            hi = budget
            break
        lo, budget = budget, budget * 2
    if hi is None:  # every doubling up to max_budget fits (or start is past it)
        top = max_budget // step * step
        if lo is None or search.fits(top):
            return (top if lo is not None else None), None
        hi = top
    if lo is None:
        return None, hi
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        lo, hi = (mid, hi) if search.fits(mid) else (lo, mid)
    return lo, hi


def settle(search: Search, found: int | None, step: int) -> tuple[int | None, int | None]:
    """(a multiple of ``step`` up to ``found`` whose replay fits, the next multiple, whose replay
    does not; None for either when there is none), both replayed. Every budget up to ``found``
    fits shape by shape; the replay steps down from it by doubling decrements, then bisects
    between the last that does not fit and the first that does. When replay peaks grow with the
    budget (each budget groups the same drawn lengths, :func:`replay_shapes`), the first is the
    largest whose replay fits; a caching allocator's peaks need not be monotone, so that is not
    guaranteed."""
    if found is None or search.replay_fits(found):
        return found, None
    over, gap = found, step
    while found - gap >= step and not search.replay_fits(found - gap):
        over, gap = found - gap, gap * 2
    below = found - gap
    if below < step:
        if over == step or not search.replay_fits(step):
            return None, step
        below = step
    while over - below > step:
        mid = (below + over) // 2 // step * step
        below, over = (mid, over) if search.replay_fits(mid) else (below, mid)
    return below, over


def tune(model: nn.Module, limit: int, cutoff: int, budget: str = "padded", device: str = "cpu", step: int = 128,
         start: int | None = None, max_budget: int = 1 << 20, optimizer: str = "adamw", max_shapes: int | None = 8,
         measure: Measure | None = None, replay_steps: int | None = None, seed: int = 0,
         replay: ReplayRun | None = None) -> dict[str, Any]:
    """The largest L_max (a multiple of ``step``) whose worst shapes fit ``limit`` bytes and, with
    ``replay_steps`` (0: none; None: :data:`REPLAY_STEPS` on a GPU, none on a CPU), whose replay of
    that many admitted shapes back to back fits too, as a JSON-ready dict (a ``transformers``
    model's ``config.use_cache`` is set False, as in training): ``token_budget`` (None if nothing
    fits), ``next_budget`` (measured not to fit), ``shapes_budget`` (the largest whose shapes fit
    one by one), the per-budget verdicts, every shape's measurement and every replay."""
    if replay_steps is None:
        replay_steps = 0 if device == "cpu" else REPLAY_STEPS
    if limit <= 0 or step < 1 or cutoff < 1 or replay_steps < 0:
        raise ValueError(f"limit, step and cut-off must be positive and replay steps not negative, got {limit}, "
                         f"{step}, {cutoff}, {replay_steps}")
    if max(start or step, step) > max_budget:
        raise ValueError(f"the first budget {max(start or step, step)} is past max_budget {max_budget}")
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False):  # training runs without a KV cache, and a packed row needs it off
        config.use_cache = False  # type: ignore[union-attr]  # (odb_torch.check_packed_attention)
    search = Search(model, limit, budget, cutoff, device, optimizer, max_shapes, measure, replay_steps=replay_steps,
                    seed=seed, replay=replay)
    warm_up(model, search.vocab, device, optimizer)
    by_shape, nxt = find_budget(search, step, start or step, max_budget)
    found, over = settle(search, by_shape, step) if replay_steps else (by_shape, None)
    return {
        "token_budget": found, "next_budget": over or nxt, "shapes_budget": by_shape, "budget": budget,
        "max_length": cutoff, "device": device, "limit_bytes": limit, "baseline_bytes": baseline_bytes(device),
        "optimizer": optimizer, "step": step, "allocator": allocator_setting(device),
        "measure": "peak RSS of a forked child" if device == "cpu" else "torch.cuda.max_memory_allocated",
        "budgets": sorted(search.budgets.values(), key=lambda r: r["token_budget"]),
        "shapes": [{**asdict(m.shape), "tokens": m.shape.tokens, "peak_bytes": m.peak, "error": m.error}
                   for m in search.shapes.values()],
        "replay": _replays(search),
    }


EXPANDABLE = "expandable_segments:True"
"""The CUDA allocator setting a GPU run at tune's budget needs (README "odb tune"): on an H200
capped at 80 GiB, ODB padded at the 23,552 tokens whose 16-shape replay fit ran out of memory at
step 9 with the default allocator, and trained 46 steps within the cap with this one; tune run
under it kept 19,456 packed where its replay under the default allocator fell to 16,384."""


def allocator_setting(device: str) -> str | None:
    """The allocator settings this process runs under (``PYTORCH_ALLOC_CONF``, else the older
    ``PYTORCH_CUDA_ALLOC_CONF``; ``default`` when neither is set); None on CPU."""
    if device == "cpu":
        return None
    return os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or "default"


def allocator_advice(result: dict[str, Any]) -> str | None:
    """The line telling a GPU user to train under :data:`EXPANDABLE` unless tune already ran under it."""
    setting = result.get("allocator")
    if setting is None or EXPANDABLE in setting.replace(" ", ""):
        return None
    return (f"rerun tune and train with PYTORCH_CUDA_ALLOC_CONF={EXPANDABLE}: under the {setting} allocator a "
            "run's changing shapes fragment its cache, a run at a budget whose replay fit ran out of memory, "
            "and the replay may keep less than expandable segments allow (README \"odb tune\")")


def _replays(search: Search) -> dict[str, Any] | None:
    if not search.replay_steps:
        return None
    return {"steps": search.replay_steps, "seed": search.seed,
            "measure": "peak RSS of a forked child" if search.device == "cpu"
            else "torch.cuda.max_memory_reserved, the allocator capped at the limit",
            "budgets": [{"token_budget": r.token_budget, "fits": search.replay_fits(r.token_budget),
                         "peak_bytes": r.peak, "error": r.error, "shapes": [s.label() for s in r.shapes]}
                        for r in sorted(search.replays.values(), key=lambda r: r.token_budget)]}


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.0f}"


def markdown(result: dict[str, Any]) -> str:
    """The per-budget table, the replays and the verdict, for people."""
    lines = [f"| L_max | fits | worst shape | peak MiB (limit {_mib(result['limit_bytes'])}) |", "|---|---|---|---|"]
    lines += [f"| {r['token_budget']} | {'yes' if r['fits'] else 'no'} | {r['worst_shape']} | "
              f"{_mib(r['peak_bytes'])}{' (' + r['error'] + ')' if r['error'] else ''} |" for r in result["budgets"]]
    replay = result.get("replay")
    if replay and replay["budgets"]:
        lines += ["", f"replays ({replay['steps']} admitted shapes back to back, seed {replay['seed']}; "
                  f"{replay['measure']}):"]
        lines += [f"  L_max {r['token_budget']}: {'fits' if r['fits'] else 'does not fit'}, peak "
                  f"{_mib(r['peak_bytes'])} MiB{' (' + r['error'] + ')' if r['error'] else ''}" for r in replay["budgets"]]
    found = result["token_budget"]
    verdict = (f"largest L_max that fits ({result['budget']} budget, cut-off {result['max_length']}): {found}"
               + (f"; {result['next_budget']} does not" if result["next_budget"] else "")
               if found else f"no budget fits: not even L_max={result['next_budget']} "
               f"(lower --max-length, or raise the limit)")
    if result.get("shapes_budget") and result["shapes_budget"] != found:
        verdict += f" (its worst shapes one by one allow {result['shapes_budget']}; the replay does not fit there)"
    advice = allocator_advice(result)
    return "\n".join([*lines, "", verdict, f"measured: {result['measure']} ({result['device']}, optimizer "
                      f"{result['optimizer']}); baseline {_mib(result['baseline_bytes'])} MiB",
                      *([advice] if advice else [])])
