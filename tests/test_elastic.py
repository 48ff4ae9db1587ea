"""Elastic resume in the core (odb_core.elastic): W ranks' states of a real epoch prefix, merged,
redistributed over W' ranks and run there, yield every view of the epoch exactly once (P4),
with equal steps per run (P2); malformed states get typed errors naming the rank and field."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from odb_core import ODBConfig, simulate
from odb_core.elastic import GlobalState, assign_views, global_state_from, merge_states
from odb_core.epoch import EpochDriver
from odb_core.errors import ResumeStateError
from odb_core.sampler import padded_order, permutation
from odb_core.simulator import gather_round

SEED = 3
Assign = Callable[[GlobalState, int, int], list[int]]
Case = tuple[list[int], int, int, ODBConfig, float, float]


def rank_states(steps: Sequence[Sequence[Any]], k: int, world: int, total: int,
                views: Sequence[Sequence[int]] | None = None, pool: int = 0,
                order_world: int = 0) -> list[dict[str, Any]]:
    """Every rank's loader state after its first ``k`` steps (a real step boundary)."""
    states = []
    for r in range(world):
        consumed = sorted(p for s in steps[r][:k] for p in s.positions)
        state = {"rank": r, "world_size": world, "epoch": 0, "steps": k, "seed": SEED, "consumed": consumed,
                 "total": total}
        if views is not None:
            state.update(views=list(views[r]), pool=pool, order_world=order_world)
        states.append(state)
    return states


def run_views(order: Sequence[int], views: Sequence[Sequence[int]], lengths: Sequence[int],
              config: ODBConfig) -> list[list[Any]]:
    """A join epoch whose rank r' runs over the global positions ``views[r']`` (the resumed run)."""
    drivers = [EpochDriver(config, r, len(views)) for r in range(len(views))]
    for d, mine in zip(drivers, views):
        d.start_iteration([order[g] for g in mine])
    steps: list[list[Any]] = [[] for _ in views]
    for _ in range(10 * (len(order) + config.buffer_size) + 20):
        for d in drivers:
            for pos in d.fetch():
                d.arrive(pos, lengths[d.views[pos]])
        ended, delivered = gather_round(drivers)
        if ended:
            return steps
        for r, out in enumerate(delivered):
            steps[r].extend(out)
    raise AssertionError("the resumed epoch did not end (P6)")


@st.composite
def cases(draw: st.DrawFn) -> Case:
    lengths = draw(st.lists(st.integers(1, 40), min_size=1, max_size=30))
    config = ODBConfig(token_budget=draw(st.sampled_from([40, 80])), buffer_size=draw(st.integers(1, 6)),
                       seed=SEED, shuffle_steps=False)
    return (lengths, draw(st.integers(1, 4)), draw(st.integers(1, 4)), config,
            draw(st.floats(0, 1)), draw(st.floats(0, 1)))


