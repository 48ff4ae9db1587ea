"""Wire format: headers and step vectors round-trip; malformed or inconsistent peer data raises."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from odb_core import Header, ODBConfig, PeerInconsistencyError, RankProtocol, Status, WireFormatError
from odb_core.wire import HEADER_LEN, TAIL_HEADER_LEN, decode_header, decode_steps, payload_bytes

ints = st.integers(0, 2**40)


@st.composite
def headers(draw):
    status = draw(st.sampled_from(list(Status)))
    if status in (Status.FINISHED, Status.IDLE):  # IDLE: a shared tail's rank with nothing now
        groups = samples = tokens = 0
    else:
        samples = draw(st.integers(0 if status is Status.WAITING else 1, 10_000))
        groups = 0 if status is Status.WAITING else draw(st.integers(1, samples))
        tokens = draw(ints) if samples else 0  # loss tokens come with samples
    return Header(draw(ints), draw(ints), status, groups, draw(ints), samples, tokens)


@given(headers())
def test_header_round_trips(header):
    vector = header.encode()
    assert len(vector) == HEADER_LEN
    assert decode_header(vector, 0) == header


@pytest.mark.parametrize(
    ("vector", "error", "needle"),
    [
        ([0] * 6, WireFormatError, "expected 7"),
        ([0, 0, 1, 1, 0, -1, 0], WireFormatError, "field 5"),
        ([0, 0, 9, 0, 0, 0, 0], WireFormatError, "unknown status 9"),
        ([0, 0, 2, 0, 0, 3, 0], PeerInconsistencyError, "finished while holding 3"),
        ([0, 0, 0, 2, 0, 5, 0], PeerInconsistencyError, "waiting with 2 groups"),
        ([0, 0, 1, 0, 0, 5, 0], PeerInconsistencyError, "ready with 0 groups"),
        ([0, 0, 1, 6, 0, 5, 0], PeerInconsistencyError, "ready with 6 groups over 5"),
        ([0, 0, 1, 1, 0, 2**63, 0], WireFormatError, "field 5"),
        ([0, 0, 1, 1, 0, 2.7, 0], WireFormatError, "field 5 is 2.7, not an integer"),
        ([0, 0, 1, 1, 0, "2", 0], WireFormatError, "field 5 is '2', not an integer"),
        ([0, 0, 1, 1, 0, None, 0], WireFormatError, "not a vector of integers"),
        ([0, 0, 1, 1, 0, float("nan"), 0], WireFormatError, "not a vector of integers"),
        (None, WireFormatError, "not a vector of integers"),
        ([0, 0, 0, 0, 0, 0, 5], PeerInconsistencyError, "5 loss tokens and a load of 0 without samples"),
    ],
)
def test_malformed_or_inconsistent_header_raises(vector, error, needle):
    with pytest.raises(error, match=needle):
        decode_header(vector, 3)


@pytest.mark.parametrize(
    ("vector", "needle"),
    [
        ([0, 0, 0, 0, 0, 5, 9, 2, 40, 300], "300 room in held groups with 5 samples and 2 pending"),
        ([0, 0, 0, 0, 0, 0, 0, 0, 0, 300], "300 room in held groups with 0 samples"),
        ([0, 0, 3, 0, 0, 0, 0, 0, 0, 300], "idle while holding"),
    ],
)
def test_a_tail_header_with_room_it_cannot_have_raises(vector, needle):
    """The packed pool's ``room`` comes only from held groups of a rank whose views have all
    arrived: room with views pending, with no samples, or from an idle rank is a peer's bug."""
    with pytest.raises(PeerInconsistencyError, match=needle):
        decode_header(vector, 3, TAIL_HEADER_LEN)
    assert decode_header([0, 0, 0, 0, 0, 5, 9, 0, 40, 300], 3, TAIL_HEADER_LEN).room == 300


def ready(samples=4, groups=2):
    return Header(0, 0, Status.READY, groups, 0, samples, 10)


def idle():
    return Header(0, 0, Status.WAITING, 0, 0, 0, 0)


@pytest.mark.parametrize(
    ("vectors", "hdrs", "target", "error", "needle"),
    [
        ([[1, 1, 1, 1]], [ready()], 3, WireFormatError, "expected 6"),
        ([[1, 1, 0, 0]], [ready()], 2, PeerInconsistencyError, "empty item"),
        ([[3, 1, 2, 1]], [ready()], 2, PeerInconsistencyError, "more samples than the 4"),
        ([[2, 6, 1, 5]], [ready()], 2, PeerInconsistencyError, "more loss tokens than the 10"),
        ([[2, 6, 1.5, 1]], [ready()], 2, WireFormatError, "field 2 is 1.5"),
        ([[0, 0, 1, 0]], [idle()], 2, PeerInconsistencyError, "not ready but sent"),
        ([[0, 0]], [idle(), idle()], 1, WireFormatError, "expected 2 vectors"),
    ],
)
def test_malformed_or_inconsistent_step_vector_raises(vectors, hdrs, target, error, needle):
    with pytest.raises(error, match=needle):
        decode_steps(vectors, hdrs, target)


