"""ODBDataLoader under real multi-process Gloo runs, W = 1..4.

Each test starts W trainer ranks (forked from a forkserver that imported torch once, each
in its own session with the test's environment: a spawned rank would import torch again,
about 3 s of CPU each on this machine), each with its own ODBDataLoader (and so its own
collate process in its own Gloo group), waits with a timeout, kills anything still
running, and checks that no process carrying the test's tag and no /dev/shm entry
created during the run is left behind.
"""

from __future__ import annotations

import json
import math
import os
import signal
import time
import uuid
from collections import Counter
from multiprocessing import forkserver, resource_tracker
from pathlib import Path
from typing import Any

import pytest
import torch.multiprocessing as tmp
from torch_support import (
    check_real_traces,
    describe,
    forked_rank,
    leaking_rank_main,
    rank_main,
    sample_length,
    wait_for_no_leftovers,
)

from odb_torch.ports import free_port

pytestmark = pytest.mark.timeout(300)
# the ranks' forkserver imports these once (it starts with the first run_ranks)
tmp.set_forkserver_preload(["torch", "torch.distributed", "odb_torch", "torch_support"])


def free_port_triple() -> int:
    """A port p with p, p+1 and p+2 free (trainer group, collate group, resumed collate group)."""
    return free_port(3)


def run_ranks(
    world: int, task: dict[str, Any], tmp_path: Path, timeout: float = 240, killed_ranks: int = 0,
    trace: bool = False, target: Any = rank_main, grace: float = 15.0,
) -> list[dict[str, Any]]:
    """Start the ranks (``target(rank, world, port, out_dir, task)``, through
    :func:`forked_rank`); check no tagged process, none in a rank's session, and no new
    /dev/shm entry survives. Each result carries the rank process's ``exitcode``
    (-9: killed here at ``timeout``); helpers get ``grace`` seconds to exit after the ranks.
    ``trace``: the collate processes trace the protocol
    into ``tmp_path/traces`` (``ODB_TRACE_DIR``), for :func:`check_real_traces`.

    The ranks' forkserver starts with the first call and keeps that call's environment for
    the session; each rank gets the caller's environment, working directory and a session of
    its own from :func:`forked_rank` (anything torch reads when imported comes from the first).

    A SIGKILLed trainer rank cannot unlink the named semaphores of its loader's two
    queues (3 each); they are registered with this process's resource
    tracker, which unlinks them when it exits. ``killed_ranks`` allows exactly that.
    """
    resource_tracker.ensure_running()  # this process's own helpers must not carry the tag
    forkserver.ensure_running()
    tmp_path.mkdir(parents=True, exist_ok=True)
    shm_before = set(os.listdir("/dev/shm"))
    tag = uuid.uuid4().hex
    os.environ["ODB_TEST_TAG"] = tag
    if trace:
        (tmp_path / "traces").mkdir(exist_ok=True)
        os.environ["ODB_TRACE_DIR"] = str(tmp_path / "traces")
    try:
        args = (target, dict(os.environ), os.getcwd(), str(tmp_path), world, free_port_triple(), str(tmp_path), task)
        ctx = tmp.start_processes(forked_rank, args=args, nprocs=world, join=False, start_method="forkserver")
        deadline = time.monotonic() + timeout
        try:
            for p in ctx.processes:  # each on its own: ProcessContext.join kills the rest when one fails
                p.join(max(0.0, deadline - time.monotonic()))
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                p.join(10)
    finally:
        del os.environ["ODB_TEST_TAG"]
        os.environ.pop("ODB_TRACE_DIR", None)
        for r in range(world):
            log = tmp_path / f"rank{r}.log"
            if log.exists() and log.stat().st_size:  # shown when the test fails
                print(f"--- rank {r} output ---\n{log.read_text(errors='replace')[-4000:]}")
    leftovers = wait_for_no_leftovers(tag, grace, frozenset(p.pid for p in ctx.processes))
    described = [describe(pid) for pid in leftovers]
    for pid in leftovers:
        os.kill(pid, signal.SIGKILL)
    assert not leftovers, f"processes left behind: {described}"
    leaked = sorted(set(os.listdir("/dev/shm")) - shm_before)
    semaphores = [x for x in leaked if x.startswith("sem.mp-")]
    assert len(semaphores) <= 6 * killed_ranks and len(semaphores) == len(leaked), f"shared memory left behind: {leaked}"
    results = []
    for r, p in enumerate(ctx.processes):
        path = tmp_path / f"rank{r}.json"
        results.append(json.loads(path.read_text()) if path.exists() else {"rank": r, "error": "no result"})
        results[-1]["exitcode"] = p.exitcode
    return results


