"""The core refuses, with a typed error naming the field, what it used to read with ``int()``:
a merged resume's rank states and a global state whose counts are strings, floats, bools or
negative (``"012"`` was read as positions 0, 1, 2; 1.9 as 1; steps -3 dealt views), on the
elastic path as on the same-world one (P4 across a resume); and a hand-built header gather is
decoded again rather than trusted (its headers were never checked)."""

from __future__ import annotations

from typing import Any

import pytest

from odb_core import ODBConfig, RankProtocol
from odb_core.elastic import global_state_from, merge_states
from odb_core.errors import PeerInconsistencyError, ResumeStateError
from odb_core.wire import Header, HeaderGather, Status, decode_header


def _state(rank: int, consumed: Any = (0,), **changes: Any) -> dict[str, Any]:
    return {"rank": rank, "world_size": 2, "epoch": 0, "steps": 1, "seed": 0, "total": 10,
            "consumed": list(consumed) if isinstance(consumed, tuple) else consumed} | changes


RANK_CASES = [
    ({"consumed": [0, 1.9]}, "consumed"), ({"consumed": "012"}, "consumed"), ({"consumed": [0, True]}, "consumed"),
    ({"steps": -3}, "steps"), ({"epoch": -1}, "epoch"), ({"steps": "3"}, "steps"), ({"total": 10.0}, "total"),
    ({"world_size": True}, "world_size"), ({"order_world": 0}, "order_world"), ({"seed": "0"}, "seed"),
    ({"views": [0, "2"], "pool": 5}, "views"),
]


@pytest.mark.parametrize(("change", "field"), RANK_CASES, ids=[f"{f}-{i}" for i, (_, f) in enumerate(RANK_CASES)])
def test_a_merged_rank_state_of_the_wrong_types_is_refused_naming_the_field(change, field):
    states = [_state(0, **change), _state(1, **({k: v for k, v in change.items() if k != "consumed"}))]
    with pytest.raises(ResumeStateError) as err:
        merge_states(states)
    assert err.value.field == field, (err.value.field, str(err.value))


def test_a_badly_typed_state_is_named_by_its_rank_not_its_place_in_the_list():
    states = [_state(r, world_size=3, total=9) for r in (2, 0, 1)]
    states[0] = states[0] | {"total": 9.0}
    with pytest.raises(ResumeStateError) as err:
        merge_states(states)
    assert (err.value.field, err.value.ranks, err.value.rank) == ("total", (2,), 2), str(err.value)
    assert "(rank 2)" in str(err.value)


def test_well_typed_states_still_merge():
    merged = merge_states([_state(0, (0, 1)), _state(1, (0,))])
    assert merged.consumed == (0, 1, 2) and merged.steps == 1 and merged.total == 10


GLOBAL = {"kind": "odb-global", "epoch": 0, "steps": 1, "seed": 0, "total": 10, "order_world": 2, "consumed": [0, 3]}
GLOBAL_CASES = [
    ({"epoch": -2}, "epoch"), ({"steps": -7}, "steps"), ({"order_world": 0}, "order_world"),
    ({"consumed": [0.5, 1.7]}, "consumed"), ({"consumed": "03"}, "consumed"), ({"total": "10"}, "total"),
    ({"seed": None}, "seed"), ({"order_tail": 1.5}, "order_tail"), ({"order_tail": True}, "order_tail"),
    ({"sampler_seed": "1"}, "sampler_seed"),
]


@pytest.mark.parametrize(("change", "field"), GLOBAL_CASES, ids=[f"{f}-{i}" for i, (_, f) in enumerate(GLOBAL_CASES)])
def test_a_global_state_of_the_wrong_types_is_refused_naming_the_field(change, field):
    with pytest.raises(ResumeStateError) as err:
        global_state_from(GLOBAL | change)
    assert err.value.field == field, (err.value.field, str(err.value))
    assert global_state_from(GLOBAL).consumed == (0, 3)


def test_a_hand_built_header_gather_is_decoded_again_not_trusted():
    """A READY header with no groups is refused from raw vectors; wrapped in a HeaderGather built
    by hand (not by ``decode``) it was accepted and planned a round."""
    proto = RankProtocol(ODBConfig(token_budget=100, buffer_size=2), 0, 2, [0, 1])
    proto.fetch()
    proto.arrive(0, 5)
    proto.arrive(1, 5)
    mine = proto.begin_round()
    forged = HeaderGather([decode_header(mine, 0), Header(0, 0, Status.READY, 0, 0, 3, 3)], 0, 0)
    assert not forged.checked
    with pytest.raises(PeerInconsistencyError, match="rank 1 reports ready with 0 groups"):
        proto.on_headers(forged)


def test_a_rank_outside_the_world_is_an_unsupported_setting_naming_the_rank():
    """The core's constructors raised a bare ValueError, outside the one error tree."""
    from odb_core.elastic import GlobalState, assign_views
    from odb_core.errors import UnsupportedSettingError
    from odb_core.sampler import shard_views

    calls = [lambda: RankProtocol(ODBConfig(token_budget=10), 3, 2, []),
             lambda: assign_views(GlobalState(0, 0, 0, 4, 2, ()), 2, 2), lambda: shard_views(list(range(10)), 2, 5)]
    for call in calls:
        with pytest.raises(UnsupportedSettingError) as err:
            call()
        assert err.value.field == "rank" and err.value.rank in (2, 3, 5)
