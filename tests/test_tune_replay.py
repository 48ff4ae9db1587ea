"""``odb tune``'s replay (:mod:`odb_tools.tune.replay`): after the shape-by-shape search, the
budget found runs many admitted shapes back to back, the allocator never emptied, and is
lowered until that run's peak fits too (on an H100 a budget whose worst shapes each fit ran out
of memory at step 8 of training). Real CPU runs (``tests/tune_check.py``, a fresh process): the
reported budget's replay fits and peaks at least as high as every shape it ran does alone; a
seeded replay that runs only its first shape is caught. Hypothesis: the replay's shapes are
admitted by the budget (P3), hold its worst shapes and depend only on the seed, and a larger
budget's shapes hold a smaller one's; with replay peaks that grow with the budget the search
settles on the largest multiple of the step whose replay fits, which a search that ignores the
replay (the seeded bug) does not."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tune_support import tiny_lm

from odb_tools.tune import markdown, tune
from odb_tools.tune.measure import Measurement, capped_cuda, cuda_fraction
from odb_tools.tune.replay import Replay, replay_shapes
from odb_tools.tune.search import Search, allocator_setting, find_budget, settle
from odb_tools.tune.shapes import worst_shapes


def test_the_reported_budget_replays_within_the_limit_and_runs_every_shape(tune_checked: dict[str, Any]) -> None:
    replay = tune_checked["replay"]
    assert replay["objections"] == [], replay["objections"]
    result = replay["result"]
    assert result["token_budget"] <= result["shapes_budget"]
    verdicts = {r["token_budget"]: r["fits"] for r in result["replay"]["budgets"]}
    assert verdicts[result["token_budget"]]
    if result["next_budget"] is not None and result["next_budget"] in verdicts:  # lowered: the next one was replayed
        assert not verdicts[result["next_budget"]] and result["next_budget"] == result["token_budget"] + 64


def test_a_replay_that_runs_only_its_first_shape_is_caught(tune_checked: dict[str, Any]) -> None:
    assert tune_checked["replay_first_only"]["objections"] != [], tune_checked["replay_first_only"]


@given(st.sampled_from(["padded", "packed"]), st.integers(1, 5000), st.integers(1, 5000), st.integers(1, 40),
       st.integers(0, 3))
def test_replay_shapes_are_admitted_hold_the_worst_and_follow_the_seed(budget, token_budget, cutoff, steps, seed):
    shapes = replay_shapes(budget, token_budget, cutoff, steps, seed)
    assert len(shapes) == steps
    for s in shapes:  # P3: a lone sample up to the cut-off, else within the budget
        assert s.length <= max(cutoff, token_budget) and s.batch >= 1
        assert s.tokens <= token_budget or (s.batch == 1 and s.length <= cutoff), s
    worst = worst_shapes(budget, token_budget, cutoff)[:steps]
    assert all(shapes.count(w) >= 1 for w in worst)
    assert replay_shapes(budget, token_budget, cutoff, steps, seed) == shapes


@given(st.sampled_from(["padded", "packed"]), st.integers(1, 3000), st.integers(1, 3000), st.integers(1, 3000),
       st.integers(1, 30), st.integers(0, 3))
def test_a_larger_budget_groups_the_same_draws_into_shapes_that_hold_the_smaller_ones(budget, b1, extra, cutoff,
                                                                                      steps, seed):
    """Replays of two budgets differ in their shapes, not in their draws: place by place, the
    larger budget's drawn shape has at least the rows and the length of the smaller one's (so
    its replay holds at least as much, which the settling search relies on)."""
    import odb_tools.tune.replay as replay_mod

    saved = replay_mod.worst_shapes
    replay_mod.worst_shapes = lambda *a, **k: []  # the drawn shapes alone
    try:
        small = replay_shapes(budget, b1, cutoff, steps, seed)
        large = replay_shapes(budget, b1 + extra, cutoff, steps, seed)
    finally:
        replay_mod.worst_shapes = saved
    assert all(y.batch >= x.batch and y.length >= x.length for x, y in zip(small, large)), (small, large)


def _fake(a: float, c: float) -> tuple[Any, Any]:
    """A shape's peak a x tokens; a replay's c x L_max (more than any of its shapes alone when c > a)."""
    def measure(model, shape, vocab, optimizer):
        return Measurement(shape, int(a * shape.tokens))

    def replay(model, token_budget, shapes, vocab, optimizer):
        return Replay(token_budget, tuple(shapes), int(c * token_budget))
    return measure, replay


def _property(search: Search, found: int | None, nxt: int | None, by_shape: int | None, step: int) -> list[str]:
    """The settled budget's replay fits, it is at most the shape-by-shape one, and the next multiple of the
    step up to that one does not replay within the limit (empty when all hold)."""
    out = []
    if found is not None and not search.replay_fits(found):
        out.append(f"{found}'s replay does not fit")
    if found is not None and by_shape is not None and found > by_shape:
        out.append(f"{found} is past the shape-by-shape budget {by_shape}")
    if by_shape is not None and (found or 0) + step <= by_shape and search.replay_fits((found or 0) + step):
        out.append(f"{(found or 0) + step} replays within the limit: {found} is not the largest")
    if found is not None and found < by_shape and nxt != found + step:  # type: ignore[operator]
        out.append(f"next budget {nxt}, not {found + step}")
    return out


@settings(max_examples=60)
@given(st.integers(16, 200), st.floats(0.1, 1.0), st.floats(1.0, 3.0), st.integers(100, 4000))
def test_the_search_settles_on_the_largest_budget_whose_replay_fits(step, a, ratio, limit):
    measure, replay = _fake(a, a * ratio)
    search = Search(torch.nn.Embedding(8, 2), limit, "padded", 64, "cpu", "none", 8, measure,
                    replay_steps=4, replay=replay)
    by_shape, _ = find_budget(search, step, step, 8192)
    found, over = settle(search, by_shape, step)
    assert _property(search, found, over, by_shape, step) == []


def test_a_search_that_ignores_the_replay_reports_a_budget_the_property_rejects():
    measure, replay = _fake(0.5, 1.0)  # a replay holds twice a shape's peak
    search = Search(torch.nn.Embedding(8, 2), 1000, "padded", 64, "cpu", "none", 8, measure,
                    replay_steps=4, replay=replay)
    by_shape, nxt = find_budget(search, 64, 64, 8192)
    assert _property(search, by_shape, nxt, by_shape, 64) != []  # the seeded bug: no settle
    found, over = settle(search, by_shape, 64)
    assert (found, over) == (960, 1024) and _property(search, found, over, by_shape, 64) == []


def test_the_report_names_each_replay_and_the_budget_it_lowered():
    measure, replay = _fake(0.5, 1.0)
    result = tune(tiny_lm(), 1000, 64, step=64, optimizer="none", measure=measure, replay_steps=4, replay=replay)
    assert (result["token_budget"], result["shapes_budget"], result["next_budget"]) == (960, 1984, 1024)
    assert result["replay"]["steps"] == 4 and all(len(r["shapes"]) == 4 for r in result["replay"]["budgets"])
    text = markdown(result)
    assert "L_max 1024: does not fit" in text and "L_max 960: fits" in text
    assert "its worst shapes one by one allow 1984" in text


def test_no_replay_on_cpu_unless_asked_and_a_negative_count_is_refused():
    measure, replay = _fake(0.5, 1.0)
    result = tune(tiny_lm(), 1000, 64, step=64, optimizer="none", measure=measure, replay=replay)
    assert result["replay"] is None and result["token_budget"] == result["shapes_budget"] == 1984
    with pytest.raises(ValueError, match="replay steps"):
        tune(tiny_lm(), 1000, 64, replay_steps=-1, measure=measure)


def _fake_card(monkeypatch: pytest.MonkeyPatch, total: int) -> list[tuple[float, int]]:
    """torch.cuda's memory-fraction calls, recorded, on a card of ``total`` bytes (no GPU needed)."""
    fractions: list[tuple[float, int]] = []
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, i=None: fractions.append((f, i)))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction",
                        lambda i=None: fractions[-1][0] if fractions else 1.0)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=total))
    return fractions


