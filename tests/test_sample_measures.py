"""Measuring samples in the DataLoader workers (``odb_torch.sample_packing.Packer``): a length
or loss-token count is used only if it is an integer in range; anything else is an
``InvalidSampleError`` naming the sample and rank, returned with the chunk (never raised
in the worker, where its attributes would be lost), and never silently converted."""

from __future__ import annotations

import math
import pickle

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from odb_core import InvalidSampleError, SampleLoadError
from odb_torch.sample_packing import IndexedDataset, Packer, as_count, default_loss_tokens, label_counts

VALUES = st.one_of(
    st.integers(-5, 5000), st.floats(allow_nan=True), st.text(max_size=4), st.none(), st.booleans(),
    st.integers(0, 5000).map(np.int64), st.integers(0, 5000).map(lambda i: torch.tensor(i)),
    st.floats(0, 5000).map(lambda f: torch.tensor(f)), st.just(math.nan), st.just(895.7), st.just("12"),
)


def integral(value: object) -> bool:
    """What a count must be: an int (not bool), a NumPy integer or a one-element integer tensor."""
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and not value.dtype.is_floating_point and value.dtype != torch.bool
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


@given(length=VALUES, tokens=VALUES)
def test_measure_accepts_exactly_the_integer_counts_in_range(length, tokens):
    packer = Packer(rank=3, length_fn=lambda s: length, loss_tokens_fn=lambda s: tokens)
    chunk = packer([(17, {"input_ids": [1, 2]})])
    ok = integral(length) and integral(tokens) and 0 <= int(length) and 0 <= int(tokens) <= int(length)
    if ok:
        assert chunk.error is None and chunk.measures == [(int(length), int(tokens))]
        assert all(type(x) is int for x in chunk.measures[0])
    else:
        assert isinstance(chunk.error, InvalidSampleError), (length, tokens)
        assert (chunk.error.rank, chunk.error.indices) == (3, (17,)) and "sample 17" in str(chunk.error)


def test_the_error_survives_the_trip_from_a_worker_with_its_attributes():
    chunk = Packer(rank=1, length_fn=lambda s: "12")([(5, {}), (9, {})])
    error = pickle.loads(pickle.dumps(chunk)).error
    assert isinstance(error, InvalidSampleError) and (error.rank, error.indices) == (1, (5,))


def test_a_failing_getitem_names_its_index_and_rank_in_the_chunk():
    class Broken(torch.utils.data.Dataset):  # type: ignore[type-arg]
        def __len__(self) -> int:
            return 10

        def __getitem__(self, i: int) -> dict[str, list[int]]:
            if i == 4:
                raise KeyError("corrupt record")
            return {"input_ids": [1] * i}

    data = IndexedDataset(Broken(), rank=2)
    chunk = Packer(rank=2)([(i, data[i]) for i in (3, 4, 5)])
    assert isinstance(chunk.error, SampleLoadError) and (chunk.error.rank, chunk.error.indices) == (2, (4,))
    assert "corrupt record" in str(chunk.error) and "Traceback" in str(chunk.error)


@pytest.mark.parametrize("value", [7, np.int32(7), torch.tensor(7), torch.tensor([7])])
def test_integer_types_count(value):
    assert as_count(value) == 7


ROWS = st.lists(st.integers(0, 1000), max_size=12)
INPUT_IDS = st.one_of(
    ROWS.map(lambda r: ("row", r)),                                              # a list of ids
    ROWS.map(lambda r: ("row", torch.tensor(r, dtype=torch.int64))),             # a 1-D tensor
    ROWS.map(lambda r: ("row", np.array(r, dtype=np.int64))),                    # a 1-D array
    ROWS.filter(len).map(lambda r: ("batched", torch.tensor([r]))),              # tokenizer(..., return_tensors="pt")
    ROWS.filter(len).map(lambda r: ("batched", [r])),                            # a batched tokenizer call
    st.text(min_size=1, max_size=8).map(lambda t: ("text", t)),                  # text, not ids
    ROWS.filter(len).map(lambda r: ("float", torch.tensor(r, dtype=torch.float32) + 0.5)),  # values, not ids
    ROWS.filter(len).map(lambda r: ("bool", torch.tensor(r, dtype=torch.bool))),  # a mask, not ids
)


