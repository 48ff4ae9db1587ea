"""check_packed_attention accepts exactly the architectures shown here to keep packed sequences
apart: for every model_type of PACKED_MODEL_TYPES a tiny model built from its config gives a
packed row the logits of its sequences run alone (eager and sdpa where transformers offers it,
float32, three rows, sliding windows shorter than the sequences where the architecture has
them); architectures that import transformers' mask builder yet mix the row (they call it
without position_ids, or pick keys or scale queries across the row) are refused, and do mix:
the check that accepted them before this file is the seeded bug."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from odb_core.errors import PackedAttentionError
from odb_torch import check_packed_attention, packed_collate
from odb_torch.padding_free import FLASH_MIXING, PACKED_MODEL_TYPES

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
#: the tiny-config pieces the additions share
_SW = dict(sliding_window=3, layer_types=["sliding_attention", "full_attention"])  # a window shorter than the sequences
_MLA = dict(num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
_DS_MOE = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1)
EXTRA.update({
    "apertus": {}, "arcee": {}, "beam": _SW, "bitnet": {}, "codegen": dict(rotary_dim=4), "cohere2": _SW, "cohere2_moe": _SW,
    "ctrl": {}, "cwm": _SW, "deepseek_v2": {**_MLA, **_DS_MOE},
    "deepseek_v3": {**_MLA, **_DS_MOE, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1},
    "diffllama": {}, "dots1": {**_DS_MOE, **_SW, "first_k_dense_replace": 1, "use_sliding_window": True, "max_window_layers": 1},
    "ernie4_5": {}, "ernie4_5_moe": dict(moe_num_experts=4, moe_k=2, moe_intermediate_size=16, moe_num_shared_experts=1),
    "exaone4": _SW, "exaone_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, **_SW),
    "flex_olmo": {}, "flint": _SW,
    "gemma3n_text": dict(num_hidden_layers=4, num_kv_shared_layers=2, vocab_size_per_layer_input=VOCAB,
                         hidden_size_per_layer_input=8, laurel_rank=4,
                         layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=3,
                         activation_sparsity_pattern=[0.95, 0.95, 0.0, 0.0]),
    "gemma4_text": dict(num_hidden_layers=4, num_kv_shared_layers=2, vocab_size_per_layer_input=VOCAB,
                        hidden_size_per_layer_input=8, layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=3),
    "glm": {}, "glm4": {}, "glm4_moe": {**_DS_MOE, "first_k_dense_replace": 1}, "glm4_moe_lite": {**_MLA, **_DS_MOE},
    "gpt_bigcode": {}, "gpt_neox_japanese": {}, "gptj": dict(rotary_dim=4), "granite_swa": _SW,
    "granitemoe": dict(num_local_experts=4, num_experts_per_tok=2), "granitemoe_swa": _SW,
    "granitemoeshared": dict(num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=16),
    "helium": {}, "hunyuan_v1_dense": {}, "hunyuan_v1_moe": dict(num_experts=4, moe_topk=2),
    "hy_v3": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16), "hyperclovax": {}, "internlm3": {},
    "iquestcoder": {}, "jais2": {}, "jetmoe": dict(num_local_experts=4, num_experts_per_tok=2),
    "kolibri1": dict(num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
                     sliding_window=3),
    "laguna": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16, **_SW),
    "longcat_flash": {**_MLA, "n_routed_experts": 4, "moe_topk": 2, "zero_expert_num": 2, "expert_ffn_hidden_size": 16},
    "mellum": dict(num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, **_SW),
    "mimo_v2_flash": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, sliding_window=3),
    "minicpm3": {**_MLA, "dim_model_base": 32}, "minimax_m2": dict(num_local_experts=4, num_experts_per_tok=2),
    "ministral": _SW, "ministral3": _SW,
    "modernbert-decoder": _SW, "nanochat": {}, "nemotron": {}, "olmo3": _SW, "olmoe": dict(num_experts=4, num_experts_per_tok=2),
    "persimmon": {}, "phimoe": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=3), "seed_oss": {},
    "smollm3": dict(use_sliding_window=True, **_SW),
    "solar_open": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
    "vaultgemma": _SW, "youtu": _MLA,
})
#: import create_causal_mask, call it without position_ids: packed rows mix
MIXING = {"opt": dict(ffn_dim=32, word_embed_proj_dim=32), "biogpt": {},
          "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2),
          "afmoe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)}
#: pass position_ids to the mask builder, yet still mix the row: a sparse-attention indexer that picks keys across
#: it (DSA), a key top-k over the row (Doge's dynamic mask, rows longer than keep_window_size), a NoPE-layer query
#: scale from the row index instead of position_ids (Llama 4 attn_temperature_tuning, offsets past floor_scale)
MIXING.update({
    "deepseek_v32": {**_MLA, **_DS_MOE, "n_group": 1, "topk_group": 1, "index_topk": 3, "index_head_dim": 8, "index_n_heads": 2},
    "glm_moe_dsa": {**_MLA, **_DS_MOE, "index_topk": 3, "index_head_dim": 8, "index_n_heads": 2},
    "doge": dict(keep_window_size=3),
    "llama4_text": dict(num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=32, no_rope_layers=[1, 0],
                        floor_scale=1, attn_scale=20.0),
})
#: sdpa is not offered for these (transformers refuses to build them with it)
EAGER_ONLY = {"gemma2", "codegen", "flint", "gpt_neox_japanese", "gptj", "granite_swa", "granitemoe_swa", "mimo_v2_flash",
              "vaultgemma"}


def build(model_type: str, impl: str, extra: dict[str, Any]) -> torch.nn.Module:
    """A tiny float32 model of ``model_type`` from its config, eval, no cache."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = transformers.AutoConfig.for_model(model_type, **{**BASE, **extra})  # EXTRA may override BASE
        config.use_cache = False
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=impl).float().eval()