def test_harness_finds_a_process_a_rank_leaves_behind(tmp_path):
    """The leak check itself catches a seeded leak: a rank's forked child that outlives it."""
    with pytest.raises(AssertionError, match="processes left behind"):
        run_ranks(2, {}, tmp_path, target=leaking_rank_main, grace=2.0)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_lockstep_coverage_budget_over_two_epochs_without_leaks(world, tmp_path):
    n = 113
    results = run_ranks(world, {"kind": "audit", "n": n, "epochs": 2, "workers": 1 if world == 2 else 0}, tmp_path,
                        trace=world in (2, 3))
    for r in results:
        assert "error" not in r, r
    if world in (2, 3):  # the real run, traced, is a behaviour of the spec (every invariant, every state)
        check_real_traces(tmp_path / "traces", require=("fetch", "drain", "gather", "split", "end"))
    for epoch in range(2):
        steps = [r["epochs"][epoch] for r in results]
        assert len({len(s) for s in steps}) == 1, "P2: ranks yielded different step counts"
        assert all([x["step"] for x in s] == list(range(len(s))) for s in steps)
        ids = [i for s in steps for x in s for i in x["ids"]]
        assert set(ids) == set(range(n)), "P4: a dataset index was never yielded"
        assert len(ids) == world * math.ceil(n / world), "P4: views lost or duplicated beyond sampler padding"
        for s in steps:
            for x in s:
                if not x["idle"] and x["size"] >= 2:
                    assert x["longest"] * x["size"] <= 128, "P3: a multi-sample batch exceeds the budget"
                assert x["over"] == (x["size"] == 1 and not x["idle"] and sample_length(x["ids"][0]) > 128)
    for r in results:
        first, *later = r["fds_after_epoch"]
        assert all(n <= first for n in later), f"rank {r['rank']}: open file descriptors grow per epoch: {r['fds_after_epoch']}"
    if world > 1:
        orders = [[x["ids"] for x in r["epochs"][0]] for r in results]
        assert orders != [[x["ids"] for x in r["epochs"][1]] for r in results], "epochs must reshuffle"


def test_same_seed_same_batches(tmp_path):
    task = {"kind": "audit", "n": 90, "epochs": 1, "seed": 7}
    first = run_ranks(2, task, tmp_path / "a")
    second = run_ranks(2, task, tmp_path / "b")
    assert [r["epochs"] for r in first] == [r["epochs"] for r in second]


@pytest.mark.parametrize("world", [2, 3])
def test_exact_loss_scaling_matches_per_token_reference_gradient(world, tmp_path):
    results = run_ranks(world, {"kind": "grad", "n": 60, "buffer": 8}, tmp_path)
    for r in results:
        assert "error" not in r, r.get("trace")
        assert r["max_err"] < 1e-12, f"rank {r['rank']}: DDP gradient differs from the reference by {r['max_err']}"


@pytest.mark.parametrize("stop_after", [1, 4])
def test_resume_mid_epoch_emits_exactly_the_rest(stop_after, tmp_path):
    n = 101
    results = run_ranks(2, {"kind": "resume", "n": n, "stop_after": stop_after, "buffer": 8}, tmp_path, trace=True)
    for r in results:
        assert "error" not in r, r
    check_real_traces(tmp_path / "traces", cut=1)  # the cut run and the resumed one (fewer views)
    assert all(len(r["before"]) == stop_after for r in results)
    assert len({len(r["after"]) for r in results}) == 1, "P2 after resume"
    ids = [i for r in results for part in ("before", "after") for batch in r[part] for i in batch]
    assert set(ids) == set(range(n)) and len(ids) == 2 * math.ceil(n / 2), "a view was lost or repeated"


def test_abandoned_epoch_does_not_leak_stale_batches_into_the_next(tmp_path):
    n = 120
    results = run_ranks(2, {"kind": "abandon", "n": n, "buffer": 8}, tmp_path)
    for r in results:
        assert "error" not in r, r
    assert all(epoch == 1 for r in results for epoch, _ in r["epoch1"]), "a batch of epoch 0 leaked into epoch 1"
    ids = [i for r in results for _, batch in r["epoch1"] for i in batch]
    assert set(ids) == set(range(n)) and len(ids) == n, "epoch 1 must be a whole epoch"
    assert len({len(r["epoch1"]) for r in results}) == 1


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
def test_other_start_methods_give_the_same_epoch(start_method, tmp_path):
    task = {"kind": "audit", "n": 70, "epochs": 1, "seed": 3}
    default = run_ranks(2, task, tmp_path / "auto")  # start_method="auto": fork on Linux
    other = run_ranks(2, {**task, "start_method": start_method}, tmp_path / start_method)
    for r in default + other:
        assert "error" not in r, r
    assert [r["epochs"] for r in other] == [r["epochs"] for r in default]


