"""The adapter, verified where it runs: seeded bugs in the epoch loop of real multi-process
runs are caught by replaying their traces with TLC, and ranks that disagree on the protocol
configuration or the sampler get a typed error naming the field, on every rank, before any batch.

(The traced clean runs live beside the tests that make them, in test_torch_loader.py:
join and non-join at W = 2 and 3, skip_idle with uneven shards, resume after k steps, and
three faults traced up to the fault.)
"""

from __future__ import annotations

import time

import pytest
from test_torch_loader import run_ranks
from torch_support import check_real_traces

from model_checks.traces import merge_directory, replay

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize(
    ("mutant", "task"),
    [
        # overflow groups vanish from the buffer: the balanced target overflows surplus groups
        ("drop-overflow", {"kind": "audit", "n": 80, "epochs": 1, "buffer": 8}),
        # the quota checked once per round: every step of the round that reaches N is consumed
        # (uneven fixed shards: iterations chain and the quota falls inside a round)
        ("round-quota", {"kind": "audit", "n": 61, "epochs": 3, "mode": "non-join", "buffer": 12,
                         "shards": [list(range(45)), list(range(45, 61))]}),
    ],
)
def test_real_traces_of_a_broken_epoch_loop_are_rejected(mutant, task, tmp_path):
    """A deliberately broken collate loop (a seeded bug of model_checks.mutants run by the real
    collate processes of a W=2 Gloo run) writes traces that TLC rejects, on their states alone
    (their ranks' reported statuses are not compared: merge's own check is not what catches them)."""
    run_ranks(2, {**task, "driver": mutant, "timeout": 20}, tmp_path, trace=True)
    traces = merge_directory(tmp_path / "traces", statuses=False)
    assert traces, "the mutated run wrote no trace"
    verdicts = replay(traces)
    assert any(not v.accepted for v in verdicts), f"TLC accepted every trace of the {mutant} run"


def test_real_non_join_run_that_chains_iterations_is_a_spec_behaviour(tmp_path):
    """Non-join over uneven fixed shards (45 and 16 views) at W=2, three epochs: iterations end
    when rank 1 finishes and chain; every trace replays with every invariant (the same run
    under the round-quota mutant above is rejected)."""
    task = {"kind": "audit", "n": 61, "epochs": 3, "mode": "non-join", "buffer": 12,
            "shards": [list(range(45)), list(range(45, 61))]}
    results = run_ranks(2, task, tmp_path, trace=True)
    assert all("error" not in r for r in results), results
    check_real_traces(tmp_path / "traces", require=("fetch", "drain", "gather", "chain", "split", "end"))


@pytest.mark.parametrize(
    ("per_rank", "field"),
    [
        ({"1": {"target_policy": "paper"}}, "target_policy"),
        ({"1": {"seed": 4}}, "seed"),
        ({"1": {"n": 80}}, "dataset_size"),
        ({"1": {"buffer": 8}}, "buffer_size"),
        ({"1": {"budget": "packed"}}, "budget"),
        ({"1": {"mode": "non-join"}}, "mode"),
        # a user's DistributedSampler per rank: one drops the uneven tail, the other pads it (a view
        # lost or repeated; accepted before)
        ({"0": {"drop_last": False}, "1": {"drop_last": True}}, "sampler_drop_last"),
        # a stream on one rank: a longer handshake vector than the other's (a gloo abort before)
        ({"0": {"stream": True}}, "a stream (IterableDataset) on one rank"),
        # streams read by other worker counts: a per-example split keeps one element in W of each
        # worker's stream, so the ranks lost some elements and repeated others (accepted before)
        ({"0": {"stream": True, "workers": 1}, "1": {"stream": True, "workers": 0}}, "num_workers"),
    ],
)
def test_ranks_that_disagree_get_a_typed_error_naming_the_field(per_rank, field, tmp_path):
    """Rank 1 builds its loader with another target policy, seed, dataset size, buffer, budget or
    mode: every rank
    raises ConfigMismatchError naming the field at the epoch's handshake, before any batch,
    within seconds (not a hang, not an error elsewhere)."""
    started = time.monotonic()
    results = run_ranks(2, {"kind": "audit", "n": 90, "epochs": 1, "per_rank": per_rank, "timeout": 30}, tmp_path)
    assert time.monotonic() - started < 90
    for r in results:
        assert r.get("error") == "ConfigMismatchError", r
        assert field in r["message"], r["message"]