def test_payload_grows_with_groups_not_buffer():
    assert payload_bytes(0) == 56
    assert payload_bytes(10) == 56 + 160
    assert payload_bytes(0, pooled=True) == 80 and payload_bytes(10, pooled=True) == 80 + 160  # 3 more fields


def two_ranks():
    cfg = ODBConfig(token_budget=100, buffer_size=2)
    protos = [RankProtocol(cfg, r, 2, [10 * r + i for i in range(3)]) for r in range(2)]
    for p in protos:
        for pos in p.fetch():
            p.arrive(pos, 30)
    return protos


def test_peer_in_another_round_is_rejected():
    a, b = two_ranks()
    ha, hb = a.begin_round(), b.begin_round()
    hb[1] = 7
    with pytest.raises(PeerInconsistencyError, match="rank 1 is at iteration 0 round 7"):
        a.on_headers([ha, hb])


def test_tampered_own_header_is_rejected_and_state_kept():
    a, b = two_ranks()
    ha, hb = a.begin_round(), b.begin_round()
    forged = list(ha)
    forged[6] += 1
    with pytest.raises(PeerInconsistencyError, match="differs from the one sent"):
        a.on_headers([forged, hb])
    plan = a.on_headers([ha, hb])  # the rejected call changed nothing
    assert plan.target >= 1


@pytest.mark.parametrize("raw", [False, True])
def test_a_step_gather_with_more_loss_tokens_than_its_header_held_is_refused_on_both_paths(raw):
    """The step gather checked a rank's samples against its header, not its loss tokens: a peer
    reporting 10^12 tokens it never held was accepted, and every rank's P7 weights went wrong."""
    import struct

    from odb_core.wire import HeaderGather, StepGather

    headers = HeaderGather.decode([[0, 0, 1, 1, 0, 2, 5], [0, 0, 0, 0, 0, 0, 0]], 2, 0, 0)
    vectors = [[1, 10**12], [0, 0]]
    gathered = struct.pack("<4q", *vectors[0], *vectors[1]) if raw else vectors
    with pytest.raises(PeerInconsistencyError, match="more loss tokens than the 5"):
        StepGather(gathered, headers, 1)
    fine = [[1, 5], [0, 0]]
    assert StepGather(struct.pack("<4q", *fine[0], *fine[1]) if raw else fine, headers, 1).global_tokens == [5]


def test_a_gather_with_loss_tokens_but_no_samples_is_refused_on_the_fast_path_too():
    """The check was added to decode_header only: HeaderGather's one-pass decoder (every round's,
    without a shared tail) accepted a waiting header with 10^12 tokens and no samples."""
    from odb_core.wire import decode_headers

    with pytest.raises(PeerInconsistencyError, match="rank 1 reports 1000000000000 loss tokens"):
        decode_headers([[0, 0, 0, 0, 0, 3, 30], [0, 0, 0, 0, 0, 0, 10**12]], 2, 0, 0)


@pytest.mark.parametrize("raw", [False, True])
def test_wire_errors_carry_the_rank_whose_vector_is_wrong(raw):
    """Every error names the rank in its message; its ``rank`` attribute was None."""
    import struct

    from odb_core.wire import HeaderGather, StepGather, decode_headers

    with pytest.raises(WireFormatError) as header:
        decode_headers([[0, 0, 1, 1, 0, 2, 5], [0, 0, 9, 0, 0, 0, 0]], 2, 0, 0)
    assert header.value.rank == 1
    with pytest.raises(PeerInconsistencyError) as stale:
        decode_headers([[0, 0, 1, 1, 0, 2, 5], [0, 1, 1, 1, 0, 2, 5]], 2, 0, 0)
    assert stale.value.rank == 1
    headers = HeaderGather.decode([[0, 0, 0, 0, 0, 0, 0], [0, 0, 1, 1, 0, 2, 5]], 2, 0, 0)
    vectors = [[0, 0], [3, 5]]  # rank 1 emits 3 samples of the 2 it held
    with pytest.raises(PeerInconsistencyError) as steps:
        StepGather(struct.pack("<4q", *vectors[0], *vectors[1]) if raw else vectors, headers, 1)
    assert steps.value.rank == 1
