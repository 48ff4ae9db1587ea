"""Page-locking a batch's tensors in the trainer (``ODBDataLoader(pin_memory=True)``).

As a plain ``DataLoader`` with ``pin_memory=True`` does, every tensor of a yielded batch is
copied into page-locked memory, so that ``tensor.to("cuda", non_blocking=True)`` is an
asynchronous copy, and the batch's containers are rebuilt around the pinned leaves with
the contract of ``DataLoader``'s pinning: any leaf with a ``pin_memory()`` method (a
tensor, a custom batch type) is replaced by what it returns; strings and bytes are kept;
a mapping is copied and updated (a mutable one: ``OrderedDict``, ``defaultdict``, a dict
subclass, Hugging Face's ``BatchEncoding``) or rebuilt from a dict, a plain dict where
neither works; a namedtuple, tuple or other sequence is rebuilt as its own type (a
mutable one copied and set item by item), a list where that fails; anything else is
kept. Moving data only: nothing here decides anything (P1-P8 are the core's).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, MutableMapping, MutableSequence, Sequence
from typing import Any

import torch


def pin_batch(batch: Any, pin: Callable[[Any], Any] | None = None) -> Any:
    """``batch`` with every leaf that has a ``pin_memory()`` method replaced by ``pin(leaf)``
    (default: ``leaf.pin_memory()``), its containers rebuilt as the module says."""
    if isinstance(batch, torch.Tensor) or callable(getattr(batch, "pin_memory", None)):
        return batch.pin_memory() if pin is None else pin(batch)
    if isinstance(batch, str | bytes | bytearray):
        return batch
    if isinstance(batch, Mapping):
        return _mapping(batch, {k: pin_batch(v, pin) for k, v in batch.items()})
    if isinstance(batch, tuple):
        items = [pin_batch(v, pin) for v in batch]
        try:
            return type(batch)(*items) if hasattr(batch, "_fields") else type(batch)(items)
        except TypeError:
            return tuple(items)
    if isinstance(batch, Sequence):
        return _sequence(batch, [pin_batch(v, pin) for v in batch])
    return batch


def _mapping(original: Mapping[Any, Any], items: dict[Any, Any]) -> Any:
    """``original``'s type around ``items``: a copy updated (mutable), rebuilt, or a dict."""
    try:
        if isinstance(original, MutableMapping):
            clone = copy.copy(original)
            clone.update(items)
            return clone
        return type(original)(items)  # type: ignore[call-arg]
    except TypeError:
        return items


def _sequence(original: Sequence[Any], items: list[Any]) -> Any:
    """``original``'s type around ``items``: a copy set item by item (mutable), rebuilt, or a list."""
    try:
        if isinstance(original, MutableSequence):
            clone = copy.copy(original)
            for i, item in enumerate(items):
                clone[i] = item
            return clone
        return type(original)(items)  # type: ignore[call-arg]
    except TypeError:
        return items


def pinning_available() -> bool:
    """Whether page-locked memory helps here: an accelerator (CUDA or another) is available."""
    return bool(torch.accelerator.is_available())
