"""Batches travel from the collate process to the trainer in one flat buffer
(odb_torch/batch_transfer.py) and come back equal: structure, container types, dtypes,
shapes and values, through the real message encoding (odb_torch/messages.py)."""

from __future__ import annotations

from collections import UserDict
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from odb_torch import batch_transfer
from odb_torch.batch_transfer import PackedBatch, pack_batch, unpack_batch
from odb_torch.messages import Batch, decode, encode
from odb_torch.step_info import StepInfo

DTYPES = [torch.int64, torch.int32, torch.int16, torch.uint8, torch.bool, torch.float32, torch.float64,
          torch.float16, torch.bfloat16, torch.complex64]
INFO = StepInfo(epoch=0, step=0, round=0, is_idle=False, local_samples=1, global_samples=1, local_tokens=1,
                global_tokens=1, loss_scale=1.0, weight_num=1, weight_den=1, over_budget=False, indices=(0,))


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
    dtype = draw(st.sampled_from(DTYPES))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    t = (torch.rand(shape, generator=g) * 100).to(dtype)
    if draw(st.booleans()) and t.dim() == 2 and t.shape[1] > 1:
        t = t.t()  # non-contiguous: travels as the queue's pickler sends it
    return t


leaves = st.one_of(tensors(), st.integers(), st.text(max_size=3), st.none())
batches = st.recursive(leaves, lambda c: st.one_of(st.lists(c, max_size=3), st.dictionaries(st.text(max_size=2), c,
                                                                                            max_size=3),
                                                   st.lists(c, max_size=3).map(tuple),
                                                   st.dictionaries(st.text(max_size=2), c, max_size=3).map(UserDict)),
                         max_leaves=10)


def same_batch(a: Any, b: Any) -> bool:
    """Equal structure, container types, dtypes, shapes and values."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, UserDict):
        return same_batch(a.data, b.data)
    if isinstance(a, dict):
        return list(a) == list(b) and all(same_batch(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_batch(x, y) for x, y in zip(a, b))
    return bool(a == b)


def through_messages(batch: Any) -> Any:
    item = decode(encode(Batch(batch, INFO, (0,))))
    assert isinstance(item, Batch) and item.info == INFO and item.positions == (0,)
    return item.batch


@settings(max_examples=80, deadline=None)
@given(batches)
def test_batches_arrive_equal_by_value(batch: Any) -> None:
    assert same_batch(batch, through_messages(batch))


@settings(max_examples=40, deadline=None)
@given(batches)
def test_large_batches_arrive_equal_through_one_shared_buffer(batch: Any) -> None:
    old = batch_transfer.INLINE_BYTES
    batch_transfer.INLINE_BYTES = 0  # every batch with a tensor byte takes the shared-memory path
    try:
        packed = pack_batch(batch)
        assert isinstance(packed.buffer, torch.Tensor) or not packed.buffer
        assert same_batch(batch, through_messages(batch))
    finally:
        batch_transfer.INLINE_BYTES = old


def test_a_pad_collate_batch_travels_by_value_without_descriptors() -> None:
    batch = {"input_ids": torch.arange(24).view(3, 8), "labels": torch.full((3, 8), -100),
             "attention_mask": torch.ones(3, 8, dtype=torch.int64), "idx": torch.tensor([4, 5, 6])}
    payload = encode(Batch(batch, INFO, (0,)))
    assert b"rebuild_storage" not in payload  # no tensor shared through a file descriptor
    got = through_messages(batch)
    assert same_batch(batch, got)
    got["input_ids"][0, 0] = 99  # each tensor is writable and owns its bytes
    assert got["labels"][0, 0] == -100 and batch["input_ids"][0, 0] == 0


def test_the_round_trip_check_catches_a_shifted_slot(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded bug: an unpacker that reads every slot one alignment step late is caught."""
    real = unpack_batch

    def shifted(packed: PackedBatch) -> Any:
        raw = packed.buffer
        assert isinstance(raw, bytearray)
        return real(PackedBatch(packed.skeleton, raw[batch_transfer.ALIGN:] + bytearray(batch_transfer.ALIGN)))

    batch = {"a": torch.tensor([1, 2]), "b": torch.tensor([3.0, 4.0])}
    assert same_batch(batch, through_messages(batch))
    monkeypatch.setattr("odb_torch.messages.unpack_batch", shifted)
    assert not same_batch(batch, through_messages(batch))


def test_a_hugging_face_batch_encoding_travels_in_the_flat_buffer() -> None:
    """HF collators return a ``BatchEncoding`` (a ``UserDict``): its tensors travel in the flat
    buffer too (no descriptor), and it arrives a ``BatchEncoding`` with equal tensors."""
    transformers = pytest.importorskip("transformers")
    batch = transformers.BatchEncoding({"input_ids": torch.arange(6).view(2, 3),
                                        "attention_mask": torch.ones(2, 3, dtype=torch.int64)})
    assert b"rebuild_storage" not in encode(Batch(batch, INFO, (0,)))
    got = through_messages(batch)
    assert type(got) is type(batch) and same_batch(batch, got) and got.input_ids is got["input_ids"]


@pytest.mark.parametrize("inline", [True, False])
def test_a_tensor_twice_arrives_as_one_tensor_and_lazy_views_with_their_values(inline: bool) -> None:
    """The same tensor under two keys arrived as two copies (its bytes sent twice, a write
    through one not seen in the other); a conjugate or negative view arrived with its base's
    values (torch's queue pickler drops the bits, as a DataLoader's does)."""
    t = torch.arange(6, dtype=torch.int64)
    z = torch.tensor([1 + 2j, 3 - 1j])
    batch = {"a": t, "b": t, "nested": [t], "conj": z.conj(), "neg": torch.tensor([1 + 1j]).conj().imag,
             "real": torch.tensor([2 + 1j]).real}  # one element, stride 2: packing it crashed
    old = batch_transfer.INLINE_BYTES
    batch_transfer.INLINE_BYTES = old if inline else 0
    try:
        got = through_messages(batch)
    finally:
        batch_transfer.INLINE_BYTES = old
    assert got["a"] is got["b"] is got["nested"][0] and torch.equal(got["a"], t)
    assert torch.equal(got["conj"], torch.tensor([1 - 2j, 3 + 1j])) and not got["conj"].is_conj()
    assert torch.equal(got["neg"], torch.tensor([-1.0])) and torch.equal(got["real"], torch.tensor([2.0]))


def test_in_a_shared_batch_a_small_tensor_owns_its_storage() -> None:
    """In a batch over 4 MiB every tensor was a view of the one shared buffer: saving or keeping
    a small one (the batch's indices, for logging) wrote or held the whole batch."""
    import io

    batch = {"input_ids": torch.zeros(5 << 20, dtype=torch.uint8), "idx": torch.arange(4)}
    got = through_messages(batch)
    assert got["idx"].untyped_storage().nbytes() == 4 * 8
    out = io.BytesIO()
    torch.save(got["idx"], out)
    assert out.tell() < 4096 and torch.equal(got["idx"], batch["idx"])
    assert got["input_ids"].untyped_storage().nbytes() >= 5 << 20  # a large one stays a view (no copy)
