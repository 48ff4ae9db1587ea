"""``odb demo --quick``, ``odb bench batching`` and ``odb profile`` from the command line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from odb_tools import baselines
from odb_tools.bench_batching import shape

ODB = [sys.executable, "-m", "odb_tools.cli"]


def run(*args: str, timeout: float = 600) -> str:
    out = subprocess.run([*ODB, *args], capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.mark.timeout(600)
def test_demo_quick_json_table_and_plots(tmp_path):
    summary = json.loads(run("demo", "--quick", "--json", "--results", str(tmp_path)))
    names = [m["name"] for m in summary["methods"]]
    assert names == ["standard", "sorted", "odb", "odb-packed"]
    assert summary["config"]["max_grad_norm"] == 1.0, "every method clips the gradient norm at the recorded value"
    for m in summary["methods"]:
        for key in ("samples_per_second", "padding_fraction", "samples_per_update", "updates", "final_loss"):
            assert key in m, key
        assert m["samples"] >= summary["config"]["samples"], f"{m['name']} lost samples"
        assert m["updates"] > 0 and 0 <= m["padding_fraction"] < 1 and m["final_loss"] > 0
    odb, standard, packed = summary["methods"][2], summary["methods"][0], summary["methods"][3]
    assert odb["padding_fraction"] < standard["padding_fraction"], "ODB must pad less than random fixed batches"
    assert packed["padding_fraction"] == 0, "a packed row processes only real tokens"
    steps, packed_steps = summary["config"]["accumulation_steps"], summary["config"]["packed_accumulation_steps"]
    assert packed["samples_per_update"] / packed_steps > odb["samples_per_update"] / steps, \
        "packed micro-batches of the same budget hold more samples"
    assert packed_steps < steps and packed["updates"] >= odb["updates"], \
        "the packed row accumulates fewer micro-batches, so it makes at least the padded row's updates"
    # time to loss: Standard reaches its own final smoothed loss (the target) by the end of its epoch
    assert summary["time_to_loss"]["target"] == standard["tail_loss"]
    assert 0 < standard["time_to_standard_loss"] <= standard["seconds"]
    for m in summary["methods"]:
        t = m["time_to_standard_loss"]
        assert t is None or 0 < t <= m["seconds"], m
    assert [Path(p).name for p in summary["plots"]] == ["loss_vs_samples.png", "padding_vs_throughput.png",
                                                        "loss_vs_seconds.png"]
    for png in summary["plots"]:
        assert Path(png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_batching_json_rows():
    rows = json.loads(run("bench", "batching", "--samples", "3000", "--budgets", "8192", "--worlds", "2,8",
                          "--distributions", "sharegpt4o", "--reference-worlds", "2", "--json"))["rows"]
    rows, packed_rows = ([r for r in rows if (r.get("budget_kind") == "packed") == kind] for kind in (False, True))
    keys = {"batcher", "distribution", "token_budget", "world", "padding_fraction", "samples_per_update",
            "updates", "over_budget_batches", "alignment_overhead", "formation_seconds_per_1e5"}
    assert all(keys <= set(r) for r in rows)
    batchers = {r["batcher"] for r in rows}
    assert {"standard", "sorted", "hfg-oracle", "gmt-oracle", "bmt-oracle", "odb"} <= batchers
    for r in rows:
        if not r["batcher"].startswith("lhotse"):  # lhotse bounds the sum of lengths, not the padded area
            assert r["over_budget_batches"] == 0, f"{r['batcher']}: a multi-sample batch over the budget"
    odb8 = next(r for r in rows if r["batcher"] == "odb" and r["world"] == 8)
    assert 0 <= odb8["alignment_overhead"] < 0.2 and odb8["padding_fraction"] < 0.05
    packed = {(r["batcher"], r["world"]): r for r in packed_rows}
    assert {b for b, _ in packed} == {"odb packed (target balanced)", "odb packed (target min)",
                                      "odb packed (target min, pool 2%)",
                                      "ffd oracle (offline)",
                                      "ffd per rank (offline, each rank's shard)",
                                      "trl pack_dataset bfd (offline, map batches of 1000)",
                                      "trl pack_dataset bfd (offline, one batch)"}
    oracle = packed["ffd oracle (offline)", 2]
    for (batcher, world), r in packed.items():
        assert r["samples"] == 3000, f"{batcher} W={world} lost samples"
        assert 0.9 < r["packing_efficiency"] <= oracle["packing_efficiency"] + 1e-3
        assert r["updates"] * world >= r["batches"], (batcher, world)
    over = packed["odb packed (target balanced)", 2]["over_budget_singletons"]
    assert over > 0 and oracle["over_budget_singletons"] == over, "first-fit decreasing sends each alone, as ODB"
    for world in (2, 8):
        per_rank = packed["ffd per rank (offline, each rank's shard)", world]
        assert per_rank["over_budget_singletons"] == over, "so does it over each rank's shard (it said 0)"
        assert per_rank["updates"] * world >= per_rank["batches"] >= oracle["batches"] - 1, \
            "each rank packs its own shard: its largest count times W covers every batch"
        assert per_rank["alignment_overhead"] == pytest.approx(per_rank["updates"] * world / per_rank["batches"] - 1)
    for world, label in ((2, "odb packed (target balanced)"), (8, "odb packed (target balanced)"),
                         (2, "odb packed (target min)"),
                         (8, "odb packed (target min)"), (8, "odb packed (target min, pool 2%)")):
        odb = packed[label, world]
        assert odb["coverage_exact"] and 0 <= odb["alignment_overhead"] < 0.2
        assert odb["over_budget_singletons"] == packed["trl pack_dataset bfd (offline, one batch)", world][
            "truncated_samples"] > 0, "sharegpt4o has samples over 8192: ODB sends them alone, TRL truncates them"


def test_reference_package_alignment_runs_live_on_gloo_ranks_and_emits_every_view():
    pytest.importorskip("odb.grouping", reason="online-dynamic-batching comes with the dev and bench extras")
    from odb_core.distributions import sample_lengths
    from odb_tools.reference_alignment import reference_alignment

    lengths = sample_lengths("sharegpt4o", 3000, 0)
    live = reference_alignment(lengths, 8192, world=2, buffer_size=256, timeout=300)
    assert live is not None
    assert live["unemitted"] == 0, "the reference package left views unemitted on this input"
    assert max(live["steps_per_rank"]) == live["steps"] >= 1 and live["alone"] >= 1
    assert live["over_budget_batches"] == 0, "the reference package formed a group over the budget"
    assert round(live["samples_per_update"] * live["steps"]) == len(lengths), "the harness miscounted samples"


def test_lhotse_rows_cover_every_sample_within_its_duration_budget():
    pytest.importorskip("lhotse", reason="lhotse comes with the dev and bench extras")
    from odb_core.distributions import sample_lengths
    from odb_tools.bench_batching import lhotse_groups

    lengths = sample_lengths("llava", 3000, 0)
    result = lhotse_groups(lengths, 8192)
    assert result is not None
    groups, seconds = result
    ids = [i for g in groups for i in g]
    assert sorted(ids) == list(range(len(lengths))), "lhotse's sampler lost or repeated a sample"
    assert all(len(g) == 1 or sum(lengths[i] for i in g) <= 8192 for g in groups), "lhotse's sum bound"
    assert seconds > 0


@pytest.mark.parametrize("batcher", ["standard", "sorted", "hfg", "gmt", "bmt"])
def test_baselines_cover_every_sample_and_respect_the_budget(batcher):
    lengths = [1 + (i * 7919) % 3000 for i in range(2000)]
    world, budget = 4, 8192
    bs = baselines.survival_batch_size(lengths, budget)
    make = {"standard": lambda: baselines.standard(lengths, bs, world),
            "sorted": lambda: baselines.sorted_online(lengths, bs, world, 256),
            "hfg": lambda: baselines.hfg(lengths, bs, world),
            "gmt": lambda: baselines.gmt(lengths, budget, world),
            "bmt": lambda: baselines.bmt(lengths, budget, world)}[batcher]
    batches = make()
    assert len(batches) % world == 0, "every rank runs the same number of steps"
    assert {i for b in batches for i in b} == set(range(len(lengths))), "a sample was dropped"
    assert shape(batches, lengths, budget, world)["over_budget_batches"] == 0


def test_profile_suggests_a_budget_and_predicts_speed(tmp_path):
    path = tmp_path / "lengths.txt"
    path.write_text("\n".join(str(10 + (i * 37) % 2000) for i in range(5000)))
    packed = json.loads(run("profile", "--lengths", str(path), "--budgets", "2048,8192", "--budget", "packed",
                            "--json"))
    assert packed["budget"] == "packed" and all(r["odb_padding"] == 0 for r in packed["budgets"])
    p = json.loads(run("profile", "--lengths", str(path), "--budgets", "2048,8192",
                       "--step-fixed", "0.05", "--step-per-token", "1e-5", "--json"))
    assert p["samples"] == 5000 and p["suggested_token_budget"] in (2048, 8192)
    assert all(r["odb_padding"] < r["fixed_padding"] or r["fixed_batch_size"] == 1 for r in p["budgets"])
    assert all(r["predicted_speedup"] > 1 for r in p["budgets"])
    for pk, pd in zip(packed["budgets"], p["budgets"], strict=True):  # --budget packed: fuller groups, fewer of them
        assert pk["odb_packing_efficiency"] > pd["odb_packing_efficiency"]
        assert pk["odb_samples_per_update"] > pd["odb_samples_per_update"]


def test_profile_rejects_a_bad_jsonl_line_by_number(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"text": "hello there"}\n{"prompt": "no text"}\n')
    out = subprocess.run([*ODB, "profile", "--jsonl", str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and f"{path}:2" in out.stderr


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 500), min_size=1, max_size=300), st.integers(1, 40), st.integers(1, 8),
       st.integers(0, 3))
def test_sorted_baseline_trains_every_sample_once_with_equal_steps_per_rank(lengths, batch_size, world, seed):
    """The demo's Sorted batches: the same step count on every rank, and every sample exactly once
    whenever some batch can be split. It used to repeat whole batches to reach a multiple of W:
    the full demo's Sorted trained (and counted) 1,292 samples for 1,280."""
    from odb_tools.demo.train import LengthGroupedBatches

    ranks = [LengthGroupedBatches(lengths, batch_size, r, world, seed).batches for r in range(world)]
    assert len({len(b) for b in ranks}) == 1, [len(b) for b in ranks]
    ids = sorted(i for batches in ranks for b in batches for i in b)
    if batch_size > 1 and len(lengths) >= world:
        assert ids == list(range(len(lengths)))
    else:
        assert set(ids) == set(range(len(lengths)))
    assert all(0 < len(b) <= batch_size for batches in ranks for b in batches)


