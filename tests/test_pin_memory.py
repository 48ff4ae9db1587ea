"""``pin_memory=True``: every tensor of a yielded batch page-locked, the batch otherwise unchanged.

This machine has no accelerator, so the tests here check the walk with an injected pin
function (every tensor leaf, inside any nesting the loader hands over, and nothing else), the
loader's refusal to pin without an accelerator (a warning, as DataLoader gives, and batches
equal to unpinned ones), and that the Hugging Face adapter passes ``dataloader_pin_memory``.
On a machine with an accelerator the last test pins for real (every tensor of every batch,
inside an ``OrderedDict`` and a namedtuple), and ``benchmarks/bench_gpu.py`` pins on a GPU
and refuses a batch that arrives unpinned.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import warnings
from collections import OrderedDict, UserDict, defaultdict, namedtuple
from collections.abc import Mapping
from types import MappingProxyType

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from odb_torch.pinning import pin_batch, pinning_available

pytestmark = pytest.mark.timeout(180)


class Marked:
    """What the injected pin function returns: the leaf it was given."""

    def __init__(self, of: object) -> None:
        self.of = of


class CustomBatch:
    """A leaf with its own pin_memory method (the DataLoader contract for custom batch types)."""

    def pin_memory(self) -> CustomBatch:
        return self


Pair = namedtuple("Pair", "first second")


class TaggedDict(dict):  # type: ignore[type-arg]
    """A dict subclass with an attribute of its own (kept by the copy)."""

    tag = "kept"


class TaggedList(list):  # type: ignore[type-arg]
    """A list subclass."""


leaves = st.one_of(st.integers(), st.text(max_size=3), st.none(), st.binary(max_size=2),
                   st.integers(0, 4).map(lambda n: torch.arange(n)), st.just(CustomBatch()))
mappings = st.sampled_from([dict, OrderedDict, UserDict, TaggedDict, lambda d: defaultdict(list, d),
                            lambda d: MappingProxyType(dict(d))])
sequences = st.sampled_from([list, tuple, TaggedList, lambda xs: Pair(*(xs + [None, None])[:2])])
batches = st.recursive(leaves, lambda inner: st.one_of(
    st.tuples(sequences, st.lists(inner, max_size=3)).map(lambda p: p[0](p[1])),
    st.tuples(mappings, st.dictionaries(st.text(max_size=2), inner, max_size=3)).map(lambda p: p[0](p[1]))),
    max_leaves=12)


def canonical(x: object, pinned: bool) -> object:
    """The batch as plain data: containers by type name and items, pinned leaves by the id of the
    leaf they came from (``pinned``: the output, whose pinned leaves are :class:`Marked`)."""
    if pinned and isinstance(x, Marked):
        return ("pinned", id(x.of))
    if not pinned and isinstance(x, torch.Tensor | CustomBatch):
        return ("pinned", id(x))
    if isinstance(x, str | bytes):
        return x
    if isinstance(x, Mapping):
        extra = getattr(x, "tag", None), getattr(x, "default_factory", None)
        return (type(x).__name__, extra, [(k, canonical(v, pinned)) for k, v in x.items()])
    if isinstance(x, tuple | list):
        return (type(x).__name__, [canonical(v, pinned) for v in x])
    return x


@settings(max_examples=300, deadline=None)
@given(batches)
def test_every_pinnable_leaf_is_pinned_inside_every_container_type_and_nothing_else_changes(batch):
    """The DataLoader's pinning contract: every container keeps its type (a mapping proxy is
    rebuilt, a mutable mapping or list subclass copied with its attributes), namedtuples
    their fields, and only leaves with a pin_memory() method change."""
    assert canonical(pin_batch(batch, pin=Marked), pinned=True) == canonical(batch, pinned=False)


CHILD = """
    import json, warnings
    from odb_torch import ODBDataLoader

    data = [{"input_ids": list(range(1 + i % 5))} for i in range(24)]
    out = {}
    for pin in (False, True):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loader = ODBDataLoader(data, token_budget=16, collate_fn=lambda b: [s["input_ids"] for s in b],
                                   num_workers=0, world_size=1, rank=0, timeout=60, pin_memory=pin)
        out[str(pin)] = {"batches": [b for b in loader], "attr": loader.pin_memory,
                         "warnings": [str(w.message) for w in caught if "pin_memory" in str(w.message)]}
        loader.close()
    print(json.dumps(out))
