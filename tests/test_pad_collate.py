"""odb_torch.pad_collate: right-padding of token fields, default_collate for the rest."""

import torch

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


def test_packed_transport_round_trips_structure_values_and_dtypes():
    from odb_torch.transport import pack, unpack

    samples = [
        {"input_ids": torch.arange(5), "pixel": torch.ones(2, 3, dtype=torch.float16), "meta": ("a", [torch.tensor(7)]),
         "n": 3},
        {"input_ids": torch.arange(2) + 9, "pixel": torch.zeros(2, 3, dtype=torch.float16), "meta": ("b", []), "n": 1},
    ]
    chunk = pack(samples)
    assert set(chunk.buffers) == {torch.int64, torch.float16}  # one storage per dtype
    back = unpack(chunk)
    for a, b in zip(samples, back):
        assert a.keys() == b.keys() and a["n"] == b["n"] and a["meta"][0] == b["meta"][0]
        for key in ("input_ids", "pixel"):
            assert b[key].dtype == a[key].dtype and torch.equal(b[key], a[key])
        assert [t.item() for t in b["meta"][1]] == [t.item() for t in a["meta"][1]]
