"""The worst batch shapes a token budget admits (P3), and the tensors of each.

Under either budget a sample longer than L_max travels alone, so ``[1, C]`` (one sample
at the cut-off length C) is always admitted. Beyond it:

* ``padded`` (max_len x size <= L_max): the B(l) groups ``[B(l), l]``, B(l) = max(floor(L_max/l), 1),
  l <= C. For each batch size b only the longest l with B(l) = b matters (memory grows with
  both dimensions), so the candidates are the frontier l in {floor(L_max/b)} capped at C:
  about 2 sqrt(L_max) shapes. Which is worst depends on the model (attention grows with l,
  logits and activations with b x l, which is L_max only when l divides it): the few that
  could be worst are measured (:func:`worst_shapes`).
* ``packed`` (sum of lengths <= L_max): one row ``[1, L_max]`` of sequences of C tokens,
  ``position_ids`` restarting at each (the last one shorter).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from odb_core.config import BUDGETS
from odb_torch.padding_free import packed_collate


@dataclass(frozen=True, order=True)
class Shape:
    """``batch`` rows of ``length`` tokens; ``kind`` is ``single``, ``padded`` or ``packed``."""

    kind: str
    batch: int
    length: int
    cutoff: int

    @property
    def tokens(self) -> int:
        return self.batch * self.length

    def label(self) -> str:
        return f"{self.kind} [{self.batch}, {self.length}]"

    def tensors(self, vocab_size: int, device: str | torch.device = "cpu") -> dict[str, Any]:
        """Inputs of this shape: every token a loss token. A padded group of >= 2 rows carries an
        ``attention_mask`` with one padding position (as a real padded batch does); a packed row
        is :func:`~odb_torch.packed_collate`'s row of sequences of ``cutoff`` tokens (the last
        shorter): ``position_ids`` restarting at each, the varlen keywords, no mask, and each
        sequence's first label -100."""
        g = torch.Generator().manual_seed(self.tokens)
        ids = torch.randint(2, max(vocab_size, 3), (self.batch, self.length), generator=g)
        if self.kind == "packed":
            parts = torch.split(ids[0], max(self.cutoff, 1))
            row = packed_collate([{"input_ids": part} for part in parts])
            return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in row.items()}
        ids = ids.to(device)
        batch: dict[str, Any] = {"input_ids": ids, "labels": ids.clone()}
        if self.kind == "padded" and self.batch >= 2:
            mask = torch.ones_like(ids)
            mask[-1, -1] = 0
            batch["labels"][-1, -1] = -100
            batch["attention_mask"] = mask
        return batch


def padded_frontier(token_budget: int, cutoff: int) -> list[Shape]:
    """Every frontier ``[B(l), l]`` of the padded budget with l <= ``cutoff``, longest l first."""
    lengths = set()
    b = 1
    while b <= token_budget:
        q = token_budget // b
        lengths.add(min(q, cutoff))
        b = token_budget // q + 1
    return [Shape("padded", max(token_budget // ln, 1), ln, cutoff) for ln in sorted(lengths, reverse=True)]


def worst_shapes(budget: str, token_budget: int, cutoff: int, max_shapes: int | None = 8) -> list[Shape]:
    """The shapes to measure for ``token_budget``, likely worst first: the lone sample at the
    cut-off when it exceeds L_max; then the packed row, or of the padded frontier (all of it
    when ``max_shapes`` is None) the vertices of its upper convex hull in (tokens, tokens x
    length) from the most tokens x length to the most tokens, then its most rows ([L_max, 1]).
    A memory of the form a x tokens + b x tokens x length + c (a, b >= 0: activations and
    logits, attention scores) peaks on a hull vertex; a cost per row, on the last shape. Past
    ``max_shapes`` the hull's two ends and vertices evenly spaced between them are kept: the
    worst is then approximated (:func:`_hull`)."""
    if budget not in BUDGETS:
        raise ValueError(f"unknown budget {budget!r} (one of {', '.join(BUDGETS)})")
    if token_budget < 1 or cutoff < 1:
        raise ValueError(f"token budget and cut-off must be >= 1, got {token_budget}, {cutoff}")
    out = [Shape("single", 1, cutoff, cutoff)] if cutoff > token_budget else []
    if budget == "packed":
        return [*out, Shape("packed", 1, token_budget, cutoff)]
    frontier = padded_frontier(token_budget, cutoff)
    if max_shapes is None:
        return out + frontier
    kept = _hull(frontier)
    room = max(max_shapes - 1, 1)
    if len(kept) > room:
        last = len(kept) - 1
        kept = [kept[round(k * last / (room - 1))] for k in range(room)] if room > 1 else kept[:1]
    rows = [frontier[-1]] if frontier[-1] not in kept else []
    return out + kept + rows


def _hull(frontier: list[Shape]) -> list[Shape]:
    """The upper convex hull of ``frontier`` in (tokens, tokens x length), from its most tokens x
    length to its most tokens: the shapes on which some a x tokens + b x tokens x length (a, b >= 0)
    is largest."""
    def point(s: Shape) -> tuple[int, int]:
        return s.tokens, s.tokens * s.length

    up: list[Shape] = []
    for shape in sorted(frontier, key=point):
        while len(up) >= 2:
            (x1, y1), (x2, y2), (x3, y3) = point(up[-2]), point(up[-1]), point(shape)
            if (x2 - x1) * (y3 - y1) - (y2 - y1) * (x3 - x1) < 0:
                break
            up.pop()
        up.append(shape)
    top = max(range(len(up)), key=lambda k: (point(up[k])[1], point(up[k])[0]))
    return up[top:]
