"""``benchmarks/bench_gpu.py --size tiny`` on CPU: the same code as the GPU run, in one run,
every method over every sample, each ODB step within L_max (P3), the packed budget without
padding; and its model keeps a packed row's sequences apart (a model with the default
cache, which does not, is refused)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import odb_torch
from odb_core.errors import PackedAttentionError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_gpu  # noqa: E402


def test_the_benchmark_model_keeps_packed_sequences_apart():
    from transformers.models.qwen2 import Qwen2Config, Qwen2ForCausalLM

    tiny = bench_gpu.SIZES["tiny"]
    assert odb_torch.check_packed_attention(bench_gpu.build_model(tiny, "cpu", 0)) == "sdpa"
    with pytest.raises(PackedAttentionError):  # seeded bug: the config's default cache turns the per-sequence mask off
        odb_torch.check_packed_attention(Qwen2ForCausalLM(Qwen2Config(**tiny["model"])))


def test_tiny_cpu_run_compares_four_methods_side_by_side(capsys, tmp_path):
    rows_to = tmp_path / "rows.jsonl"
    assert bench_gpu.main(["--size", "tiny", "--device", "cpu", "--json", "--rows-to", str(rows_to)]) == 0
    result = json.loads(capsys.readouterr().out)
    streamed = [json.loads(line) for line in rows_to.read_text().splitlines()]
    assert [r["method"] for r in streamed] == list(bench_gpu.METHODS)  # each row as its method finished
    assert all(s["samples"] == r["samples"] for s, r in zip(streamed, result["rows"]))
    rows = {r["method"]: r for r in result["rows"]}
    assert list(rows) == list(bench_gpu.METHODS)
    for r in rows.values():
        assert r["samples"] == result["samples"], f"{r['method']} saw {r['samples']} of {result['samples']} samples"
        assert r["samples_per_second"] > 0 and r["tokens_per_second"] > 0 and r["peak_memory_bytes"] > 0
    for method in ("odb", "odb_packed"):
        assert rows[method]["max_step_tokens"] <= result["token_budget"], method  # P3: no sample exceeds the cut-off
    assert rows["odb_packed"]["padding_fraction"] == 0.0
    assert rows["odb"]["padding_fraction"] < rows["standard"]["padding_fraction"]
    assert rows["standard"]["speedup_vs_standard"] == 1.0


def test_a_method_that_runs_out_of_memory_is_reported_and_the_others_still_run(monkeypatch, capsys):
    real_step = bench_gpu.training_step

    def step_out_of_memory_on_padded_rows(model, opt, inputs):
        if inputs["input_ids"].shape[0] > 1:  # Standard's padded batches; a packed row is one row
            raise torch.OutOfMemoryError("seeded: CUDA out of memory")
        real_step(model, opt, inputs)

    monkeypatch.setattr(bench_gpu, "training_step", step_out_of_memory_on_padded_rows)
    assert bench_gpu.main(["--size", "tiny", "--device", "cpu", "--methods", "standard,odb_packed", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    standard, packed = result["rows"]
    oom = standard["out_of_memory"]
    assert oom["step"] == 0 and oom["shape"][0] == result["fixed_batch_size"] > 1  # its first batch, as collated
    assert standard["samples_per_second"] is None and standard["steps"] == 0
    assert packed["out_of_memory"] is None and packed["samples"] == result["samples"]
    assert packed["speedup_vs_standard"] is None  # no ratio against a Standard that did not finish
    assert "out of memory at step 1" in bench_gpu.table(result)


def test_batch_size_sets_the_fixed_batches_and_attn_the_models_attention(capsys):
    assert bench_gpu.main(["--size", "tiny", "--device", "cpu", "--methods", "standard,sorted", "--batch-size", "4",
                           "--attn", "eager", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["fixed_batch_size"] == 4 and result["attn_implementation"] == "eager"
    for r in result["rows"]:  # 32 samples in batches of 4 (the tiny size's default would be 3)
        assert r["steps"] == -(-result["samples"] // 4) and r["samples"] == result["samples"], r["method"]
    model = bench_gpu.build_model({**bench_gpu.SIZES["tiny"], "attn_implementation": "eager"}, "cpu", 0)
    assert model.config._attn_implementation == "eager"


def test_without_a_standard_row_no_ratio_is_printed_and_one_sample_is_refused(capsys):
    """``--methods sorted`` printed 'speedup vs Standard 1.00x' (against itself); ``--samples 1``
    crashed in the untimed warm-up, which collates two samples."""
    assert bench_gpu.main(["--size", "tiny", "--device", "cpu", "--methods", "sorted", "--samples", "8",
                           "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["rows"]
    assert row["speedup_vs_standard"] is None and row["peak_memory_vs_standard"] is None
    with pytest.raises(SystemExit) as exit_:
        bench_gpu.main(["--size", "tiny", "--device", "cpu", "--samples", "1"])
    assert exit_.value.code == 2 and "at least 2" in capsys.readouterr().err


def test_a_memory_cap_needs_a_gpu():
    with pytest.raises(SystemExit, match="needs --device cuda"):
        bench_gpu.main(["--memory-limit", "1000"])
