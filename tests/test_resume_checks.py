"""Resume states that do not fit the resuming loader are typed errors naming the field (P4: a
state's positions naming other samples would repeat some and drop others, silently), on the
same-world path as on the elastic one, and through the trainer adapters' checkpoint loading with
their ``field``, ``ranks`` and ``indices`` kept."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DistributedSampler
from torch_support import ShardSampler, ToyDataset

from odb_core.config import ODBConfig
from odb_core.elastic import merge_states
from odb_core.epoch import EpochDriver
from odb_core.errors import (
    CheckpointStateError,
    ResumeStateError,
    UnsupportedSettingError,
)
from odb_torch import ODBDataLoader, pad_collate
from odb_torch.windows import AccumulationWindows, load_windows_state, state_file

pytestmark = pytest.mark.timeout(120)

BASE = {"epoch": 0, "steps": 2, "seed": 0, "shuffle": 1, "sampler_seed": 0}


def _loader(n: int = 40, world: int = 2, rank: int = 0, **kw: Any) -> ODBDataLoader:
    return ODBDataLoader(ToyDataset(n), token_budget=256, collate_fn=pad_collate, num_workers=0, rank=rank,
                         world_size=world, init_method="tcp://127.0.0.1:1", **kw)


def _own(world: int = 2, rank: int = 0, total: int = 40, **kw: Any) -> dict[str, Any]:
    return {**BASE, "rank": rank, "world_size": world, "order_world": world, "total": total,
            "consumed": [0, 1, 2], **kw}


def test_a_same_world_state_of_another_dataset_size_is_refused_naming_total():
    """A checkpoint of 40 samples loaded into a loader over 30: accepted before, it then yielded
    three samples twice and three never."""
    with pytest.raises(ResumeStateError) as err:
        _loader(n=30).load_state_dict(_own(total=40))
    assert err.value.field == "total" and err.value.rank == 0
    _loader(n=40).load_state_dict(_own(total=40))  # the fitting one is accepted


@pytest.mark.parametrize("world", [1, 2, 3])
def test_states_of_another_dataset_size_with_the_same_padded_total_are_refused_on_every_path(world):
    """Ten samples at W=2 pad to 10 views, and nine do too: a list of the 10-sample run's states
    resumed over 9 samples on 1 rank was accepted (the total matched; the elastic path dropped the
    order digest) and trained samples 1, 4 and 8 twice, 0 and 3 never. ``state_dict`` now records
    the dataset's size, and every resume compares it (P4)."""
    states = [_own(rank=r, total=10, dataset_size=10, consumed=[0]) for r in range(2)]
    with pytest.raises(ResumeStateError) as err:
        _loader(n=9, world=world).load_state_dict(states)
    assert err.value.field == "dataset_size" and err.value.rank == 0
    _loader(n=10, world=world).load_state_dict(states)  # the fitting one is accepted
    if world == 2:
        with pytest.raises(ResumeStateError) as own:
            _loader(n=9).load_state_dict(states[0])
        assert own.value.field == "dataset_size"


def test_state_dict_records_the_dataset_size():
    loader = _loader(n=37)
    assert loader.state_dict()["dataset_size"] == 37


def test_a_same_world_share_of_another_dataset_is_refused_before_the_epoch_starts():
    share = _own(world=2, views=list(range(20, 40)), pool=20, order_world=1, total=40)
    with pytest.raises(ResumeStateError) as err:
        _loader(n=30).load_state_dict(share)
    assert err.value.field == "total"


@pytest.mark.parametrize(("change", "field"), [({"rank": 1}, "rank"), ({"seed": 5}, "seed"),
                                               ({"consumed": [4, 4]}, "consumed"), ({"consumed": [-3]}, "consumed"),
                                               ({"views": [0, 99], "pool": 2}, "views")])
def test_a_same_world_state_that_is_not_this_ranks_is_a_resume_state_error_naming_the_field(change, field):
    with pytest.raises(ResumeStateError) as err:
        _loader().load_state_dict(_own(**change))
    assert err.value.field == field and err.value.rank == 0
    if field in ("consumed", "views"):
        assert err.value.indices, "the bad positions are named"


