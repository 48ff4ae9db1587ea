"""Edge cases of the two collates and the loss-token counts that must agree with them: fields
that differ between samples or carry one entry per token (``packed_collate``), padded samples
in a padding-free row, integer dtypes of every width (``pad_collate``), label rows longer than
their own sample, and unsigned labels (whose ``-100`` comparison wraps)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from odb_core.errors import InvalidSampleError, ODBError, UnsupportedSettingError
from odb_torch import packed_collate, pad_collate
from odb_torch.losses import causal_lm_loss_sum, shifted_loss_tokens
from odb_torch.sample_packing import Packer, default_loss_tokens, label_counts

rows = st.lists(st.lists(st.integers(0, 1000), min_size=1, max_size=20), min_size=1, max_size=8)


def raises(kind, fn, *args):
    """The exception ``fn(*args)`` raises, checked to be ``kind`` (also an ODBError)."""
    with pytest.raises(kind) as err:
        fn(*args)
    assert isinstance(err.value, ODBError)
    return err.value


# 1. packed_collate: every sample of a group has the same fields (as pad_collate checks)

@given(ids=rows.filter(lambda r: len(r) > 1), data=st.data())
def test_packed_collate_names_a_field_only_some_samples_have(ids, data):
    """A field sample 0 lacks was silently dropped, a field a later sample lacks a bare KeyError."""
    k = data.draw(st.integers(1, len(ids) - 1))
    lacking = data.draw(st.booleans())
    group = [{"input_ids": r, "idx": i} for i, r in enumerate(ids)]
    if lacking:
        del group[k]["idx"]
    else:
        group[k]["extra"] = 1
    err = raises(InvalidSampleError, packed_collate, group)
    assert f"sample {k}" in str(err) and ("'idx'" if lacking else "'extra'") in str(err), str(err)


def test_packed_collate_still_takes_samples_with_and_without_labels():
    """Row fields (labels, attention_mask, position_ids) are each sample's own: no field check on them."""
    batch = packed_collate([{"input_ids": [1, 2]}, {"input_ids": [3, 4], "labels": [-100, 4], "attention_mask": [1, 1]}])
    assert batch["labels"].tolist() == [[-100, 2, -100, 4]]


# 2. packed_collate: per-token fields, padded samples, collate failures

@pytest.mark.parametrize("field", ["token_type_ids", "loss_mask", "completion_mask"])
@pytest.mark.parametrize("as_tensor", [False, True])
def test_packed_collate_refuses_a_per_token_field(field, as_tensor):
    """Collated per sample it came back [n, L] (or a transposed list) beside a [1, sum L] row."""
    def value(n):
        return torch.ones(n, dtype=torch.int64) if as_tensor else [1] * n
    for lengths in ((3, 3), (2, 5), (4,)):
        group = [{"input_ids": list(range(n)), field: value(n)} for n in lengths]
        err = raises(UnsupportedSettingError, packed_collate, group)
        assert err.field == field and f"{field!r} has one entry per input_id" in str(err)


def test_packed_collate_refuses_any_field_that_follows_different_lengths_and_stacks_one_that_may_be_fixed():
    """A field of another name is per-token when it follows the lengths of samples of different
    lengths; with one sample, or samples of one length (common: groups form by length), a
    fixed-size field such as class scores matches by chance and is stacked as before."""
    err = raises(UnsupportedSettingError, packed_collate,
                 [{"input_ids": list(range(n)), "weights": [0.5] * n} for n in (2, 5)])
    assert err.field == "weights"
    for lengths in ((4,), (4, 4)):
        batch = packed_collate([{"input_ids": list(range(n)), "scores": torch.rand(4)} for n in lengths])
        assert batch["scores"].shape == (len(lengths), 4)


def test_packed_collate_still_collates_fields_that_are_not_per_token():
    """Fields of a fixed size, even one a sample's length happens to equal (pixel_values of sample 1)."""
    group = [{"input_ids": [1, 2, 3], "idx": 7, "text": "abc", "pixel_values": torch.zeros(2, 4)},
             {"input_ids": [4, 5], "idx": 9, "text": "de", "pixel_values": torch.ones(2, 4)}]
    batch = packed_collate(group)
    assert batch["idx"].tolist() == [7, 9] and batch["text"] == ["abc", "de"]
    assert batch["pixel_values"].shape == (2, 2, 4)


