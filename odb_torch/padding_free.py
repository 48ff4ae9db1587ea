"""A padding-free ``collate_fn`` for the packed budget, and the check that a model keeps
packed sequences apart (``docs/packing.md``).

``packed_collate`` concatenates a group into one row, the format Hugging Face models take
padding-free (as ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` builds it):
``position_ids`` restart at 0 per sequence and the varlen keywords carry the boundaries.
Whether the model honours them depends on its attention implementation:
:func:`check_packed_attention` refuses a combination that would not.
"""

from __future__ import annotations

import functools
import sys
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from odb_core.errors import InvalidSampleError, PackedAttentionCostWarning, PackedAttentionError, UnsupportedSettingError
from odb_torch.collate import check_fields, collate_field, holds_counts

IGNORE_INDEX = -100

#: the batch keys the collate returns (the demo and the adapters rely on them)
PACKED_KEYS = ("input_ids", "labels", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")

#: sample fields the row replaces (every other field is default-collated, unless it has one entry per token)
ROW_KEYS = ("input_ids", "labels", "attention_mask", "position_ids")
_ROW_FIELDS = frozenset(ROW_KEYS)

#: the varlen keywords flash-attention kernels take (``transformers``' ``FlashAttentionKwargs``)
VARLEN_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")

#: implementations that read the boundaries from ``cu_seq_lens_*`` or ``position_ids`` themselves
FLASH_IMPLEMENTATIONS = frozenset({"flash_attention_2", "flash_attention_3", "flash_attention_4"})

#: accepted architectures whose own flash-attention code passes neither ``position_ids`` nor
#: ``cu_seq_lens_*`` to the kernel (GPT-J's ``GPTJFlashAttention2``): one causal pass over the
#: whole packed row; flash is refused for them (``tests/test_packed_architectures.py`` probes
#: every accepted architecture's attention calls)
FLASH_MIXING = frozenset({"gptj"})

#: implementations whose mask ``transformers.masking_utils.create_causal_mask`` builds per
#: sequence from restarting ``position_ids`` (only without a 2D attention mask and without a cache)
MASKED_IMPLEMENTATIONS = frozenset({"eager", "sdpa", "flex_attention"})

#: ``config.model_type`` of the architectures whose packed logits equal their sequences' alone
#: (eager and sdpa, tiny configs, ``tests/test_packed_architectures.py``). Importing
#: ``create_causal_mask`` is not enough: OPT, BioGPT, gpt_oss, afmoe, Falcon, MPT and Bloom call
#: it without ``position_ids``; DeepSeek-V3.2's and GLM-DSA's sparse indexers pick keys across the
#: row, Llama 4's NoPE layers scale queries by the row's index, Doge keeps the row's top keys;
#: hybrid models (Bamba, Jamba, LFM2, Qwen3-Next) run recurrent or convolution layers across
#: the whole row; all of those mix packed sequences.
PACKED_MODEL_TYPES = frozenset({
    "apertus", "arcee", "beam", "bitnet", "codegen", "cohere", "cohere2", "cohere2_moe", "ctrl", "cwm", "deepseek_v2",
    "deepseek_v3", "diffllama", "dots1", "ernie4_5", "ernie4_5_moe", "exaone4", "exaone_moe", "flex_olmo", "flint",
    "gemma", "gemma2", "gemma3_text", "gemma3n_text", "gemma4_text", "glm", "glm4", "glm4_moe", "glm4_moe_lite",
    "gpt2", "gpt_bigcode", "gpt_neox", "gpt_neox_japanese", "gptj", "granite", "granite_swa", "granitemoe",
    "granitemoe_swa", "granitemoeshared", "helium", "hunyuan_v1_dense", "hunyuan_v1_moe", "hy_v3", "hyperclovax",
    "internlm3", "iquestcoder", "jais2", "jetmoe", "kolibri1", "laguna", "llama", "longcat_flash", "mellum",
    "mimo_v2_flash", "minicpm3", "minimax_m2", "ministral", "ministral3", "mistral", "mixtral", "modernbert-decoder",
    "nanochat", "nemotron", "olmo", "olmo2", "olmo3", "olmoe", "persimmon", "phi", "phi3", "phimoe", "qwen2",
    "qwen2_moe", "qwen3", "qwen3_moe", "seed_oss", "smollm3", "solar_open", "stablelm", "starcoder2", "vaultgemma",
    "youtu",
})


def packed_collate(samples: Sequence[Mapping[str, Any]], label_pad_id: int = IGNORE_INDEX) -> dict[str, Any]:
    """One padding-free row from ``samples`` (each with ``input_ids``, optional ``labels``).

    Returns ``input_ids`` and ``labels`` (int64, ``[1, total]``; a sample without labels is
    labelled by its ``input_ids``), ``position_ids`` (int64, ``[1, total]``, 0.. per sample),
    ``cu_seq_lens_q`` = ``cu_seq_lens_k`` (int32, ``[n + 1]``, the boundaries) and
    ``max_length_q`` = ``max_length_k`` (int, the longest sample). The first label of every
    sample is ``label_pad_id``, so no label crosses a boundary and a causal loss over the
    row counts exactly each sample's shifted labels (``losses.shifted_loss_tokens``, P7).
    No ``attention_mask`` (a 2D mask would stop ``transformers`` from separating the samples;
    an all-ones one the samples carry is left out: the row has no padding). Any other field goes
    through torch's ``default_collate``, as in ``pad_collate``. Labels of another length than a
    sample's ``input_ids``, ``input_ids`` or ``labels`` that are not one row of integers (a
    ``[1, L]`` row, float or bool values: a cast would change them), an ``attention_mask``
    with zeros (a padded sample: the row would train on its padding), fields that differ
    between samples, and a failing ``default_collate`` are
    :class:`~odb_core.errors.InvalidSampleError` naming the sample's place in the group or the
    field (the loader adds the dataset indices: ``CollateFnError``). A field with one entry per token (its
    first dimension each sample's ``input_ids`` length) cannot line up with the row collated per
    sample: :class:`~odb_core.errors.UnsupportedSettingError` names it (``field``).
    """
    if not samples:
        raise InvalidSampleError("packed_collate needs at least one sample")
    for k, sample in enumerate(samples):
        if not isinstance(sample, Mapping) or "input_ids" not in sample:
            raise InvalidSampleError(f"packed_collate: sample {k} of the group is a {type(sample).__name__}"
                                     f"{' without input_ids' if isinstance(sample, Mapping) else ''}, not a "
                                     "mapping with input_ids")
    check_fields(samples, "packed_collate", _ROW_FIELDS)  # the row takes each sample's own
    ids = [_token_row(s["input_ids"], k, "input_ids") for k, s in enumerate(samples)]
    labels = []
    for k, (s, row) in enumerate(zip(samples, ids, strict=True)):
        lab = _token_row(s["labels"], k, "labels").clone() if "labels" in s else row.clone()
        if len(lab) != len(row):
            raise InvalidSampleError(f"sample {k} of the group: {len(lab)} labels for {len(row)} input_ids")
        lab[:1] = label_pad_id
        labels.append(lab)
    lengths = torch.tensor([len(r) for r in ids], dtype=torch.int32)
    cu = torch.zeros(len(ids) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lengths, 0)
    longest = int(lengths.max())
    _check_masks(samples, ids)
    rest = {key: _collate_extra([s[key] for s in samples], ids, key) for key in samples[0] if key not in ROW_KEYS}
    return {**rest, "input_ids": torch.cat(ids)[None], "labels": torch.cat(labels)[None],
            "position_ids": torch.cat([torch.arange(len(r), dtype=torch.int64) for r in ids])[None],
            "cu_seq_lens_q": cu, "cu_seq_lens_k": cu.clone(), "max_length_q": longest, "max_length_k": longest}


def _token_row(value: Any, k: int, field: str) -> torch.Tensor:
    """``value`` as one int64 row; :class:`~odb_core.errors.InvalidSampleError` naming sample ``k``
    and ``field`` if it is not one row of integers (a ``[1, L]`` tokenizer output, float or bool
    values: cast, they would silently become other tokens or labels)."""
    row = torch.as_tensor(value)
    if row.dim() != 1:
        raise InvalidSampleError(f"packed_collate: sample {k} of the group: {field} has shape {list(row.shape)}, "
                                 "not one row (squeeze a tokenizer's batch dimension)")
    if row.numel() and not holds_counts(row.dtype):
        raise InvalidSampleError(f"packed_collate: sample {k} of the group: {field} are {row.dtype}, not integer "
                                 "token ids (a cast would change them)")
    return row.to(torch.int64)


def _check_masks(samples: Sequence[Mapping[str, Any]], ids: list[torch.Tensor]) -> None:
    """:class:`~odb_core.errors.InvalidSampleError` naming the sample unless each ``attention_mask``
    is all ones over exactly its sample's ``input_ids`` (a zero marks padding the row would attend
    to and train on)."""
    masks = [torch.as_tensor(s["attention_mask"]).reshape(-1) for s in samples if "attention_mask" in s]
    if not masks or (len(masks) == len(ids) and [m.shape[0] for m in masks] == [r.shape[0] for r in ids]
                     and bool(torch.cat(masks).all())):  # the common cases, checked at once
        return
    for k, (s, row) in enumerate(zip(samples, ids)):
        mask = torch.as_tensor(s.get("attention_mask", torch.ones(len(row)))).reshape(-1)
        if len(mask) != len(row) or not bool(mask.all()):
            problem = (f"{len(mask)} attention_mask entries for {len(row)} input_ids" if len(mask) != len(row)
                       else f"an attention_mask with {int((mask == 0).sum())} zeros (a padded sample)")
            raise InvalidSampleError(f"packed_collate: sample {k} of the group has {problem}; the padding-free row "
                                     "has no mask, so it would attend to and train on those tokens: store samples "
                                     "unpadded")


def _first_dim(value: Any) -> int | None:
    """The first dimension of a tensor, array, list or tuple; None for anything else (scalars, strings)."""
    if isinstance(value, (list, tuple)):
        return len(value)
    shape = getattr(value, "shape", None)
    return int(shape[0]) if isinstance(shape, (tuple, torch.Size)) and len(shape) else None


#: fields Hugging Face tokenizers, collators and TRL give one entry per token
PER_TOKEN_NAMES = frozenset({"token_type_ids", "special_tokens_mask", "completion_mask", "assistant_masks",
                             "loss_mask", "offset_mapping"})


def _collate_extra(values: list[Any], ids: list[torch.Tensor], key: str) -> Any:
    """``default_collate(values)`` of a field outside the row. A per-token field is
    :class:`~odb_core.errors.UnsupportedSettingError`: one of :data:`PER_TOKEN_NAMES` whose first
    dimension is its sample's ``input_ids`` length in every sample, or any field that is so in a
    group of samples of different lengths (a fixed-size field matching equal lengths, or the one
    sample of a group, by chance, is collated per sample)."""
    lengths = [len(r) for r in ids]
    matches = all(_first_dim(v) == n for v, n in zip(values, lengths))
    if matches and (key in PER_TOKEN_NAMES or len(set(lengths)) > 1):
        raise UnsupportedSettingError(
            f"packed_collate: field {key!r} has one entry per input_id in every sample of the group (sample 0: "
            f"{len(ids[0])}); collated per sample it would not line up with the padding-free row, which holds no "
            "per-token field but input_ids, labels and position_ids: fold it into labels (-100 where no loss), "
            "drop it, or use budget='padded' with pad_collate", field=key)
    return collate_field(values, key, "packed_collate")


def check_packed_attention(model: torch.nn.Module, device: str | torch.device | None = None) -> str | None:
    """Raise :class:`~odb_core.errors.PackedAttentionError` when ``model`` (a ``transformers``
    model, or a module holding one) would let the samples of a packed row attend to each
    other; return its attention implementation when it keeps them apart.

    Only the architectures of :data:`PACKED_MODEL_TYPES` (``config.model_type``) are accepted, and
    for them: ``flash_attention_2/3/4`` (varlen kernels over ``cu_seq_lens_*``/``position_ids``);
    ``eager``, ``sdpa``, ``flex_attention`` when the model builds its mask with
    ``transformers.masking_utils.create_causal_mask`` and ``config.use_cache`` is False (a
    cache, even an empty one, switches the per-sequence mask off). Anything else is refused.
    ``eager`` and ``sdpa`` also warn (:class:`~odb_core.errors.PackedAttentionCostWarning`)
    when the model trains off the CPU: ``device`` (where it will train; an adapter passes its
    own) or else where its parameters are. Their dense mask costs the square of the row.
    A module holding no ``transformers`` model returns ``None``: its attention is the caller's.
    """
    hf = _transformers_model(model)
    if hf is None:
        return None
    config = hf.config
    impl = str(config._attn_implementation)
    name = type(hf).__name__
    kind = getattr(config, "model_type", None)
    if kind not in PACKED_MODEL_TYPES:
        raise PackedAttentionError(
            f"{name} (model_type {kind!r}) with attn_implementation={impl!r}: not an architecture ODB has shown to "
            "keep packed sequences apart (some call the mask builder without position_ids, some run recurrent or "
            f"convolution layers across the row); verified: {', '.join(sorted(PACKED_MODEL_TYPES))}. Use "
            "budget='padded'", model_class=name, attn_implementation=impl)
    if impl in FLASH_IMPLEMENTATIONS and kind in FLASH_MIXING:
        raise PackedAttentionError(
            f"{name} with attn_implementation={impl!r}: its own flash-attention code passes neither position_ids "
            "nor cu_seq_lens to the kernel, so packed sequences attend to each other; use 'sdpa' or 'eager', or "
            "budget='padded'", model_class=name, attn_implementation=impl)
    if impl in FLASH_IMPLEMENTATIONS:
        return impl
    if impl not in MASKED_IMPLEMENTATIONS:
        raise PackedAttentionError(
            f"{name} with attn_implementation={impl!r}: ODB knows no way it keeps packed sequences apart; "
            "use 'flash_attention_2' (GPU), 'sdpa' or 'eager', or budget='padded'",
            model_class=name, attn_implementation=impl)
    if not _builds_packed_masks(model):
        raise PackedAttentionError(
            f"{name} with attn_implementation={impl!r}: its modeling code does not build its mask with "
            "transformers.masking_utils.create_causal_mask, so restarting position_ids do not separate the "
            "sequences; use a flash_attention implementation or budget='padded'",
            model_class=name, attn_implementation=impl)
    bidirectional = _bidirectional_setting(config)
    if bidirectional is not None:
        raise PackedAttentionError(
            f"{name} with attn_implementation={impl!r} and config.{bidirectional}: its mask builder then makes a "
            "bidirectional mask without position_ids, so packed sequences attend to each other (or, for Gemma's "
            "bidirectional attention, each sequence is masked causally in the row and not alone); "
            "use budget='padded'", model_class=name, attn_implementation=impl)
    if any(getattr(getattr(m, "config", None), "use_cache", False) for m in model.modules()):
        raise PackedAttentionError(
            f"{name} with attn_implementation={impl!r} and config.use_cache=True: the cache it creates in "
            "forward switches off the per-sequence mask, so packed sequences would attend to each other; "
            "set model.config.use_cache = False for training",
            model_class=name, attn_implementation=impl)
    where = _off_cpu(model) if device is None else torch.device(device).type
    if impl != "flex_attention" and where not in (None, "cpu"):
        warnings.warn(PackedAttentionCostWarning(
            f"{name} with attn_implementation={impl!r} on {where}: packed rows stay apart, but through a dense "
            "L_max x L_max mask, so attention costs the square of the row; 'flash_attention_2' or 'flex_attention' "
            "cost the sum of the sequences' squares (or use budget='padded')",
            model_class=name, attn_implementation=impl), stacklevel=2)
    return impl


def _bidirectional_setting(config: Any) -> str | None:
    """``"is_causal=False"`` or ``"use_bidirectional_attention=True"`` (or ``'all'``) when the model's (or its text
    model's) config asks for bidirectional attention, else None. ``transformers``'
    ``create_causal_mask`` then returns a bidirectional mask built without ``position_ids``
    (``config.is_causal=False`` moved a packed sequence's logits by 0.08 on Llama and Qwen2:
    its neighbour's tokens reached it). ``is_causal=False`` passed to ``forward`` is not seen here."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for cfg in (config, text):
        if getattr(cfg, "is_causal", True) is False:
            return "is_causal=False"
        both = getattr(cfg, "use_bidirectional_attention", None)
        if both is True or both == "all":  # Gemma 4's "vision" is bidirectional over image tokens only
            return f"use_bidirectional_attention={both!r}"
    return None


def _off_cpu(model: torch.nn.Module) -> str | None:
    """The device type of ``model``'s first parameter when it is not the CPU (an accelerator,
    or ``meta`` before one); ``None`` on the CPU or without parameters."""
    first = next(iter(model.parameters()), None)
    return None if first is None or first.device.type == "cpu" else first.device.type


def _transformers_model(model: torch.nn.Module) -> Any:
    """``model`` or its first submodule with a ``transformers`` config naming an attention implementation."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            return module
    return None


