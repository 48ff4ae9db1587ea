"""The demo's packed row and time to loss, in process: the demo model on a packed row equals
the same sequences run one by one (``odb_torch``'s packed collate), its attention costs
the sum of squared lengths, the time-to-loss definition, and the offline FFD oracle."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from odb_core.sampler import permutation
from odb_core.schedules import shard
from odb_tools.bench_packed import efficiency, ffd_per_rank, first_fit_decreasing
from odb_tools.demo import model as demo_model
from odb_tools.demo import packed_accumulation_steps, window_groups
from odb_tools.demo.model import ModelConfig, TinyCausalLM
from odb_tools.demo.report import smoothed, summarize, time_to_loss
from odb_torch.padding_free import packed_collate

LENGTHS = [7, 1, 12, 4]


def _samples() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for n in LENGTHS:
        ids = torch.randint(1, 64, (n,), generator=g)
        labels = ids.clone()
        labels[: n // 3] = -100  # a prompt part without loss
        out.append({"input_ids": ids, "labels": labels})
    return out


def _loss_and_grads(model: TinyCausalLM, batches: list[dict[str, torch.Tensor]]) -> tuple[float, int, list[torch.Tensor]]:
    model.zero_grad()
    total, tokens = torch.zeros((), dtype=torch.float64), 0
    for b in batches:
        loss, n = model(b["input_ids"], b["labels"], b.get("position_ids"), b.get("cu_seq_lens_q"))
        total, tokens = total + loss, tokens + n
    total.backward()
    return float(total.detach()), tokens, [p.grad.clone() for p in model.parameters()]


def _model() -> TinyCausalLM:
    return TinyCausalLM(ModelConfig(vocab_size=64, max_length=32, d_model=16, n_layers=2, n_heads=2)).double()


def test_packed_row_loss_and_gradients_equal_the_sequences_run_alone(monkeypatch):
    model = _model()
    alone = [{"input_ids": s["input_ids"][None], "labels": s["labels"][None]} for s in _samples()]
    packed = packed_collate(_samples())
    loss_a, tokens_a, grads_a = _loss_and_grads(model, alone)
    loss_p, tokens_p, grads_p = _loss_and_grads(model, [packed])
    assert tokens_p == tokens_a
    assert loss_p == pytest.approx(loss_a, rel=1e-12)
    for a, p in zip(grads_a, grads_p, strict=True):
        torch.testing.assert_close(p, a, rtol=1e-10, atol=1e-12)
    # seeded bug: attention over the whole packed row lets sequences attend to each other
    original = demo_model.causal_attention
    monkeypatch.setattr(demo_model, "causal_attention", lambda q, k, v, bounds: original(q, k, v, None))
    leaked, _, _ = _loss_and_grads(model, [packed])
    assert leaked != pytest.approx(loss_a, rel=1e-9), "the check does not see cross-sequence attention"


def test_packed_attention_cost_is_the_sum_of_squared_lengths(monkeypatch):
    """Every attention call of a packed row covers one sequence: sum of t_q x t_k = sum l^2 per layer."""
    calls: list[tuple[int, int]] = []
    sdpa = demo_model.F.scaled_dot_product_attention

    def counting(q, k, v, **kw):
        calls.append((q.shape[-2], k.shape[-2]))
        return sdpa(q, k, v, **kw)

    monkeypatch.setattr(demo_model.F, "scaled_dot_product_attention", counting)
    packed = packed_collate(_samples())
    _model()(packed["input_ids"], packed["labels"], packed["position_ids"], packed["cu_seq_lens_q"])
    assert sum(q * k for q, k in calls) == 2 * sum(n * n for n in LENGTHS) < 2 * sum(LENGTHS) ** 2


def test_packed_model_refuses_positions_without_boundaries():
    packed = packed_collate(_samples())
    with pytest.raises(ValueError, match="both position_ids and cu_seq_lens"):
        _model()(packed["input_ids"], packed["labels"], packed["position_ids"], None)


def _run(losses: list[float], seconds_per_update: float, per_update: int = 10) -> dict:
    log = [{"samples": per_update * (k + 1), "loss": x, "tokens": 100.0, "seconds": seconds_per_update * (k + 1)}
           for k, x in enumerate(losses)]
    return {"samples": per_update * len(losses), "seconds": seconds_per_update * len(losses), "real_tokens": 1,
            "padded_tokens": 1, "final_loss": losses[-1], "log": log}


def test_time_to_loss_is_the_first_smoothed_point_at_standards_final_smoothed_loss():
    standard = _run([9, 8, 7, 6, 5, 4, 4, 4, 4, 4], 2.0)  # window: 10% of 100 samples = the last update
    target = smoothed(standard)[-1][2]
    assert target == 4.0 and time_to_loss(standard, target) == 12.0  # Standard reaches its own at update 6
    fast = _run([9, 6, 3, 3, 3, 3, 3, 3, 3, 3], 1.0)
    assert time_to_loss(fast, target) == 3.0
    assert time_to_loss(_run([9] * 10, 1.0), target) is None
    row = summarize("fast", fast, standard_rate=1.0, target=target)
    assert row["time_to_standard_loss"] == 3.0 and row["tail_loss"] == 3.0
    wide = _run([8, 2] + [6] * 18, 1.0)  # 10% of 200 samples: a two-update window, from the second update on
    assert [p[2] for p in smoothed(wide)][:2] == [5.0, 4.0]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 120), max_size=60), st.integers(1, 100))
def test_first_fit_decreasing_covers_every_sample_once_within_the_budget(lengths, budget):
    batches = first_fit_decreasing(lengths, budget)
    assert sorted(k for b in batches for k in b) == list(range(len(lengths)))
    for b in batches:
        assert len(b) == 1 or sum(max(lengths[k], 1) for k in b) <= budget
    within = [x for x in lengths if x <= budget]
    if within:  # first fit: no two batches of within-budget samples fit in one
        loads = sorted(sum(max(lengths[k], 1) for k in b) for b in batches if lengths[b[0]] <= budget)
        assert len(loads) < 2 or loads[0] + loads[1] > budget
    assert 0 <= efficiency([[lengths[k] for k in b] for b in batches], budget) <= 1


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 120), max_size=60), st.integers(1, 100), st.integers(1, 5), st.integers(0, 3))
def test_ffd_per_rank_packs_each_rank_shard_and_nothing_else(lengths, budget, world, seed):
    per_rank = ffd_per_rank(lengths, budget, world, seed)
    shards = shard(permutation(len(lengths), seed, 0, True), world, "in_order", seed)
    assert len(per_rank) == world
    for batches, views in zip(per_rank, shards, strict=True):
        assert sorted(x for b in batches for x in b) == sorted(lengths[v] for v in views), \
            "a rank's batches hold exactly its own shard's samples"
        assert all(len(b) == 1 or sum(max(x, 1) for x in b) <= budget for b in batches)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 300), min_size=1, max_size=80), st.integers(1, 6), st.integers(4, 32))
def test_packed_accumulation_steps_make_at_least_the_padded_rows_updates(lengths, steps, buffer_size):
    """The packed row accumulates the most micro-batches per update that still give at least
    the padded row's estimated updates per epoch (``odb demo``'s rule)."""
    micro = 256
    padded = window_groups(lengths, buffer_size, micro, packed=False)
    packed = window_groups(lengths, buffer_size, micro, packed=True)
    assert packed <= padded, "best fit never needs more groups than B(l) at the same budget"
    a = packed_accumulation_steps(lengths, buffer_size, micro, steps)
    assert 1 <= a <= steps
    assert a == 1 or packed / a >= padded / steps, "fewer updates than the padded row"
    assert packed / (a + 1) < padded / steps, "not the most micro-batches per update"


def test_packed_accumulation_steps_on_the_demo_shape():
    lengths = [1024, 900, 700, 500, 300, 120, 60, 30] * 32  # B(l) groups leave room a packed row fills
    a = packed_accumulation_steps(lengths, 256, 1024, 4)
    assert a == 3, a
    # seeded bug: keeping the padded row's 4 micro-batches per update gives fewer updates
    padded, packed = (window_groups(lengths, 256, 1024, packed=p) for p in (False, True))
    assert packed / 4 < padded / 4 <= packed / a


def test_the_demo_table_prints_the_target_and_epoch_seconds_as_readme_quotes_it():
    """README's demo table is a copy of ``odb demo``'s: fed README's own figures, :func:`table`
    prints README's header (the target loss in it) and rows line for line (each time to loss with
    the method's epoch seconds). It printed a speedup column, no target and no epoch seconds."""
    import re
    from pathlib import Path

    from odb_tools.demo.report import speedups, table

    readme = (Path(__file__).parents[1] / "README.md").read_text().splitlines()
    start = next(k for k, line in enumerate(readme) if line.startswith("| method | samples/s") and "(" in line)
    quoted = readme[start:start + 6]
    target = float(re.search(r"time to Standard's loss \((\d+\.\d+)\)", quoted[0]).group(1))
    config = {"token_budget": 4096, "accumulation_steps": 4, "packed_accumulation_steps": 3}  # the full preset's
    rows = []
    for line, name in zip(quoted[2:], ("standard", "sorted", "odb", "odb-packed"), strict=True):
        cells = line.strip("|").split(" | ")
        reached = re.fullmatch(r"(\d+\.\d) s \(of (\d+\.\d) s\)", cells[7].strip())
        rows.append({"name": name, "samples_per_second": float(cells[1]), "tokens_per_second": float(cells[2].replace(",", "")),
                     "padding_fraction": float(cells[3].rstrip("%")) / 100, "samples_per_update": float(cells[4]),
                     "updates": int(cells[5]), "final_loss": float(cells[6]),
                     "time_to_standard_loss": float(reached.group(1)) if reached else None,
                     "seconds": float(reached.group(2)) if reached else 60.0, "speedup_vs_standard": 1.0})
    assert rows[1]["time_to_standard_loss"] is None and rows[0]["time_to_standard_loss"] is not None
    assert table(rows, target, config).splitlines() == quoted
    assert table(rows).splitlines()[0].endswith("| time to Standard's loss |")  # no target: none shown
    rows[2]["speedup_vs_standard"] = 3.478
    assert "ODB 3.48x" in speedups(rows) and "Standard" not in speedups(rows).split(":", 1)[1]