def check_elastic(case: Case, assign: Assign) -> None:
    lengths, world, world2, config, cut, cut2 = case
    first = simulate(lengths, world, config)
    order_world = world
    total = world * -(-len(lengths) // world)
    order = padded_order(permutation(len(lengths), SEED, 0), world)  # the simulator's global order
    k = round(cut * len(first.steps[0]))
    merged = merge_states(rank_states(first.steps, k, world, total))
    before = [order[g] for g in merged.consumed]
    views = [assign(merged, world2, r) for r in range(world2)]
    second = run_views(order, views, lengths, config)
    assert len({len(s) for s in second}) == 1, "P2: every rank of the resumed run takes the same steps"
    after = [order[views[r][p]] for r in range(world2) for s in second[r] for p in s.positions]
    assert Counter(before + after) == Counter(order), "P4 across the resume: every view exactly once"
    # a second resume, from a prefix of the resumed run (states that list their views), at the old W
    k2 = round(cut2 * len(second[0]))
    states = rank_states(second, k2, world2, total, views, sum(map(len, views)), order_world)
    again = global_state_from([dict(s, steps=merged.steps + k2) for s in states])
    done = set(merged.consumed) | {views[r][p] for r in range(world2) for s in second[r][:k2] for p in s.positions}
    assert set(again.consumed) == done and len(again.consumed) == len(done), "the re-merge keeps every consumed view"
    third_views = [assign(again, world, r) for r in range(world)]
    assert sorted(g for v in third_views for g in v) == sorted(set(range(total)) - done)
    third = run_views(order, third_views, lengths, config)  # the run resumed the second time, to its end
    assert len({len(s) for s in third}) == 1, "P2: every rank of the twice-resumed run takes the same steps"
    emitted = [g for r in range(world) for s in third[r] for g in (third_views[r][p] for p in s.positions)]
    assert Counter(emitted) == Counter(set(range(total)) - done), "P4 across both resumes: every view exactly once"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_views_yielded_before_and_after_an_elastic_resume_cover_the_epoch_exactly_once(case: Case) -> None:
    check_elastic(case, assign_views)


def give_twice(state: GlobalState, world: int, rank: int) -> list[int]:
    """Seeded bug: the first remaining view is dealt to every rank."""
    rest = state.remaining()
    return rest[rank::world] + (rest[:1] if rank else [])


def drop_tail(state: GlobalState, world: int, rank: int) -> list[int]:
    """Seeded bug: the remainder that does not divide by W' is dropped (even shares, as padding-free DDP would)."""
    rest = state.remaining()
    return rest[: len(rest) - len(rest) % world][rank::world]


#: a case both seeded bugs break (10 views, 2 ranks resumed on 3, cut at 30%): the seeded-bug test
#: runs it first, so catching a bug never rests on the random search alone
KNOWN_BREAKING: Case = ([(i * 7) % 13 + 1 for i in range(10)], 2, 3,
                        ODBConfig(token_budget=40, buffer_size=2, seed=SEED, shuffle_steps=False), 0.3, 0.5)


@pytest.mark.parametrize("bug", [give_twice, drop_tail])
def test_the_property_catches_a_seeded_bug_in_the_redistribution(bug: Assign) -> None:
    @settings(max_examples=150, deadline=None, database=None, report_multiple_bugs=False,
              suppress_health_check=[HealthCheck.too_slow])
    @given(cases())
    @example(KNOWN_BREAKING)
    def run(case: Case) -> None:
        check_elastic(case, bug)

    with pytest.raises(AssertionError):
        run()


def good_states() -> list[dict[str, Any]]:
    return [{"rank": r, "world_size": 3, "epoch": 1, "steps": 3, "seed": 0, "consumed": [0, 1], "total": 12}
            for r in range(3)]


@pytest.mark.parametrize(("edit", "field", "ranks"), [
    (lambda s: s.pop(), "rank", (2,)),
    (lambda s: s.append(dict(s[0])), "rank", (0,)),
    (lambda s: s[1].update(epoch=2), "epoch", (1,)),
    (lambda s: s[0].update(steps=4), "steps", (0,)),
    (lambda s: s[1].update(seed=9), "seed", (1,)),
    (lambda s: s[1].update(consumed=[0, 0]), "consumed", (1,)),
    (lambda s: s[0].update(consumed=[4]), "consumed", (0,)),
    (lambda s: s[1].pop("total"), "total", (1,)),
    (lambda s: s[0].update(views=[1, 4], pool=4), "views", (1,)),
])
def test_states_that_are_not_one_step_boundary_are_refused_naming_rank_and_field(
        edit: Callable[[list[dict[str, Any]]], object], field: str, ranks: tuple[int, ...]) -> None:
    states = good_states()
    assert merge_states(states).consumed == (0, 1, 2, 3, 4, 5)  # rank r's position p is global r + 3p
    edit(states)
    with pytest.raises(ResumeStateError) as err:
        merge_states(states)
    assert err.value.field == field and set(ranks) <= set(err.value.ranks)


def test_a_single_rank_state_is_refused_for_another_world_and_a_merged_state_round_trips() -> None:
    merged = merge_states(good_states())
    assert global_state_from(merged.to_dict()) == merged
    with pytest.raises(ResumeStateError) as err:
        global_state_from(good_states()[0])
    assert err.value.field == "kind"


# ---- the torch side: the global order, and what the loader refuses (no process starts) ----------

def loader(world: int = 2, rank: int = 0, **kw: Any) -> Any:
    from torch_support import ToyDataset

    from odb_torch import ODBDataLoader

    return ODBDataLoader(ToyDataset(23), token_budget=128, rank=rank, world_size=world, num_workers=0,
                         init_method="tcp://127.0.0.1:1", **kw)


def check_global_order(order_fn: Callable[..., list[int]], drop_last: bool, shuffle: bool) -> None:
    from torch.utils.data import DistributedSampler

    for n in range(1, 10):
        for world in range(1, 5):
            ranks = [DistributedSampler(cast(Any, range(n)), num_replicas=world, rank=r, shuffle=shuffle, seed=5,
                                        drop_last=drop_last) for r in range(world)]
            for s in ranks:
                s.set_epoch(3)
            order = order_fn(ranks[0], 3, world)
            assert [order[r::world] for r in range(world)] == [list(s) for s in ranks], (n, world)


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [False, True])
def test_the_rebuilt_global_order_is_what_every_distributed_sampler_rank_yields(drop_last: bool, shuffle: bool) -> None:
    from odb_torch.elastic import global_order

    check_global_order(global_order, drop_last, shuffle)


