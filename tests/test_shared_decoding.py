"""The simulator's shared decoding is decision-neutral.

``odb_core.simulator.gather_round`` decodes each gather once and hands the decoded value
(``HeaderGather`` / ``StepGather``) to every simulated rank, where a rank in a real run
decodes the raw vectors itself. Every epoch must come out identical either way: every
step (positions, identities, lengths, counts, weights), every figure of the run, every
rank's final state and trace events, and the same error where a seeded bug breaks the
round. The reference below is the per-rank decoding (the raw vectors to every rank).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import odb_core.simulator as simulator
import odb_core.wire as wire
from model_checks.mutants import ADAPTER_MUTANTS, MUTANTS, driver
from model_checks.strategies import lengths_from_seed
from odb_core import ODBConfig, simulate
from odb_core.config import TARGET_POLICIES
from odb_core.epoch import Delivery, EpochDriver
from odb_core.loss import round_denominators, weight_denominator
from odb_core.schedules import SCHEDULES


def per_rank_gather_round(drivers: Sequence[EpochDriver]) -> tuple[bool, list[list[Any]]]:
    """The round as in a real run: every rank decodes the raw gathered vectors itself."""
    headers = [d.begin_round() for d in drivers]
    plans = [d.on_headers(headers) for d in drivers]
    if plans[0].done or plans[0].step_vector is None:
        return plans[0].done, [[] for _ in drivers]
    vectors = [plan.step_vector or [] for plan in plans]
    outs = [d.on_steps(vectors) for d in drivers]
    return False, [[o.step for o in out if isinstance(o, Delivery)] for out in outs]


def outcome(case: dict[str, Any]) -> Any:
    """Everything observable of one simulated epoch (or the error it raised)."""
    events: list[list[dict[str, Any]]] = []
    try:
        result = simulate(case["lengths"], case["world"], case["config"], case["schedule"], tokens=case["tokens"],
                          driver_cls=driver(case["mutant"]), events=events)
    except Exception as exc:  # noqa: BLE001 - the same error must come out both ways
        return ("raised", type(exc).__name__, str(exc))
    states = [(p.rank, p.round, p.iteration, p.emitted, sorted(p.buffered.items()), sorted(p.held),
               p.max_wait_rounds, p.skip_rounds, p.finished_ranks) for p in result.final_states]
    return (result.steps, result.shards, result.rounds, result.skip_rounds, result.payload_bytes,
            result.max_wait_rounds, result.unemitted_views, result.quota_emitted, result.max_step_samples,
            states, events)


@st.composite
def small_cases(draw: st.DrawFn) -> dict[str, Any]:
    world = draw(st.integers(1, 7))
    n = draw(st.one_of(st.integers(0, world + 1), st.integers(0, 150)))
    budget = draw(st.sampled_from([1, 7, 64, 1000, 4096]))
    buffer_size = draw(st.integers(1, 12))
    config = ODBConfig(
        token_budget=budget,
        buffer_size=buffer_size,
        depth=draw(st.one_of(st.none(), st.integers(buffer_size, buffer_size + 16))),
        mode=draw(st.sampled_from(["join", "non-join"])),
        loss_scaling=draw(st.sampled_from(["none", "sample", "approx", "exact"])),
        seed=draw(st.integers(0, 2**16)),
        target_policy=draw(st.sampled_from(TARGET_POLICIES)),
        overflow_policy=draw(st.sampled_from(["largest", "oldest"])),
        output_capacity=draw(st.one_of(st.none(), st.integers(1, 6))),
        regroup_padding=draw(st.sampled_from([None, 0.0, 0.02, 0.1])),
        shuffle_steps=draw(st.booleans()),
    )
    lengths = lengths_from_seed(n, budget, draw(st.integers(0, 2**32)), draw(st.sampled_from([0.0, 0.05])))
    tokens = None
    if draw(st.booleans()):
        tokens = [draw(st.integers(0, length)) if length < 50 else length // (1 + i % 3)
                  for i, length in enumerate(lengths)]
    mutant = draw(st.one_of(st.none(), st.sampled_from(sorted({**MUTANTS, **ADAPTER_MUTANTS}))))
    return {"world": world, "lengths": lengths, "tokens": tokens, "config": config,
            "schedule": draw(st.sampled_from(SCHEDULES)), "mutant": mutant}


@given(small_cases())
def test_shared_decoding_gives_the_per_rank_decoding_epoch(case):
    shared = outcome(case)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(simulator, "gather_round", per_rank_gather_round)
        reference = outcome(case)
    assert shared == reference


CASE = {"world": 5, "lengths": lengths_from_seed(120, 1000, 3, 0.0), "tokens": None,
        "config": ODBConfig(token_budget=1000, buffer_size=6), "schedule": "random", "mutant": None}


@pytest.mark.parametrize("shared_tail", [0.0, 0.3])
def test_simulated_ranks_share_one_decoding_per_gather(monkeypatch, shared_tail):
    """The sharing is real: a gather is decoded once, not once per rank, also with a shared
    tail's longer headers (decoded at the default length, every rank decoded its own: O(W^2))."""
    calls = {"headers": 0, "steps": 0}
    decode, init = wire.HeaderGather.decode.__func__, wire.StepGather.__init__

    def counting_decode(cls, *args):
        calls["headers"] += 1
        return decode(cls, *args)

    def counting_init(self, *args):
        calls["steps"] += 1
        init(self, *args)

    monkeypatch.setattr(wire.HeaderGather, "decode", classmethod(counting_decode))
    monkeypatch.setattr(wire.StepGather, "__init__", counting_init)
    config = CASE["config"].model_copy(update={"shared_tail": shared_tail})
    result = simulate(CASE["lengths"], CASE["world"], config, CASE["schedule"])
    assert calls["headers"] == result.rounds
    emitting = {(s.iteration, s.round) for s in result.steps[0]}  # every rank emits T >= 1 items in those
    assert calls["steps"] == len(emitting) > 1


