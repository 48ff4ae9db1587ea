"""A completed epoch of a shuffling sampler that starts again without ``set_epoch`` warns
(``ODBWarning``): every epoch would repeat its order and ``state_dict`` name it, so a resume
from ``loader.epoch`` reruns epochs (torch's DistributedSampler repeats silently). An unshuffled
loader (evaluation), ``set_epoch`` before each epoch, and a resumed position do not warn. Real
W=1 loaders (one collate process each, no DataLoader workers)."""

from __future__ import annotations

import warnings

import pytest
from torch_support import ToyDataset

from odb_core.errors import ODBWarning
from odb_torch import ODBDataLoader, pad_collate

pytestmark = pytest.mark.timeout(120)


def _epochs(shuffle: bool, set_epoch: bool) -> tuple[list[list[int]], list[warnings.WarningMessage]]:
    orders: list[list[int]] = []
    with ODBDataLoader(ToyDataset(30), token_budget=256, collate_fn=pad_collate, num_workers=0, buffer_size=8,
                       shuffle=shuffle) as loader, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for epoch in range(2):
            if set_epoch:
                loader.set_epoch(epoch)
            orders.append([i for _ in loader for i in loader.step_info.indices])
    return orders, [w for w in caught if issubclass(w.category, ODBWarning)]


def test_a_shuffled_epoch_started_again_without_set_epoch_warns_once_it_repeats():
    orders, caught = _epochs(shuffle=True, set_epoch=False)
    assert orders[0] == orders[1], "without set_epoch the order repeats (as DistributedSampler's does)"
    assert len(caught) == 1 and "call loader.set_epoch(epoch)" in str(caught[0].message)


@pytest.mark.parametrize(("shuffle", "set_epoch"), [(True, True), (False, False)])
def test_set_epoch_or_an_unshuffled_order_says_nothing(shuffle, set_epoch):
    orders, caught = _epochs(shuffle, set_epoch)
    assert caught == [] and sorted(orders[0]) == sorted(orders[1]) == list(range(30))
