"""The loader takes the packed budget through ``config=`` and runs it (W = 1, in process
order): what it yields is packed by best fit, within the packed budget (P3), every
sample once (P4), each group as one padding-free row (``packed_collate``)."""

from __future__ import annotations

from torch_support import ToyDataset, sample_length

from odb_core import ODBConfig
from odb_torch import ODBDataLoader, packed_collate
from odb_torch.ports import free_port


def test_the_loader_runs_the_packed_budget_from_config():
    config = ODBConfig(token_budget=128, buffer_size=16, budget="packed")
    loader = ODBDataLoader(ToyDataset(60), config=config, collate_fn=packed_collate, num_workers=0, rank=0,
                           world_size=1, init_method=f"tcp://127.0.0.1:{free_port(1)}", timeout=60)
    assert loader.config.budget == "packed"
    groups = []
    try:
        for batch in loader:
            groups.append([sample_length(i) for i in loader.step_info.indices])
            assert batch["input_ids"].shape == (1, sum(groups[-1]))
            assert batch["cu_seq_lens_q"].diff().tolist() == groups[-1]
            # P7: the loader counts what a loss over the row counts (packed_collate's first labels are
            # -100), shifted_loss_tokens by default with packed_collate; the labels' own count is more
            assert loader.step_info.local_tokens == int((batch["labels"] != -100).sum())
    finally:
        loader.close()
    assert sorted(n for g in groups for n in g) == sorted(sample_length(i) for i in range(60))
    assert all(sum(g) <= 128 for g in groups if len(g) >= 2)
    assert any(len(g) >= 2 and max(g) * len(g) > 128 for g in groups), "nothing the padded budget would refuse"


def test_a_partial_of_packed_collate_counts_as_packed_collate_and_another_collate_is_warned():
    """A ``functools.partial(packed_collate)`` got the unshifted default count: one loss token per
    sample more than a loss over its rows sums (P7), silently. A collate ODB cannot see into (a
    function calling packed_collate) under the packed budget is now warned about."""
    import functools

    import pytest

    from odb_core.errors import ODBWarning
    from odb_torch.losses import shifted_loss_tokens

    config = ODBConfig(token_budget=128, buffer_size=16, budget="packed")
    kw = dict(config=config, num_workers=0, rank=0, world_size=1, timeout=60, init_method="tcp://127.0.0.1:1")
    partial = ODBDataLoader(ToyDataset(8), collate_fn=functools.partial(packed_collate), **kw)
    assert partial._spec.loss_tokens_fn is shifted_loss_tokens
    with pytest.warns(ODBWarning, match="shifted_loss_tokens"):
        wrapped = ODBDataLoader(ToyDataset(8), collate_fn=lambda group: packed_collate(group), **kw)
    assert wrapped._spec.loss_tokens_fn is None