def test_a_wrong_shared_decoding_is_caught(monkeypatch):
    """Non-vacuity: shared step sums off by one token make the epochs differ."""
    reference = outcome(CASE)
    init = wire.StepGather.__init__

    def off_by_one(self, *args):
        init(self, *args)
        self.global_tokens = [t + 1 for t in self.global_tokens]

    monkeypatch.setattr(simulator, "StepGather", type("Wrong", (wire.StepGather,), {"__init__": off_by_one}))
    assert outcome(CASE) != reference


@given(st.sampled_from(["none", "sample", "approx", "exact"]),
       st.lists(st.tuples(st.integers(0, 2000), st.integers(0, 50)), min_size=1, max_size=9), st.data())
def test_round_denominators_are_each_steps_weight_denominator(mode, headers, data):
    """The per-round denominators (global sums; "approx" over a common denominator) equal
    weight_denominator of each step's per-rank counts, which rank_weight uses."""
    world = len(headers)
    mean_tokens = [Fraction(t, s) if s else Fraction(0) for t, s in headers]
    target = data.draw(st.integers(1, 6))
    samples = [tuple(data.draw(st.integers(0, 40)) for _ in range(world)) for _ in range(target)]
    tokens = [tuple(data.draw(st.integers(0, 10**6)) for _ in range(world)) for _ in range(target)]
    got = round_denominators(mode, world, [sum(c) for c in samples], [sum(c) for c in tokens],
                             lambda: (samples, tokens), mean_tokens)
    assert got == [weight_denominator(mode, n, t, mean_tokens) for n, t in zip(samples, tokens)]


EDGE_VALUES = [2**63, -1, 0, 2**64, 2**63 - 1, 2**48, 2**48 - 1, 1.0, 2.5, True, 1, 7]
WIRE_VALUES = st.one_of(st.sampled_from(EDGE_VALUES), st.integers(0, 2**16))


def result_of(fn, *args):
    try:
        return ("ok", fn(*args))
    except Exception as exc:  # noqa: BLE001
        return ("raised", type(exc).__name__, str(exc))


def reference_step_sums(vectors, headers, target):
    pairs = wire.decode_steps(vectors, headers, target)
    return [sum(rank[i][j] for rank in pairs) for i in range(target) for j in (0, 1)]


def draw_round(data, target, sizes_st, corrupt_st):
    """One round's step vectors and headers for 1-5 ranks: READY ranks' (samples, tokens)
    items summing to about their header's count (off by -1..3), others all zero, then up
    to two values replaced from ``corrupt_st``."""
    headers, vectors = [], []
    for _ in range(data.draw(st.integers(1, 5))):
        status = data.draw(st.sampled_from([wire.Status.READY, wire.Status.READY, wire.Status.WAITING,
                                            wire.Status.FINISHED]))
        sizes = [data.draw(sizes_st) for _ in range(target)]
        ready = status is wire.Status.READY
        tokens = [data.draw(st.integers(0, 9999)) if ready else 0 for _ in sizes]
        samples = sum(sizes) + data.draw(st.integers(0, 3)) - data.draw(st.booleans()) if ready else 0
        held = sum(tokens) + data.draw(st.integers(0, 3)) - data.draw(st.booleans()) if ready and samples > 0 else 0
        headers.append(wire.Header(0, 0, status, 1, 0, max(samples, 0), max(held, 0)))
        vectors.append([v for n, t in zip(sizes, tokens) for v in ((n, t) if ready else (0, 0))])
    for _ in range(data.draw(st.integers(0, 2))):  # corrupt some values
        r, i = data.draw(st.integers(0, len(vectors) - 1)), data.draw(st.integers(0, target - 1))
        vectors[r][2 * i + data.draw(st.sampled_from([1, 0]))] = data.draw(corrupt_st)  # tokens, samples
    return vectors, headers


