"""``odb tune``: the largest token budget L_max whose worst admitted shapes fit a memory limit.

Budgets are multiples of ``step``. From ``start`` the budget doubles until one does not fit
(or passes ``max_budget``), then bisection between the last that fits and the first that
does not ends with two measured neighbours: the reported budget fits, budget + step does not.
A budget fits when every shape :func:`~odb_tools.tune.shapes.worst_shapes` gives it peaks at
most ``limit`` bytes; shapes are measured likely-worst first, a budget stops at its first
that does not fit, and a shape is measured once per run (the lone sample at the cut-off recurs).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from torch import nn

from odb_tools.tune.measure import Measurement, baseline_bytes, measure_cpu, measure_cuda, warm_up
from odb_tools.tune.shapes import Shape, worst_shapes

Measure = Callable[[nn.Module, Shape, int, str], Measurement]
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """``"24GiB"``, ``"1.5G"``, ``"800MB"``, ``"123456"`` -> bytes (decimal units, binary with i)."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"memory size {text!r}: expected a number with an optional unit (B, KB, MB, GB, KiB, MiB, GiB)")
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
                 max_shapes: int | None, measure: Measure | None = None) -> None:
        self.model, self.limit, self.budget, self.cutoff = model, limit, budget, cutoff
        self.device, self.optimizer, self.max_shapes = device, optimizer, max_shapes
        self.vocab = vocab_of(model)
        self.measure = measure or (measure_cpu if device == "cpu" else measure_cuda)
        self.shapes: dict[Shape, Measurement] = {}
        self.budgets: dict[int, dict[str, Any]] = {}

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


def tune(model: nn.Module, limit: int, cutoff: int, budget: str = "padded", device: str = "cpu", step: int = 128,
         start: int | None = None, max_budget: int = 1 << 20, optimizer: str = "adamw", max_shapes: int | None = 8,
         measure: Measure | None = None) -> dict[str, Any]:
    """The largest L_max (a multiple of ``step``) whose worst shapes fit ``limit`` bytes, as a JSON-ready dict
    (a ``transformers`` model's ``config.use_cache`` is set False, as in training):
    ``token_budget`` (None if not even ``start`` fits), ``next_budget`` (measured not to fit), the
    per-budget verdicts and every shape's measurement."""
    if limit <= 0 or step < 1 or cutoff < 1:
        raise ValueError(f"limit, step and cut-off must be positive, got {limit}, {step}, {cutoff}")
    if max(start or step, step) > max_budget:
        raise ValueError(f"the first budget {max(start or step, step)} is past max_budget {max_budget}")
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False):  # training runs without a KV cache, and a packed row needs it off
        config.use_cache = False  # type: ignore[union-attr]  # (odb_torch.check_packed_attention)
    search = Search(model, limit, budget, cutoff, device, optimizer, max_shapes, measure)
    warm_up(model, search.vocab, device, optimizer)
    found, nxt = find_budget(search, step, start or step, max_budget)
    return {
        "token_budget": found, "next_budget": nxt, "budget": budget, "max_length": cutoff, "device": device,
        "limit_bytes": limit, "baseline_bytes": baseline_bytes(device), "optimizer": optimizer, "step": step,
        "measure": "peak RSS of a forked child" if device == "cpu" else "torch.cuda.max_memory_allocated",
        "budgets": sorted(search.budgets.values(), key=lambda r: r["token_budget"]),
        "shapes": [{**asdict(m.shape), "tokens": m.shape.tokens, "peak_bytes": m.peak, "error": m.error}
                   for m in search.shapes.values()],
    }


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.0f}"


def markdown(result: dict[str, Any]) -> str:
    """The per-budget table and the verdict, for people."""
    lines = [f"| L_max | fits | worst shape | peak MiB (limit {_mib(result['limit_bytes'])}) |", "|---|---|---|---|"]
    lines += [f"| {r['token_budget']} | {'yes' if r['fits'] else 'no'} | {r['worst_shape']} | "
              f"{_mib(r['peak_bytes'])}{' (' + r['error'] + ')' if r['error'] else ''} |" for r in result["budgets"]]
    found = result["token_budget"]
    verdict = (f"largest L_max that fits ({result['budget']} budget, cut-off {result['max_length']}): {found}"
               + (f"; {result['next_budget']} does not" if result["next_budget"] else "")
               if found else f"no budget fits: not even L_max={result['next_budget']} "
               f"(lower --max-length, or raise the limit)")
    return "\n".join([*lines, "", verdict, f"measured: {result['measure']} ({result['device']}, optimizer "
                      f"{result['optimizer']}); baseline {_mib(result['baseline_bytes'])} MiB"])
