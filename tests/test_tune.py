"""``odb tune`` on CPU with a tiny model: the reported L_max fits the memory limit and
L_max + step does not, checked by this file's own measurement (a forked child's peak RSS
over a forward + backward on the budget's most-token B(l) group, enumerated here). Two
seeded bugs, a measurement that skips backward and a search that measures only the
longest-l group, each report a budget that this check rejects. Hypothesis: the padded
shapes measured hold the frontier's worst under any memory a x tokens + b x tokens x length
(a longest-only selection does not), the frontier covers every admitted group, and the
search returns the largest fitting multiple of the step under a synthetic measurement."""

from __future__ import annotations

import contextlib
import io
import json
import os

import pytest
import torch
import tune_support  # tests/tune_support.py
from hypothesis import given, settings
from hypothesis import strategies as st

import odb_tools.tune.search as search_mod
from odb_tools.cli import main
from odb_tools.tune import tune
from odb_tools.tune.measure import Measurement, warm_up
from odb_tools.tune.model import call_loss
from odb_tools.tune.search import Search, find_budget
from odb_tools.tune.shapes import Shape, padded_frontier, worst_shapes

CUTOFF, STEP, START = 400, 64, 512
HEADROOM = 32 * 2**20  # over the process's RSS once the model is built and warmed up
TOLERANCE = 2**20  # RSS noise between two forks measuring the same shape


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
    assert found is not None, "no budget reported"
    fits = oracle_peak(model, *most_tokens(found))
    over = oracle_peak(model, *most_tokens(found + STEP))
    out = []
    if fits > limit + TOLERANCE:
        out.append(f"L_max {found}: {most_tokens(found)} peaks {fits - limit:+,} bytes over the limit")
    if over <= limit - TOLERANCE:
        out.append(f"L_max {found + STEP}: {most_tokens(found + STEP)} fits ({over - limit:+,} B): {found} is not the largest")
    return out


@pytest.fixture(scope="module")
def model_and_limit() -> tuple[torch.nn.Module, int]:
    torch.set_num_threads(1)
    model = tune_support.tiny_lm()
    warm_up(model, 4096, "cpu", "none")
    return model, _rss() + HEADROOM


def test_odb_tune_reports_the_largest_budget_that_fits_and_prints_its_measurements(model_and_limit, monkeypatch):
    model, limit = model_and_limit
    monkeypatch.setattr(tune_support, "tiny_lm", lambda: model)  # the CLI builds this very model
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["tune", "--model", "tune_support:tiny_lm", "--memory", str(limit), "--max-length", str(CUTOFF),
                   "--device", "cpu", "--optimizer", "none", "--step", str(STEP), "--start", str(START),
                   "--max-shapes", "3", "--json"])
    result = json.loads(out.getvalue())
    assert rc == 0 and result["next_budget"] == result["token_budget"] + STEP
    verdicts = {r["token_budget"]: r for r in result["budgets"]}
    assert verdicts[result["token_budget"]]["fits"] and not verdicts[result["next_budget"]]["fits"]
    assert all(r["fits"] == (r["token_budget"] <= result["token_budget"]) for r in result["budgets"])  # monotone
    assert budget_is_tight(model, limit, result["token_budget"]) == []



def _forward_only_step(model: torch.nn.Module, shape: Shape, vocab: int, device: str, optimizer: str) -> None:
    """Seeded bug: the measured step skips backward."""
    call_loss(model, shape.tensors(vocab, device))


def test_seeded_bugs_report_a_budget_the_property_rejects(model_and_limit, monkeypatch):
    model, limit = model_and_limit
    with monkeypatch.context() as patch:
        patch.setattr("odb_tools.tune.measure.train_step", _forward_only_step)
        no_backward = tune(model, limit, CUTOFF, step=STEP, start=START, optimizer="none", max_shapes=3)
    assert budget_is_tight(model, limit, no_backward["token_budget"]) != []

    real_shapes = search_mod.worst_shapes
    with monkeypatch.context() as patch:  # seeded bug: only the longest-l group is measured
        patch.setattr(search_mod, "worst_shapes", lambda *a, **k: real_shapes(*a, **k)[:1])
        longest_only = tune(model, limit, CUTOFF, step=STEP, start=START, optimizer="none", max_shapes=3)
    assert budget_is_tight(model, limit, longest_only["token_budget"]) != []


def _misses_worst(select, token_budget: int, cutoff: int, a: float, b: float) -> bool:
    """Whether ``select``'s shapes miss the padded frontier's worst under memory a x tokens + b x tokens x length."""
    def cost(s: Shape) -> float:
        return a * s.tokens + b * s.tokens * s.length
    return max(map(cost, select("padded", token_budget, cutoff))) < max(map(cost, padded_frontier(token_budget, cutoff)))


@given(st.integers(1, 3000), st.integers(1, 3000), st.floats(0, 1), st.floats(0, 1))
def test_the_measured_padded_shapes_hold_the_worst_of_the_frontier(token_budget, cutoff, a, b):
    assert not _misses_worst(worst_shapes, token_budget, cutoff, a, b)
    # the frontier covers every admitted group: each [size, l] (l <= cut-off, size x l <= L_max or size 1) fits inside one
    frontier = padded_frontier(token_budget, cutoff)
    for n in range(1, min(cutoff, token_budget) + 1, max(1, min(cutoff, token_budget) // 50)):
        size = max(token_budget // n, 1)
        assert any(s.batch >= size and s.length >= n for s in frontier), (size, n)


def test_a_selection_of_the_longest_group_only_misses_the_worst():
    longest_only = lambda *args: worst_shapes(*args)[:1]  # noqa: E731 - seeded bug
    assert _misses_worst(longest_only, 100, 60, 1.0, 0.0)  # [1, 60]: 60 tokens, [2, 50]: 100


@settings(max_examples=40)
@given(st.integers(16, 200), st.integers(1, 1024), st.integers(1, 400), st.floats(0, 1), st.floats(0, 0.01),
       st.integers(0, 1500))
def test_search_returns_the_largest_fitting_multiple_of_step(step, start, cutoff, a, b, headroom):
    def measure(model, shape, vocab, optimizer):
        return Measurement(shape, int(a * shape.tokens + b * shape.tokens * shape.length))
    max_budget = 1024
    search = Search(torch.nn.Embedding(8, 2), headroom, "padded", cutoff, "cpu", "none", 8, measure)
    found, nxt = find_budget(search, step, start, max_budget)
    first = max(step, start // step * step)
    fitting = [n for n in range(first, max_budget + 1, step) if search.fits(n)]
    if not search.fits(first):
        assert found is None and nxt == first
        return
    assert found == max(fitting) and all(n in fitting for n in range(first, found + 1, step))  # monotone up to it
    assert nxt is None or (nxt == found + step and not search.fits(nxt))