def test_packed_collate_names_the_field_default_collate_fails_on():
    group = [{"input_ids": [1], "pixel_values": torch.zeros(4, 8)}, {"input_ids": [3, 4], "pixel_values": torch.zeros(6, 8)}]
    err = raises(InvalidSampleError, packed_collate, group)
    assert "'pixel_values'" in str(err)


@given(ids=rows, data=st.data())
def test_packed_collate_refuses_exactly_the_masks_with_zeros(ids, data):
    """A padded sample's mask was dropped: the row attended to and trained on its padding."""
    masks = [data.draw(st.lists(st.sampled_from([0, 1, 1, 1]), min_size=len(r), max_size=len(r))) for r in ids]
    as_tensor = data.draw(st.booleans())
    group = [{"input_ids": r, "attention_mask": torch.tensor(m) if as_tensor else m} for r, m in zip(ids, masks)]
    padded = [k for k, m in enumerate(masks) if 0 in m]
    if not padded:
        assert "attention_mask" not in packed_collate(group)
        return
    err = raises(InvalidSampleError, packed_collate, group)
    assert f"sample {padded[0]} of the group" in str(err) and "zeros" in str(err)


def test_packed_collate_refuses_a_mask_of_another_length():
    err = raises(InvalidSampleError, packed_collate, [{"input_ids": [1, 2], "attention_mask": [1, 1]},
                                                      {"input_ids": [1, 2], "attention_mask": [1, 1, 1]}])
    assert "sample 1 of the group has 3 attention_mask entries for 2 input_ids" in str(err)
    err = raises(InvalidSampleError, packed_collate, [{"input_ids": [1, 2]}, {"input_ids": [0, 3], "attention_mask": [0, 1]}])
    assert "sample 1 of the group has an attention_mask with 1 zeros" in str(err)  # a mask only some samples carry


# 3. pad_collate: integer token rows of any width come back int64, no value wrapped

INT_DTYPES = [(torch.int64, 2**40), (torch.int32, 2**31 - 1), (torch.int16, 2**15 - 1), (torch.uint8, 255),
              (torch.uint16, 2**16 - 1), (torch.uint32, 2**32 - 1), (None, 2**40)]  # None: a Python list


@given(data=st.data(), n=st.integers(1, 6), np_array=st.booleans())
def test_pad_collate_casts_integer_token_rows_to_int64_without_wrapping(data, n, np_array):
    """uint16/uint32 batches were refused by nn.Embedding, uint labels padded with -100 overflowed,
    and a narrow first row wrapped later ids (int16 then 40000 gave -25536)."""
    samples, expected = [], []
    for _ in range(n):
        dtype, top = data.draw(st.sampled_from(INT_DTYPES))
        row = data.draw(st.lists(st.integers(0, top), min_size=1, max_size=12))
        labels = row[: data.draw(st.integers(0, len(row)))]
        if dtype is None:
            samples.append({"input_ids": row, "labels": labels})
        elif np_array and dtype in (torch.uint16, torch.int32, torch.uint8):
            npt = {torch.uint16: np.uint16, torch.int32: np.int32, torch.uint8: np.uint8}[dtype]
            samples.append({"input_ids": np.array(row, dtype=npt), "labels": np.array(labels, dtype=npt)})
        else:
            samples.append({"input_ids": torch.tensor(row, dtype=dtype), "labels": torch.tensor(labels, dtype=dtype)})
        expected.append((row, labels))
    batch = pad_collate(samples)
    width = max(len(r) for r, _ in expected)
    assert batch["input_ids"].dtype == batch["labels"].dtype == torch.int64
    assert batch["input_ids"].tolist() == [r + [0] * (width - len(r)) for r, _ in expected]
    assert batch["labels"].tolist() == [lab + [-100] * (width - len(lab)) for _, lab in expected]


