"""ODB's PyTorch adapter: the production DataLoader over :mod:`odb_core`.

``from odb_torch import ODBDataLoader, pad_collate`` (and ``from_dataloader`` to convert a
DataLoader a framework built; ``packed_collate`` and ``check_packed_attention`` for the
packed budget). Importing this package does not import
torch until the loader is used. It holds only what runs in training (the loader, its
collate process, windows, schedules, losses, step info, collates, trainer adapters) and
imports only :mod:`odb_core`; the ``odb`` command and its tools live in :mod:`odb_tools`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from odb_torch.collate import pad_collate
    from odb_torch.convert import from_dataloader
    from odb_torch.loader import ODBDataLoader
    from odb_torch.padding_free import check_packed_attention, packed_collate
    from odb_torch.step_info import StepInfo

__all__ = ["ODBDataLoader", "StepInfo", "check_packed_attention", "from_dataloader", "packed_collate", "pad_collate"]


def __getattr__(name: str) -> Any:
    if name == "ODBDataLoader":
        from odb_torch.loader import ODBDataLoader

        return ODBDataLoader
    if name == "pad_collate":
        from odb_torch.collate import pad_collate

        return pad_collate
    if name in ("packed_collate", "check_packed_attention"):
        from odb_torch import padding_free

        return getattr(padding_free, name)
    if name == "from_dataloader":
        from odb_torch.convert import from_dataloader

        return from_dataloader
    if name == "StepInfo":
        from odb_torch.step_info import StepInfo

        return StepInfo
    raise AttributeError(name)
