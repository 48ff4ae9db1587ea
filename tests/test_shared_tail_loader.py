"""The shared tail in the loader: real Gloo ranks claim the pool's views as their own run out,
and the epoch still trains every view exactly once in lockstep (P2, P4); settings it cannot
serve are refused, typed, before anything starts."""

from __future__ import annotations

import math

import pytest
from test_torch_loader import run_ranks
from torch.utils.data import DistributedSampler
from torch_support import ToyDataset, check_real_traces, sample_length

from odb_core.errors import UnsupportedSettingError
from odb_torch import ODBDataLoader, pad_collate
from odb_torch.elastic import global_order

pytestmark = pytest.mark.timeout(300)


PACKED = {"budget": "packed", "target_policy": "min"}
#: the budgets of the traced runs: packed-spread deals the packed reserve to both ranks a round
SETTINGS = {"padded": {}, "packed": PACKED, "packed-spread": {**PACKED, "reserve_divisor": 1}}
#: the steps the traced runs must exercise: under the packed budget the pool holds part-full groups
HOLDS = ("fetch", "drain", "gather", "claim", "hold")
REQUIRE = {"padded": ("fetch", "drain", "gather", "claim"), "packed": HOLDS, "packed-spread": HOLDS}


@pytest.mark.parametrize("budget", ["padded", "packed", "packed-spread"])
def test_a_pooled_epoch_trains_every_view_once_in_lockstep_and_replays_in_tlc(tmp_path, budget):
    """P2, P3, P4 with a pool on real Gloo ranks, and the run's traces, claims included, are
    behaviours of the spec (TLC, every invariant); under the packed budget the pool's reserve
    fills part-full groups (held open, claimed by room; packed-spread: ``reserve_divisor`` 1,
    so a reserve round deals to both ranks). Later epochs cut their own pools: the
    single-rank resume test below runs two."""
    n, world, tail = 113, 2, 0.3
    task = {"kind": "audit", "n": n, "epochs": 1, "workers": 1, "shared_tail": tail, **SETTINGS[budget]}
    results = run_ranks(world, task, tmp_path, trace=True)
    for r in results:
        assert "error" not in r, r
    k = int(n * tail)
    for epoch in range(1):
        steps = [r["epochs"][epoch] for r in results]
        assert len({len(s) for s in steps}) == 1, "P2: ranks yielded different step counts"
        per_rank = [[i for x in s for i in x["ids"]] for s in steps]
        ids = [i for rank_ids in per_rank for i in rank_ids]
        assert set(ids) == set(range(n)), "P4: a dataset index was never yielded"
        assert len(ids) == k + world * math.ceil((n - k) / world), "P4: views lost or duplicated beyond padding"
        pool = set(global_order(DistributedSampler(ToyDataset(n), 1, 0, seed=0), epoch, 1)[n - k:])
        takers = [r for r, rank_ids in enumerate(per_rank) if pool & set(rank_ids)]
        assert len(takers) > 1, f"epoch {epoch}: the pool went to ranks {takers} only"
        for s in steps:
            for x in s:
                if not x["idle"] and x["size"] >= 2:
                    cost = sum(map(sample_length, x["ids"])) if budget != "padded" else x["longest"] * x["size"]
                    assert cost <= 128, "P3: a multi-sample batch exceeds the budget"
                assert x["over"] == (x["size"] == 1 and not x["idle"] and sample_length(x["ids"][0]) > 128)
    check_real_traces(tmp_path / "traces", require=REQUIRE[budget])
    if budget == "packed-spread":  # the replay checked every gather's claims against ReserveDiv 1
        from model_checks.conformance import VARIABLES
        from model_checks.traces import merge_directory

        at = VARIABLES.index("claimed")
        runs = merge_directory(tmp_path / "traces")
        assert {t.scenario.reserve_divisor for t in runs} == {1}
        both = [t for t in runs for a, b in zip(t.states, t.states[1:])
                if all(len(b[at][r]) == len(a[at][r]) + 1 for r in range(world))]
        assert both, "no gather dealt one pool view to each rank"  # none does at the default divisor


class _Order(DistributedSampler):  # type: ignore[type-arg]
    """A DistributedSampler subclass: its global order is its own business."""


@pytest.mark.parametrize("sampler", ["subclass", "drop_last"])
def test_a_sampler_whose_global_order_is_unknown_is_refused_with_a_pool(sampler):
    ds = ToyDataset(20)
    given = _Order(ds, 2, 1) if sampler == "subclass" else DistributedSampler(ds, 2, 1, drop_last=True)
    with pytest.raises(UnsupportedSettingError) as caught:
        ODBDataLoader(ds, token_budget=64, rank=1, world_size=2, sampler=given, shared_tail=0.1)
    assert (caught.value.field, caught.value.rank) == ("shared_tail", 1)


