"""A small synthetic token dataset for the adapter guides and their tests (no download).

Lengths are heavy-tailed like chat data (many short samples, a few long ones), and
deterministic in the index, so every rank and every run sees the same samples.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import Dataset


class TokenDataset(Dataset):  # type: ignore[type-arg]
    """``n`` samples ``{"input_ids", "labels", "idx"}``; the first quarter of each is prompt (labels -100)."""

    def __init__(self, n: int = 96, vocab_size: int = 128, max_length: int = 192, long_every: int = 7) -> None:
        self.n, self.vocab_size, self.max_length, self.long_every = n, vocab_size, max_length, long_every

    def __len__(self) -> int:
        return self.n

    def length(self, i: int) -> int:
        """Length of sample ``i``: mostly 4-40 tokens, every ``long_every``-th 40 to ``max_length``."""
        if i % self.long_every == 0:
            return min(self.max_length, 40 + (i * 37) % self.max_length)
        return 4 + (i * 13) % 37

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not 0 <= i < self.n:
            raise IndexError(f"index {i} out of range for TokenDataset of {self.n} samples")
        n = self.length(i)
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(1, self.vocab_size, (n,), generator=g)
        labels = ids.clone()
        labels[: n // 4] = -100
        return {"input_ids": ids, "labels": labels, "idx": i}