def test_pad_collate_uint16_ids_feed_an_embedding():
    samples = [{"input_ids": np.array([1, 2, 3], dtype=np.uint16)}, {"input_ids": np.array([60000], dtype=np.uint16)}]
    batch = pad_collate(samples)
    assert torch.nn.Embedding(60001, 2)(batch["input_ids"]).shape == (2, 3, 2)


def test_pad_collate_masks_keep_a_common_dtype():
    same = pad_collate([{"input_ids": [1, 2], "attention_mask": torch.tensor([1, 1], dtype=torch.uint8)},
                        {"input_ids": [3], "attention_mask": torch.tensor([1], dtype=torch.uint8)}])
    assert same["attention_mask"].dtype == torch.uint8 and same["attention_mask"].tolist() == [[1, 1], [1, 0]]
    mixed = pad_collate([{"input_ids": [1], "attention_mask": torch.tensor([True])},
                         {"input_ids": [3, 4], "attention_mask": torch.tensor([1, 1], dtype=torch.int16)}])
    assert mixed["attention_mask"].dtype == torch.int64 and mixed["attention_mask"].tolist() == [[1, 0], [1, 1]]


# 4. pad_collate: a label or mask row is checked against its own sample's input_ids

@given(ids=rows, data=st.data(), key=st.sampled_from(["labels", "attention_mask"]))
def test_pad_collate_refuses_a_row_longer_than_its_own_input_ids(ids, data, key):
    """Checked against the batch's widest sample, a 4th label for 3 tokens sat on padding, trained on."""
    k = data.draw(st.integers(0, len(ids) - 1))
    extra = data.draw(st.integers(1, 25))
    samples = [{"input_ids": r, key: [1] * (len(r) + (extra if i == k else 0))} for i, r in enumerate(ids)]
    err = raises(InvalidSampleError, pad_collate, samples)
    assert f"{key!r} of sample {k} in the batch has {len(ids[k]) + extra} entries" in str(err), str(err)
    assert f"its own input_ids ({len(ids[k])})" in str(err)


def test_the_review_case_a_fourth_label_for_three_tokens_beside_a_longer_sample():
    bad = {"input_ids": [1, 2, 3], "labels": [-100, 2, 3, 4]}
    other = {"input_ids": [5, 6, 7, 8, 9], "labels": [5, 6, 7, 8, 9]}
    assert "'labels' of sample 0" in str(raises(InvalidSampleError, pad_collate, [bad, other]))


# 5. unsigned labels: the loader's counts agree with what the collated loss trains on

uint8_rows = st.lists(st.lists(st.integers(0, 255) | st.just(156), min_size=1, max_size=16), min_size=1, max_size=6)


@given(labels=uint8_rows)
def test_uint8_label_counts_match_the_loss_over_the_collated_row(labels):
    """uint8(156) == -100 wraps: a real label 156 counted as ignored, while packed_collate casts to
    int64 and the loss trains on it (the exact loss weights, P7, were off)."""
    samples = [{"input_ids": torch.tensor(r, dtype=torch.uint8), "labels": torch.tensor(r, dtype=torch.uint8)}
               for r in labels]
    assert label_counts(samples) == [len(r) for r in labels]
    assert [default_loss_tokens(s, len(r)) for s, r in zip(samples, labels)] == [len(r) for r in labels]
    assert Packer(0)(list(enumerate(samples))).measures == [(len(r), len(r)) for r in labels]
    shifted = [shifted_loss_tokens(s) for s in samples]
    assert shifted == [len(r) - 1 for r in labels]
    batch = packed_collate(samples)
    _, trained = causal_lm_loss_sum(torch.zeros(1, batch["input_ids"].shape[1], 256), batch["labels"])
    assert trained == sum(shifted)


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32])
def test_wider_unsigned_labels_count_every_label(dtype):
    top = torch.iinfo(dtype).max
    s = {"input_ids": [1, 2, 3], "labels": torch.tensor([top - 99, 5, top - 99], dtype=dtype)}  # top - 99 wraps to -100
    assert label_counts([s]) == [3] and default_loss_tokens(s, 3) == 3 and shifted_loss_tokens(s) == 2