@settings(max_examples=400)
@given(st.data())
def test_fast_step_decoding_agrees_with_the_rank_by_rank_decoder(data):
    """Sums and every error (type, message, rank named) as decode_steps gives them, on
    valid, out-of-range, wrongly typed, self-contradicting and mis-sized vectors."""
    target = data.draw(st.integers(1, 4))
    vectors, headers = draw_round(data, target, st.integers(1, 5), WIRE_VALUES)
    if data.draw(st.integers(0, 9)) == 0:
        vectors[data.draw(st.integers(0, len(vectors) - 1))].append(0)
    assert result_of(wire._step_sums, vectors, headers, target) == result_of(reference_step_sums, vectors,
                                                                               headers, target)


@pytest.mark.parametrize("value", EDGE_VALUES)
@pytest.mark.parametrize("status", list(wire.Status))
@pytest.mark.parametrize("slot", [0, 1, 2, 3])
@pytest.mark.parametrize("rank", [0, 1])
def test_fast_step_decoding_agrees_on_every_edge_value(value, status, slot, rank):
    headers = [wire.Header(0, 0, wire.Status.READY, 2, 0, 9, 0), wire.Header(0, 0, wire.Status.READY, 2, 0, 9, 0)]
    vectors = [[2, 30, 3, 2**20], [1, 0, 4, 7]]
    headers[rank] = wire.Header(0, 0, status, 2 if status is wire.Status.READY else 0, 0,
                                9 if status is not wire.Status.FINISHED else 0, 0)
    if status is not wire.Status.READY:
        vectors[rank] = [0, 0, 0, 0]
    vectors[rank][slot] = value
    assert result_of(wire._step_sums, vectors, headers, 2) == result_of(reference_step_sums, vectors, headers, 2)


def reference_headers(vectors, world, iteration, rnd):
    """decode_headers as it was: rank by rank, then the round check."""
    if len(vectors) != world:
        raise wire.WireFormatError(f"header gather: expected {world} vectors, got {len(vectors)}")
    headers = [wire.decode_header(v, r) for r, v in enumerate(vectors)]
    for r, h in enumerate(headers):
        if (h.iteration, h.round) != (iteration, rnd):
            raise wire.PeerInconsistencyError(
                f"rank {r} is at iteration {h.iteration} round {h.round}, expected iteration {iteration} round {rnd}")
    return headers


@settings(max_examples=400)
@given(st.data())
def test_fast_header_decoding_agrees_with_the_rank_by_rank_decoder(data):
    world = data.draw(st.integers(1, 5))
    vectors = []
    for _ in range(world):
        status = data.draw(st.sampled_from(list(wire.Status)))
        samples = data.draw(st.integers(0, 50)) if status is not wire.Status.FINISHED else 0
        groups = data.draw(st.integers(1, max(samples, 1))) if status is wire.Status.READY else 0
        tokens = data.draw(st.integers(0, 10**6)) if samples else 0
        vectors.append([2, 5, int(status), groups, data.draw(st.integers(0, 3)), samples, tokens])
    for _ in range(data.draw(st.sampled_from([0, 1, 1, 2]))):
        vectors[data.draw(st.integers(0, world - 1))][data.draw(st.integers(0, 6))] = data.draw(WIRE_VALUES)
    if data.draw(st.integers(0, 9)) == 0:
        vectors[data.draw(st.integers(0, world - 1))].pop()
    args = (vectors, data.draw(st.sampled_from([world, world + 1])), 2, 5)
    assert result_of(wire.decode_headers, *args) == result_of(reference_headers, *args)


# ---- the step gather as raw bytes (what the collate process hands the core) ----------------

INT64_VALUES = st.one_of(st.sampled_from([-1, -(2**63), 2**63 - 1, 2**48, 2**48 - 1, 2**47, 0, 1]),
                         st.integers(0, 2**16), st.integers(-(2**63), 2**63 - 1))


def as_bytes(vectors: Sequence[Sequence[int]]) -> bytes:
    """The gather as a W x 2T int64 tensor's little-endian bytes."""
    flat = [v for vector in vectors for v in vector]
    return struct.pack(f"<{len(flat)}q", *flat)


