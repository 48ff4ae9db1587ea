"""``odb tune``'s end-to-end checks, run by ``tests/test_tune.py`` in a fresh, small Python process.

Why a process of its own: a measurement is this process's RSS plus a forked child's growth.
Inside a long pytest run the parent's RSS drifts (earlier tests' memory freed or touched) and
its copy-on-write pages make the children's growth noisy, by as much as the few MB that
separate a correct budget from a seeded bug's (CI at 96b1847 saw one such flake).

It builds the tiny model, fixes the limit at its RSS + ``HEADROOM``, runs ``odb tune`` (the CLI,
with ``--json``) and the two seeded bugs, and checks each reported budget with this file's own
oracle: a forked child's peak RSS over a forward + backward on the budget's most-token B(l)
group, enumerated here. Prints one JSON object: per case, the reported budget and the
oracle's objections (empty when the property holds)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from typing import Any

import torch
import tune_support  # tests/tune_support.py (this file's directory is on sys.path when run as a script)

import odb_tools.tune.measure as measure_mod
import odb_tools.tune.replay as replay_mod
import odb_tools.tune.search as search_mod
from odb_tools.cli import main
from odb_tools.tune import tune
from odb_tools.tune.measure import warm_up
from odb_tools.tune.model import call_loss
from odb_tools.tune.shapes import Shape, padded_frontier

CUTOFF, STEP, START = 400, 64, 512
HEADROOM = 32 * 2**20  # over the process's RSS once the model is built and warmed up
TOLERANCE = 2 * 2**20
"""RSS noise between two forks measuring the same shape: 1.07 MB seen in a CI run (2026-11-27);
a step of 64 tokens moves the peak by about 3 MiB, the seeded bugs' budgets by about 10 MB."""


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _hwm() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def oracle_peak(model: torch.nn.Module, batch: int, length: int) -> int:
    """This process's RSS plus a forked child's growth over forward + backward on [batch, length]."""
    parent = _rss()
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        ids = torch.randint(2, 4096, (batch, length))
        model(ids[:1, :1], ids[:1, :1])[0].backward()  # touch the code pages first
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        start = _rss()
        loss, _ = model(ids, ids)
        loss.backward()
        os.write(write_fd, str(parent + _hwm() - start).encode())
        os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd) as f:
        peak = int(f.read())
    os.waitpid(pid, 0)
    return peak


def most_tokens(token_budget: int) -> tuple[int, int]:
    """The B(l) group of ``token_budget`` with the most tokens (longest l among equals), l <= CUTOFF."""
    return max(((max(token_budget // n, 1), n) for n in range(1, min(CUTOFF, token_budget) + 1)),
               key=lambda s: (s[0] * s[1], s[1]))


def budget_is_tight(model: torch.nn.Module, limit: int, found: int | None) -> list[str]:
    """The property: ``found`` fits and ``found + STEP`` does not (empty when it holds)."""
    if found is None:
        return ["no budget reported"]
    fits = oracle_peak(model, *most_tokens(found))
    over = oracle_peak(model, *most_tokens(found + STEP))
    out = []
    if fits > limit + TOLERANCE:
        out.append(f"L_max {found}: {most_tokens(found)} peaks {fits - limit:+,} bytes over the limit")
    if over <= limit - TOLERANCE:
        out.append(f"L_max {found + STEP}: {most_tokens(found + STEP)} fits ({over - limit:+,} B): {found} is not the largest")
    return out


def _forward_only_step(model: torch.nn.Module, shape: Shape, vocab: int, device: str, optimizer: str) -> None:
    """Seeded bug: the measured step skips backward."""
    call_loss(model, shape.tensors(vocab, device))


def run_cli(model: torch.nn.Module, limit: int) -> dict[str, Any]:
    """``odb tune --json`` on this very model (the CLI's builder returns it)."""
    tune_support.tiny_lm = lambda vocab_size=4096: model  # type: ignore[assignment]  # a throwaway process
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["tune", "--model", "tune_support:tiny_lm", "--memory", str(limit), "--max-length", str(CUTOFF),
                   "--device", "cpu", "--optimizer", "none", "--step", str(STEP), "--start", str(START),
                   "--max-shapes", "3", "--json"])
    return {"rc": rc, **json.loads(out.getvalue())}


def run_seeded(model: torch.nn.Module, limit: int, bug: str) -> int | None:
    """The budget ``tune`` reports with ``bug`` planted: ``no_backward`` (the measured step skips
    backward) or ``longest_only`` (only the longest-l group is measured)."""
    saved_step, saved_shapes = measure_mod.train_step, search_mod.worst_shapes
    try:
        if bug == "no_backward":
            measure_mod.train_step = _forward_only_step
        else:
            search_mod.worst_shapes = lambda budget, token_budget, cutoff, max_shapes=None: [
                padded_frontier(token_budget, cutoff)[0]]  # the longest-l group alone
        return tune(model, limit, CUTOFF, step=STEP, start=START, optimizer="none", max_shapes=3)["token_budget"]
    finally:
        measure_mod.train_step, search_mod.worst_shapes = saved_step, saved_shapes


REPLAY_STEPS, REPLAY_HEADROOM = 6, 96 * 2**20


def replay_objections(model: torch.nn.Module, limit: int, bug: bool = False) -> dict[str, Any]:
    """``tune`` with a replay of REPLAY_STEPS shapes (``bug``: seeded, the replay runs only its first
    shape) and the objections to its result: a reported budget whose replay peaks over the limit,
    or below the per-shape peak of a shape it ran (it skipped that shape)."""
    saved = replay_mod.run_steps
    if bug:
        replay_mod.run_steps = lambda m, shapes, *rest: saved(m, shapes[:1], *rest)  # type: ignore[assignment]
    try:
        result = tune(model, limit, CUTOFF, step=STEP, start=START, optimizer="none", max_shapes=3,
                      replay_steps=REPLAY_STEPS)
    finally:
        replay_mod.run_steps = saved
    found, out = result["token_budget"], []
    replays = {r["token_budget"]: r for r in result["replay"]["budgets"]}
    if found is None or found not in replays:
        return {"result": result, "objections": [f"no replayed budget reported ({found})"]}
    rep = replays[found]
    alone = [oracle_peak(model, *json.loads(label.split(" ", 1)[1])) for label in rep["shapes"]]
    if rep["peak_bytes"] > limit:
        out.append(f"L_max {found}: its replay peaks {rep['peak_bytes'] - limit:+,} bytes over the limit")
    if rep["peak_bytes"] < max(alone) - TOLERANCE:
        out.append(f"L_max {found}: its replay peaks {max(alone) - rep['peak_bytes']:,} bytes below a shape it ran")
    return {"result": result, "objections": out}


def check_all() -> dict[str, Any]:
    torch.set_num_threads(1)
    model = tune_support.tiny_lm()
    warm_up(model, 4096, "cpu", "none")
    limit = _rss() + HEADROOM
    cli = run_cli(model, limit)
    report: dict[str, Any] = {"limit": limit, "cli": cli, "cli_objections": budget_is_tight(model, limit, cli["token_budget"])}
    for bug in ("no_backward", "longest_only"):
        found = run_seeded(model, limit, bug)
        report[bug] = {"token_budget": found, "objections": budget_is_tight(model, limit, found)}
    report["replay"] = replay_objections(model, limit + REPLAY_HEADROOM)
    report["replay_first_only"] = replay_objections(model, limit + REPLAY_HEADROOM, bug=True)
    return report


if __name__ == "__main__":
    json.dump(check_all(), sys.stdout)