def test_a_gpu_replay_runs_with_the_allocator_capped_at_the_limit_and_uncapped_after(monkeypatch):
    """Uncapped, a larger card's allocator keeps every freed block, so the replay's reserved peak
    overstates what a card of the limit needs (on an H200, packed rows at L_max 11,264 held its
    whole 142 GB and tune picked 6,144 where the capped replay fits 16,384). The seeded bug, an
    uncapped replay, leaves the fraction unset while it runs."""
    import odb_tools.tune.replay as replay_mod

    fractions = _fake_card(monkeypatch, 4000)
    in_force: list[list[tuple[float, int]]] = []

    def peak_on_cuda(model, run, peak):
        in_force.append(list(fractions))
        return 900, None
    monkeypatch.setattr(replay_mod, "peak_on_cuda", peak_on_cuda)
    search = Search(torch.nn.Embedding(8, 2), 1000, "padded", 64, "cuda", "none", 8, replay_steps=4)
    assert search.replay_fits(128)
    assert in_force == [[(0.25, 0)]] and fractions == [(0.25, 0), (1.0, 0)]


def test_the_cap_is_lifted_when_the_replay_raises_and_never_exceeds_the_card(monkeypatch):
    fractions = _fake_card(monkeypatch, 4000)
    with pytest.raises(RuntimeError, match="boom"), capped_cuda("cuda:0", 1000):
        raise RuntimeError("boom")
    with capped_cuda("cuda", 10_000):  # a limit above the card: the whole card
        pass
    assert fractions == [(0.25, 0), (1.0, 0), (1.0, 0), (1.0, 0)]
    with pytest.raises(ValueError, match="must be positive"):
        cuda_fraction("cuda", 0)
    fractions.append((0.5, 0))  # the process's own cap: the tighter one holds inside, and comes back after
    with capped_cuda("cuda", 3000):
        pass
    with capped_cuda("cuda", 1000):
        pass
    assert fractions[-4:] == [(0.5, 0), (0.5, 0), (0.25, 0), (0.5, 0)]


