"""Errors that name the rank, the sample and the cause (found by a review of ranks that disagree
or fail): a user's sampler built for another rank or world size is refused before it repeats
or loses views (P4); ``collate_fn`` failing on an idle step's template names that sample; a
check of every rank's merged states carries the loading rank."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DistributedSampler
from torch_support import ToyDataset, fork_two_ranks

from odb_core.elastic import typed_state_errors
from odb_core.errors import CollateFnError, ODBWarning, ResumeStateError, UnsupportedSettingError
from odb_torch import ODBDataLoader, pad_collate


def _loader(sampler: object, rank: int = 0, world: int = 2) -> ODBDataLoader:
    return ODBDataLoader(ToyDataset(20), token_budget=64, rank=rank, world_size=world, sampler=sampler, num_workers=0)


@pytest.mark.parametrize(("replicas", "its_rank"), [(2, 1), (4, 0), (3, 2)])
def test_a_sampler_built_for_another_rank_or_world_is_refused(replicas, its_rank):
    """Two ranks with ``DistributedSampler(rank=0)`` each trained rank 0's views twice and rank
    1's never, with no error; a sampler of another world size repeats or drops views."""
    with pytest.raises(UnsupportedSettingError) as err:
        _loader(DistributedSampler(ToyDataset(20), num_replicas=replicas, rank=its_rank))
    assert (err.value.field, err.value.rank) == ("sampler", 0)
    assert f"built for rank {its_rank} of {replicas}" in str(err.value)


def test_this_ranks_own_shard_passes_and_a_whole_dataset_sampler_warns():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _loader(DistributedSampler(ToyDataset(20), num_replicas=2, rank=1), rank=1).close()
        _loader(DistributedSampler(ToyDataset(20), num_replicas=1, rank=0), world=1).close()
    with pytest.warns(ODBWarning, match="num_replicas=1: this rank iterates its whole dataset"):
        _loader(DistributedSampler(ToyDataset(20), num_replicas=1, rank=0)).close()


def test_a_check_of_every_ranks_states_names_the_loading_rank():
    with pytest.raises(ResumeStateError) as err, typed_state_errors(2):
        raise ResumeStateError("ranks [1] have another steps than the others (5)", field="steps")
    assert err.value.rank == 2 and str(err.value).startswith("rank 2: ranks [1]")
    with pytest.raises(ResumeStateError) as kept, typed_state_errors(2):
        raise ResumeStateError("rank 0: its own", field="steps", rank=0)
    assert kept.value.rank == 0 and str(kept.value) == "rank 0: its own"


class _Uneven(ToyDataset):
    """Rank 0's samples (even indices) 40 tokens, rank 1's 2: rank 1 runs out first and idles."""

    def __getitem__(self, i: int) -> dict[str, object]:
        return {"input_ids": torch.arange(40 if i % 2 == 0 else 2), "idx": i}


def _one_epoch(rank: int, out: str, dataset: ToyDataset, **kwargs: object) -> None:
    """One epoch of an ODBDataLoader over ``dataset`` on this rank of a W=2 run (``kwargs``
    overriding), its step count or its error (type, message, indices, ranks, field) to ``out``."""
    result: dict[str, object] = {}
    options: dict[str, object] = dict(token_budget=64, buffer_size=4, rank=rank, world_size=2, num_workers=0,
                                      shuffle=False, timeout=20)
    try:
        with ODBDataLoader(dataset, **{**options, **kwargs}) as loader:  # type: ignore[arg-type]
            loader.set_epoch(0)
            result["steps"] = sum(1 for _ in loader)
    except Exception as exc:
        result.update(error=type(exc).__name__, message=str(exc), indices=list(getattr(exc, "indices", ())),
                      ranks=list(getattr(exc, "ranks", ())), field=getattr(exc, "field", None))
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def _idle_rank(rank: int, port: int, out: str) -> None:
    seen: set[object] = set()

    def collate(batch: list[dict[str, object]]) -> dict[str, object]:
        ids = [s["idx"] for s in batch]
        if rank == 1 and seen.intersection(ids):  # a sample collated again: the idle step's template
            raise RuntimeError(f"cannot collate {ids}")
        seen.update(ids)
        return pad_collate(batch)

    _one_epoch(rank, out, _Uneven(16), collate_fn=collate, init_method=f"tcp://127.0.0.1:{port}")


@pytest.mark.timeout(120)
def test_collate_fn_failing_on_an_idle_steps_template_names_that_sample(tmp_path):
    """An idle step collates the rank's template sample (its loss scaled by 0); when collate_fn
    fails there, the error named ``dataset indices []`` and carried none."""
    fork_two_ranks(_idle_rank, tmp_path)
    rank1 = json.loads((tmp_path / "rank1.json").read_text())
    assert rank1.get("error") == CollateFnError.__name__, rank1
    assert "an idle step's template, dataset index" in rank1["message"], rank1
    assert len(rank1["indices"]) == 1 and rank1["indices"][0] % 2 == 1, rank1  # one of rank 1's own samples


