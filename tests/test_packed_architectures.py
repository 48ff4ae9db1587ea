"""check_packed_attention accepts exactly the architectures shown here to keep packed sequences
apart: for every model_type of PACKED_MODEL_TYPES a tiny model built from its config gives a
packed row the logits of its sequences run alone (eager and sdpa, float32); architectures that
import transformers' mask builder yet mix the row (they call it without position_ids) are
refused, and do mix: the check that accepted them before this file is the seeded bug."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from odb_core.errors import PackedAttentionError
from odb_torch import check_packed_attention, packed_collate
from odb_torch.padding_free import PACKED_MODEL_TYPES

transformers = pytest.importorskip("transformers")

VOCAB = 97
BASE = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
            intermediate_size=32, head_dim=8, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
            eos_token_id=2)
#: what each architecture's tiny config needs beyond BASE
EXTRA: dict[str, dict[str, Any]] = {
    "cohere": {}, "gemma": {}, "gemma2": dict(sliding_window=4, query_pre_attn_scalar=8), "gemma3_text": {},
    "gpt2": dict(n_embd=32, n_head=4, n_layer=2, n_positions=64), "gpt_neox": {}, "granite": {}, "llama": {},
    "mistral": dict(sliding_window=4), "mixtral": dict(num_local_experts=4, num_experts_per_tok=2), "olmo": {},
    "olmo2": {}, "phi": {}, "phi3": {}, "qwen2": {},
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16),
    "qwen3": {}, "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16), "stablelm": {},
    "starcoder2": {},
}
#: import create_causal_mask, call it without position_ids: packed rows mix
MIXING = {"opt": dict(ffn_dim=32, word_embed_proj_dim=32), "biogpt": {}}
#: sdpa is not offered for these (transformers refuses to build them with it)
EAGER_ONLY = {"gemma2"}


def build(model_type: str, impl: str, extra: dict[str, Any]) -> torch.nn.Module:
    """A tiny float32 model of ``model_type`` from its config, eval, no cache."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = transformers.AutoConfig.for_model(model_type, **BASE, **extra)
        config.use_cache = False
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=impl).float().eval()


def packed_gap(model: torch.nn.Module) -> float:
    """The largest difference between a packed row's logits and its sequences' logits alone."""
    gen = torch.Generator().manual_seed(3)
    group = [{"input_ids": torch.randint(3, VOCAB, (n,), generator=gen)} for n in (7, 5, 9)]
    batch = packed_collate(group)
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[0]
        alone = torch.cat([model(input_ids=s["input_ids"][None]).logits[0] for s in group])
    return float((packed - alone).abs().max())


def test_every_accepted_architecture_has_a_tiny_config_here():
    assert set(EXTRA) == PACKED_MODEL_TYPES


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("model_type", sorted(PACKED_MODEL_TYPES))
def test_an_accepted_architecture_keeps_packed_sequences_apart(model_type, impl):
    if impl == "sdpa" and model_type in EAGER_ONLY:
        with pytest.raises(ValueError):
            build(model_type, impl, EXTRA[model_type])
        return
    model = build(model_type, impl, EXTRA[model_type])
    assert check_packed_attention(model) == impl
    assert packed_gap(model) < 1e-5, model_type


@pytest.mark.parametrize("impl", ["eager", "sdpa", "flash_attention_2"])
@pytest.mark.parametrize("model_type", sorted(MIXING))
def test_an_architecture_that_mixes_packed_sequences_is_refused(model_type, impl):
    model = build(model_type, "eager", MIXING[model_type])
    assert packed_gap(model) > 1e-2  # it mixes: the refusal is needed
    model.config._attn_implementation = impl  # flash too: not shown for this architecture's code
    with pytest.raises(PackedAttentionError, match=f"model_type '{model_type}'.*not an architecture") as err:
        check_packed_attention(model)
    assert (err.value.model_class, err.value.attn_implementation) == (type(model).__name__, impl)
