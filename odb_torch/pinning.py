"""Page-locking a batch's tensors in the trainer (``ODBDataLoader(pin_memory=True)``).

As a plain ``DataLoader`` with ``pin_memory=True`` does, every tensor of a yielded batch is
copied into page-locked memory, so that ``tensor.to("cuda", non_blocking=True)`` is an
asynchronous copy. The batch's structure is kept: exact dicts, lists and tuples and a
``collections.UserDict``'s ``data`` (Hugging Face's ``BatchEncoding``) are walked as
:mod:`odb_torch.batch_transfer` walks them; any other leaf with a ``pin_memory()`` method is
replaced by what that method returns (the ``DataLoader`` contract for custom batch types);
other leaves are kept. Moving data only: nothing here decides anything (P1-P8 are the core's).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from odb_torch.batch_transfer import map_leaves


def pin_batch(batch: Any, pin: Callable[[Any], Any] | None = None) -> Any:
    """``batch`` with every leaf that has a ``pin_memory()`` method replaced by ``pin(leaf)``
    (default: ``leaf.pin_memory()``); structure and the other leaves are kept."""
    def leaf(x: Any) -> Any:
        if isinstance(x, torch.Tensor) or callable(getattr(x, "pin_memory", None)):
            return x.pin_memory() if pin is None else pin(x)
        return x

    return map_leaves(batch, leaf)


def pinning_available() -> bool:
    """Whether page-locked memory helps here: an accelerator (CUDA or another) is available."""
    return bool(torch.accelerator.is_available())