@pytest.mark.parametrize("collate", ["tuple", "tensor"])
def test_collate_fn_may_return_a_tuple_or_a_tensor(collate, tmp_path):
    (result,) = run_ranks(1, {"kind": "audit", "n": 30, "epochs": 1, "collate": collate}, tmp_path)
    assert "error" not in result, result
    steps = result["epochs"][0]
    assert sorted(i for s in steps for i in s["ids"]) == list(range(30))
    assert all(s["shape"][0] == len(s["ids"]) for s in steps)


def test_zero_length_sample_is_emitted_not_dropped_nor_made_the_idle_template(tmp_path):
    """A zero-length sample counts as length 1 for grouping and reaches the trainer (P4). Rank 0
    reads two empty samples first, then three others, and idles while rank 1 works through 35:
    its idle batches copy its first non-empty sample, never a [1, 0] batch a model cannot run."""
    shards = [[14, 15, 0, 1, 2], [i for i in range(40) if i not in (14, 15, 0, 1, 2)]]
    task = {"kind": "audit", "n": 40, "epochs": 1, "fail": {"14": "empty", "15": "empty"}, "shards": shards}
    results = run_ranks(2, task, tmp_path)
    for r in results:
        assert "error" not in r, r
    ids = [i for r in results for s in r["epochs"][0] for i in s["ids"]]
    assert sorted(ids) == list(range(40)), "every sample, the empty ones included, is emitted once"
    idle = [s for s in results[0]["epochs"][0] if s["idle"]]
    assert idle, "rank 0 should idle while rank 1 works"
    assert all(s["longest"] == sample_length(0) for s in idle), [s["longest"] for s in idle]


@pytest.mark.parametrize("world", [2, 3])
def test_non_join_epoch_closes_the_quota_in_lockstep(world, tmp_path):
    """Non-join (P5): every rank stops at the same step, the first whose cumulative global
    sample count reaches N, so N <= emitted <= N + the largest step; over two epochs."""
    n = 61
    # unshuffled, so the chained iterations' traces fit the spec's fixed lengths per position
    results = run_ranks(world, {"kind": "audit", "n": n, "epochs": 2, "mode": "non-join", "shuffle": False}, tmp_path,
                        trace=True)
    for r in results:
        assert "error" not in r, r
    check_real_traces(tmp_path / "traces", require=("fetch", "drain", "gather", "end"))
    for epoch in range(2):
        steps = [r["epochs"][epoch] for r in results]
        assert len({len(s) for s in steps}) == 1, "P2: equal step counts"
        globals_ = [s["global"] for s in steps[0]]
        assert all([s["global"] for s in other] == globals_ for other in steps), "every rank sees the same global counts"
        emitted = sum(len(s["ids"]) for rank in steps for s in rank)
        assert emitted == sum(globals_)
        assert n <= emitted <= n + max(globals_) and sum(globals_[:-1]) < n, "P5: the quota closes at the first step reaching N"
        assert all(0 <= i < n for rank in steps for s in rank for i in s["ids"])


def test_skip_idle_under_join_ends_a_finished_rank_early_without_deadlock(tmp_path):
    """Join mode + ``skip_idle`` under torch ``Join``, uneven shards (rank 0: 36 samples,
    rank 1: 4; each 100 tokens, so one per batch at budget 128) and an output queue of 1:
    rank 1's loop must end while rank 0 still trains, far more trailing steps than its
    queue holds (else the ranks deadlock: rank 0 in DDP's all-reduce, rank 1 waiting for
    the epoch's end). Every sample is trained once per epoch (P4)."""
    n = 40
    task = {"kind": "join", "n": n, "epochs": 2, "length": 100, "shards": [list(range(36)), list(range(36, 40))],
            "skip_idle": True, "queue_size": 1, "timeout": 30, "buffer": 8}
    results = run_ranks(2, task, tmp_path, trace=True)
    for r in results:
        assert "error" not in r, r
    check_real_traces(tmp_path / "traces", require=("fetch", "drain", "gather", "end"))
    for epoch in range(2):
        counts = [len(r["epochs"][epoch]) for r in results]
        assert counts[0] >= counts[1] + 10, f"rank 1 should run far fewer batches than rank 0, got {counts}"
        ids = [i for r in results for batch in r["epochs"][epoch] for i in batch]
        assert sorted(ids) == list(range(n)), f"P4: epoch {epoch} under Join trains every sample once"
        # the states after the epoch name one step boundary, its end (rank 1's said its own last
        # real step, and no end-of-epoch checkpoint under skip_idle resumed: ranks disagreed on steps)
        states = [r["states"][epoch] for r in results]
        assert states[0]["steps"] == states[1]["steps"] >= counts[0], [s["steps"] for s in states]
        assert [len(s["consumed"]) for s in states] == [36, 4], "the epoch's end: every view consumed"


