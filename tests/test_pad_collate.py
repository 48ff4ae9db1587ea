"""odb_torch.pad_collate: right-padding of token fields, default_collate for the rest."""

from collections import OrderedDict, defaultdict

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from odb_torch import pad_collate


def test_pads_token_fields_and_collates_the_rest():
    samples = [
        {"input_ids": torch.tensor([5, 6, 7]), "labels": [1, 2, 3], "attention_mask": [1, 1, 1], "idx": 4},
        {"input_ids": torch.tensor([8]), "labels": [9], "attention_mask": [1], "idx": 2},
    ]
    batch = pad_collate(samples, pad_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["labels"].tolist() == [[1, 2, 3], [9, -100, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["idx"].tolist() == [4, 2]


def test_single_sample_batch_is_unpadded():
    batch = pad_collate([{"input_ids": [1, 2], "labels": [-100, 2]}])
    assert batch["input_ids"].tolist() == [[1, 2]] and batch["labels"].tolist() == [[-100, 2]]
    assert batch["attention_mask"].tolist() == [[1, 1]]


token_rows = st.lists(st.lists(st.integers(0, 1000), min_size=1, max_size=40), min_size=1, max_size=12)


@settings(max_examples=200, deadline=None)
@given(rows=token_rows, pad_id=st.integers(0, 5), as_tensor=st.booleans())
def test_made_attention_mask_marks_exactly_the_real_tokens(rows, pad_id, as_tensor):
    """Samples without a mask get one: row k is 1 over its real length, 0 over the padding,
    whatever the token values (pad_id may occur inside a sample)."""
    samples = [{"input_ids": torch.tensor(r) if as_tensor else r, "labels": r} for r in rows]
    batch = pad_collate(samples, pad_id=pad_id)
    mask = batch["attention_mask"]
    width = max(map(len, rows))
    assert mask.dtype == torch.int64 and mask.shape == batch["input_ids"].shape == (len(rows), width)
    assert mask.sum(dim=1).tolist() == [len(r) for r in rows]
    assert mask.tolist() == [[1] * len(r) + [0] * (width - len(r)) for r in rows]
    assert batch["input_ids"].tolist() == [r + [pad_id] * (width - len(r)) for r in rows]
    assert batch["labels"].tolist() == [r + [-100] * (width - len(r)) for r in rows]


@settings(max_examples=100, deadline=None)
@given(rows=token_rows, data=st.data())
def test_a_carried_attention_mask_is_padded_not_replaced(rows, data):
    own = [data.draw(st.lists(st.integers(0, 1), min_size=len(r), max_size=len(r))) for r in rows]
    batch = pad_collate([{"input_ids": r, "attention_mask": m} for r, m in zip(rows, own)])
    width = max(map(len, rows))
    assert batch["attention_mask"].tolist() == [m + [0] * (width - len(m)) for m in own]


@settings(max_examples=50, deadline=None)
@given(rows=token_rows)
def test_attention_mask_false_adds_none(rows):
    batch = pad_collate([{"input_ids": r} for r in rows], attention_mask=False)
    assert set(batch) == {"input_ids"}


def test_sample_packing_round_trips_structure_values_and_dtypes():
    from odb_torch.sample_packing import pack, unpack

    samples = [
        {"input_ids": torch.arange(5), "pixel": torch.ones(2, 3, dtype=torch.float16), "meta": ("a", [torch.tensor(7)]),
         "n": 3},
        {"input_ids": torch.arange(2) + 9, "pixel": torch.zeros(2, 3, dtype=torch.float16), "meta": ("b", []), "n": 1},
        {"input_ids": torch.arange(0), "pixel": torch.zeros(0, 3, dtype=torch.float16), "meta": ("c", []), "n": 0},
        {"input_ids": torch.arange(3) - 4, "pixel": torch.full((1, 3), 2.5, dtype=torch.float16),
         "meta": ("d", [torch.tensor([[5, 6]])]), "n": 2},
        # mapping subclasses keep their type and state (a defaultdict's factory), in their key order
        OrderedDict([("pixel", torch.ones(1, 3, dtype=torch.float16)), ("input_ids", torch.arange(4)),
                     ("meta", ("e", [])), ("n", 4)]),
        defaultdict(list, {"input_ids": torch.arange(2) * 3, "pixel": torch.zeros(1, 3, dtype=torch.float16),
                           "meta": ("f", [torch.tensor(1)]), "n": 5}),
    ]
    chunk = pack(samples)
    assert set(chunk.buffers) == {torch.int64, torch.float16}  # one storage per dtype
    back = unpack(chunk)
    for a, b in zip(samples, back):
        assert type(a) is type(b) and list(a) == list(b) and getattr(b, "default_factory", list) is list
        assert a.keys() == b.keys() and a["n"] == b["n"] and a["meta"][0] == b["meta"][0]
        for key in ("input_ids", "pixel"):
            assert b[key].dtype == a[key].dtype and torch.equal(b[key], a[key])
        assert [(t.shape, t.tolist()) for t in b["meta"][1]] == [(t.shape, t.tolist()) for t in a["meta"][1]]
    # a collate_fn may edit an unpacked sample in place, also with an operand that requires grad
    back[0]["pixel"].add_(torch.ones(3, dtype=torch.float16, requires_grad=True))
    back[1]["input_ids"][0] = -100
    assert back[0]["pixel"].tolist() == [[2.0] * 3] * 2 and back[1]["input_ids"].tolist() == [-100, 10]
    assert torch.equal(back[2]["input_ids"], torch.arange(0)), "an edit stays inside its own tensor"


def test_a_field_longer_than_the_input_ids_is_a_value_error_naming_field_and_sample():
    """Padding to the longest input_ids cannot hold a longer label row: a clear error, never a cut."""
    mixed = [torch.tensor([1, 2]), torch.tensor([3, 4, 5], dtype=torch.int32)]  # the row-by-row path
    for labels in ([[1, 2], [3, 4, 5]], mixed):
        samples = [{"input_ids": [1, 2], "labels": labels[0]}, {"input_ids": [3], "labels": labels[1]}]
        try:
            pad_collate(samples)
        except ValueError as exc:
            assert "'labels' of sample 1" in str(exc) and "3 entries" in str(exc)
        else:
            raise AssertionError("a labels row longer than every input_ids row was padded without error")


@settings(max_examples=100, deadline=None)
@given(rows=token_rows, data=st.data())
def test_rows_of_mixed_dtypes_or_shorter_labels_pad_like_a_row_by_row_copy(rows, data):
    """Shorter label rows are padded to the input_ids' width; integer token rows of any mix of
    dtypes come back int64 (as packed_collate's and Hugging Face's collators do: no value wraps)."""
    cut = [r[: data.draw(st.integers(0, len(r)))] for r in rows]
    dtypes = [data.draw(st.sampled_from([torch.int64, torch.int32])) for _ in rows]
    samples = [{"input_ids": torch.tensor(r, dtype=d), "labels": torch.tensor(c, dtype=d)}
               for r, c, d in zip(rows, cut, dtypes)]
    batch = pad_collate(samples)
    width = max(map(len, rows))
    for key, fill, values in (("input_ids", 0, rows), ("labels", -100, cut)):
        assert batch[key].dtype == torch.int64
        assert batch[key].tolist() == [v + [fill] * (width - len(v)) for v in values]


@settings(max_examples=100, deadline=None)
@given(rows=st.lists(st.lists(st.integers(0, 1000), max_size=20), min_size=1, max_size=8), empty_first=st.booleans())
def test_empty_list_samples_keep_integer_token_rows(rows, empty_first):
    """A sample whose input_ids and labels are empty lists (a length-sorted group puts it first)
    still gives int64 token rows, not the float32 of ``torch.as_tensor([])``: an embedding
    layer takes only integer ids."""
    rows = [[]] + rows if empty_first else rows
    batch = pad_collate([{"input_ids": r, "labels": r} for r in rows])
    width = max(map(len, rows))
    for key, fill in (("input_ids", 0), ("labels", -100)):
        assert batch[key].dtype == torch.int64, (key, batch[key].dtype)
        assert batch[key].tolist() == [r + [fill] * (width - len(r)) for r in rows]


@settings(max_examples=50, deadline=None)
@given(rows=token_rows, data=st.data())
def test_samples_with_different_fields_are_a_value_error_naming_field_and_sample(rows, data):
    """A field only some samples of a batch have is neither dropped (``default_collate`` reads
    the first sample's keys) nor a bare KeyError: a ValueError names it and the sample."""
    k = data.draw(st.integers(0, len(rows) - 1))
    samples = [{"input_ids": r, **({"extra": 1} if i == k else {})} for i, r in enumerate(rows)]
    if len(rows) == 1:
        assert pad_collate(samples)["extra"].tolist() == [1]
        return
    try:
        pad_collate(samples)
    except ValueError as exc:
        assert "'extra'" in str(exc) and f"sample {max(k, 1)}" in str(exc), str(exc)
    else:
        raise AssertionError("a field only one sample has was collated without error")
