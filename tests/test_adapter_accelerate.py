"""The Accelerate helpers (docs/examples/accelerate_loop.py) under torchrun at W=1 and W=2.

Lockstep: a run checkpoints mid-epoch and stops, a second resumes: exactly-once coverage
per epoch across the two (P4), equal micro-batches per update on every rank (P2), exact
window weights (P7), and the first update's DDP gradient equal to the single-process
per-token-mean gradient over the same samples; at W=2, A's checkpoint also resumes on one rank
(elastic resume) with the same exactly-once coverage. W=1 runs under the packed budget
(padding-free rows; the reference gradient re-collates each row), W=2 under the padded one.
Join: ``skip_idle`` batches under torch ``Join`` with uneven shards: coverage, and ranks
really ran different batch counts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("accelerate", reason="the accelerate extra is not installed")

from torch_support import check_resume_exactly_once, check_windows, run_torchrun, trained  # noqa: E402

from odb_tools.demo.synthetic import TokenDataset  # noqa: E402

pytestmark = pytest.mark.timeout(400)

WORKER = Path(__file__).with_name("accelerate_worker.py")
N = 96


@pytest.mark.parametrize(("world", "budget"), [(1, "packed"), (2, "padded")])
def test_accelerate_lockstep_resume_exact_gradient(world, budget, tmp_path):
    run_torchrun(WORKER, [str(tmp_path), "lockstep", budget], world)
    ranks = [json.loads((tmp_path / f"lockstep_rank{r}.json").read_text()) for r in range(world)]
    lengths = TokenDataset(N).length
    real = [rec for r in ranks for run in ("a", "b") for rec in r["runs"][run] if not rec["padding"] and not rec["idle"]]
    if budget == "packed":  # one padding-free row per group, within the packed budget (P3)
        assert all(rec["row"] == [1, sum(map(lengths, rec["indices"]))] for rec in real)
        assert all(len(rec["indices"]) == 1 or rec["row"][1] <= 256 for rec in real)
        assert any(len(rec["indices"]) * max(map(lengths, rec["indices"])) > 256 for rec in real), "nothing packed"
    assert all(r["updates_a"] == 5 for r in ranks)
    before = trained([r["runs"]["a"] for r in ranks], keep=lambda rec: rec["update"] < 5)
    after = trained([r["runs"]["b"] for r in ranks])
    check_resume_exactly_once(before, after, N)
    check_windows([r["runs"]["a"] for r in ranks])
    check_windows([r["runs"]["b"] for r in ranks])
    check = ranks[0]["grad_check"]
    assert check["samples"] > world and check["max_rel_err"] < 1e-5, (
        f"P7: DDP gradient differs from the per-token-mean reference by {check['max_rel_err']:.2e}")
    if world == 2:  # elastic: A's 2-rank checkpoint resumed on 1 rank (both rank files merged) loses nothing
        run_torchrun(WORKER, [str(tmp_path), "resume", budget], 1)
        resumed = json.loads((tmp_path / "resume_rank0.json").read_text())
        check_resume_exactly_once(before, trained([resumed["records"]]), N)
        check_windows([resumed["records"]])
        assert resumed["updates"] > 0 and resumed["records"][0]["update"] == 5, "the update count continues"


def test_accelerate_join_uneven_shards(tmp_path):
    run_torchrun(WORKER, [str(tmp_path), "join"], 2)
    ranks = [json.loads((tmp_path / f"join_rank{r}.json").read_text())["steps"] for r in range(2)]
    for epoch in (0, 1):
        counts = [sum(1 for s in steps if s["epoch"] == epoch) for steps in ranks]
        assert counts[0] != counts[1], f"uneven shards should give uneven batch counts, got {counts}"
        ids = [i for steps in ranks for s in steps if s["epoch"] == epoch for i in s["indices"]]
        assert sorted(ids) == list(range(N)), f"P4: epoch {epoch} under Join"


def test_an_accelerator_that_counts_one_process_of_two_is_refused_on_every_rank(tmp_path):
    """On a machine without GPUs ``Accelerator()`` (no ``cpu=True``) under torchrun counts one process
    on each rank; the loader it got was a W=1 loader on every rank, each training the whole dataset
    alone, silently. Now ``odb_loader`` (and ``prepare``) refuse it on every rank."""
    run_torchrun(WORKER, [str(tmp_path), "no_cpu_flag"], 2)
    for r in range(2):
        result = json.loads((tmp_path / f"no_cpu_flag_rank{r}.json").read_text())
        assert result["counted"] == 1, "this machine's Accelerator() no longer counts one process: the test is moot"
        assert "loader_world" not in result, f"rank {r} built a loader for a world of {result.get('loader_world')}"
        refused = result["refused"]
        assert (refused["field"], refused["rank"]) == ("num_processes", r), refused
        assert "Accelerator(cpu=True)" in refused["message"] and "this job has 2" in refused["message"]


def test_a_launchers_world_without_a_process_group_is_compared_too(monkeypatch):
    """Before torch.distributed is initialised the launcher's WORLD_SIZE and RANK are the job's:
    an accelerator counting one process of a WORLD_SIZE=2 job is refused naming RANK; one that
    counts the job's processes, or a lone process with no launcher, is accepted."""
    from types import SimpleNamespace

    from odb_core.errors import UnsupportedSettingError
    from odb_torch.integrations.accelerate import check_accelerator_world

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(UnsupportedSettingError) as err:
        check_accelerator_world(SimpleNamespace(num_processes=1, distributed_type="NO"))
    assert (err.value.field, err.value.rank) == ("num_processes", 1) and "this job has 2" in str(err.value)
    check_accelerator_world(SimpleNamespace(num_processes=2))
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("RANK")
    check_accelerator_world(SimpleNamespace(num_processes=1))