def test_profile_suggests_the_smallest_good_budget_whatever_their_order():
    """It took the first good budget in the order given (4,096 or 16,384 for the same lengths)."""
    from odb_core.distributions import sample_lengths
    from odb_tools.profile import profile

    lengths = sample_lengths("ultrachat", 5000, seed=0)
    up, down = (profile(lengths, budgets=b)["suggested_token_budget"] for b in ([4096, 8192, 16384],
                                                                                [16384, 8192, 4096]))
    assert up == down == 4096


def test_profile_of_empty_samples_reports_no_padding():
    from odb_tools.profile import profile

    row = profile([0, 0, 0], budgets=[64])["budgets"][0]
    assert row["odb_padding"] == 0.0 and row["fixed_padding"] == 0.0, row


def test_lhotse_rows_run_on_fewer_samples_than_its_buckets():
    """lhotse's sampler was built with 30 buckets, which it refuses for fewer than 30 samples."""
    pytest.importorskip("lhotse")
    from odb_tools.bench_batching import lhotse_groups

    result = lhotse_groups([5, 9, 3] * 6, 32, 0)
    assert result is not None
    groups, _ = result
    assert sorted(i for g in groups for i in g) == list(range(18))


def test_profile_packed_text_table_shows_odb_packing_efficiency():
    """``--budget packed``'s text table has ODB's packing efficiency (real tokens / L_max per group),
    which README promises and only --json had; the padded table keeps its seven columns."""
    from odb_core.distributions import sample_lengths
    from odb_tools.profile import markdown, profile

    lengths = sample_lengths("ultrachat", 3000, seed=0)
    packed = profile(lengths, budgets=[4096, 8192], budget_kind="packed")
    table = markdown(packed).splitlines()
    header = next(line for line in table if line.startswith("| L_max"))
    cells = header.strip("|").split(" | ")
    assert cells[3] == "ODB packing efficiency", cells
    rows = [line.strip("|").split(" | ") for line in table if line.startswith(("| 4096 ", "| 8192 "))]
    assert [r[3] for r in rows] == [f"{b['odb_packing_efficiency']:.2%}" for b in packed["budgets"]], rows
    padded_header = next(line for line in markdown(profile(lengths, budgets=[4096])).splitlines()
                         if line.startswith("| L_max"))
    assert "efficiency" not in padded_header and padded_header.count("|") == 8, padded_header