def test_a_gpu_report_says_to_train_under_expandable_segments_unless_tune_ran_under_them(monkeypatch):
    """On an H200 capped at 80 GiB, ODB padded at tune's 23,552 (its replay fit) ran out of memory
    at step 9 with the default allocator and fit 46 steps with expandable segments."""
    measure, replay = _fake(0.5, 1.0)
    result = tune(tiny_lm(), 1000, 64, step=64, optimizer="none", measure=measure, replay_steps=4, replay=replay)
    assert result["allocator"] is None and "PYTORCH_CUDA_ALLOC_CONF" not in markdown(result)  # CPU: no advice
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    result["allocator"] = allocator_setting("cuda")
    assert result["allocator"] == "default"
    assert "rerun tune and train with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in markdown(result)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    result["allocator"] = allocator_setting("cuda")
    assert "train with" not in markdown(result)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")  # torch's newer name
    assert allocator_setting("cuda") == "expandable_segments:True"


def test_a_step_is_measured_on_the_models_own_device(monkeypatch):
    """peak_on_cuda reset, read and emptied the current device's memory statistics: a model on
    ``cuda:1`` while ``cuda:0`` is current was measured on ``cuda:0``. Every call now runs inside
    the model's device (faked: no GPU here; the seeded bug, no device context, records None)."""
    from contextlib import contextmanager

    from odb_tools.tune.measure import peak_on_cuda

    current: list[object] = [None]
    calls: list[tuple[str, object]] = []

    @contextmanager
    def device(d):
        current.append(d)
        try:
            yield
        finally:
            current.pop()

    for name in ("empty_cache", "reset_peak_memory_stats", "synchronize"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, _n=name: calls.append((_n, current[-1])))
    monkeypatch.setattr(torch.cuda, "device", device)
    model = torch.nn.Linear(2, 2)
    got = peak_on_cuda(model, lambda: calls.append(("run", current[-1])), lambda: calls.append(("peak", current[-1])) or 7)
    assert got == (7, None)
    where = next(model.parameters()).device
    assert calls and all(d == where for _, d in calls), calls
