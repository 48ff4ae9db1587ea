"""The model ``odb tune`` measures: built from a spec, fed a batch, reduced to a loss.

A spec is one of:

* a path to a ``transformers`` config JSON (``config.json`` of a checkpoint; no weights read);
* a ``transformers`` model-type name (``llama``, ``qwen2``, ...) with ``overrides``
  (``hidden_size=896`` ...) passed to ``AutoConfig.for_model``;
* ``module:callable``: a callable of no arguments returning a ``torch.nn.Module``.

Weights are randomly initialised: memory does not depend on their values.
"""

from __future__ import annotations

import importlib
import inspect
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

ModelSpec = str | Callable[[], nn.Module]


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``["hidden_size=64", "tie_word_embeddings=false"]`` -> values parsed as JSON where they parse."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"override {item!r} is not key=value")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


def build_model(spec: ModelSpec, overrides: Mapping[str, Any] | None = None) -> nn.Module:
    """The model of ``spec`` (see the module docstring); ``ValueError`` names a spec it cannot read."""
    if callable(spec):
        return _checked(spec(), repr(spec))
    if ":" in spec and not Path(spec).exists():
        module, _, name = spec.partition(":")
        try:
            factory = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"model {spec!r}: cannot import {name!r} from {module!r}: {exc}") from None
        try:  # a --set keyword the callable does not take: bad input (its own errors go on as they are)
            inspect.signature(factory, follow_wrapped=False).bind(**dict(overrides or {}))  # a wrapper's own
        except TypeError as exc:
            raise ValueError(f"model {spec!r} with --set {dict(overrides or {})}: {exc}") from None
        except ValueError:  # no signature to read (a builtin): call it and let it say
            pass
        return _checked(factory(**dict(overrides or {})), spec)
    from transformers import AutoConfig, AutoModelForCausalLM

    if Path(spec).is_file():
        try:
            loaded = json.loads(Path(spec).read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"model {spec!r}: not a JSON config: {exc}") from None
        if not isinstance(loaded, dict):
            raise ValueError(f"model {spec!r}: a config JSON is an object, this holds a {type(loaded).__name__}")
        data = {**loaded, **dict(overrides or {})}
        if "model_type" not in data:
            raise ValueError(f"model {spec!r}: the config JSON has no 'model_type'")
        config = _config(spec, overrides, **data)
        _refuse_new_keys(config, AutoConfig.for_model(data["model_type"]), overrides, spec, also=loaded)
    else:
        try:
            default = AutoConfig.for_model(spec)
        except ValueError as exc:
            raise ValueError(f"model {spec!r} is neither a file, module:callable nor a transformers model type: {exc}") from None
        config = _config(spec, overrides, spec, **dict(overrides or {}))
        _refuse_new_keys(config, default, overrides, spec)
    return _checked(AutoModelForCausalLM.from_config(config), spec)  # type: ignore[no-untyped-call]


def _config(spec: str, overrides: Mapping[str, Any] | None, *args: Any, **kwargs: Any) -> Any:
    """``AutoConfig.for_model(*args, **kwargs)``; a value it rejects (transformers' validation
    errors are not all ``ValueError``s) is a ``ValueError`` naming the model and the overrides."""
    from transformers import AutoConfig

    try:
        return AutoConfig.for_model(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - any rejection of the user's values, reported as bad input
        reason = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())  # one line, all of it
        raise ValueError(f"model {spec!r} with --set {dict(overrides or {})}: {type(exc).__name__}: "
                         f"{reason}") from None


def _refuse_new_keys(config: Any, default: Any, overrides: Mapping[str, Any] | None, spec: str,
                     also: Mapping[str, Any] = {}) -> None:
    """ValueError naming an override that ``config`` only stores as a new attribute, absent from
    the model type's ``default`` config (and from the JSON ``also``): transformers keeps any
    unknown keyword that way, so a misspelt ``hidden_sise=64`` would silently measure the
    default model. Aliases and keywords the config consumes (``hidden_size`` for gpt2,
    ``attn_implementation``) are not new attributes."""
    unknown = sorted((set(config.to_dict()) - set(default.to_dict()) - set(also)) & set(overrides or {}))
    if unknown:
        raise ValueError(f"model {spec!r}: --set {', '.join(unknown)}: not a field of its {default.model_type!r} config")


def _checked(model: object, what: str) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise ValueError(f"model {what}: built a {type(model).__name__}, not a torch.nn.Module")
    return model


def call_loss(model: nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The scalar loss of ``model(**batch)``: keys the forward does not take are left out
    (unless it takes ``**kwargs``); the output's ``.loss``, first element, or itself, summed."""
    params = inspect.signature(model.forward).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        batch = {k: v for k, v in batch.items() if k in params}
    try:
        inspect.signature(model.forward).bind(**batch)
    except TypeError as exc:
        raise ValueError(f"{type(model).__name__}.forward cannot take the batch as keywords "
                         f"({', '.join(batch) or 'none it accepts'}): {exc}; odb tune calls model(input_ids=..., "
                         "labels=...) and reads the loss") from None
    out: Any = model(**batch)
    loss = out.loss if hasattr(out, "loss") else out[0] if isinstance(out, tuple | list) else out
    if not isinstance(loss, torch.Tensor):
        raise ValueError(f"the model returned no loss tensor (got {type(loss).__name__})")
    return loss.float().sum()
