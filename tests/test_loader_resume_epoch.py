"""A loaded position is never discarded silently: iterating another epoch than the one
``load_state_dict`` loaded is a typed error, raised before any process starts."""

from __future__ import annotations

import pytest
from torch_support import ToyDataset

from odb_core.errors import LoaderStateError
from odb_torch import ODBDataLoader


def _state(epoch: int) -> dict[str, object]:
    return {"epoch": epoch, "steps": 3, "consumed": [0, 1, 2], "rank": 0, "world_size": 1, "seed": 0}


@pytest.mark.parametrize("other_epoch", [0, 2])
def test_iterating_another_epoch_than_the_loaded_one_is_refused(other_epoch):
    loader = ODBDataLoader(ToyDataset(10), token_budget=64, rank=0, world_size=1)
    try:
        loader.load_state_dict(_state(1))
        assert loader.epoch == 1  # the resume loop starts from loader.epoch
        loader.set_epoch(other_epoch)
        with pytest.raises(LoaderStateError) as caught:
            next(iter(loader))
        assert caught.value.rank == 0
        assert "epoch 1" in str(caught.value) and f"epoch {other_epoch}" in str(caught.value)
        assert loader._proc is None  # refused before the collate process starts
        assert loader.state_dict()["consumed"] == [0, 1, 2]  # the loaded position is still held
    finally:
        loader.close()
