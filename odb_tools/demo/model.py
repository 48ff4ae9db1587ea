"""A small causal transformer built from a config (no weights are downloaded).

It takes padded batches ``[b, t]`` and padding-free packed rows ``[1, total]`` (the packed
collate's format: ``position_ids`` restarting at 0 per sequence, ``cu_seq_lens_q``). Packed,
attention runs sequence by sequence (split at ``cu_seq_lens_q``), so no token attends
across a sequence boundary and its cost grows with the sum of squared sequence lengths,
not with the square of the packed row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ModelConfig:
    """Sizes of :class:`TinyCausalLM`."""

    vocab_size: int = 4096
    max_length: int = 1024
    d_model: int = 96
    n_layers: int = 2
    n_heads: int = 4
    seed: int = 0


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: list[int] | None) -> torch.Tensor:
    """Causal attention over ``[b, heads, t, dh]``; with ``bounds`` (``cu_seq_lens_q`` as a list,
    ``b == 1``) each sequence ``bounds[i]:bounds[i+1]`` attends only within itself, one
    attention call per sequence (cost: the sum of squared sequence lengths)."""
    if bounds is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    parts = [F.scaled_dot_product_attention(q[:, :, a:z], k[:, :, a:z], v[:, :, a:z], is_causal=True)
             for a, z in zip(bounds, bounds[1:], strict=False) if z > a]
    return torch.cat(parts, dim=2)


class _Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor, bounds: list[int] | None = None) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = causal_attention(q, k, v, bounds).transpose(1, 2).reshape(b, t, d)
        x = x + self.out(attn)
        out: torch.Tensor = x + self.mlp(self.norm2(x))
        return out


class TinyCausalLM(nn.Module):
    """Token + position embeddings, pre-norm blocks, a tied output head.

    Right padding needs no attention mask under the causal mask: a real token never
    attends to the padding after it, and padded positions carry label -100.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        torch.manual_seed(config.seed)
        self.config = config
        self.tok = nn.Embedding(config.vocab_size, config.d_model)
        self.pos = nn.Embedding(config.max_length, config.d_model)
        self.blocks = nn.ModuleList(_Block(config.d_model, config.n_heads) for _ in range(config.n_layers))
        self.norm = nn.LayerNorm(config.d_model)
        for module in self.modules():  # GPT-2 style: small initial logits under the tied head
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor | None = None,
                cu_seq_lens_q: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
        """(sum of next-token cross-entropy over loss tokens, number of loss tokens).

        Packed (``cu_seq_lens_q`` given, ``input_ids`` ``[1, total]``): positions are
        ``position_ids`` (restarting at 0 per sequence) and attention stays within each
        sequence; the packed labels carry -100 at every sequence's first token, so no
        sequence's last token is trained to predict the next sequence's first."""
        t = input_ids.shape[1]
        if (position_ids is None) != (cu_seq_lens_q is None):
            raise ValueError("a packed batch needs both position_ids and cu_seq_lens_q")
        bounds = None if cu_seq_lens_q is None else [int(x) for x in cu_seq_lens_q.tolist()]
        if bounds is not None and (input_ids.shape[0] != 1 or bounds[0] != 0 or bounds[-1] != t):
            raise ValueError(f"cu_seq_lens_q {bounds[:3]}...{bounds[-1:]} does not cover the packed row of {t} tokens")
        positions = torch.arange(t) if position_ids is None else position_ids
        h = self.tok(input_ids) + self.pos(positions)
        for block in self.blocks:
            h = block(h, bounds)
        logits = self.norm(h)[:, :-1] @ self.tok.weight.T
        targets = labels[:, 1:]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                               ignore_index=-100, reduction="sum")
        return loss, int((targets != -100).sum())