@given(case=INPUT_IDS)
def test_the_default_length_takes_only_one_row_of_token_ids(case):
    """The default length is the number of token ids of a 1-D ``input_ids``; a batched row
    (``[1, L]``, which ``len`` would count as 1 and so break the budget, P3) or a string is an
    InvalidSampleError naming the sample, the rank and ``input_ids``, never a silent length;
    so is a float or bool tensor (no token ids: collated, a cast would change them)."""
    kind, ids = case
    chunk = Packer(rank=1)([(23, {"input_ids": ids})])
    if kind == "row":
        assert chunk.error is None and chunk.measures == [(len(ids), len(ids))]
    else:
        assert isinstance(chunk.error, InvalidSampleError), (kind, ids)
        assert (chunk.error.rank, chunk.error.indices) == (1, (23,)) and "input_ids" in str(chunk.error)


def test_too_many_default_loss_tokens_name_the_labels_not_a_function_never_passed():
    chunk = Packer(rank=0)([(4, {"input_ids": [1, 2], "labels": [1, 2, 3]})])
    assert isinstance(chunk.error, InvalidSampleError) and "labels" in str(chunk.error)
    assert "loss_tokens_fn" not in str(chunk.error)


LABEL_ROWS = st.tuples(
    st.lists(st.sampled_from([-100, -1, 0, 1, 7, 100]), max_size=9),
    st.sampled_from([torch.int64, torch.int32, torch.int16, torch.float32, torch.float64, torch.bool]),
    st.sampled_from(["flat", "column", "list", "none", "strided"]),
)


def _labels(row: list[int], dtype: torch.dtype, shape: str) -> object:
    if shape == "list":
        return list(row)
    t = torch.tensor(row, dtype=dtype)
    if shape == "column":
        return t.reshape(-1, 1)
    if shape == "strided":  # a non-contiguous view: every other label of a longer row
        return torch.stack([t, torch.full_like(t, -100)], dim=1)[:, 0]
    return t


@given(rows=st.lists(LABEL_ROWS, max_size=12))
def test_the_chunk_wide_label_count_is_the_default_count_of_every_sample(rows):
    """``label_counts`` (a few tensor operations per chunk) gives each sample exactly what
    ``default_loss_tokens`` counts one by one (labels != -100, P7's loss tokens), for any mix of
    dtypes, shapes, empty rows and non-contiguous views in one chunk, and None for samples it
    leaves to the per-sample count (lists, no labels, bool)."""
    samples = [{"input_ids": list(range(9))} if shape == "none" else
               {"input_ids": list(range(9)), "labels": _labels(row, dtype, shape)} for row, dtype, shape in rows]
    counts = label_counts(samples)
    for sample, got in zip(samples, counts):
        labels = sample.get("labels")
        if isinstance(labels, torch.Tensor) and labels.dtype != torch.bool:
            assert got == default_loss_tokens(sample, 9) and type(got) is int
        else:
            assert got is None
    chunk = Packer(rank=0)(list(enumerate(samples)))
    assert chunk.error is None  # at most 9 labels for 9 input ids: every count is in range
    assert chunk.measures == [(9, default_loss_tokens(s, 9)) for s in samples]  # whichever way counted


def test_a_failing_chunk_wide_count_falls_back_to_counting_each_sample(monkeypatch):
    """Whatever goes wrong in the chunk-wide count, the samples are counted one by one: the
    same measures, and a sample that cannot be counted is still an error naming it."""
    import odb_torch.sample_packing as sp

    def broken(samples):
        raise RuntimeError("a tensor type the chunk-wide count cannot take")

    monkeypatch.setattr(sp, "_label_counts", broken)
    good = [(3, {"input_ids": [1, 2, 3], "labels": torch.tensor([-100, 5, 6])})]
    assert Packer(rank=0)(good).measures == [(3, 2)]
    bad = Packer(rank=2)(good + [(8, {"input_ids": [1, 2], "labels": [1, 2, 3]})])
    assert isinstance(bad.error, InvalidSampleError) and (bad.error.rank, bad.error.indices) == (2, (8,))
