"""ODBDataLoader over streams, on real Gloo ranks: local JSONL and Parquet files streamed with
Hugging Face ``datasets`` (``streaming=True``, no hub), sharded with ``split_dataset_by_node``
(whole files when the file count divides W, else the per-example path), tokenized in the
pipeline, and a plain ``IterableDataset`` generator with an empty stream on one rank.

Each run asserts, over every element: every rank yields the same number of steps, every
element of every rank's stream is yielded exactly once (audit by the records' ids), each
rank yields only its own shard, and every batch of >= 2 samples fits the token budget.
The W=2 runs are traced and their merged per-rank logs replayed by TLC over the stream spec.
A resumed run (``state_dict`` mid-epoch, ``load_state_dict`` on a new loader) must together
with the run it continues yield every element exactly once. No process or /dev/shm entry
may be left behind (``run_ranks``).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from stream_support import BUDGET, hf_stream, stream_rank_main, write_files
from test_torch_loader import run_ranks
from torch_support import check_real_traces

from odb_core import ODBConfig
from odb_core.errors import ResumeStateError, UnsupportedSettingError
from odb_torch import ODBDataLoader
from odb_torch.ports import free_port

pytestmark = pytest.mark.timeout(300)


def audit(results: list[dict[str, Any]], name: str, total: int) -> list[list[dict[str, Any]]]:
    """Equal steps on every rank; every record 0..total-1 yielded exactly once over all ranks (across
    a resume: the shards partition the records, so each rank yielded its own stream once); budget."""
    for res in results:
        assert "error" not in res, res.get("error")
    runs = [res["runs"][name] for res in results]
    steps = [run["steps"] + run.get("resumed", []) for run in runs]
    assert len({len(s) for s in steps}) == 1, f"{name}: ranks yielded {[len(s) for s in steps]} steps"
    got = Counter(i for rank_steps in steps for s in rank_steps for i in s["ids"])
    assert got == Counter(range(total)), f"{name}: not every record exactly once " \
                                         f"(missing {sorted(set(range(total)) - set(got))[:5]}, " \
                                         f"twice {[i for i, c in got.items() if c > 1][:5]})"
    for rank_steps in steps:
        assert [s["step"] for s in rank_steps] == list(range(len(rank_steps)))
        assert len({p for s in rank_steps for p in s["positions"]}) == sum(len(s["ids"]) for s in rank_steps)
        for s in rank_steps:
            assert s["over"] or len(s["ids"]) < 2 or s["tokens"] <= BUDGET
    return steps


def test_streams_at_w2_jsonl_parquet_generator_and_resume_every_element_once(tmp_path: Path) -> None:
    """W=2: JSONL (4 uneven files: whole files per rank, 2 workers), Parquet (3 files: the
    per-example path; checkpoint after 3 steps, resumed by a new loader from the dataset's own
    state; the JSONL run too, after 2 steps, from its 2 workers' states, its elements identified
    by their own ``id``: ``element_id="id"``), and a generator whose
    rank 1 stream is empty (idle batches from ``idle_sample``; ``set_epoch`` reaches the stream)."""
    jsonl_sizes, parquet_sizes = [70, 3, 45, 0], [31, 40, 6]
    (tmp_path / "j").mkdir()
    (tmp_path / "p").mkdir()
    jsonl = write_files(tmp_path / "j", "jsonl", jsonl_sizes)
    parquet = write_files(tmp_path / "p", "parquet", parquet_sizes)
    gen_ids = [list(range(57)), []]
    idle = {"input_ids": [1], "labels": [1], "id": -1}
    task = {"port": free_port(6), "runs": [
        {"name": "jsonl", "source": "jsonl", "files": jsonl, "workers": 2, "resume_after": 2, "element_id": "id"},
        {"name": "parquet", "source": "parquet", "files": parquet, "resume_after": 3},
        {"name": "generator", "source": "generator", "ids": gen_ids, "idle_sample": idle, "workers": 2, "epoch": 5},
    ]}
    results = run_ranks(2, task, tmp_path, target=stream_rank_main, timeout=150, trace=True)
    for rank_steps in audit(results, "jsonl", sum(jsonl_sizes)):  # element_id="id": the records' own identities
        assert all(s["positions"] == s["ids"] for s in rank_steps), "step_info.indices are not the elements' ids"
    audit(results, "parquet", sum(parquet_sizes))
    gen = audit(results, "generator", 57)
    assert all(s["idle"] for s in gen[1]) and gen[1], "the empty stream's rank yields idle steps in lockstep"
    assert {e for s in gen[0] for e in s["epoch"]} == {5}, "set_epoch was not forwarded to the stream"
    states = [res["runs"]["parquet"]["state"] for res in results]
    held = [set(range(max(st["consumed"], default=-1) + 1)) - set(st["consumed"]) for st in states]
    assert any(held), "the checkpoint held no element read but not yet yielded (nothing to re-deliver)"
    assert all(len(res["runs"]["jsonl"]["state"]["consumed_ids"]) == len(res["runs"]["jsonl"]["state"]["consumed"])
               for res in results)
    for name in ("parquet", "jsonl"):  # datasets streams resume from their own state (2 workers' for jsonl)
        for res in results:
            start = res["runs"][name]["state"]["stream_resume"]
            assert start is not None and len(start["workers"]) == (2 if name == "jsonl" else 1), start
    check_real_traces(tmp_path / "traces", cut=2)  # every streamed epoch (4 per rank) replayed by TLC; the
    # epoch stopped at its checkpoint is cut


def test_streams_at_w3_jsonl_per_example_split_with_workers(tmp_path: Path) -> None:
    """W=3: 5 uneven JSONL files (5 % 3 != 0: every third record per rank, one rank's stream
    one record longer than another's), 2 workers per rank, tokenized in the pipeline."""
    sizes = [44, 2, 19, 0, 24]
    files = write_files(tmp_path, "jsonl", sizes)
    # and a generator whose rank 1 stream (2 records) is used up before the checkpoint: resumed
    # without idle_sample, that rank builds its idle batches from its stream's first element
    gen_ids = [list(range(40)), [40, 41], list(range(42, 70))]
    task = {"port": free_port(4), "runs": [{"name": "jsonl", "source": "jsonl", "files": files, "workers": 2},
                                           {"name": "exhausted", "source": "generator", "ids": gen_ids,
                                            "resume_after": 4}]}
    results = run_ranks(3, task, tmp_path, target=stream_rank_main, timeout=150)
    audit(results, "jsonl", sum(sizes))
    steps = audit(results, "exhausted", 70)
    rank1 = results[1]["runs"]["exhausted"]
    assert sorted(rank1["state"]["consumed"]) == [0, 1], "rank 1's stream was not used up at the checkpoint"
    assert rank1["state"]["stream_resume"] is None, "a plain generator has no state: it resumes by re-reading"
    assert rank1["resumed"] and all(s["idle"] for s in rank1["resumed"]), steps[1]


def _reader(chunks: list[list[Any]]) -> Any:
    from collections import deque

    from odb_torch.stream_loading import END, StreamReader

    reader = StreamReader.__new__(StreamReader)  # the reading logic alone, over given worker chunks
    reader.rank, reader.timeout, reader._it = 0, 1.0, iter((chunk, 0, None) for chunk in chunks)
    reader._buffer, reader.position, reader.count, reader.first = deque(), 0, None, END
    reader._points = deque()  # a plain generator: no dataset state
    reader.expect, reader.key = {}, None  # no element_id
    return reader


def test_a_resumed_read_drops_the_consumed_prefix_chunk_by_chunk_and_keeps_the_first_element() -> None:
    from odb_torch.stream_loading import END

    reader = _reader([list(range(k, k + 32)) for k in range(0, 20_000, 32)])
    peak = 0
    refill = reader._refill

    def watched(s: int) -> None:
        nonlocal peak
        refill(s)
        peak = max(peak, len(reader._buffer))

    reader._refill = watched
    assert reader.read(19_000) == 19_000 and peak <= 64, f"held {peak} elements to pass over 19,000"
    assert reader.first == 0, "the idle template of a rank resumed past its whole stream"
    assert reader.read(20_000) is END and reader.count == 20_000


def test_a_none_element_is_an_invalid_sample_naming_rank_and_position_not_the_end() -> None:
    from odb_core.errors import InvalidSampleError

    reader = _reader([[{"input_ids": [1]}, None, {"input_ids": [2]}]])
    assert reader.read(0) == {"input_ids": [1]}
    with pytest.raises(InvalidSampleError) as err:
        reader.read(1)
    assert err.value.rank == 0 and err.value.indices == (1,) and reader.count is None


class _Empty(__import__("torch").utils.data.IterableDataset):  # type: ignore[misc]
    def __iter__(self) -> Any:
        return iter(())


def test_a_stream_refuses_non_join_a_sampler_and_a_resume_on_another_world_size_or_worker_count() -> None:
    """Non-join needs the quota N (unknown for a stream) and a sampler has nothing to sample:
    both refused at construction; a stream checkpoint taken at W=3 is refused at W=2, one taken
    with 2 DataLoader workers (the stream's order: their round robin) is refused with 4, and
    the state records the count."""
    with pytest.raises(UnsupportedSettingError) as info:
        ODBDataLoader(_Empty(), token_budget=64, mode="non-join", rank=0, world_size=2)
    assert info.value.field == "mode"
    with pytest.raises(UnsupportedSettingError) as info:
        ODBDataLoader(_Empty(), token_budget=64, sampler=[0, 1], rank=0, world_size=2)
    assert info.value.field == "sampler"
    loader = ODBDataLoader(_Empty(), config=ODBConfig(token_budget=64), rank=1, world_size=2)
    state = {"epoch": 0, "steps": 4, "consumed": [0, 2], "rank": 1, "world_size": 3, "seed": 0, "num_workers": 4}
    with pytest.raises(ResumeStateError, match="world size") as err:
        loader.load_state_dict(state)
    assert err.value.field == "world_size" and err.value.rank == 1
    for workers in (2, None):
        with pytest.raises(ResumeStateError, match="num_workers") as err:
            loader.load_state_dict({**state, "world_size": 2, "num_workers": workers})
        assert err.value.field == "num_workers" and err.value.rank == 1
    with pytest.raises(ResumeStateError) as err:  # a dataset state for a stream that has none
        loader.load_state_dict({**state, "world_size": 2, "stream_resume": {"position": 2, "workers": [None] * 4}})
    assert err.value.field == "stream_resume"
    with pytest.raises(ResumeStateError, match=r"pass states\[1\]") as err:  # every rank's, at this world size
        loader.load_state_dict([{**state, "world_size": 2, "rank": r} for r in range(2)])
    assert err.value.field == "state" and err.value.rank == 1
    with pytest.raises(ResumeStateError, match="a map-style loader's") as err:  # a sampler's state, not a stream's
        loader.load_state_dict({**state, "world_size": 2, "total": 8, "order_digest": "x", "shuffle": True})
    assert err.value.field == "stream" and err.value.rank == 1
    loader.load_state_dict({**state, "world_size": 2})
    assert loader.epoch == 0 and loader.state_dict()["num_workers"] == 4


@pytest.mark.parametrize("workers", [0, 2])
def test_a_datasets_stream_resumes_from_its_own_state_at_a_round_boundary(tmp_path: Path, monkeypatch: Any,
                                                                           workers: int) -> None:
    """A ``datasets`` stream (3 uneven JSONL files, tokenized with ``.map``) read in chunks of 4,
    in-process and by 2 workers (round robin over their files): for every low-water position L,
    the reader's resume point P <= L is a round boundary whose worker states, loaded into a new
    reader, yield exactly the stream's elements P, P+1, ... in order (no re-read from 0: P is
    close below L). With a shuffle buffer (its state leaves the buffer out) it is not resumable."""
    from odb_torch import stream_loading
    from odb_torch.collate_process import CollateSpec
    from odb_torch.stream_loading import END, StreamReader

    monkeypatch.setattr(stream_loading, "STREAM_CHUNK", 4)
    files = write_files(tmp_path, "jsonl", [10, 7, 0])
    spec = CollateSpec(hf_stream(files, "jsonl", 0, 1), list, None, None, ODBConfig(token_budget=64), 0, 1, "",
                       30.0, workers, 2 if workers else None, "fork" if workers else None)

    def read_all(reader: StreamReader, start: int) -> list[int]:
        ids, s = [], start
        while (element := reader.read(s)) is not END:
            ids.append(element["id"])
            s += 1
        return ids

    assert stream_loading.resumable(spec.dataset)
    assert not stream_loading.resumable(spec.dataset.shuffle(seed=0, buffer_size=8)), \
        "a datasets shuffle buffer's state leaves the buffer out: such a stream must resume by re-reading"
    full = read_all(StreamReader(spec), 0)
    assert sorted(full) == list(range(17)) and (workers == 0 or full[:8] == [0, 1, 2, 3, 10, 11, 12, 13])
    reader, lows = StreamReader(spec), [0, 3, 5, 9, 16, 17]
    points = []
    for low in lows:
        reader.read(low) if low < 17 else read_all(reader, 17)
        points.append(reader.point(low))
    reader.close()
    for low, point in zip(lows, points):
        assert point is not None and low - 8 < point["position"] <= low, (low, point)
        resumed = StreamReader(spec, point)
        assert read_all(resumed, point["position"]) == full[point["position"]:], (low, point)


def test_element_id_identities_missing_duplicated_or_mismatched_are_typed_errors() -> None:
    """``element_id``: an element without an integer identity, or with one already seen this epoch
    (before a checkpoint included), is an InvalidSampleError naming rank and position/identity; a
    state whose consumed_ids do not match the loader's element_id is refused; a map-style
    dataset refuses element_id."""
    from odb_core.errors import InvalidSampleError
    from odb_torch.stream_loading import StreamSampler, StreamServer

    server = StreamServer.__new__(StreamServer)  # the identity bookkeeping alone
    server.spec, server.options = type("Spec", (), {"rank": 1})(), StreamSampler(element_id="id")
    server._ids, server._seen = {}, {7: 0}  # identity 7 consumed at position 0 before a checkpoint
    server._identify({"id": 3}, 1)
    server._identify({"id": __import__("numpy").int64(4)}, 2)  # a stream formatted for NumPy
    server._identify({"id": __import__("numpy").array(5)}, 10)  # the same after .map(): a 0-d array
    for element, position, field in (({"id": 7}, 3, 7), ({"id": 3}, 4, 3), ({"text": "x"}, 5, 5),
                                     ({"id": "3"}, 6, 6), ("plain", 7, 7), ({"id": True}, 8, 8),
                                     ({"id": __import__("numpy").float64(9)}, 9, 9),
                                     ({"id": __import__("numpy").array(9.5)}, 11, 11)):
        with pytest.raises(InvalidSampleError) as err:
            server._identify(element, position)
        assert err.value.rank == 1 and err.value.indices == (field,), (element, err.value)
    assert server._ids == {1: 3, 2: 4, 10: 5} and all(type(i) is int for i in server._ids.values())
    loader = ODBDataLoader(_Empty(), config=ODBConfig(token_budget=64), rank=0, world_size=1, element_id="id")
    state = {"epoch": 0, "steps": 1, "consumed": [0, 1], "rank": 0, "world_size": 1, "seed": 0, "num_workers": 4}
    for ids in (None, [5]):
        with pytest.raises(ResumeStateError) as rerr:
            loader.load_state_dict({**state, "consumed_ids": ids})
        assert rerr.value.field == "consumed_ids"
    loader.load_state_dict({**state, "consumed_ids": [5, 9]})
    assert loader.state_dict()["consumed_ids"] == [5, 9]
    with pytest.raises(UnsupportedSettingError) as uerr:
        ODBDataLoader([1, 2], token_budget=64, rank=0, world_size=1, element_id="id")
    assert uerr.value.field == "element_id"


class _DyingStream(__import__("torch").utils.data.IterableDataset):  # type: ignore[misc]
    """Five elements, then its DataLoader worker dies (as an out-of-memory kill would end it)."""

    def __iter__(self) -> Any:
        import os

        import torch

        for k in range(1000):
            if k == 5 and torch.utils.data.get_worker_info() is not None:
                os._exit(3)
            yield {"input_ids": [1 + k % 7] * (1 + k % 5)}


def test_a_dead_stream_worker_is_a_typed_error_within_seconds_not_the_timeout() -> None:
    """A stream's DataLoader worker that dies is reported as a SampleLoadError naming the rank
    within a slice of the timeout (at most 5 s), as a map-style dataset's is. The case that
    needs it: a trainer that already ran a multi-worker DataLoader forks the collate process,
    which then inherits torch's "SIGCHLD handler set" flag with SIGCHLD reset to its default,
    so no handler reports the death; before, the read waited the whole timeout (60 s here)."""
    import time

    import torch


    list(torch.utils.data.DataLoader(list(range(4)), num_workers=1))  # as a trainer's own DataLoader would
    loader = ODBDataLoader(_DyingStream(), token_budget=64, buffer_size=8, num_workers=1, rank=0, world_size=1,
                           timeout=60, start_method="fork")
    started = time.monotonic()
    error = _load_error(loader)
    assert error.rank == 0 and "exited unexpectedly" in str(error), error
    assert time.monotonic() - started < 30, f"reported after {time.monotonic() - started:.0f}s"


def _load_error(loader: ODBDataLoader) -> Any:
    """The SampleLoadError a pass over ``loader`` ends with (the loader closed after it)."""
    from odb_core.errors import SampleLoadError

    try:
        with pytest.raises(SampleLoadError) as err:
            for _ in loader:
                pass
    finally:
        loader.close()
    return err.value


class _FailingStream(__import__("torch").utils.data.IterableDataset):  # type: ignore[misc]
    """Elements until position ``at``, where its ``__iter__`` raises."""

    def __init__(self, at: int) -> None:
        self.at = at

    def __iter__(self) -> Any:
        for k in range(1000):
            if k == self.at:
                raise ValueError(f"corrupt record {k}")
            yield {"input_ids": [1 + k % 7] * (1 + k % 5)}


@pytest.mark.parametrize("at", [20, 40])
def test_a_failing_stream_names_where_the_failed_read_began(at: int) -> None:
    """Elements are read in chunks, so a failure mid-chunk is only known to lie at or after the
    first position not yet read: the SampleLoadError names that position (its indices) as such,
    and the failing element lies in the chunk it begins (it said "reading position 0 failed" for
    an element at 20)."""
    from odb_torch import pad_collate
    from odb_torch.stream_loading import STREAM_CHUNK

    loader = ODBDataLoader(_FailingStream(at), token_budget=64, buffer_size=8, num_workers=0, rank=0, world_size=1,
                           timeout=60, collate_fn=pad_collate)
    error = _load_error(loader)
    (first,) = error.indices
    assert first <= at < first + STREAM_CHUNK and f"at or after position {first}" in str(error), error
    assert f"corrupt record {at}" in str(error)


class _IdStream(__import__("torch").utils.data.IterableDataset):  # type: ignore[misc]
    """60 elements of mixed lengths, element k with identity 1000 + k (its stream position + 1000)."""

    def __iter__(self) -> Any:
        return iter({"input_ids": [1] * (1 + (k * 37) % 23), "id": 1000 + k} for k in range(60))


def test_a_stream_states_consumed_ids_name_the_elements_at_its_consumed_positions() -> None:
    """``consumed_ids[k]`` is the identity of the element at ``consumed[k]`` (README "Streaming":
    the identities of ``consumed``, in order), though batches deliver positions out of order;
    a resumed loader's state keeps the pairing."""
    from odb_torch import pad_collate

    first = ODBDataLoader(_IdStream(), token_budget=64, buffer_size=16, num_workers=0, rank=0, world_size=1,
                          element_id="id", collate_fn=pad_collate)
    try:
        delivered = []
        for step, _ in enumerate(first):
            delivered += list(first.step_info.indices)
            if step == 4:
                break
        state = first.state_dict()
    finally:
        first.close()
    assert delivered != sorted(delivered), "the check needs positions delivered out of order"
    assert state["consumed_ids"] == [1000 + p for p in state["consumed"]]
    again = ODBDataLoader(_IdStream(), token_budget=64, buffer_size=16, num_workers=0, rank=0, world_size=1,
                          element_id="id", collate_fn=pad_collate)
    try:
        again.load_state_dict(state)
        for step, _ in enumerate(again):
            if step == 2:
                break
        later = again.state_dict()
    finally:
        again.close()
    assert later["consumed_ids"] == [1000 + p for p in later["consumed"]] and len(later["consumed"]) > len(state["consumed"])


def test_a_map_style_loader_refuses_a_streams_checkpoint() -> None:
    """A stream's state names stream positions; a loader over a map-style dataset would take them
    for sampler positions and skip and repeat other samples: a ResumeStateError naming the field."""
    state = {"epoch": 0, "steps": 2, "consumed": [0, 1, 2, 5], "rank": 0, "world_size": 1, "seed": 0,
             "stream": True, "num_workers": 2}
    loader = ODBDataLoader([{"input_ids": [1, 2]}] * 8, token_budget=64, rank=0, world_size=1)
    with pytest.raises(ResumeStateError) as err:
        loader.load_state_dict(state)
    assert err.value.field == "stream" and err.value.rank == 0
    loader.load_state_dict({k: v for k, v in state.items() if k not in ("stream", "num_workers")})  # its own kind


def test_a_stream_resume_point_above_an_unconsumed_position_is_refused() -> None:
    """The read resumes at ``stream_resume``'s position, so every position below it must be
    consumed; a state where one is not (edited, or paired with another state's positions) would
    lose that element: a ResumeStateError naming the field, not a silent loss (P4)."""
    from odb_torch.stream_loading import check_stream_start

    class Resumable:
        def state_dict(self) -> dict[str, int]:
            return {}

        def load_state_dict(self, state: dict[str, int]) -> None:
            pass

    start = {"position": 4, "workers": [None, {"shard": 1}]}
    assert check_stream_start(start, 1, 2, Resumable(), [0, 1, 2, 3, 7])["position"] == 4
    with pytest.raises(ResumeStateError) as err:
        check_stream_start(start, 1, 2, Resumable(), [0, 1, 3, 7, 9])  # position 2 never trained
    assert err.value.field == "stream_resume" and err.value.rank == 1


def test_an_empty_stream_without_idle_sample_is_a_typed_error_naming_the_fix(tmp_path: Path) -> None:
    """W=2, rank 1's stream is empty and no ``idle_sample`` is given: rank 1 has no element to build
    its idle batches from, so its epoch fails with CollateProcessError saying to pass idle_sample
    (not a hang, not a batch made up); rank 0 learns it as an error too."""
    task = {"port": free_port(2), "runs": [{"name": "empty", "source": "generator", "ids": [list(range(20)), []]}]}
    results = run_ranks(2, task, tmp_path, target=stream_rank_main, timeout=120)
    assert "CollateProcessError" in results[1].get("error", "") and "idle_sample" in results[1]["error"], results[1]
    assert results[0].get("error", "").startswith("PeerError"), results[0]


def test_a_stream_checkpoint_resumed_over_another_stream_is_refused_naming_the_position(tmp_path: Path) -> None:
    """``element_id``: a checkpoint after 10 steps, resumed with rank 0's stream replaced by
    other elements (ids 1000..): the consumed prefix is read again and was dropped unchecked, so
    the new stream's elements at those positions were never trained (17 of them), without an
    error. Now each element passed over must be the one the checkpoint consumed there: rank 0
    raises ResumeStateError (field consumed_ids) and rank 1, whose peer is gone, PeerError."""
    ids = [list(range(60)), list(range(100, 160))]
    other = [list(range(1000, 1060)), ids[1]]
    task = {"port": free_port(6), "runs": [{"name": "g", "source": "generator", "ids": ids, "element_id": "id",
                                            "resume_after": 10, "resumed_ids": other}]}
    results = run_ranks(2, task, tmp_path, target=stream_rank_main, timeout=150)
    first = results[0].get("error", "").split("\n")[0]
    assert first.startswith("ResumeStateError") and "holds element_id 10" in first, results[0].get("error")
    assert "not the one the checkpoint read" in first, first
    assert results[1].get("error", "").startswith("PeerError"), results[1].get("error")