@pytest.mark.parametrize("tail", [0.0, 0.3])
def test_elastic_resume_cut_on_2_ranks_resumed_on_3_then_on_2_yields_every_view_exactly_once(tail, tmp_path):
    """Elastic resume (join, P2/P4 across world sizes): 2 ranks stop after 3 steps, 3 ranks resume
    from the 2 rank states and stop after 2 more, 2 ranks resume from the 3 states (which list
    their dealt views) and finish. Every view of the epoch's padded order on 2 ranks is yielded
    exactly once over the three runs, each run's ranks take equal steps, the step count continues.
    With a shared tail (0.3) the first run stops at the step after the pool's last claim: its states'
    positions index the pooled order (claimed, unyielded pool views are dealt again too)."""
    n, states_a, states_b = 61, tmp_path / "states_a", tmp_path / "states_b"
    states_a.mkdir()
    states_b.mkdir()
    base = {"kind": "elastic", "n": n, "buffer": 8, **({"shared_tail": tail} if tail else {})}
    runs = [run_ranks(2, {**base, "stop_after": "pool" if tail else 3, "save": str(states_a)}, tmp_path / "a"),
            run_ranks(3, {**base, "load": str(states_a), "stop_after": 2, "save": str(states_b)}, tmp_path / "b"),
            run_ranks(2, {**base, "load": str(states_b)}, tmp_path / "c")]
    for results in runs:
        for r in results:
            assert "error" not in r, r.get("trace")
    first = 0
    for results in runs:
        numbers = [[number for number, _ in r["steps"]] for r in results]
        assert len({len(x) for x in numbers}) == 1, "P2: a run's ranks took different step counts"
        assert all(x == list(range(first, first + len(x))) for x in numbers), "the step count continues"
        first += len(numbers[0])
    cut = len(runs[0][0]["steps"])
    assert tail or cut == 3
    own = math.ceil((n - int(n * tail)) / 2)  # a pooled state's positions from here on are pool views
    assert not tail or any(p >= own for f in states_a.glob("state_rank*.json") for p in json.loads(f.read_text())[
        "consumed"]), "the pooled cut must have yielded some pool views (the merge maps them)"
    later = len(runs[1][0]["steps"])  # 2, or fewer if the epoch ended first (the pooled cut comes late)
    assert later == 2 or tail and later >= 1
    assert [r["saved_steps"] for results in runs[:2] for r in results] == [cut, cut] + [cut + later] * 3
    assert all(r["single_state_refused"] == "kind" for results in runs[1:] for r in results)
    ids = [i for results in runs for r in results for _, batch in r["steps"] for i in batch]
    counts = Counter(ids)
    assert set(counts) == set(range(n)), "P4 across the world-size changes: a view lost"
    pool = int(n * tail)
    assert len(ids) == pool + 2 * math.ceil((n - pool) / 2) and max(counts.values()) <= 2, "P4: a view yielded twice"


def test_ranks_resumed_from_different_checkpoints_of_one_step_count_are_refused_naming_the_state(tmp_path):
    """Two W=3 runs cut at step 3 (buffers 12 and 6: other views consumed), resumed on 2 ranks,
    rank 0 from the first run's states and rank 1 from the second's (a stale checkpoint folder on
    one node): each deals from its own merge, and 8 of 47 samples were trained twice and 8 never,
    without an error. The merged state's digest is a handshake fact now: every rank raises
    ConfigMismatchError naming ``resumed_state`` before any batch."""
    n, states_a, states_b = 47, tmp_path / "states_a", tmp_path / "states_b"
    states_a.mkdir()
    states_b.mkdir()
    base = {"kind": "elastic", "n": n}
    for buffer, states, out in ((12, states_a, "a"), (6, states_b, "b")):
        for r in run_ranks(3, {**base, "buffer": buffer, "stop_after": 3, "save": str(states)}, tmp_path / out):
            assert "error" not in r, r.get("trace")
    assert [json.loads((states_a / f"state_rank{r}.json").read_text())["consumed"] for r in range(3)] != [
        json.loads((states_b / f"state_rank{r}.json").read_text())["consumed"] for r in range(3)], "the case"
    results = run_ranks(2, {**base, "buffer": 8, "load": str(states_a), "per_rank": {"1": {"load": str(states_b)}}},
                        tmp_path / "c")
    for r in results:
        assert r.get("error") == "ConfigMismatchError" and "resumed_state" in r["message"], r