def bytes_gather_round(drivers: Sequence[EpochDriver]) -> tuple[bool, list[list[Any]]]:
    """A real run's round as the collate process runs it: each rank gets the step gather's raw bytes."""
    headers = [d.begin_round() for d in drivers]
    plans = [d.on_headers(headers) for d in drivers]
    if plans[0].done or plans[0].step_vector is None:
        return plans[0].done, [[] for _ in drivers]
    vectors = [plan.step_vector or [] for plan in plans]
    if len({len(v) for v in vectors}) > 1:
        # a (mutant) rank sent a vector of another length: a real all_gather of unequal tensors
        # fails in Gloo and delivers no bytes at all, so each rank decodes the lists (the rank-named
        # error); the bytes path is compared wherever a gather of bytes can exist
        outs = [d.on_steps(vectors) for d in drivers]
    else:
        raw = as_bytes(vectors)
        outs = [d.on_steps(memoryview(raw)) for d in drivers]
    return False, [[o.step for o in out if isinstance(o, Delivery)] for out in outs]


@settings(max_examples=60)
@given(small_cases())
def test_step_bytes_give_the_per_rank_decoding_epoch(case):
    """Every epoch (steps, weights, figures, states, errors) is the same when each rank reads
    the step gather's raw bytes instead of lists."""
    with pytest.MonkeyPatch.context() as m:
        m.setattr(simulator, "gather_round", per_rank_gather_round)
        reference = outcome(case)
        m.setattr(simulator, "gather_round", bytes_gather_round)
        assert outcome(case) == reference


def bytes_agree_with_lists(vectors, headers, target, kind=bytes) -> None:
    """The bytes path's sums or error (type, message, rank) are the lists' (P6)."""
    raw = kind(as_bytes(vectors))
    assert result_of(wire._step_sums_bytes, raw, headers, target) == result_of(wire._step_sums, vectors, headers,
                                                                               target)


@settings(max_examples=80)
@given(st.data())
def test_step_bytes_agree_with_the_lists(data):
    """Sums and every error as the list path gives them, on valid vectors and on negative,
    >= 2^48, empty, over-held (samples or loss tokens) and non-idle-while-inactive ones, for T up to 40 (every fold
    shape); a bytes StepGather reads each rank's vector and the columns back."""
    target = data.draw(st.integers(1, 40))
    vectors, headers = draw_round(data, target, st.one_of(st.integers(1, 5), st.integers(1, 2**40)), INT64_VALUES)
    bytes_agree_with_lists(vectors, headers, target, data.draw(st.sampled_from([bytes, bytearray, memoryview])))
    gather = wire.HeaderGather(headers, 0, 0)
    try:
        from_lists = wire.StepGather(vectors, gather, target)
    except (wire.WireFormatError, wire.PeerInconsistencyError):
        return
    from_bytes = wire.StepGather(as_bytes(vectors), gather, target)
    assert [from_bytes.vector(r) for r in range(len(vectors))] == [from_lists.vector(r) for r in range(len(vectors))]
    assert from_bytes.columns() == from_lists.columns() and from_bytes.vectors == vectors


def test_step_bytes_of_the_wrong_size_are_a_wire_format_error():
    headers = [wire.Header(0, 0, wire.Status.READY, 1, 0, 4, 0)] * 2
    with pytest.raises(wire.WireFormatError, match=r"expected 2 x 4 int64 values \(64 bytes\), got 56 bytes"):
        wire._step_sums_bytes(as_bytes([[1, 2, 1, 2], [1, 2, 1]]), headers, 2)


@pytest.mark.parametrize("bug", ["fold", "empty"])
def test_a_wrong_bytes_check_is_caught(monkeypatch, bug):
    """Seeded bugs in the bytes path, each caught by the comparison above: the sample sum
    folded at the wrong shift (an over-held rank passes) or the empty-item test lost."""
    ready = wire.Header(0, 0, wire.Status.READY, 3, 0, 6, 70)
    over_held = ([[1, 10, 2, 20, 4, 40]], [ready], 3)  # 7 samples, 6 held
    empty = ([[1, 10, 0, 20, 4, 40]], [ready], 3)
    for case in (over_held, empty):
        bytes_agree_with_lists(*case)
    masks = wire._sample_masks

    def wrong(target):
        samples, bit48, folds = masks(target)
        if bug == "fold":
            return samples, bit48, tuple((2 * shift, mask) for shift, mask in folds)
        return samples, 0, folds

    monkeypatch.setattr(wire, "_sample_masks", wrong)
    with pytest.raises(AssertionError):
        bytes_agree_with_lists(*(over_held if bug == "fold" else empty))
