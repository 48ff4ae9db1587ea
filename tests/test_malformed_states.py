"""A malformed loader state handed to ``ODBDataLoader.load_state_dict`` (a stream's, a rank's own,
a merged global one, a list of rank states) is a ``ResumeStateError`` naming the field, never a
bare ``KeyError``/``TypeError``/``ValueError``/``ZeroDivisionError``, and a stream state of
negative counts, repeated positions or repeated identities is refused as the map-style path
refuses them (it was accepted). No process starts: the loaders are never iterated."""

from __future__ import annotations

from typing import Any

import pytest
from stream_support import RankStream, collate
from torch_support import ToyDataset

from odb_core.errors import ResumeStateError
from odb_torch import ODBDataLoader, pad_collate

STREAM = {"epoch": 0, "steps": 2, "consumed": [0, 1, 2], "rank": 0, "world_size": 2, "seed": 0, "stream": True,
          "num_workers": 0, "stream_resume": None}
OWN = {"epoch": 0, "steps": 1, "consumed": [0, 1], "rank": 0, "world_size": 2, "seed": 0, "order_world": 2,
       "total": 40, "shuffle": 1, "sampler_seed": 0}
GLOBAL = {"kind": "odb-global", "epoch": 0, "steps": 1, "seed": 0, "total": 40, "order_world": 2, "consumed": []}


def _stream(**kw: Any) -> ODBDataLoader:
    return ODBDataLoader(RankStream([1, 2, 3]), token_budget=96, collate_fn=collate, rank=0, world_size=2,
                         num_workers=0, init_method="tcp://127.0.0.1:1", **kw)


def _map() -> ODBDataLoader:
    return ODBDataLoader(ToyDataset(40), token_budget=256, collate_fn=pad_collate, rank=0, world_size=2,
                         num_workers=0, init_method="tcp://127.0.0.1:1")


def _without(state: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in state.items() if k != key}


STREAM_CASES = [
    (_without(STREAM, "consumed"), "consumed"), (_without(STREAM, "steps"), "steps"),
    (_without(STREAM, "epoch"), "epoch"), (STREAM | {"consumed": ["a"]}, "consumed"),
    (STREAM | {"consumed": None}, "consumed"), (STREAM | {"consumed": [-5, 0, 0]}, "consumed"),
    (STREAM | {"steps": -3}, "steps"), (STREAM | {"epoch": -1}, "epoch"), (None, "state"), ("abc", "state"),
]


@pytest.mark.parametrize(("state", "field"), STREAM_CASES, ids=[f"stream-{f}-{i}" for i, (_, f) in
                                                                 enumerate(STREAM_CASES)])
def test_a_malformed_stream_state_is_a_resume_state_error_naming_the_field(state, field):
    with pytest.raises(ResumeStateError) as err:
        _stream().load_state_dict(state)
    assert err.value.field == field, (err.value.field, str(err.value))


@pytest.mark.parametrize(("ids", "element_id"), [(["a", "b", "c"], "id"), ([7, 7, 7], "id"), ([None, 1, 2], "id"),
                                                 ([1, 2, 3], "uid")])
def test_stream_identities_that_are_not_distinct_integers_of_this_key_are_refused(ids, element_id):
    """Identities listed twice, or not integers, or written under another ``element_id`` key,
    were accepted (or a bare ValueError/TypeError)."""
    state = STREAM | {"consumed_ids": ids, "element_id": "id"}
    with pytest.raises(ResumeStateError) as err:
        _stream(element_id=element_id).load_state_dict(state)
    assert err.value.field == ("element_id" if element_id == "uid" else "consumed_ids"), str(err.value)


MAP_CASES = [
    (OWN | {"consumed": ["x"]}, "consumed"), (OWN | {"steps": "x"}, "steps"),
    (_without(GLOBAL, "consumed"), "consumed"), (_without(GLOBAL, "total"), "total"),
    (GLOBAL | {"consumed": ["x"]}, "consumed"), (GLOBAL | {"order_world": 0}, "order_world"),
    ([OWN | {"world_size": 3, "order_world": 3, "total": 42, "rank": r} for r in ("a", 1, 2)], "rank"),
    ([OWN | {"world_size": 3, "order_world": 3, "total": 42, "rank": r} for r in (None, 1, 2)], "rank"),
    ([1, 2, 3], "state"),
]