@settings(max_examples=60, deadline=None)
@given(own=st.integers(0, 12), skip=st.sets(st.integers(-3, 20), max_size=6))
def test_the_driver_refuses_a_skip_outside_the_epochs_positions(own, skip):
    """P4: the core starts a resumed epoch only from positions it has; one outside them (a
    checkpoint of another sampler) is a ResumeStateError naming them, not ignored."""
    driver = EpochDriver(ODBConfig(token_budget=64), rank=0, world=1, epoch=0, skip=sorted(skip))
    bad = sorted(p for p in skip if not 0 <= p < own)
    if bad:
        with pytest.raises(ResumeStateError) as err:
            driver.start_iteration(list(range(own)))
        assert err.value.field == "consumed" and list(err.value.indices) == bad
    else:
        driver.start_iteration(list(range(own)))
        assert driver.kept == [p for p in range(own) if p not in skip]


@pytest.mark.parametrize("key", ["world_size", "rank"])
def test_merging_states_that_lack_a_key_names_it(key):
    states = [{k: v for k, v in _own(rank=r).items() if k != key} for r in (0, 1)]
    with pytest.raises(ResumeStateError) as err:
        merge_states(states)
    assert err.value.field == key


def test_state_dict_in_non_join_mode_is_an_unsupported_setting_naming_mode():
    loader = _loader(mode="non-join")
    for call in (loader.state_dict, lambda: loader.load_state_dict(_own())):
        with pytest.raises(UnsupportedSettingError) as err:
            call()
        assert err.value.field == "mode" and err.value.rank == 0


def _window_state(loader_state: dict[str, Any]) -> dict[str, Any]:
    return {"version": 1, "epoch": 0, "epochs_completed": 0, "samples_seen": 0, "tokens_seen": 0, "updates": 1,
            "samples_in_epoch": 0, "accumulation_steps": 1, "loader": loader_state}


def _checkpoint(folder: Path, states: list[dict[str, Any]]) -> str:
    for s in states:
        Path(state_file(str(folder), s["rank"])).write_text(json.dumps(_window_state(s)))
    return str(folder)


def test_checkpoint_loading_keeps_the_typed_errors_fields_and_names_the_file(tmp_path):
    """``load_windows_state`` (HF Trainer and Accelerate resume) used to re-raise a bare
    CheckpointStateError: ``field``, ``ranks`` and ``indices`` lost, an unsupported sampler no
    longer an UnsupportedSettingError."""
    (tmp_path / "a").mkdir()
    elastic = _checkpoint(tmp_path / "a", [_own(rank=0), _own(rank=1, consumed=[999])])
    with pytest.raises(ResumeStateError) as err:
        load_windows_state(AccumulationWindows(_loader(world=1), 1), elastic)
    assert (err.value.field, err.value.ranks, err.value.indices) == ("consumed", (1,), (999,))
    assert any(elastic in note for note in err.value.__notes__)
    _checkpoint(tmp_path / "a", [_own(rank=0), _own(rank=1)])
    with pytest.raises(UnsupportedSettingError) as unsupported:
        load_windows_state(AccumulationWindows(_loader(world=1, sampler=ShardSampler(list(range(40)))), 1), elastic)
    assert unsupported.value.field == "sampler"
    (tmp_path / "b").mkdir()
    same = _checkpoint(tmp_path / "b", [_own(rank=0, sampler_seed=7)])
    with pytest.raises(ResumeStateError) as order:
        load_windows_state(AccumulationWindows(_loader(), 1), same)
    assert order.value.field == "sampler_seed" and isinstance(order.value, CheckpointStateError)


def test_an_elastic_share_is_served_once_a_later_pass_of_the_epoch_is_whole():
    """After an elastic resume (W=2 states on W=1) of epoch 0, a second pass of epoch 0 (no
    set_epoch to another number) used to serve the dealt remainder again; now it serves the whole
    epoch, as a same-world resume does."""
    states = [_own(rank=r, consumed=list(range(10))) for r in (0, 1)]
    loader = _loader(world=1, buffer_size=8, timeout=30)
    try:
        loader.load_state_dict(states)
        served = []
        for _ in range(2):
            loader.set_epoch(0)
            served.append(sorted(i for _ in loader for i in loader.step_info.indices))
        order = list(DistributedSampler(ToyDataset(40), num_replicas=1, rank=0, seed=0))
        assert len(served[0]) == 20 and served[1] == sorted(order)
    finally:
        loader.close()