class _BadOnRank1(ToyDataset):
    """Index 9 (rank 1's shard, unshuffled) cannot be read."""

    def __getitem__(self, i: int) -> dict[str, object]:
        if i == 9:
            raise ValueError("corrupt record 9")
        return super().__getitem__(i)


def _failing_peer_rank(rank: int, port: int, out: str) -> None:
    _one_epoch(rank, out, _BadOnRank1(40), init_method=f"tcp://127.0.0.1:{port}")


@pytest.mark.timeout(120)
def test_a_peer_error_names_the_rank_that_failed_and_its_error(tmp_path):
    """Rank 1 cannot read a sample: rank 0's PeerError said only "a peer rank died or exceeded
    the timeout" (nothing died); it now names rank 1 and its SampleLoadError, read from the
    collate group's store, where the failing rank reported it (``ranks`` == (1,))."""
    fork_two_ranks(_failing_peer_rank, tmp_path)
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert rank1.get("error") == "SampleLoadError" and "9" in rank1["message"], rank1
    assert rank0.get("error") == "PeerError", rank0
    assert rank0["ranks"] == [1] and "rank 1 failed: SampleLoadError" in rank0["message"], rank0


def _world_rank(rank: int, port: int, out: str) -> None:
    # rank 1 believes in a world of 3
    _one_epoch(rank, out, ToyDataset(40), world_size=2 + rank, timeout=4, init_method=f"tcp://127.0.0.1:{port}")


@pytest.mark.timeout(120)
def test_ranks_that_disagree_on_world_size_are_told_so(tmp_path):
    """Rank 1 passes world_size=3 in a world of 2: both ranks waited out the timeout and got a
    PeerError naming no cause. Rank 1 now compares rank 0's world size in the store at once
    (ConfigMismatchError, field world_size); rank 0, whose group rendezvous still waits for its
    timeout, names rank 1's refusal."""
    fork_two_ranks(_world_rank, tmp_path)
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert (rank1.get("error"), rank1.get("field"), rank1.get("ranks")) == ("ConfigMismatchError", "world_size", [0])
    assert "world_size is 3, rank 0's is 2" in rank1["message"], rank1
    assert rank0.get("error") == "PeerError" and rank0["ranks"] == [1], rank0
    assert "rank 1 failed: ConfigMismatchError" in rank0["message"], rank0


def _absent_rank(absent: int, rank: int, port: int, out: str) -> None:
    if rank == absent:  # this rank never creates its loader (it crashed earlier, or skipped the epoch)
        Path(out, f"rank{rank}.json").write_text(json.dumps({"absent": True}))
        return
    _one_epoch(rank, out, ToyDataset(40), timeout=3, init_method=f"tcp://127.0.0.1:{port}")


@pytest.mark.parametrize("absent", [0, 1])
@pytest.mark.timeout(120)
def test_a_rank_that_never_iterates_its_loader_is_named_by_the_others(absent, tmp_path):
    """A rank that never created or iterated its loader: its peer got, after its timeout, a
    PeerError naming no rank ("DistStoreError: wait timeout after 3000ms, keys: /0/1", or rank 0's
    store "serves start none (no store answered)" blaming another loader on the port). It now
    names the absent rank (``ranks``) and says what it did not do."""
    import functools

    fork_two_ranks(functools.partial(_absent_rank, absent), tmp_path)
    peer = json.loads((tmp_path / f"rank{1 - absent}.json").read_text())
    assert peer.get("error") == "PeerError" and peer["ranks"] == [absent], peer
    said = "ranks [1] never joined it" if absent == 1 else "rank 0 never served the collate group's store"
    assert said in peer["message"] and "not created or iterated" in peer["message"], peer


class _LongOnRank0(ToyDataset):
    """Rank 0's samples (even indices, unshuffled) 200 tokens, rank 1's 6: rank 1's loop ends first."""

    def __getitem__(self, i: int) -> dict[str, object]:
        return {"input_ids": torch.arange(200 if i % 2 == 0 else 6), "idx": i}