@pytest.mark.parametrize(("state", "field"), MAP_CASES, ids=[f"map-{f}-{i}" for i, (_, f) in enumerate(MAP_CASES)])
def test_a_malformed_map_style_or_elastic_state_is_a_resume_state_error(state, field):
    with pytest.raises(ResumeStateError) as err:
        _map().load_state_dict(state)
    assert err.value.field == field, (err.value.field, str(err.value))


def test_samples_per_epoch_of_a_stream_is_an_unsupported_setting_naming_the_dataset():
    """A stream's size is unknown: it raised a bare TypeError (no len() of a StreamSampler),
    reached from the Lightning callback's lr_scheduler."""
    from odb_core.errors import UnsupportedSettingError
    from odb_torch.windows import AccumulationWindows

    with pytest.raises(UnsupportedSettingError) as err:
        AccumulationWindows(_stream(), 2).samples_per_epoch()
    assert err.value.field == "dataset"


LONE_CASES = [
    ({"foo": 1}, "world_size", "not an ODBDataLoader.state_dict()"),
    (_without(OWN, "world_size"), "world_size", "lacks ['world_size']"),
    ({"loader": OWN, "windows": 3, "phase": 0}, "loader", "load_windows_state"),
    (OWN | {"world_size": 3, "rank": 2}, "kind", "rank 2's of a world of 3 ranks, this loader's world has 2"),
]


@pytest.mark.parametrize(("state", "field", "says"), LONE_CASES, ids=[c[1] + str(i) for i, c in enumerate(LONE_CASES)])
def test_a_lone_state_that_is_not_this_worlds_own_says_what_it_is(state, field, says):
    """A mapping that is no state_dict, one without its world size, an adapter's windows state (the
    loader's under 'loader') and one rank's state of another world all read as "a single rank's
    state cannot resume another world size" (field 'kind'); now each names what it is, the sizes
    where they differ, and the rank (``ranks=(0,)``)."""
    with pytest.raises(ResumeStateError) as err:
        _map().load_state_dict(state)
    assert (err.value.field, err.value.ranks) == (field, (0,)), (err.value.field, err.value.ranks, str(err.value))
    assert says in str(err.value)


@pytest.mark.parametrize(("change", "field"), [({"epoch": -1}, "epoch"), ({"order_digest": 5}, "order_digest"),
                                               ({"stream": True}, "stream"), ({"consumed": "x"}, "consumed")])
def test_a_resume_error_of_this_ranks_own_state_names_this_rank(change, field):
    """Raised with this ``rank`` but no ``ranks``, these carried ``ranks=()`` while the seed's,
    the size's and the shuffle's carried ``(0,)``: ranks now defaults to the raising rank."""
    with pytest.raises(ResumeStateError) as err:
        _map().load_state_dict(OWN | change)
    assert (err.value.field, err.value.ranks, err.value.rank) == (field, (0,), 0), str(err.value)


def test_a_streams_epoch_start_state_resumes_at_any_world_size_and_worker_count_a_later_one_does_not():
    """A stream state that names no element (set_epoch(next) taken, nothing consumed) was refused at
    another world size or worker count, although the error itself said to resume at an epoch boundary."""
    from odb_torch.stream_loading import stream_resume

    start = {**STREAM, "epoch": 1, "steps": 0, "consumed": [], "num_workers": 2}
    assert stream_resume(start, 0, 1, 0, 3) == (1, [], 0)
    with pytest.raises(ResumeStateError) as err:
        stream_resume({**start, "steps": 2, "consumed": [0, 1]}, 0, 1, 0, 3)
    assert err.value.field == "world_size"
    with pytest.raises(ResumeStateError) as seed:
        stream_resume(start, 0, 1, 7, 3)
    assert seed.value.field == "seed"


def test_a_stream_read_error_of_a_worker_puts_its_cause_on_the_first_line():
    """A peer quotes the first line of a failing rank's error: for a DataLoader worker's error it was
    "Caught OSError in DataLoader worker process 0.", not the cause."""
    from odb_torch.sample_packing import cause_line

    wrapped = OSError("Caught OSError in DataLoader worker process 0.\nOriginal Traceback (most recent call last):\n"
                      "  File \"x.py\", line 1, in f\nOSError: cannot open shard 3\n")
    assert cause_line(wrapped) == "OSError: cannot open shard 3"
    assert cause_line(ValueError("bad record\nmore")) == "ValueError: bad record"
