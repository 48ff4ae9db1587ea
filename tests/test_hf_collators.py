"""Hugging Face's own data collators as ODB's ``collate_fn``, over a ``datasets.Dataset``.

A real :class:`~odb_torch.ODBDataLoader` (one rank, no DataLoader workers) runs an
epoch with each of ``DataCollatorWithPadding``, ``DataCollatorForSeq2Seq`` and
``DataCollatorWithFlattening``. For each: every sample is yielded exactly once; each
batch is exactly what the collator returns for the samples ODB grouped (keys, shapes,
dtypes, values); and the padded tokens of each batch are within the token budget (P3).
The tokenizer is a small word-level ``PreTrainedTokenizerFast`` built here (no hub).
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

from odb_torch import ODBDataLoader  # noqa: E402

pytestmark = pytest.mark.timeout(120)

N, BUDGET, BUFFER = 120, 256, 32
WORDS = [f"w{k}" for k in range(50)]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1, **{w: k + 2 for k, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
                                   model_input_names=["input_ids", "attention_mask"])


def texts(seed: int, longest: int) -> list[str]:
    """N texts of 1..``longest`` words, mostly short (a long tail, as chat data)."""
    rng = random.Random(seed)
    lengths = [min(longest, 1 + int(rng.paretovariate(1.2) * 4)) for _ in range(N)]
    return [" ".join(rng.choice(WORDS) for _ in range(n)) for n in lengths]


def encoded(tokenizer: Any, **columns: list[Any]) -> Any:
    """A ``datasets.Dataset`` of the tokenized ``text`` column and the other columns."""
    ds = datasets.Dataset.from_dict({"text": texts(0, 200), **columns})
    return ds.map(lambda b: tokenizer(b["text"]), batched=True, remove_columns=["text"])


def epoch(dataset: Any, collator: Any, **kwargs: Any) -> list[tuple[tuple[int, ...], dict[str, Any]]]:
    """(dataset indices, batch) of every step of one ODB epoch on one rank."""
    out = []
    with ODBDataLoader(dataset, token_budget=BUDGET, collate_fn=collator, buffer_size=BUFFER, num_workers=0,
                       prefetch_factor=None, rank=0, world_size=1, timeout=60, **kwargs) as loader:
        for batch in loader:
            out.append((loader.step_info.indices, batch))
    return out


def check_epoch(dataset: Any, collator: Any, steps: list[tuple[tuple[int, ...], dict[str, Any]]]) -> None:
    """Every sample once; each batch equals the collator's own output on its samples."""
    seen = sorted(i for indices, _ in steps for i in indices)
    assert seen == list(range(len(dataset))), "a sample was lost or yielded twice"
    assert any(len(indices) > 1 for indices, _ in steps), "ODB formed no multi-sample batch"
    for indices, batch in steps:
        expected = collator([dataset[i] for i in indices])
        assert set(batch) == set(expected), f"keys {set(batch)} != HF's {set(expected)}"
        for key, value in expected.items():
            got = batch[key]
            if isinstance(value, torch.Tensor):
                assert got.dtype == value.dtype and torch.equal(got, value), key
            else:
                assert got == value, key


def test_data_collator_with_padding(tokenizer):
    from transformers import DataCollatorWithPadding

    dataset = encoded(tokenizer, label=[k % 3 for k in range(N)])
    collator = DataCollatorWithPadding(tokenizer)
    steps = epoch(dataset, collator)
    check_epoch(dataset, collator, steps)
    for indices, batch in steps:
        longest = max(len(dataset[i]["input_ids"]) for i in indices)
        assert batch["input_ids"].shape == batch["attention_mask"].shape == (len(indices), longest)
        assert batch["labels"].shape == (len(indices),)
        assert batch["input_ids"].numel() <= BUDGET, "P3: padded tokens over the budget"
        assert batch["attention_mask"].sum(1).tolist() == [len(dataset[i]["input_ids"]) for i in indices]


def longer_of_input_and_labels(sample: dict[str, Any]) -> int:
    """A seq2seq sample's length: the longer of its two padded fields."""
    return max(len(sample["input_ids"]), len(sample["labels"]))


def test_data_collator_for_seq2seq(tokenizer):
    """Targets longer or shorter than the inputs: ``length_fn`` measures the longer of the
    two, so both padded tensors (input and labels) stay within the budget."""
    from transformers import DataCollatorForSeq2Seq

    targets = [tokenizer(t)["input_ids"] for t in texts(1, 120)]
    dataset = encoded(tokenizer, labels=targets)
    collator = DataCollatorForSeq2Seq(tokenizer)
    steps = epoch(dataset, collator, length_fn=longer_of_input_and_labels)
    check_epoch(dataset, collator, steps)
    for indices, batch in steps:
        rows = [dataset[i] for i in indices]
        assert batch["input_ids"].shape == (len(rows), max(len(r["input_ids"]) for r in rows))
        assert batch["labels"].shape == (len(rows), max(len(r["labels"]) for r in rows))
        assert batch["input_ids"].numel() <= BUDGET and batch["labels"].numel() <= BUDGET, "P3"
        assert (batch["labels"] != -100).sum().item() == sum(len(r["labels"]) for r in rows)


def test_data_collator_with_flattening(tokenizer):
    """Padding-free batches: one row of every sample's tokens. ODB bounds the group's
    longest length x its size by the budget, which bounds the flattened total."""
    from transformers import DataCollatorWithFlattening

    dataset = encoded(tokenizer)
    collator = DataCollatorWithFlattening()
    steps = epoch(dataset, collator)
    check_epoch(dataset, collator, steps)
    for indices, batch in steps:
        lengths = [len(dataset[i]["input_ids"]) for i in indices]
        assert batch["input_ids"].shape == batch["labels"].shape == batch["position_ids"].shape == (1, sum(lengths))
        assert sum(lengths) <= max(lengths) * len(lengths) <= BUDGET, "P3"
        starts = (batch["position_ids"][0] == 0).nonzero().flatten().tolist()
        assert starts == [sum(lengths[:k]) for k in range(len(lengths))], "one sequence per sample"
