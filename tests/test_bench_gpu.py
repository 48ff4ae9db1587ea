"""``benchmarks/bench_gpu.py --size tiny`` on CPU: the same code as the GPU run, in one run,
every method over every sample, each ODB step within L_max (P3), the packed budget without
padding; and the packed rows' flattening (position_ids restart, no loss across a boundary),
shown to reject a flattening whose positions run on."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_gpu  # noqa: E402


def flattening_errors(samples: list[dict[str, torch.Tensor]], row: dict[str, torch.Tensor]) -> list[str]:
    """Where ``row`` is not ``samples`` flattened: ids in order, positions 0..len-1 per sequence,
    each sequence's first label -100 and the rest its own labels."""
    out, at = [], 0
    for k, s in enumerate(samples):
        n = len(s["input_ids"])
        if not torch.equal(row["input_ids"][0, at:at + n], s["input_ids"]):
            out.append(f"sequence {k}: ids")
        if not torch.equal(row["position_ids"][0, at:at + n], torch.arange(n)):
            out.append(f"sequence {k}: positions")
        if row["labels"][0, at] != -100 or not torch.equal(row["labels"][0, at + 1:at + n], s["labels"][1:]):
            out.append(f"sequence {k}: labels")
        at += n
    return out + ([f"row holds {row['input_ids'].shape[1]} tokens, samples {at}"] if row["input_ids"].shape[1] != at else [])


def test_flatten_collate_restarts_positions_and_masks_boundaries():
    samples = [{"input_ids": torch.arange(2, 2 + n), "labels": torch.arange(2, 2 + n)} for n in (5, 1, 3)]
    assert flattening_errors(samples, bench_gpu.flatten_collate(samples)) == []
    seeded = dict(bench_gpu.flatten_collate(samples))
    seeded["position_ids"] = torch.arange(9)[None]  # seeded bug: one sequence's positions
    assert flattening_errors(samples, seeded) == ["sequence 1: positions", "sequence 2: positions"]


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
