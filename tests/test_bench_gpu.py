"""``benchmarks/bench_gpu.py --size tiny`` on CPU: the same code as the GPU run, in one run,
every method over every sample, each ODB step within L_max (P3), the packed budget without
padding; and its model keeps a packed row's sequences apart (a model with the default
cache, which does not, is refused)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

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


def test_tiny_cpu_run_compares_four_methods_side_by_side(capsys):
    assert bench_gpu.main(["--size", "tiny", "--device", "cpu", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
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
