"""Configuration validation names the field; misuse of the state machine is a typed error."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from odb_core import InvalidSampleError, ODBConfig, ProtocolStateError, RankProtocol, simulate


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"token_budget": 0}, "token_budget"),
        ({"token_budget": 10, "buffer_size": 0}, "buffer_size"),
        ({"token_budget": 10, "buffer_size": 8, "depth": 4}, "depth"),
        ({"token_budget": 10, "mode": "joined"}, "mode"),
        ({"token_budget": 10, "loss_scaling": "tokens"}, "loss_scaling"),
        ({"token_budget": 10, "target_policy": "greedy"}, "target_policy"),
        ({"token_budget": 10, "output_capacity": 0}, "output_capacity"),
        ({"token_budget": 10, "colour": "red"}, "colour"),
    ],
)
def test_invalid_config_names_the_field(kwargs, field):
    with pytest.raises(ValidationError, match=field):
        ODBConfig(**kwargs)


INTEGER_FIELDS = ("token_budget", "buffer_size", "depth", "seed", "output_capacity")


@given(field=st.sampled_from(INTEGER_FIELDS),
       value=st.one_of(st.booleans(), st.floats(allow_nan=False), st.integers(1, 5000).map(str),
                       st.integers(2000, 5000).map(float), st.integers(2000, 5000).map(np.int64)))
def test_integer_fields_take_integers_and_refuse_what_lax_parsing_would_coerce(field, value):
    """An integer field takes a Python or NumPy integer or an integral float (as an int) and
    refuses, naming the field, a bool, a string or a fractional float that pydantic's lax mode
    would coerce (``True`` as a budget of 1, ``"8192"`` as 8192)."""
    kwargs = {"token_budget": 4096, field: value}
    integral = isinstance(value, np.integer) or (isinstance(value, float) and value.is_integer())
    if not integral:
        with pytest.raises(ValidationError, match=field):
            ODBConfig(**kwargs)
        return
    try:  # the same verdict as the equal int (an out-of-range one is refused by its bound)
        expected = getattr(ODBConfig(**{**kwargs, field: int(value)}), field)
    except ValidationError:
        with pytest.raises(ValidationError, match=field):
            ODBConfig(**kwargs)
    else:
        got = getattr(ODBConfig(**kwargs), field)
        assert got == expected == int(value) and type(got) is int


def test_depth_defaults_to_buffer_size():
    assert ODBConfig(token_budget=10, buffer_size=32).outstanding_depth == 32
    assert ODBConfig(token_budget=10, buffer_size=32, depth=40).outstanding_depth == 40


def test_calls_out_of_order_raise_protocol_state_error():
    p = RankProtocol(ODBConfig(token_budget=10, buffer_size=1), 0, 1, [5])
    with pytest.raises(ProtocolStateError, match="on_headers"):
        p.on_headers([[0] * 7])
    p.begin_round()
    with pytest.raises(ProtocolStateError, match="fetch"):
        p.fetch()


def test_arrival_of_unrequested_view_is_rejected():
    p = RankProtocol(ODBConfig(token_budget=10, buffer_size=1), 0, 1, [5, 6])
    with pytest.raises(ProtocolStateError, match="not in flight"):
        p.arrive(0, 3)


@pytest.mark.parametrize(("length", "tokens", "needle"), [
    (-1, None, "length"), (3, -2, "loss tokens"), ("7", None, "length"), (3, 30, "loss tokens"), (3.0, None, "length"),
])
def test_bad_sample_names_the_dataset_index(length, tokens, needle):
    """A bad length, or loss tokens outside [0, length], is an InvalidSampleError naming the sample."""
    p = RankProtocol(ODBConfig(token_budget=10, buffer_size=1), 0, 1, [42])
    (pos,) = p.fetch()
    with pytest.raises(InvalidSampleError, match=rf"sample 42 .*{needle}") as caught:
        p.arrive(pos, length, tokens)
    assert (caught.value.rank, caught.value.indices) == (0, (42,))
    assert p.in_flight == {pos}  # nothing moved: the sample is still accounted in Q


def test_zero_length_samples_are_emitted_not_dropped():
    result = simulate([0, 0, 5, 0], 2, ODBConfig(token_budget=10, buffer_size=1))
    emitted = sorted(i for steps in result.steps for s in steps for i in s.identities)
    assert emitted == [0, 1, 2, 3]
    zero_groups = [s.lengths for steps in result.steps for s in steps if s.lengths and max(s.lengths) == 0]
    assert zero_groups, "zero-length samples travel in ordinary groups"


def test_ranks_that_disagree_on_skip_idle_fail_the_handshake():
    """skip_idle ends a rank's loop at its last real step: ranks that disagree would yield different
    numbers of steps (P2), silently; the handshake names it."""
    from odb_core.epoch import EpochDriver
    from odb_core.errors import ConfigMismatchError

    drivers = [EpochDriver(ODBConfig(token_budget=10), r, 2, skip_idle=flag) for r, flag in enumerate((True, False))]
    gathered = [d.hello() for d in drivers]
    with pytest.raises(ConfigMismatchError) as info:
        drivers[0].check_hello(gathered)
    assert info.value.field == "skip_idle" and info.value.ranks == (1,)


@pytest.mark.parametrize(("depths", "agree"), [((None, 32), True), ((None, 64), False), ((64, 64), True)])
def test_the_handshake_compares_the_depth_in_use(depths, agree):
    """``depth=None`` means the buffer size: a rank leaving it out and one giving ``depth=32`` with
    ``buffer_size=32`` run the same protocol, yet were refused (``field="depth"``, "this rank has
    None"); a real difference is still named."""
    from odb_core.epoch import EpochDriver
    from odb_core.errors import ConfigMismatchError

    drivers = [EpochDriver(ODBConfig(token_budget=10, buffer_size=32, depth=d), r, 2) for r, d in enumerate(depths)]
    gathered = [d.hello() for d in drivers]
    if agree:
        drivers[0].check_hello(gathered)
        return
    with pytest.raises(ConfigMismatchError) as info:
        drivers[0].check_hello(gathered)
    assert info.value.field == "depth" and info.value.ranks == (1,) and "None" not in str(info.value)


@pytest.mark.parametrize(("field", "value"), [("regroup_padding", False), ("regroup_padding", "0.5"),
                                              ("shared_tail", True), ("shared_tail", "0.3"),
                                              ("output_capacity", 2**63)])
def test_a_float_field_refuses_bools_and_strings_and_capacity_fits_its_header_field(field, value):
    """``regroup_padding=False`` was read as 0.0 (hold every padded group: the most holding, not
    none), a string as its number; an output_capacity of 2^63 passed and then failed every round
    as a WireFormatError blaming rank 0's header."""
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as err:
        ODBConfig(token_budget=10, **{field: value})
    assert err.value.errors()[0]["loc"][0] == field


def test_a_length_past_2_to_the_40_is_an_invalid_sample_naming_it():
    """Two samples of 2^62 tokens in one buffer overflowed the int64 header and failed each round
    as a WireFormatError blaming the rank's header, not the sample."""
    from odb_core.errors import InvalidSampleError
    from odb_core.grouping import MAX_LENGTH, check_length

    assert check_length(MAX_LENGTH, "sample 3") == MAX_LENGTH
    with pytest.raises(InvalidSampleError, match="sample 3"):
        check_length(MAX_LENGTH + 1, "sample 3")


def test_an_epoch_driver_of_a_rank_outside_the_world_and_a_pooled_resume_of_negative_positions_are_refused():
    from odb_core.epoch import EpochDriver
    from odb_core.errors import ResumeStateError, UnsupportedSettingError
    from odb_core.tail import TailPosition

    with pytest.raises(UnsupportedSettingError) as err:
        EpochDriver(ODBConfig(token_budget=10), 3, 2)
    assert err.value.field == "rank"
    driver = EpochDriver(ODBConfig(token_budget=10, buffer_size=2, shared_tail=0.2), 0, 2, skip=[-3, 0],
                         tail=TailPosition(0, ()))
    with pytest.raises(ResumeStateError) as resumed:
        driver.start_iteration([5, 6, 7, 8], pool=(9,))
    assert resumed.value.field == "consumed" and resumed.value.indices == (-3,)


def test_every_error_and_warning_of_the_one_tree_is_importable_from_odb_core():
    """The README names errors bare and roots them at ``odb_core.ODBError``: each class of
    ``odb_core.errors`` (``ResumeStateError``, ``ConfigMismatchError``, ... were only there) is
    exported by ``odb_core`` as the same object, and every error derives from ``ODBError``."""
    import inspect

    import odb_core
    import odb_core.errors as errors

    defined = {name: cls for name, cls in inspect.getmembers(errors, inspect.isclass) if cls.__module__ == errors.__name__}
    assert {"ResumeStateError", "ConfigMismatchError", "UnsupportedSettingError"} <= set(defined)
    for name, cls in defined.items():
        assert getattr(odb_core, name, None) is cls and name in odb_core.__all__, name
        assert issubclass(cls, errors.ODBError) or issubclass(cls, errors.ODBWarning), name


def test_ranks_on_other_epochs_are_told_to_call_set_epoch_alike():
    """The epoch mismatch said to build every loader with the same configuration; what differs
    is the epoch each rank's loop asked for (``set_epoch``)."""
    from odb_core.epoch import EpochDriver
    from odb_core.errors import ConfigMismatchError

    drivers = [EpochDriver(ODBConfig(token_budget=10), r, 2, epoch=r) for r in range(2)]
    with pytest.raises(ConfigMismatchError) as info:
        drivers[1].check_hello([d.hello() for d in drivers])
    assert info.value.field == "epoch" and "set_epoch with the same epoch" in str(info.value)


@pytest.mark.parametrize(("field", "value"), [("token_budget", 2**63), ("seed", 2**63), ("seed", -(2**63) - 1),
                                              ("shuffle_steps", "yes"), ("shuffle_steps", 1)])
def test_the_budget_and_seed_fit_int64_and_shuffle_steps_takes_only_a_bool(field, value):
    """A budget of 2^63 + 10 passed and then failed mid-epoch as a WireFormatError blaming a rank's
    header (its room travels in an int64 field); a seed of 2^64 passed and then failed in the
    sampler's generator; ``shuffle_steps="yes"`` (or ``"off"``, 1) was coerced to a bool."""
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as err:
        ODBConfig(**{"token_budget": 10, field: value})
    assert err.value.errors()[0]["loc"][0] == field
    assert ODBConfig(token_budget=2**63 - 1, seed=-(2**63)).token_budget == 2**63 - 1


def test_form_groups_refuses_a_length_past_2_to_the_40_on_its_fast_path_too():
    """Plain int lengths skipped the check that other lengths get (pack_groups refused the same list)."""
    from odb_core.errors import InvalidSampleError
    from odb_core.grouping import MAX_LENGTH, form_groups

    with pytest.raises(InvalidSampleError, match="sample 1"):
        form_groups([10, MAX_LENGTH + 1], 100)
    assert form_groups([10, MAX_LENGTH], 100) == [[0], [1]]


def test_a_non_join_epoch_driver_refuses_a_resume_skip_naming_the_mode():
    """Non-join served the skipped positions again (join left them out)."""
    from odb_core.epoch import EpochDriver
    from odb_core.errors import UnsupportedSettingError

    with pytest.raises(UnsupportedSettingError) as err:
        EpochDriver(ODBConfig(token_budget=10, mode="non-join"), 0, 1, quota=4, skip=[0, 1])
    assert err.value.field == "mode"