"""


@pytest.mark.skipif(pinning_available(), reason="checks the no-accelerator path")
def test_without_an_accelerator_pin_memory_warns_once_and_yields_the_same_batches():
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(CHILD)], capture_output=True, text=True, timeout=150)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    plain, pinned = got["False"], got["True"]
    assert plain["warnings"] == [] and not plain["attr"]
    assert len(pinned["warnings"]) == 1 and "rank 0" in pinned["warnings"][0], pinned["warnings"]
    assert pinned["attr"] is False, "nothing to pin into"
    assert pinned["batches"] == plain["batches"] and plain["batches"], "pinning asked for changes no batch"


def test_hf_trainer_passes_dataloader_pin_memory_to_the_loader(tmp_path):
    pytest.importorskip("transformers", reason="the hf extra is not installed")
    from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

    from odb_tools.demo.synthetic import TokenDataset
    from odb_torch.integrations.hf import ODBTrainer

    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256))
    for flag in (False, True):
        args = TrainingArguments(output_dir=str(tmp_path / str(flag)), report_to=[], disable_tqdm=True,
                                 dataloader_pin_memory=flag, num_train_epochs=1, save_strategy="no")
        trainer = ODBTrainer(model=model, args=args, train_dataset=TokenDataset(8), token_budget=64,
                             odb_kwargs={"num_workers": 0, "buffer_size": 4, "timeout": 60})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.get_train_dataloader()
        warned = [str(w.message) for w in caught if "pin_memory=True" in str(w.message)]
        assert len(warned) == (1 if flag and not pinning_available() else 0), (flag, warned)
        assert trainer.odb_windows.loader.pin_memory is (flag and pinning_available())
        trainer.odb_windows.loader.close()


GPU_CHILD = """
    import json
    from collections import OrderedDict, namedtuple
    import torch
    from odb_torch import ODBDataLoader

    Pair = namedtuple("Pair", "ids lengths")

    def collate(samples):
        ids = [torch.tensor(s["input_ids"]) for s in samples]
        return OrderedDict(pair=Pair(torch.cat(ids), torch.tensor([len(i) for i in ids])), n=len(ids))

    data = [{"input_ids": list(range(1 + i % 5))} for i in range(24)]
    loader = ODBDataLoader(data, token_budget=16, collate_fn=collate, num_workers=0, world_size=1, rank=0,
                           timeout=60, pin_memory=True)
    pinned = [[b["pair"].ids.is_pinned(), b["pair"].lengths.is_pinned(), type(b).__name__, type(b["pair"]).__name__]
              for b in loader]
    loader.close()
    print(json.dumps(pinned))
"""


@pytest.mark.skipif(not pinning_available(), reason="needs an accelerator to pin into (runs on a GPU machine)")
def test_with_an_accelerator_every_tensor_of_every_batch_is_pinned_and_containers_kept():
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(GPU_CHILD)], capture_output=True, text=True,
                         timeout=150)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    assert rows and all(r == [True, True, "OrderedDict", "Pair"] for r in rows), rows


def test_a_pinning_failure_is_a_typed_error_naming_the_batch_and_loses_nothing(monkeypatch):
    """Page-locking fails in the trainer (torch raises an untyped RuntimeError: page-locked memory
    exhausted, a driver error): PinMemoryError naming the rank and the batch's indices; the batch
    is not counted as consumed, so the position a checkpoint takes serves it again."""
    import torch

    import odb_torch.loader as loader_module
    from odb_core.errors import PinMemoryError
    from odb_torch import ODBDataLoader, pad_collate

    calls = []

    def failing_pin(batch: object) -> object:
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("CUDA error: out of memory (page-locked)")
        return batch

    monkeypatch.setattr(loader_module, "pin_batch", failing_pin)
    data = [{"input_ids": torch.arange(1 + i % 7)} for i in range(64)]
    with ODBDataLoader(data, token_budget=16, collate_fn=pad_collate, num_workers=0, rank=0, world_size=1,
                       timeout=30) as loader:
        loader.pin_memory = True  # as where an accelerator is available
        seen: list[int] = []
        with pytest.raises(PinMemoryError) as err:
            for _ in loader:
                seen.extend(loader.step_info.indices)
        assert err.value.rank == 0 and err.value.indices and not set(err.value.indices) & set(seen)
        state = loader.state_dict()
        assert state["steps"] == 1 and len(state["consumed"]) == len(seen), state