def _skip_idle_rank(rank: int, port: int, out: str, body: Any, timeout: float) -> None:
    """A W=2 trainer rank (its Gloo group's barrier stands for Join's wait for the last rank) running
    ``body(loader, dist, result)`` over ``_LongOnRank0`` under ``skip_idle``; ``result`` (or its error) to ``out``."""
    import torch.distributed as dist
    from torch_support import init_gloo

    result: dict[str, object] = {}
    init_gloo(rank, 2, port)
    try:
        with ODBDataLoader(_LongOnRank0(120), token_budget=256, buffer_size=16, rank=rank, world_size=2,
                           num_workers=0, shuffle=False, timeout=timeout, skip_idle=True,
                           init_method=f"tcp://127.0.0.1:{port + 1}") as loader:
            body(loader, dist, result)
    except Exception as exc:
        result.update(error=type(exc).__name__, message=str(exc))
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def _two_epochs_with_a_break(loader: ODBDataLoader, dist: Any, result: dict[str, object]) -> None:
    epochs = []
    for epoch in range(2):
        loader.set_epoch(epoch)
        steps = []
        for k, _ in enumerate(loader):
            steps.append(list(loader.step_info.indices))
            if epoch == 0 and k == 44:
                break  # max_steps: only rank 0 gets this far; rank 1's loop has ended (skip_idle)
        epochs.append(steps)
        dist.barrier()  # Join: every rank's loop over the epoch is over
    result["epochs"] = epochs


def _skip_idle_break_rank(rank: int, port: int, out: str) -> None:
    _skip_idle_rank(rank, port, out, _two_epochs_with_a_break, 20)


@pytest.mark.timeout(120)
def test_a_break_at_max_steps_under_skip_idle_restarts_every_rank_for_the_next_epoch(tmp_path):
    """Join with ``skip_idle``: rank 1's loop ends at its last real batch, rank 0 leaves epoch 0
    at max_steps (break). Rank 1 could not break at the same step; its collate process was still
    in epoch 0's idle rounds and kept its group while rank 0's loader started a new one: rank 1
    got a PeerError at once and rank 0 waited out its timeout. Now rank 1's loader restarts too,
    and epoch 1 trains every sample once, in lockstep."""
    fork_two_ranks(_skip_idle_break_rank, tmp_path)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all("error" not in r for r in ranks), ranks
    assert len(ranks[0]["epochs"][0]) == 45 > len(ranks[1]["epochs"][0]), "rank 1's loop ended first in epoch 0"
    second = [ids for r in ranks for step in r["epochs"][1] for ids in step]
    assert sorted(second) == list(range(120)), "epoch 1: every sample once"


@pytest.mark.timeout(60)
def test_another_service_on_the_collate_port_is_not_blamed_on_an_absent_rank_0():
    """A store that is not ODB's answers at rank 1's init_method: the error says something else
    serves the port (another loader, or the ranks' restarts), not that rank 0 never came."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    from odb_core.errors import PeerError
    from odb_torch.ports import free_port

    port = free_port()
    server = TCPStore("127.0.0.1", port, 1, True, timedelta(seconds=30))  # someone else's store
    loader = ODBDataLoader(ToyDataset(20), token_budget=64, rank=1, world_size=2, num_workers=0, timeout=3,
                           init_method=f"tcp://127.0.0.1:{port}")
    try:
        with pytest.raises(PeerError) as err:
            next(iter(loader))
    finally:
        loader.close()
        del server
    assert "no ODB store answered" in str(err.value) and "another ODB loader uses this port" in str(err.value)
    assert "never served" not in str(err.value)


def _break_then_state(loader: ODBDataLoader, dist: Any, result: dict[str, object]) -> None:
    loader.set_epoch(0)
    for k, _ in enumerate(loader):
        if k == 44:
            break  # max_steps on rank 0; rank 1's loop ended long before (skip_idle)
    dist.barrier()  # Join: every rank's loop is over, rank 0's left the epoch unfinished
    try:
        result["steps"] = loader.state_dict()["steps"]
    except Exception as exc:
        result.update(state_error=type(exc).__name__, state_message=str(exc))
    dist.barrier()
    loader.set_epoch(1)
    result["next"] = {k: v for k, v in loader.state_dict().items() if k in ("epoch", "steps", "consumed")}


def _break_then_state_rank(rank: int, port: int, out: str) -> None:
    _skip_idle_rank(rank, port, out, _break_then_state, 4)


@pytest.mark.timeout(120)
def test_a_state_after_a_break_under_skip_idle_is_a_typed_error_on_the_ended_rank_not_a_silent_wait(tmp_path):
    """Rank 0 breaks at max_steps, rank 1's loop had ended (skip_idle): the epoch never reaches its end,
    so rank 1 cannot name the step boundary. Its state_dict waited for the epoch's end until its
    collate group failed, a PeerError blaming a peer's timeout; it now says why and what to do, and
    after set_epoch(next epoch) both ranks' states agree."""
    rank0, rank1 = fork_two_ranks(_break_then_state_rank, tmp_path)
    assert rank0.get("steps") == 45 and "error" not in rank0, rank0
    assert rank1.get("state_error") in ("LoaderStateError", "PeerError") and "error" not in rank1, rank1
    assert "set_epoch(next epoch)" in rank1["state_message"] and "break at max_steps" in rank1["state_message"], rank1
    assert rank0["next"] == rank1["next"] == {"epoch": 1, "steps": 0, "consumed": []}, (rank0, rank1)
