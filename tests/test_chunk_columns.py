"""Chunks of uniform dict samples travel as columns (``odb_torch.chunk_columns``): every sample
comes back with the same keys in the same order, values, dtypes and shapes as the general
packing gives, and the measures counted over whole columns are exactly the per-sample
default measures (P3's lengths, P7's loss tokens), or the per-sample path names the sample."""

from __future__ import annotations

import pickle

import torch
from hypothesis import given
from hypothesis import strategies as st

from odb_core import InvalidSampleError
from odb_torch.chunk_columns import column_measures, columns_of
from odb_torch.sample_packing import Packer, default_loss_tokens, pack, unpack

DTYPES = [torch.int64, torch.int32, torch.uint8, torch.int16, torch.float16, torch.float32, torch.bool,
          torch.complex64]
SHAPES = st.lists(st.integers(0, 3), min_size=0, max_size=3).map(tuple)


def _tensor(values: list[int], dtype: torch.dtype, shape: tuple[int, ...], conj: bool) -> torch.Tensor:
    n = 1
    for d in shape:
        n *= d
    t = torch.tensor((values * (n // max(len(values), 1) + 1))[:n] if values else [0] * n).to(dtype).reshape(shape)
    return t.conj() if conj and dtype.is_complex else t


@st.composite
def uniform_chunks(draw: st.DrawFn) -> list[dict[object, object]]:
    """Samples with the same keys in one order: tensor fields of one dtype each (shapes free,
    0-d and empty included), and plain-valued fields."""
    n = draw(st.integers(1, 6))
    fields = draw(st.lists(st.sampled_from(["input_ids", "labels", "pixel", "idx", "text", 7]), unique=True,
                           max_size=5))
    kinds = {f: draw(st.sampled_from(DTYPES)) if f != "idx" and f != "text" else f for f in fields}
    samples = []
    for _ in range(n):
        sample: dict[object, object] = {}
        for f in fields:
            kind = kinds[f]
            if kind == "idx":
                sample[f] = draw(st.one_of(st.integers(-5, 9), st.none(), st.floats(allow_nan=False)))
            elif kind == "text":
                sample[f] = draw(st.text(max_size=3))
            else:
                sample[f] = _tensor(draw(st.lists(st.integers(-100, 99), max_size=6)), kind, draw(SHAPES),
                                    draw(st.booleans()))
        samples.append(sample)
    return samples


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.resolve_conj(), b))
    return a == b or (a != a and b != b)


@given(samples=uniform_chunks())
def test_uniform_dict_chunks_travel_as_columns_and_come_back_whole(samples):
    chunk = pickle.loads(pickle.dumps(pack(samples)))
    assert chunk.columns is not None, "a chunk of uniform plain dicts travels as columns"
    back = unpack(chunk)
    assert len(back) == len(samples)
    for a, b in zip(samples, back):
        assert type(b) is dict and list(a) == list(b)
        assert all(_same(a[k], b[k]) for k in a), (a, b)


def test_unpacked_columns_are_separate_writable_tensors():
    """A collate_fn may edit a sample in place, also with an operand that requires grad, and an
    edit stays inside its own sample."""
    samples = [{"input_ids": torch.arange(3), "x": torch.ones(2, 2)}, {"input_ids": torch.arange(2), "x": torch.ones(2, 2)}]
    back = unpack(pickle.loads(pickle.dumps(pack(samples))))
    back[0]["x"].add_(torch.ones(2, requires_grad=True))
    back[0]["input_ids"][0] = -100
    assert back[0]["x"].tolist() == [[2.0, 2.0]] * 2 and back[1]["x"].tolist() == [[1.0, 1.0]] * 2
    assert back[0]["input_ids"].tolist() == [-100, 1, 2] and back[1]["input_ids"].tolist() == [0, 1]


@given(data=st.data())
def test_chunks_that_are_not_uniform_plain_dicts_keep_the_general_packing(data):
    """Another key order, a missing key, a field of two dtypes or of tensors and values, a nested
    container, a dict subclass: the general packing (never columns), and the samples round-trip."""
    from collections import OrderedDict

    a = {"input_ids": torch.arange(3), "labels": torch.arange(3)}
    odd = data.draw(st.sampled_from([
        {"labels": torch.arange(2), "input_ids": torch.arange(2)},
        {"input_ids": torch.arange(2)},
        {"input_ids": torch.arange(2, dtype=torch.int32), "labels": torch.arange(2)},
        {"input_ids": torch.arange(2), "labels": 5},
        {"input_ids": torch.arange(2), "labels": [torch.tensor(1)]},
        OrderedDict([("input_ids", torch.arange(2)), ("labels", torch.arange(2))]),
    ]))
    samples = [a, odd] if data.draw(st.booleans()) else [odd, a]
    chunk = pickle.loads(pickle.dumps(pack(samples)))
    assert chunk.columns is None
    for x, y in zip(samples, unpack(chunk)):
        assert type(x) is type(y) and list(x) == list(y)
        assert all(_same(x[k], y[k]) if not isinstance(x[k], list) else
                   [t.tolist() for t in x[k]] == [t.tolist() for t in y[k]] for k in x)


LABELS = st.lists(st.sampled_from([-100, -1, 0, 5, 156]), max_size=8)


@given(rows=st.lists(st.tuples(LABELS, st.integers(-2, 3)), min_size=1, max_size=8), with_labels=st.booleans(),
       dtype=st.sampled_from([torch.int64, torch.int32, torch.uint8, torch.float16, torch.float32, torch.bool]),
       column=st.booleans())
def test_column_measures_are_the_default_measures_of_every_sample(rows, with_labels, dtype, column):
    """Counted over whole columns or sample by sample, every sample gets its length (its
    ``input_ids``) and its loss tokens (labels != -100, P7); a count out of range is an
    ``InvalidSampleError`` naming that sample, whichever way it was found. Lengths are the
    labels' own give or take a few, so both in-range chunks and a sample too short are common."""
    samples = []
    for labels, extra in rows:
        sample: dict[str, object] = {"input_ids": torch.arange(max(len(labels) + extra, 0))}
        if with_labels:
            t = torch.tensor(labels).to(dtype)
            sample["labels"] = t.reshape(-1, 1) if column else t
        samples.append(sample)
    items = [(100 + k, s) for k, s in enumerate(samples)]
    columns = columns_of(samples)
    assert columns is not None
    chunk = Packer(rank=2)(items)
    expected = [(len(s["input_ids"]), default_loss_tokens(s, len(s["input_ids"]))) for s in samples]
    bad = [k for k, (n, t) in enumerate(expected) if not 0 <= t <= n]
    countable = not (with_labels and dtype == torch.bool)  # bool labels are counted sample by sample
    if not countable:
        assert column_measures(columns, len(samples)) is None
    if bad:
        assert isinstance(chunk.error, InvalidSampleError) and chunk.error.indices == (100 + bad[0],)
        assert chunk.error.rank == 2
    else:
        assert chunk.error is None and chunk.measures == expected
        assert all(type(x) is int for m in chunk.measures for x in m)
        if countable:
            assert column_measures(columns, len(samples)) == expected, "counted over whole columns"


@given(kind=st.sampled_from(["float", "bool", "2d", "0d"]))
def test_input_ids_that_are_not_one_row_of_token_ids_are_named_as_before(kind):
    ids = {"float": torch.ones(3), "bool": torch.ones(3, dtype=torch.bool), "2d": torch.ones(1, 3, dtype=torch.int64),
           "0d": torch.tensor(3)}[kind]
    chunk = Packer(rank=1)([(7, {"input_ids": ids}), (8, {"input_ids": ids.clone()})])
    assert isinstance(chunk.error, InvalidSampleError) and chunk.error.indices == (7,)
    assert "input_ids" in str(chunk.error)


def test_what_a_length_fn_does_to_a_sample_travels_with_it():
    """A user's ``length_fn`` (or ``loss_tokens_fn``) runs before the samples are copied into
    columns: a key it adds or a value it edits arrives, as with the general packing."""
    def length_fn(sample):
        sample["n"] = len(sample["input_ids"])
        sample["input_ids"][0] = 1
        return sample["n"]

    items = [(0, {"input_ids": torch.zeros(3, dtype=torch.int64)}), (1, {"input_ids": torch.zeros(2, dtype=torch.int64)})]
    chunk = pickle.loads(pickle.dumps(Packer(rank=0, length_fn=length_fn)(items)))
    assert chunk.columns is not None and chunk.measures == [(3, 3), (2, 2)]
    assert [(s["input_ids"].tolist(), s["n"]) for s in unpack(chunk)] == [([1, 0, 0], 3), ([1, 0], 2)]


class Name(str):
    """A key equal to a plain string, of another type."""


def test_equal_keys_of_other_types_stay_each_samples_own():
    for first, other in ((1, True), ("a", Name("a"))):
        samples = [{first: torch.arange(2)}, {other: torch.arange(3)}]
        back = unpack(pickle.loads(pickle.dumps(pack(samples))))
        assert [type(next(iter(s))) for s in back] == [type(first), type(other)]


def test_a_chunk_too_large_to_send_by_value_shares_one_tensor_per_dtype(monkeypatch):
    """Over the inline limit the buffers stay tensors, which the queue shares (a descriptor's round
    trip each): the fields of one dtype share one, and the samples come back whole."""
    import odb_torch.sample_packing as sp

    monkeypatch.setattr(sp, "INLINE_BYTES", 16)
    samples = [{"input_ids": torch.arange(n), "labels": torch.arange(n) - 100, "mask": torch.ones(n, 2),
                "idx": n} for n in (3, 5, 4)]
    chunk = pack(samples)
    assert chunk.columns is not None
    shared = {id(c.buffer): c.buffer for c in chunk.columns if c.dtype is not None}
    assert all(isinstance(b, torch.Tensor) for b in shared.values())
    assert sorted(str(b.dtype) for b in shared.values()) == ["torch.float32", "torch.int64"], "one per dtype"
    back = unpack(pickle.loads(pickle.dumps(chunk)))
    assert all(_same(a[k], b[k]) for a, b in zip(samples, back) for k in a)
    back[0]["input_ids"][0] = 7  # each sample's own view: an edit stays in it
    assert back[1]["input_ids"].tolist() == [0, 1, 2, 3, 4] and back[0]["labels"].tolist() == [-100, -99, -98]


def test_fields_whose_bytes_are_one_interned_object_stay_apart():
    """Python keeps one object for b"" and for each one-byte string: two fields with those bytes
    still come back with their own dtypes and storage."""
    samples = [{"a": torch.tensor([5], dtype=torch.uint8), "b": torch.tensor([5], dtype=torch.uint8),
                "c": torch.tensor([], dtype=torch.int32), "d": torch.tensor([], dtype=torch.int64),
                "e": torch.tensor([True]), "f": torch.tensor([1], dtype=torch.uint8)}]
    back = unpack(pickle.loads(pickle.dumps(pack(samples))))[0]
    assert [back[k].dtype for k in "abcdef"] == [samples[0][k].dtype for k in "abcdef"]
    back["a"][0] = 9
    back["f"][0] = 0
    assert back["b"].tolist() == [5] and back["e"].tolist() == [True]


def test_a_large_chunk_of_tensors_that_require_grad_pickles_either_way(monkeypatch):
    """Over the inline limit buffers travel as tensors, which the queue's pickler refuses when they
    require grad: both packings send values only."""
    from multiprocessing.reduction import ForkingPickler

    import odb_torch.sample_packing as sp

    monkeypatch.setattr(sp, "INLINE_BYTES", 4)
    for samples in ([{"x": torch.ones(3, requires_grad=True) * 2}], [{"x": [torch.ones(3, requires_grad=True) * 2]}]):
        chunk = pack(samples)
        back = unpack(ForkingPickler.loads(bytes(ForkingPickler.dumps(chunk))))
        x = back[0]["x"] if isinstance(back[0]["x"], torch.Tensor) else back[0]["x"][0]
        assert x.tolist() == [2.0, 2.0, 2.0] and not x.requires_grad
