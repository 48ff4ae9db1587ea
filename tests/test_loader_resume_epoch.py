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
        # the loaded position is still held, under its own epoch (a state naming other_epoch with
        # epoch 1's positions would skip them there on the next resume: found in review)
        assert (loader.state_dict()["epoch"], loader.state_dict()["consumed"]) == (1, [0, 1, 2])
    finally:
        loader.close()


def _ids(batch: dict[str, object]) -> list[int]:
    return batch["idx"].tolist()  # type: ignore[attr-defined]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("finished", [True, False])
def test_a_checkpoint_after_set_epoch_of_the_next_epoch_resumes_all_of_it(finished):
    """P4 across a checkpoint at an epoch boundary: set_epoch(e + 1) after epoch e (finished, or left
    by a break) starts e + 1 at its beginning, so a state_dict taken then resumes every view of e + 1
    (it used to carry e's consumed positions into e + 1, and the resume yielded nothing)."""
    n = 12
    loader = ODBDataLoader(ToyDataset(n), token_budget=64, rank=0, world_size=1, num_workers=0, buffer_size=4)
    try:
        loader.set_epoch(0)
        for k, _ in enumerate(loader):
            if not finished and k == 1:
                break
        loader.set_epoch(1)
        state = loader.state_dict()
        assert (state["epoch"], state["consumed"], state["steps"]) == (1, [], 0)
    finally:
        loader.close()
    resumed = ODBDataLoader(ToyDataset(n), token_budget=64, rank=0, world_size=1, num_workers=0, buffer_size=4)
    try:
        resumed.load_state_dict(state)
        resumed.set_epoch(resumed.epoch)
        ids = [i for batch in resumed for i in _ids(batch)]
        assert sorted(ids) == list(range(n)), "P4: the resumed epoch must yield every view once"
    finally:
        resumed.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("call", ["load_state_dict", "set_epoch"])
def test_a_live_iterator_is_stale_after_load_state_dict_or_a_new_epoch(call):
    """Mid-epoch, ``load_state_dict`` (or ``set_epoch`` of another epoch) makes the live iterator
    raise LoaderStateError on its next ``next()``: it used to go on yielding its epoch and append
    to the loaded position (samples trained twice, a state_dict that named them twice). The next
    loop then runs exactly what was loaded: every sample of the epoch once, across both."""
    n = 24
    loader = ODBDataLoader(ToyDataset(n), token_budget=64, rank=0, world_size=1, num_workers=0, buffer_size=4)
    try:
        loader.set_epoch(0)
        live = iter(loader)
        first = [i for _ in range(2) for i in _ids(next(live))]
        state = loader.state_dict()
        if call == "load_state_dict":
            loader.load_state_dict(state)
        else:
            loader.set_epoch(1)
        with pytest.raises(LoaderStateError, match=call) as caught:
            next(live)
        assert caught.value.rank == 0
        rest = [i for batch in loader for i in _ids(batch)]
        if call == "load_state_dict":
            assert sorted(first + rest) == list(range(n)), "every sample of the epoch exactly once"
        else:
            assert sorted(rest) == list(range(n)), "epoch 1 whole"
    finally:
        loader.close()


@pytest.mark.timeout(120)
def test_a_new_iter_makes_the_older_iterator_stale_before_its_own_first_next():
    """``iter(loader)`` supersedes the live iterator at once (it used to wait for the new one's
    first ``next()``, so the old one went on yielding batches the new one then yielded again).
    The new iterator then runs the epoch from its start: every sample once."""
    n = 24
    loader = ODBDataLoader(ToyDataset(n), token_budget=64, rank=0, world_size=1, num_workers=0, buffer_size=4)
    try:
        loader.set_epoch(0)
        old = iter(loader)
        next(old)
        new = iter(loader)
        with pytest.raises(LoaderStateError, match="superseded by a newer iter") as caught:
            next(old)
        assert caught.value.rank == 0
        assert sorted(i for batch in new for i in _ids(batch)) == list(range(n))
        unstarted, newest = iter(loader), iter(loader)
        with pytest.raises(LoaderStateError, match="superseded"):
            next(unstarted)  # superseded before it began
        assert sorted(i for batch in newest for i in _ids(batch)) == list(range(n))
    finally:
        loader.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("call", ["load_state_dict", "set_epoch"])
def test_an_iterator_made_but_not_started_survives_load_state_dict_and_set_epoch(call):
    """Only a started iterator goes stale on ``load_state_dict`` / ``set_epoch``: one made by
    ``iter(loader)`` after a pass abandoned by ``break`` and not yet started runs what they set
    (with an eager iter() it was made stale, where the same code after a completed pass ran)."""
    n = 24
    loader = ODBDataLoader(ToyDataset(n), token_budget=64, rank=0, world_size=1, num_workers=0, buffer_size=4)
    try:
        loader.set_epoch(0)
        for _ in loader:
            break  # abandoned mid-epoch
        waiting = iter(loader)
        if call == "load_state_dict":
            loader.load_state_dict({"epoch": 0, "steps": 1, "consumed": [0], "rank": 0, "world_size": 1, "seed": 0})
        else:
            loader.set_epoch(1)
        got = [i for batch in waiting for i in _ids(batch)]
        want = n - 1 if call == "load_state_dict" else n  # the loaded position consumed one view
        assert len(got) == len(set(got)) == want, got
    finally:
        loader.close()
