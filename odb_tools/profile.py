"""``odb profile``: the paper's practical guidance (Sec. 6) for a dataset's lengths.

From lengths alone: their coefficient of variation (CV), the short-sample fraction f_s
(samples at most ``short_fraction`` of the budget), and, over a range of token budgets,
the padding and samples per update of ODB (B(l) grouping over buffers) against fixed
batching at the survival batch size. It suggests a starting L_max: the smallest budget
at which ODB's padding is at most 2% and its samples per update at least 2x fixed
batching's, else the budget with the most samples per update. With a step-time model
(``fixed + per_token x padded tokens`` seconds per step) it predicts samples/s of both.

``budget="packed"``: ODB forms packed groups (sum of lengths <= L_max, best-fit
decreasing over each buffer, :func:`odb_core.packing.pack_groups`), so its padding is
0 and its processed tokens are the real ones; ``odb_packing_efficiency`` is real tokens
/ L_max per group (groups of one sample longer than L_max left out). Fixed batching
stays padded (the comparison a padding-free switch is judged against).

Both are cut from the lengths in a seeded random order (the sampler's, as ``odb simulate``
shuffles), unless ``shuffle=False``: cut in file order, a file sorted by length would make
every fixed batch homogeneous and hide the padding a training run's random batches have.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from odb_core.config import BudgetName
from odb_core.grouping import form_groups
from odb_core.packing import pack_groups
from odb_core.sampler import permutation
from odb_tools.baselines import survival_batch_size

DEFAULT_BUDGETS = (2048, 4096, 8192, 16384, 32768)


def profile(lengths: Sequence[int], budgets: Sequence[int] = DEFAULT_BUDGETS, buffer_size: int = 1024,
            short_fraction: float = 0.25, step_fixed: float | None = None,
            step_per_token: float | None = None, budget_kind: BudgetName = "padded", seed: int = 0,
            shuffle: bool = True) -> dict[str, Any]:
    """The profile as one JSON-ready dict (see the module docstring). ODB's buffers and the fixed
    batches are cut from the lengths in a seeded random order (the sampler's,
    :func:`odb_core.sampler.permutation`, as ``odb simulate`` does), or in the order given when
    ``shuffle`` is False: a file sorted by length would otherwise make every batch homogeneous."""
    if not lengths:
        raise ValueError("profile needs at least one length")
    if any(x < 0 for x in lengths):
        raise ValueError(f"lengths must be >= 0; found {min(lengths)}")
    ordered = [lengths[i] for i in permutation(len(lengths), seed, 0, shuffle)]
    mean = statistics.fmean(ordered)
    cv = statistics.pstdev(ordered) / mean if mean else 0.0
    rows = [_row(ordered, budget, buffer_size, short_fraction, budget_kind, step_fixed, step_per_token)
            for budget in budgets]
    good = [r for r in rows if r["odb_padding"] <= 0.02 and r["odb_samples_per_update"] >= 2 * r["fixed_samples_per_update"]]
    suggested = (min(good, key=lambda r: r["token_budget"]) if good
                 else max(rows, key=lambda r: r["odb_samples_per_update"]))
    return {"samples": len(ordered), "mean_length": mean, "max_length": max(ordered), "cv": cv,
            "buffer_size": buffer_size, "budget": budget_kind, "shuffle": shuffle, "seed": seed, "budgets": rows,
            "suggested_token_budget": suggested["token_budget"]}


def _row(lengths: Sequence[int], budget: int, buffer_size: int, short_fraction: float, budget_kind: BudgetName,
         step_fixed: float | None, step_per_token: float | None) -> dict[str, Any]:
    """One budget's row of :func:`profile`, ``lengths`` in the order batches are cut from."""
    groups = within = within_real = 0
    odb_padded = 0
    form = pack_groups if budget_kind == "packed" else form_groups
    for k in range(0, len(lengths), buffer_size):
        for g in form(lengths[k:k + buffer_size], budget):
            groups += 1
            real_g = sum(lengths[k + i] for i in g)
            odb_padded += real_g if budget_kind == "packed" else max(lengths[k + i] for i in g) * len(g)
            if len(g) > 1 or real_g <= budget:
                within, within_real = within + 1, within_real + real_g
    real = sum(lengths)
    bs = survival_batch_size(lengths, budget)
    fixed_padded = sum(max(lengths[k:k + bs]) * len(lengths[k:k + bs]) for k in range(0, len(lengths), bs))
    fixed_steps = -(-len(lengths) // bs)
    row: dict[str, Any] = {
        "token_budget": budget, "short_fraction": sum(1 for x in lengths if x <= short_fraction * budget) / len(lengths),
        "odb_padding": 1 - real / odb_padded if odb_padded else 0.0, "odb_samples_per_update": len(lengths) / groups,
        "odb_packing_efficiency": within_real / (within * budget) if within else 0.0,
        "fixed_batch_size": bs, "fixed_padding": 1 - real / fixed_padded if fixed_padded else 0.0,
        "fixed_samples_per_update": len(lengths) / fixed_steps,
    }
    if step_fixed is not None and step_per_token is not None:
        odb_time = groups * step_fixed + odb_padded * step_per_token
        fixed_time = fixed_steps * step_fixed + fixed_padded * step_per_token
        if not odb_time or not fixed_time:
            raise ValueError("the steps would take no time (every sample has 0 tokens and the fixed part per step "
                             "is 0): give --step-fixed > 0")
        row["odb_samples_per_second"] = len(lengths) / odb_time
        row["fixed_samples_per_second"] = len(lengths) / fixed_time
        row["predicted_speedup"] = fixed_time / odb_time
    return row


def markdown(p: dict[str, Any]) -> str:
    """The profile as text with a Markdown table (under the packed budget, with ODB's packing efficiency)."""
    order = f"lengths shuffled (seed {p['seed']})" if p.get("shuffle", True) else "lengths in the order given"
    head = (f"{p['samples']} samples, mean length {p['mean_length']:.1f}, max {p['max_length']}, CV {p['cv']:.2f}; "
            f"buffer {p['buffer_size']}; {order}; ODB's {p['budget']} budget\n\n")
    timed = "predicted_speedup" in p["budgets"][0]
    packed = p["budget"] == "packed"
    cols = ("| L_max | f_s | ODB padding |" + (" ODB packing efficiency |" if packed else "")
            + " ODB samples/update | fixed bs | fixed padding | fixed samples/update |"
            + (" ODB samples/s | fixed samples/s | speedup |" if timed else ""))
    lines = [cols, "|" + "---|" * (7 + packed + 3 * timed)]
    for r in p["budgets"]:
        line = (f"| {r['token_budget']} | {r['short_fraction']:.1%} | {r['odb_padding']:.2%} | "
                + (f"{r['odb_packing_efficiency']:.2%} | " if packed else "")
                + f"{r['odb_samples_per_update']:.1f} | {r['fixed_batch_size']} | {r['fixed_padding']:.1%} | "
                f"{r['fixed_samples_per_update']:.1f} |")
        if timed:
            line += (f" {r['odb_samples_per_second']:.1f} | {r['fixed_samples_per_second']:.1f} | "
                     f"{r['predicted_speedup']:.2f}x |")
        lines.append(line)
    return head + "\n".join(lines) + f"\n\nsuggested starting L_max: {p['suggested_token_budget']}"


def jsonl_lengths(path: str, max_length: int | None = None, limit: int | None = None) -> list[int]:
    """Qwen-tokenized lengths of a JSONL file (its first ``limit`` samples, when given): a
    ``messages`` list ({role, content}) is chat-templated as ``<|im_start|>role\\n content<|im_end|>\\n``;
    else ``text`` is encoded. A line with neither raises ``ValueError`` naming the line."""
    import json

    from odb_tools.demo.chat_data import tokenizer

    tok = tokenizer()
    out: list[int] = []
    with open(path, encoding="utf-8") as f:
        for n, line in _utf8_lines(f, path):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n}: not JSON: {exc.msg} (column {exc.colno})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{path}:{n}: a line is a JSON object, this one a {type(obj).__name__}")
            if isinstance(obj.get("messages"), list):
                if not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                           for m in obj["messages"]):
                    raise ValueError(f"{path}:{n}: every message needs a 'role' and a 'content' string")
                text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in obj["messages"])
            elif isinstance(obj.get("text"), str):
                text = obj["text"]
            else:
                raise ValueError(f"{path}:{n}: a line needs a 'messages' list or a 'text' string")
            length = len(tok.encode(text))
            out.append(min(length, max_length) if max_length else length)
    return out


def _utf8_lines(f: Iterable[str], path: str) -> Iterator[tuple[int, str]]:
    """(line number, line) of a file opened as UTF-8 text; ``ValueError`` naming ``path`` when it is not."""
    n = 0
    try:
        for n, line in enumerate(f, 1):
            yield n, line
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text ({exc.reason}{f', after line {n}' if n else ''})") from None