def test_profile_shuffles_a_sorted_length_file_unless_told_not_to(tmp_path):
    """Buffers and fixed batches were cut in file order: a file sorted by length made every fixed
    batch homogeneous (0.1% padding where a shuffled order gives about 40%). By default the lengths
    are shuffled (seeded), so a sorted file profiles like the same lengths in random order;
    ``--no-shuffle`` keeps the file's order."""
    import random

    from odb_core.distributions import sample_lengths

    lengths = sample_lengths("ultrachat", 5000, seed=1)
    random.Random(7).shuffle(lengths)
    files = {"sorted": sorted(lengths), "random": lengths}
    for name, values in files.items():
        (tmp_path / f"{name}.txt").write_text("\n".join(map(str, values)))
    args = ("--budgets", "32768", "--json")
    srt, rnd = (json.loads(run("profile", "--lengths", str(tmp_path / f"{n}.txt"), *args))["budgets"][0]
                for n in files)
    assert rnd["fixed_padding"] > 0.3 and abs(srt["fixed_padding"] - rnd["fixed_padding"]) < 0.02, (srt, rnd)
    assert abs(srt["odb_padding"] - rnd["odb_padding"]) < 0.005, (srt, rnd)
    in_order = json.loads(run("profile", "--lengths", str(tmp_path / "sorted.txt"), "--no-shuffle", *args))
    assert in_order["shuffle"] is False and in_order["budgets"][0]["fixed_padding"] < 0.01, in_order
    other_seed = json.loads(run("profile", "--lengths", str(tmp_path / "sorted.txt"), "--seed", "3", *args))
    assert other_seed["seed"] == 3 and other_seed["budgets"][0] != srt  # the seed picks the order