def _resume_rank(rank: int, port: int, folder: str, out: str) -> None:
    """One rank of a W=2 group loading its window state from ``folder``; writes its outcome."""
    import time

    import torch.distributed as dist
    from torch_support import init_gloo

    init_gloo(rank, 2, port)
    started, outcome = time.monotonic(), "loaded"
    try:
        load_windows_state(AccumulationWindows(_loader(world=2, rank=rank, timeout=60), 1), folder)
    except CheckpointStateError as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    Path(out, f"rank{rank}.json").write_text(json.dumps({"outcome": outcome, "seconds": time.monotonic() - started}))
    dist.destroy_process_group()


def test_a_rank_whose_peer_cannot_load_its_state_stops_at_once(tmp_path):
    """A W=2 checkpoint that lost rank 1's file: rank 1 fails (the file is named), and rank 0, whose
    own file loads, raises too, naming rank 1, in seconds; it used to accept its state and then wait
    for rank 1 at the collate group's rendezvous until the timeout (300 s by default)."""
    import multiprocessing

    from odb_torch.ports import free_port

    (tmp_path / "ckpt").mkdir()
    folder = _checkpoint(tmp_path / "ckpt", [_own(rank=0)])
    port, ctx = free_port(), multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_resume_rank, args=(r, port, folder, str(tmp_path))) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(90)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
        p.join()
    assert not alive and all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert "odb_state_rank1.json is missing" in results[1]["outcome"]
    assert results[0]["outcome"].startswith("CheckpointStateError") and "ranks [1]" in results[0]["outcome"]
    assert max(r["seconds"] for r in results) < 30


@pytest.mark.parametrize(("content", "why"), [("", "cannot be read"), ('{"loader": {"world_size"', "cannot be read"),
                                              ("[]", "not a window state"), ('{"loader": 5}', "not a window state"),
                                              (b"\xff\xfe", "cannot be read")])
def test_a_corrupt_state_file_is_a_checkpoint_state_error_naming_the_file_and_its_rank(tmp_path, content, why):
    """A truncated, empty or non-object ``odb_state_rank1.json`` raised a bare JSONDecodeError or
    AttributeError on every rank, naming neither the file nor the rank."""
    _checkpoint(tmp_path, [_own(rank=0)])
    bad = Path(state_file(str(tmp_path), 1))
    bad.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(CheckpointStateError) as err:
        load_windows_state(AccumulationWindows(_loader(), 1), str(tmp_path))
    assert str(bad) in str(err.value) and why in str(err.value), err.value
    assert (err.value.rank, err.value.ranks) == (0, (1,))


def test_this_world_sizes_whole_set_of_states_is_resumed_and_files_left_from_a_larger_run_ignored(tmp_path):
    """A folder saved at W=4, then at W=2 (a fixed checkpoint folder) holds ranks 2 and 3 of the
    W=4 run beside the W=2 run's own two: resuming at W=2 merged all four and failed
    (``samples_seen`` differs); the W=2 run's own complete set is what resumes."""
    old = [{**_window_state(_own(world=4, rank=r, consumed=[r])), "samples_seen": 9} for r in range(4)]
    for s in old:
        Path(state_file(str(tmp_path), s["loader"]["rank"])).write_text(json.dumps(s))
    _checkpoint(tmp_path, [_own(rank=0, consumed=[5, 7]), _own(rank=1, consumed=[6])])
    windows = AccumulationWindows(_loader(), 1)
    load_windows_state(windows, str(tmp_path))
    assert windows.samples_seen == 0 and windows.loader.state_dict()["consumed"] == [5, 7]


def test_states_of_several_world_sizes_without_this_worlds_whole_set_name_them(tmp_path):
    _checkpoint(tmp_path, [_own(rank=0), _own(rank=1)])
    Path(state_file(str(tmp_path), 2)).write_text(json.dumps(_window_state(_own(world=4, rank=2))))
    with pytest.raises(CheckpointStateError) as err:
        load_windows_state(AccumulationWindows(_loader(world=3), 1), str(tmp_path))
    assert "several world sizes" in str(err.value) and "{2: [0, 1], 4: [2]}" in str(err.value), err.value


