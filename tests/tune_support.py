"""A tiny causal LM for ``odb tune``'s tests (``--model tune_support:tiny_lm``): its vocabulary
(4096) dwarfs its width (32), so its step's memory grows with the tokens of a batch (logits),
not with their length alone: the worst padded shape is the one with the most tokens."""

from __future__ import annotations

from typing import Any

from torch import nn

from odb_tools.demo.model import ModelConfig, TinyCausalLM


def tiny_lm(vocab_size: int = 4096) -> nn.Module:
    return TinyCausalLM(ModelConfig(vocab_size=vocab_size, max_length=4096, d_model=32, n_layers=1, n_heads=2))


def broken_factory() -> nn.Module:
    """A model factory with a bug of its own (a TypeError inside its body)."""
    import torch

    return torch.nn.Linear(4, "2")  # type: ignore[arg-type]


class MismatchedMatmul(nn.Module):
    """A model whose forward multiplies a [.., 4] embedding by a [5, 3] weight: every step fails
    with a shape error, never for memory."""

    def __init__(self) -> None:
        super().__init__()
        import torch

        self.embed = nn.Embedding(16, 4)
        self.weight = nn.Parameter(torch.zeros(5, 3))

    def forward(self, input_ids: Any, labels: Any = None, attention_mask: Any = None) -> Any:
        return (self.embed(input_ids) @ self.weight).sum()


def mismatched_matmul() -> nn.Module:
    return MismatchedMatmul()