def test_profile_samples_takes_the_first_n_of_a_file_or_jsonl(tmp_path):
    """``--samples`` was ignored for a length file and --jsonl (only a named distribution's draws
    used it); it takes the first N, as ``odb simulate --samples`` does, and more than the file
    holds is one line naming the file, exit status 2."""
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(str(n) for n in range(1, 11)))
    first3 = json.loads(run("profile", "--lengths", str(lengths), "--samples", "3", "--budgets", "64", "--json"))
    assert (first3["samples"], first3["max_length"]) == (3, 3), first3
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "hello"}\n{"text": "hello there"}\n{"text": "a b c d e f g h"}\n')
    jsonl = json.loads(run("profile", "--jsonl", str(data), "--samples", "2", "--budgets", "64", "--json"))
    assert jsonl["samples"] == 2, jsonl
    out = subprocess.run([*ODB, "profile", "--lengths", str(lengths), "--samples", "11"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and f"--samples 11 exceeds the 10 lengths in {lengths}" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_each_odb_packed_row_of_bench_batching_names_its_target_policy():
    """The ``balanced`` target's row was labelled plain "odb packed", as if it were the packed
    budget's default (``min``, README's "ODB packed (`min`)"); every ODB packed label now names the
    target it ran with, and labels are distinct."""
    from odb_tools.bench_packed import ODB_PACKED, packed_rows

    for label, policy, tail in ODB_PACKED:
        assert label.startswith(f"odb packed (target {policy}") and (tail == 0) == ("pool" not in label), label
    rows = packed_rows("uniform", [100, 300, 900, 50] * 25, 1024, [2], 64)
    odb = [r["batcher"] for r in rows if r["batcher"].startswith("odb packed")]
    assert odb == [label for label, _, _ in ODB_PACKED] and len(set(odb)) == len(odb), odb
