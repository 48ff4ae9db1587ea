"""Packing changes nothing but speed: a packed row (``packed_collate``) through a tiny Llama-
and Qwen2-style ``transformers`` model, float64, eval mode, gives the same per-token losses
and the same parameter gradients as the same sequences run one by one (P7), for every
attention implementation ``check_packed_attention`` accepts on CPU (eager, sdpa).
``flex_attention`` has neither float64 nor backward on CPU: on a GPU machine the same
comparison runs in float32 for ``flex_attention`` and ``sdpa`` on CUDA (skipped elsewhere).

Seeded bugs the same comparison catches: position ids that do not restart, a 2D attention
mask (transformers then stops separating the sequences), a cache (``use_cache=True``) and
labels that cross a boundary."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from odb_torch.losses import shifted_loss_tokens  # noqa: E402
from odb_torch.padding_free import packed_collate  # noqa: E402

LENGTHS = (7, 3, 11, 1, 6)
VOCAB = 61

#: sdpa is exact to float64 rounding; eager's softmax runs in float32 in transformers' code
#: (both for the packed row and for the sequences alone), so its differences are float32's
TOLERANCE = {"sdpa": 1e-12, "eager": 1e-6}
#: a seeded bug must move the losses by far more than any tolerance
BUG_EFFECT = 1e-3


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny float64 matmuls: one intra-op thread (80x faster than two spinning threads on a
    busy 2-core machine); the previous count is restored."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_model(family: str, impl: str, device: str = "cpu", dtype: torch.dtype = torch.float64,
               hidden: int = 16) -> torch.nn.Module:
    """A 2-layer model of ``family`` ("llama" or "qwen2") built from a config, ``dtype`` (float64),
    eval, no cache, on ``device``."""
    kw = dict(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, use_cache=False, attn_implementation=impl)
    if family == "llama":
        config = transformers.LlamaConfig(**kw)
        cls = transformers.LlamaForCausalLM
    else:
        config = transformers.Qwen2Config(**kw)
        cls = transformers.Qwen2ForCausalLM
    torch.manual_seed(0)
    return cls(config).to(device=device, dtype=dtype).eval()


def samples() -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for n in LENGTHS:
        ids = torch.randint(0, VOCAB, (n,), generator=gen)
        labels = ids.clone()
        labels[: n // 3] = -100  # a prompt that does not count
        out.append({"input_ids": ids, "labels": labels})
    return out


def token_losses(model: torch.nn.Module, batch: dict, **forward: object) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token next-token losses (0 where the label is -100) of ``batch`` and the gradient of their sum."""
    model.zero_grad()
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs, **forward).logits[0]
    losses = F.cross_entropy(logits[:-1], batch["labels"][0, 1:], ignore_index=-100, reduction="none")
    losses.sum().backward()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    return losses.detach(), grads


def one_by_one(model: torch.nn.Module, group: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """The same per-token losses, each sequence alone, laid out as in the packed row (0 at boundaries)."""
    parts, grads = [], None
    for k, s in enumerate(group):
        losses, g = token_losses(model, {"input_ids": s["input_ids"][None], "labels": s["labels"][None]})
        parts.append(([torch.zeros(1, dtype=losses.dtype, device=losses.device)] if k else []) + [losses])
        grads = g if grads is None else grads + g
    assert grads is not None
    return torch.cat([t for p in parts for t in p]), grads


def packed_vs_alone(family: str, impl: str, batch: dict | None = None, device: str = "cpu",
                    dtype: torch.dtype = torch.float64, hidden: int = 16, **forward: object) -> tuple[float, float]:
    """Largest loss and gradient differences between the packed row and the sequences alone."""
    model = tiny_model(family, impl, device, dtype, hidden)
    group = [{k: v.to(device) for k, v in s.items()} for s in samples()]
    batch = batch if batch is not None else packed_collate(group)
    batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    packed, packed_grad = token_losses(model, batch, **forward)
    alone, alone_grad = one_by_one(model, group)
    return float((packed - alone).abs().max()), float((packed_grad - alone_grad).abs().max())


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_a_packed_row_gives_the_losses_and_gradients_of_its_sequences_alone(family, impl):
    loss_diff, grad_diff = packed_vs_alone(family, impl)
    assert loss_diff <= TOLERANCE[impl] and grad_diff <= TOLERANCE[impl], (loss_diff, grad_diff)


#: float32 on a GPU: TF32 off, so the differences are float32 rounding over a 2-layer model
GPU_TOLERANCE = 1e-4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: flex_attention has no backward on CPU "
                    "(runs on a GPU machine)")
@pytest.mark.parametrize("impl", ["flex_attention", "sdpa"])
def test_on_a_gpu_a_packed_row_gives_the_losses_and_gradients_of_its_sequences_alone(impl):
    tf32, torch.backends.cuda.matmul.allow_tf32 = torch.backends.cuda.matmul.allow_tf32, False
    try:
        exact = packed_vs_alone("qwen2", impl, device="cuda", dtype=torch.float32, hidden=64)  # head_dim 16 for flex
        batch = packed_collate(samples())
        batch["position_ids"] = torch.arange(batch["input_ids"].shape[1])[None]  # seeded bug: no restart
        bug = packed_vs_alone("qwen2", impl, batch, device="cuda", dtype=torch.float32, hidden=64)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    print(impl, "packed vs alone (loss, grad):", exact, "seeded bug:", bug)
    assert max(exact) <= GPU_TOLERANCE and bug[0] > BUG_EFFECT, (exact, bug)


def test_the_packed_row_counts_each_samples_shifted_loss_tokens():
    """P7: the loss over the row sums exactly the tokens ``shifted_loss_tokens`` measured per sample."""
    group = samples()
    batch = packed_collate(group)
    assert int((batch["labels"][0, 1:] != -100).sum()) == sum(shifted_loss_tokens(s) for s in group)


def test_seeded_bug_position_ids_that_do_not_restart_change_the_losses():
    batch = packed_collate(samples())
    batch["position_ids"] = torch.arange(batch["input_ids"].shape[1])[None]
    loss_diff, _ = packed_vs_alone("llama", "sdpa", batch)
    assert loss_diff > BUG_EFFECT


@pytest.mark.parametrize("bug", ["attention_mask", "use_cache"])
def test_seeded_bug_a_mask_or_a_cache_lets_the_sequences_attend_to_each_other(bug):
    batch = packed_collate(samples())
    forward: dict[str, object] = {"use_cache": True}
    if bug == "attention_mask":
        batch["attention_mask"] = torch.ones_like(batch["input_ids"])
        forward = {}
    loss_diff, _ = packed_vs_alone("qwen2", "sdpa", batch, **forward)
    assert loss_diff > BUG_EFFECT


def test_seeded_bug_labels_that_cross_a_boundary_are_counted():
    """Without the -100 at each sample's first label, the last token of a sample would be
    trained to predict the next sample's first token."""
    group = samples()
    batch = packed_collate(group)
    batch["labels"] = torch.cat([s["labels"] for s in group])[None]
    assert int((batch["labels"][0, 1:] != -100).sum()) != sum(shifted_loss_tokens(s) for s in group)