@pytest.mark.parametrize("budget", ["padded", "packed"])
def test_a_pooled_epoch_resumed_mid_epoch_trains_every_view_once_and_replays_in_tlc(tmp_path, budget):
    """P4 across the resume, with a pool: W=2 real ranks stop at the first step after the last claim,
    each saves its own state_dict (the pool's cursor and its claims), and new loaders resume
    it: the claimed views not yet yielded are served by their claimers, the pool goes on from
    its cursor, every view of the epoch is yielded once, in lockstep (P2); both runs' traces
    are spec behaviours (TLC, every invariant)."""
    n, world, tail = 101, 2, 0.3
    task = {"kind": "resume", "n": n, "stop_after": "pool", "buffer": 8, "shared_tail": tail,
            **(PACKED if budget == "packed" else {})}
    results = run_ranks(world, task, tmp_path, trace=True)
    for r in results:
        assert "error" not in r, r
    states = [r["state"] for r in results]
    assert len({s["pool_cursor"] for s in states}) == 1 and states[0]["pool_cursor"] > 0, states
    n_own = [math.ceil((n - int(n * tail)) / world)] * world  # each shard, padded like DistributedSampler
    pending = [j for s, own in zip(states, n_own) for j in s["claimed"] if own + j not in s["consumed"]]
    assert pending, "the cut must leave claimed pool views not yet yielded (the case the resume serves again)"
    assert any(p >= own for s, own in zip(states, n_own) for p in s["consumed"]), "and some pool views yielded"
    assert len({len(r["before"]) for r in results}) == 1 and len({len(r["after"]) for r in results}) == 1, "P2"
    ids = [i for r in results for part in ("before", "after") for batch in r[part] for i in batch]
    k = int(n * tail)
    assert set(ids) == set(range(n)), "P4: a dataset index was never yielded"
    assert len(ids) == k + world * math.ceil((n - k) / world), "P4: views lost or repeated across the resume"
    check_real_traces(tmp_path / "traces", require=REQUIRE[budget], cut=1)  # the epoch stopped at its checkpoint


def test_a_pooled_mid_epoch_state_resumes_only_where_its_positions_mean_the_same():
    """Typed refusals, not losses: a rank's own state into a loader with another shared_tail, a
    state without the pool's position (an older ODB), a single state of another world size
    (pass every rank's: the merge maps pooled positions); an epoch-boundary state resumes."""
    from odb_core.errors import ResumeStateError

    loader = ODBDataLoader(ToyDataset(20), token_budget=64, rank=0, world_size=1, shared_tail=0.2)
    state = {"epoch": 1, "steps": 2, "consumed": [0, 1], "rank": 0, "world_size": 1, "seed": 0, "shared_tail": 0.2,
             "pool_cursor": 0, "claimed": []}
    bad = [({**state, "shared_tail": 0.3}, UnsupportedSettingError, "shared_tail"),
           ({k: v for k, v in state.items() if k != "pool_cursor"}, UnsupportedSettingError, "shared_tail"),
           ({**state, "world_size": 2}, ResumeStateError, "kind")]
    for given, error, field in bad:
        with pytest.raises(error) as caught:
            loader.load_state_dict(given)
        assert caught.value.field == field, given
    loader.load_state_dict({**state, "consumed": [], "steps": 0})
    assert loader.epoch == 1
    loader.close()


def test_a_pooled_mid_epoch_state_is_refused_by_a_plain_loader_and_an_incomplete_merge():
    """P4: a pooled state's positions index the pooled order, so a loader without a pool must not
    read them as its own shard's (it lost and repeated views: found in review); a merge needs
    the pool's layout (``pool_size``, ``claimed``), which an older ODB did not record."""
    from odb_core.elastic import merge_states
    from odb_core.errors import ResumeStateError

    state = {"epoch": 1, "steps": 2, "consumed": [0, 1], "rank": 0, "world_size": 1, "seed": 0, "shared_tail": 0.2,
             "order_world": 1, "total": 20, "shuffle": 1, "sampler_seed": 0}
    plain = ODBDataLoader(ToyDataset(20), token_budget=64, rank=0, world_size=1)
    with pytest.raises(UnsupportedSettingError) as caught:
        plain.load_state_dict(state)
    assert (caught.value.field, caught.value.rank) == ("shared_tail", 0)
    plain.close()
    with pytest.raises(ResumeStateError) as merged:
        merge_states([state])
    assert (merged.value.field, tuple(merged.value.ranks)) == ("pool_size", (0,))


@pytest.mark.timeout(120)
def test_every_ranks_pooled_states_resume_on_a_loader_without_a_pool_every_view_once():
    """The list form of a pooled mid-epoch state is merged into the pooled global order, so any
    loader (here one without a pool) serves exactly the views not yet yielded (P4)."""
    n = 30
    options = {"token_budget": 64, "collate_fn": pad_collate, "rank": 0, "world_size": 1, "num_workers": 0}
    first = ODBDataLoader(ToyDataset(n), shared_tail=0.3, **options)
    first.set_epoch(1)
    before = []
    for k, batch in enumerate(first):
        before += batch["idx"].tolist()
        if k == 1:
            break
    state = first.state_dict()
    first.close()
    plain = ODBDataLoader(ToyDataset(n), **options)
    try:
        plain.load_state_dict([state])
        after = [i for batch in plain for i in batch["idx"].tolist()]
    finally:
        plain.close()
    assert before and sorted(before + after) == list(range(n)), "P4 across the resume"


@pytest.mark.timeout(120)
def test_an_epoch_start_state_of_a_pooled_loader_resumes_as_a_list_every_view_once():
    """The list (elastic) form of an epoch-start state resumes a pooled loader over the whole
    epoch, its pool cut anew (it used to wrap the sampler and refuse every later epoch)."""
    n = 30
    options = {"token_budget": 64, "collate_fn": pad_collate, "rank": 0, "world_size": 1, "num_workers": 0,
               "shared_tail": 0.3}
    first = ODBDataLoader(ToyDataset(n), **options)
    first.set_epoch(1)
    state = first.state_dict()
    first.close()
    loader = ODBDataLoader(ToyDataset(n), **options)
    try:
        loader.load_state_dict([state])
        assert loader.epoch == 1
        for epoch in (1, 2):
            loader.set_epoch(epoch)
            ids = [i for batch in loader for i in batch["idx"].tolist()]
            assert sorted(ids) == list(range(n)), f"P4: epoch {epoch} must yield every view once"
    finally:
        loader.close()