def packed_gap(model: torch.nn.Module) -> float:
    """The largest difference between a packed row's logits and its sequences' logits alone, over
    three rows (one with a one-token sequence first, one with it in the middle)."""
    gen = torch.Generator().manual_seed(3)
    gaps = []
    for lengths in ((7, 5, 9), (1, 7, 5), (6, 1, 8)):
        group = [{"input_ids": torch.randint(3, VOCAB, (n,), generator=gen)} for n in lengths]
        batch = packed_collate(group)
        with torch.no_grad():
            packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[0]
            alone = torch.cat([model(input_ids=s["input_ids"][None]).logits[0] for s in group])
        gaps.append(float((packed - alone).abs().max()))
    return max(gaps)


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


_SEEN: dict[str, int] = {}


def _probe_attention(module, query, key, value, attention_mask, **kwargs):
    """The module's own eager attention, counting the calls that carry a packed row's
    boundaries (what a flash kernel reads)."""
    import sys

    _SEEN["calls"] = _SEEN.get("calls", 0) + 1
    found = kwargs.get("cu_seq_lens_q") is not None or kwargs.get("position_ids") is not None
    _SEEN["bounded"] = _SEEN.get("bounded", 0) + int(found)
    eager = sys.modules[type(module).__module__].eager_attention_forward
    return eager(module, query, key, value, attention_mask, **kwargs)


def _offers_flash(model_type: str) -> bool:
    config = transformers.AutoConfig.for_model(model_type, **{**BASE, **EXTRA[model_type]})
    cls = transformers.MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    return bool(getattr(cls, "_supports_flash_attn", False) or getattr(cls, "_supports_flash_attn_2", False))


@pytest.mark.parametrize("model_type", sorted(PACKED_MODEL_TYPES))
def test_flash_is_accepted_only_where_the_row_boundaries_reach_the_attention_function(model_type):
    """Flash kernels keep packed sequences apart only when the model hands them the row's
    boundaries (``position_ids`` or ``cu_seq_lens_*``). Probed on CPU through transformers'
    attention registry: every attention call of an accepted architecture that offers flash
    carries them, except FLASH_MIXING's (GPT-J's own flash class never calls the registered
    function, and passes neither: accepted under flash before, its packed rows mixed)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    if not _offers_flash(model_type):
        return
    AttentionInterface.register("odb_probe", _probe_attention)
    AttentionMaskInterface.register("odb_probe", eager_mask)
    model = build(model_type, "eager", EXTRA[model_type])
    for module in model.modules():
        if hasattr(getattr(module, "config", None), "_attn_implementation"):
            module.config._attn_implementation = "odb_probe"
    batch = packed_collate([{"input_ids": torch.arange(3, 3 + n)} for n in (7, 5, 9)])
    _SEEN.clear()
    with torch.no_grad():
        model(**{k: v for k, v in batch.items() if k != "labels"})
    reaches = _SEEN.get("calls", 0) > 0 and _SEEN["bounded"] == _SEEN["calls"]
    assert reaches != (model_type in FLASH_MIXING), (model_type, _SEEN)
    model.config._attn_implementation = "flash_attention_2"
    if model_type in FLASH_MIXING:
        with pytest.raises(PackedAttentionError, match="passes neither position_ids nor cu_seq_lens"):
            check_packed_attention(model)
    else:
        assert check_packed_attention(model) == "flash_attention_2"