def test_the_global_order_check_catches_an_order_rebuilt_without_padding() -> None:
    from odb_torch.elastic import global_order

    def unpadded(sampler: Any, epoch: int, world: int) -> list[int]:
        return global_order(sampler, epoch, world)[: len(sampler.dataset)]

    with pytest.raises(AssertionError):
        check_global_order(unpadded, False, True)


def test_elastic_resume_refuses_a_custom_sampler_a_non_join_loader_and_a_lone_state_of_another_world() -> None:
    from torch_support import ShardSampler

    from odb_core.errors import UnsupportedSettingError

    states = [dict(s, seed=0, total=24) for s in good_states()[:2]]
    for s in states:
        s["world_size"] = 2
    with pytest.raises(UnsupportedSettingError) as err:
        loader(3, sampler=ShardSampler([0, 1])).load_state_dict(states)
    assert err.value.field == "sampler"
    with pytest.raises(UnsupportedSettingError, match="join mode only") as non_join:
        loader(3, mode="non-join").load_state_dict(states)
    assert non_join.value.field == "mode"
    with pytest.raises(ResumeStateError) as lone:
        loader(3).load_state_dict(states[0])
    assert lone.value.field == "kind"
    with pytest.raises(ResumeStateError) as size:
        loader(3).load_state_dict([dict(s, total=26) for s in states])  # 23 samples on 2 ranks: 24 views
    assert size.value.field == "total"
    resumed = loader(3, rank=2)
    resumed.load_state_dict(states)
    assert resumed.epoch == 1 and resumed._resume == (1, [], 3)
    assert resumed._elastic is not None and resumed._elastic.views == tuple(range(4, 24))[2::3]


def test_a_checkpoint_taken_right_after_a_resume_keeps_what_the_first_run_consumed() -> None:
    """state_dict() between load_state_dict() and the first yield is the loaded position, on the
    same world size and after an elastic resume (a fresh loader's empty position would make the
    next resume repeat every view the first run yielded)."""
    same = loader(2, rank=1)
    saved = {"rank": 1, "world_size": 2, "epoch": 1, "steps": 3, "seed": 0, "consumed": [0, 2, 5]}
    same.load_state_dict(saved)
    again = same.state_dict()
    assert (again["epoch"], again["steps"], again["consumed"]) == (1, 3, [0, 2, 5])
    states = [dict(s, seed=0, total=24, world_size=2) for s in good_states()[:2]]
    elastic = loader(3, rank=2)
    elastic.load_state_dict(states)
    merged = merge_states([loader_state for loader_state in (_resumed_state(r, states) for r in range(3))])
    assert merged.steps == 3 and sorted(merged.consumed) == [0, 1, 2, 3]
    assert elastic.state_dict()["steps"] == 3 and elastic.state_dict()["consumed"] == []


def test_a_resume_under_another_sampler_order_is_refused_naming_the_field() -> None:
    """The checkpoint's positions index the global order its sampler's shuffle flag and seed gave; a
    loader whose sampler orders the epoch otherwise would repeat some samples and never yield others,
    so every resume path (elastic, merged, same world) refuses it, and a merge refuses states whose
    samplers disagree. (A state of an older ODB, without the fields, cannot be checked.)"""
    first = [loader(2, rank=r).state_dict() for r in range(2)]  # epoch 0, nothing consumed, shuffle on
    assert all((s["shuffle"], s["sampler_seed"]) == (1, 0) for s in first)
    states = [dict(s, epoch=1, steps=2, consumed=[0, 1]) for s in first]
    for change, field in (({"shuffle": False}, "shuffle"), ({"seed": 5}, "sampler_seed")):
        from torch.utils.data import DistributedSampler
        from torch_support import ToyDataset

        kw = {"shuffle": True, "seed": 0, **change}
        for world, rank, state in ((3, 2, states), (3, 0, merge_states(states).to_dict()), (2, 1, states[1])):
            other = DistributedSampler(ToyDataset(23), num_replicas=world, rank=rank, drop_last=False, **kw)
            with pytest.raises(ResumeStateError) as err:
                loader(world, rank=rank, sampler=other, seed=0).load_state_dict(state)
            assert err.value.field == field and err.value.rank == rank
    with pytest.raises(ResumeStateError) as split:
        merge_states([states[0], dict(states[1], shuffle=0)])
    assert split.value.field == "shuffle" and list(split.value.ranks) == [1]
    older = [{k: v for k, v in s.items() if k not in ("shuffle", "sampler_seed")} for s in states]
    unshuffled = loader(3, rank=2, shuffle=False)
    unshuffled.load_state_dict(older)  # nothing recorded, nothing to check
    assert unshuffled._elastic is not None