def _builds_packed_masks(model: torch.nn.Module) -> bool:
    """Whether a submodule of ``model`` with a ``transformers`` config comes from a modeling
    module that uses ``create_causal_mask`` (a multimodal wrapper's language model counts)."""
    from transformers import masking_utils

    for module in model.modules():
        if getattr(module, "config", None) is None:
            continue
        namespace = vars(sys.modules.get(type(module).__module__, sys))
        if namespace.get("create_causal_mask") is masking_utils.create_causal_mask:
            return True
    return False


def budget_of(loader_kwargs: Mapping[str, Any]) -> str:
    """The budget a set of :class:`~odb_torch.ODBDataLoader` keywords selects: ``budget=``,
    else ``config.budget``, else ``"padded"``."""
    if "budget" in loader_kwargs:
        return str(loader_kwargs["budget"])
    return str(getattr(loader_kwargs.get("config"), "budget", "padded"))


def unwrapped(fn: Any) -> Any:
    """``fn`` without its ``functools.partial`` layers (what a collate given as a partial calls)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return fn


def adapter_defaults(model: torch.nn.Module | None, loader_kwargs: dict[str, Any],
                     device: str | torch.device | None = None) -> None:
    """What a trainer adapter does with its loader keywords: ``collate_fn`` defaults to
    :func:`packed_collate` under the packed budget (``pad_collate`` otherwise), and a
    ``model`` that would let packed sequences attend to each other is refused before training
    (:func:`check_packed_attention`, with ``device``, where the model will train)."""
    from odb_torch.collate import pad_collate

    packed = budget_of(loader_kwargs) == "packed"
    loader_kwargs.setdefault("collate_fn", packed_collate if packed else pad_collate)
    if packed and model is not None:
        check_packed_attention(model, device)