def test_another_accumulation_count_or_a_phase_beyond_it_is_a_resume_state_error(tmp_path):
    windows = AccumulationWindows(_loader(), 2)
    with pytest.raises(ResumeStateError) as err:
        windows.load_state_dict({**_window_state(_own()), "accumulation_steps": 4})
    assert (err.value.field, err.value.rank) == ("accumulation_steps", 0)
    with pytest.raises(ResumeStateError) as phase:
        windows.load_state_dict({**_window_state(_own()), "accumulation_steps": 2, "phase": 2})
    assert phase.value.field == "phase"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["subset", "weighted"])
def test_a_custom_random_sampler_resumed_mid_epoch_in_another_order_is_refused(kind):
    """A DataLoader's SubsetRandomSampler or WeightedRandomSampler, kept by from_dataloader, draws
    from the collate process's global generator, whose state a restart does not restore: cut in
    epoch 1 and resumed, it trained 3 of 40 samples twice and 3 never (5 each for weighted),
    silently. The state records the digest of the order its positions index, and the resumed
    epoch refuses another order (ResumeStateError, field sampler) before any batch."""
    import torch
    from torch.utils.data import DataLoader, SubsetRandomSampler, WeightedRandomSampler

    from odb_torch import from_dataloader

    def make() -> ODBDataLoader:
        sampler: Any = (SubsetRandomSampler(list(range(40))) if kind == "subset"
                        else WeightedRandomSampler([1.0] * 40, 40, replacement=False))
        dl = DataLoader(ToyDataset(40), batch_size=4, sampler=sampler, collate_fn=pad_collate)
        return from_dataloader(dl, token_budget=128, buffer_size=4, rank=0, world_size=1)

    torch.manual_seed(0)
    first = make()
    try:
        for _ in first:
            pass
        first.set_epoch(1)
        for k, _ in enumerate(first):
            if k == 4:
                break
        state = json.loads(json.dumps(first.state_dict()))
    finally:
        first.close()
    assert isinstance(state.get("order_digest"), str)
    torch.manual_seed(0)
    resumed = make()
    try:
        resumed.load_state_dict(state)
        with pytest.raises(ResumeStateError) as err:
            next(iter(resumed))
        assert err.value.field == "sampler" and err.value.rank == 0
    finally:
        resumed.close()


@pytest.mark.timeout(120)
def test_a_distributed_sampler_resumed_mid_epoch_keeps_its_order_and_trains_every_sample_once():
    """The order check accepts a reproducible order: a seeded shuffle cut in epoch 1 and resumed."""
    def make() -> ODBDataLoader:
        return ODBDataLoader(ToyDataset(40), token_budget=128, collate_fn=pad_collate, buffer_size=4, rank=0,
                             world_size=1, num_workers=0)

    first = make()
    seen: list[int] = []
    try:
        for _ in first:
            pass
        first.set_epoch(1)
        for k, batch in enumerate(first):
            seen += batch["idx"].tolist()
            if k == 4:
                break
        state = json.loads(json.dumps(first.state_dict()))
    finally:
        first.close()
    assert len(state["consumed"]) == len(seen) and state.get("order_digest")
    resumed = make()
    try:
        resumed.load_state_dict(state)
        rest = [i for batch in resumed for i in batch["idx"].tolist()]
    finally:
        resumed.close()
    assert sorted(seen + rest) == list(range(40))


@pytest.mark.timeout(120)
def test_a_custom_random_sampler_resumed_at_its_epochs_end_trains_nothing_more():
    """A state taken after the epoch's last batch (every view consumed) has nothing left to order:
    the order check refused it (a regression of the check, found in review), though "resume at an
    epoch boundary" is the remedy it names."""
    import torch
    from torch.utils.data import DataLoader, SubsetRandomSampler

    from odb_torch import from_dataloader

    def make() -> ODBDataLoader:
        dl = DataLoader(ToyDataset(40), batch_size=4, sampler=SubsetRandomSampler(list(range(40))),
                        collate_fn=pad_collate)
        return from_dataloader(dl, token_budget=128, buffer_size=4, rank=0, world_size=1)

    torch.manual_seed(0)
    first = make()
    try:
        for epoch in (0, 1):
            first.set_epoch(epoch)
            for _ in first:
                pass
        state = json.loads(json.dumps(first.state_dict()))
    finally:
        first.close()
    assert state["epoch"] == 1 and len(state["consumed"]) == 40
    resumed = make()
    try:
        resumed.load_state_dict(state)
        assert list(resumed) == []
    finally:
        resumed.close()