def test_stream_checkpoints_are_refused_on_another_world_size_by_the_core_merge() -> None:
    """The adapters merge every rank's file when the world size changed; a stream's states
    (positions in each rank's own stream) must be refused there too, naming the world size."""
    states = [dict(s, stream=True) for s in good_states()]
    with pytest.raises(ResumeStateError) as err:
        merge_states(states)
    assert err.value.field == "world_size" and err.value.ranks == (0, 1, 2)
    assert merge_states(good_states()).steps == 3  # the same states without the stream flag merge


def _resumed_state(rank: int, states: list[dict[str, Any]]) -> dict[str, Any]:
    resumed = loader(3, rank=rank)
    resumed.load_state_dict(states)
    return resumed.state_dict()


# ---- the spec: ODB from a consumed set, redistributed over W' ranks (spec/Elastic.tla) -------------

ELASTIC_CFGS = sorted(p for p in (Path(__file__).resolve().parents[1] / "spec" / "cfg" / "elastic").glob("*.cfg")
                      if not p.stem.startswith("deep_"))  # deep_*: run by hand, as spec/cfg/deep_* (suite time)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("path", ELASTIC_CFGS, ids=lambda p: p.stem)
def test_tlc_resume_from_a_consumed_set_passes_every_invariant_and_its_mutant_is_caught(path: Path) -> None:
    """quick_*: every ODB invariant, Termination and ResumeExactlyOnce hold from the resumed state;
    mutant_*: a resume that forgets a buffered view, or deals one position twice to a rank (caught in
    the initial state: the deal is fixed there), fails ResumeExactlyOnce."""
    from model_checks.suites import expectation
    from model_checks.tla import tlc

    run = tlc("Elastic", path, short=not path.stem.startswith("deep_"))
    assert run.distinct_states > 0 or "deals_twice" in path.stem, run.output[-2000:]
    assert run.outcome == expectation(path), run.output[-3000:]


def test_window_states_of_another_world_are_merged_and_disagreeing_counters_refused(tmp_path: Path) -> None:
    """load_windows_state (HF, Accelerate) at W'=3 reads both files of a W=2 checkpoint; global
    counters that differ between the files are a CheckpointStateError naming the field."""
    import json

    from odb_core.errors import CheckpointStateError
    from odb_torch.windows import AccumulationWindows, load_windows_state

    def window_state(loader_state: dict[str, Any], updates: int = 4) -> dict[str, Any]:
        return {"version": 1, "epoch": 1, "epochs_completed": 1, "samples_seen": 30, "tokens_seen": 900,
                "updates": updates, "samples_in_epoch": 7, "accumulation_steps": 2, "loader": loader_state}

    states = [dict(s, seed=0, total=24, world_size=2) for s in good_states()[:2]]
    for r, s in enumerate(states):
        (tmp_path / f"odb_state_rank{r}.json").write_text(json.dumps(window_state(s)))
    windows = AccumulationWindows(loader(3, rank=2), 2)
    load_windows_state(windows, str(tmp_path))
    assert (windows.updates, windows.samples_seen, windows.loader._resume) == (4, 30, (1, [], 3))
    assert windows.loader._elastic is not None and windows.loader._elastic.views == tuple(range(4, 24))[2::3]
    (tmp_path / "odb_state_rank1.json").write_text(json.dumps(window_state(states[1], updates=5)))
    with pytest.raises(CheckpointStateError, match="updates"):
        load_windows_state(AccumulationWindows(loader(3, rank=2), 2), str(tmp_path))


@pytest.mark.timeout(120)
def test_elastic_spec_deals_as_the_core_and_catches_seeded_wrong_deals() -> None:
    """Conformance of spec/Elastic.tla and odb_core.elastic: for 60 random cases (W=1..4
    loader states of one step boundary, W'=1..4), TLC merges the raw states (YieldedOf) and
    evaluates the spec's DealOp through a parameterised INSTANCE, and it equals assign_views over
    merge_states on every case; seeded wrong deals (the first buffered view taken for consumed: the
    spec's MutDealForget; contiguous blocks instead of round robin) and a wrong merge (the last
    rank's yielded views forgotten: the spec was handed the core's merge before, and missed it)
    differ on some case."""
    from model_checks.elastic_conformance import IMPLEMENTATIONS, run_conformance

    found, run = run_conformance(seed=0, n=60)
    assert run.outcome == "ok" and set(found) == set(IMPLEMENTATIONS), run.output[-3000:]
    assert found["core"] == set(), f"the spec deals otherwise than the core on cases {sorted(found['core'])}"
    assert all(found[name] for name in IMPLEMENTATIONS if name != "core"), found
