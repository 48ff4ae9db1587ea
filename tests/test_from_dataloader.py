"""``odb_torch.from_dataloader``: a DataLoader a framework built, converted to an ODBDataLoader.

Property-tested over random DataLoader configurations (no process starts): the conversion
either refuses with an UnsupportedSettingError naming exactly the fields that cannot be
converted, or keeps collate_fn, workers, prefetch, start method and the sampler (not the timeout)
(or maps torch's sequential/random sampler to ODB's seeded DistributedSampler, whose shards
cover every sample once), without modifying the DataLoader or torch. Then real spawned
Gloo ranks at W=1 and W=2 train converted loaders: every sample once per epoch, batches
from the DataLoader's own collate_fn, samples loaded by its workers, the kept sampler's views.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch.multiprocessing as tmp
from convert_support import convert_rank_main, tagged_collate
from hypothesis import given
from hypothesis import strategies as st
from test_torch_loader import run_ranks
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)
from torch_support import ToyDataset

from odb_core.errors import UnsupportedSettingError
from odb_torch import ODBDataLoader, from_dataloader
from odb_torch.convert import IGNORABLE, loader_keywords

pytestmark = pytest.mark.timeout(300)

TORCH_CLASSES = [DataLoader, BatchSampler, DistributedSampler, RandomSampler, SequentialSampler]
TORCH_BEFORE = [dict(vars(c)) for c in TORCH_CLASSES]


class Stream(IterableDataset):  # type: ignore[type-arg]
    def __iter__(self) -> Any:
        return iter([{"input_ids": [1, 2]}])


class FixedBatches:
    """A custom batch_sampler: fixed batches chosen by the framework."""

    def __init__(self, n: int) -> None:
        self.batches = [list(range(k, min(k + 3, n))) for k in range(0, n, 3)]

    def __iter__(self) -> Any:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


class ShardSampler:
    """A custom sampler; ``sharded`` gives it DistributedSampler's ``num_replicas``/``rank``."""

    def __init__(self, n: int, shard: tuple[int, int] | None) -> None:
        self.indices = list(range(n))[shard[1]::shard[0]] if shard else list(range(n))
        if shard:
            self.num_replicas, self.rank = shard

    def __iter__(self) -> Any:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


class FrameworkLoader(DataLoader):  # type: ignore[type-arg]
    """A DataLoader subclass, as frameworks wrap them."""


def seed_workers(worker_id: int) -> None:
    pass


def make_sampler(kind: str, n: int, world: int, rank: int) -> Any:
    dataset = ToyDataset(n)
    return {"sequential": lambda: SequentialSampler(dataset), "random": lambda: RandomSampler(dataset),
            "random_replacement": lambda: RandomSampler(dataset, replacement=True),
            "random_fewer": lambda: RandomSampler(dataset, num_samples=max(n - 1, 1)),
            "distributed_mine": lambda: DistributedSampler(dataset, num_replicas=world, rank=rank),
            "distributed_other": lambda: DistributedSampler(dataset, num_replicas=world + 1, rank=rank),
            "custom": lambda: ShardSampler(n, None), "custom_sharded": lambda: ShardSampler(n, (world, rank)),
            }[kind]()


@st.composite
def configs(draw: Any) -> dict[str, Any]:
    workers = draw(st.integers(0, 2))
    rarely = st.integers(0, 3).map(lambda k: k == 0)  # a refused option in 1 of 4 draws, so most convert
    iterable = draw(rarely)
    batchings = (["size", "none"] if iterable
                 else ["size"] * 3 + ["torch_batch_sampler"] * 2 + ["none", "custom_batch_sampler"])
    return {
        "n": draw(st.integers(1, 30)), "shard": draw(st.sampled_from([(1, 0), (2, 0), (2, 1), (3, 2)])),
        "iterable": iterable, "batching": draw(st.sampled_from(batchings)),
        "sampler": draw(st.sampled_from(["default", "sequential", "random", "random_replacement", "random_fewer",
                                         "distributed_mine", "distributed_other", "custom", "custom_sharded"])),
        "shuffle": draw(st.booleans()), "drop_last": draw(rarely), "batch": draw(st.integers(1, 5)),
        "workers": workers, "prefetch": draw(st.sampled_from([None, 1, 3])) if workers else None,
        "context": draw(st.sampled_from([None, "spawn", "fork", "context"])) if workers else None,
        "worker_init": draw(rarely), "timeout": draw(st.sampled_from([0, 7.5])),
        "collate": draw(st.booleans()), "subclass": draw(rarely), "pin": draw(st.booleans()),
        "ignore": sorted(draw(st.sets(st.sampled_from(sorted(IGNORABLE))))),
    }


def build(c: dict[str, Any]) -> tuple[DataLoader[Any], Any]:
    """The DataLoader of configuration ``c`` and the sampler its batches are drawn from."""
    world, rank = c["shard"]
    dataset: Any = Stream() if c["iterable"] else ToyDataset(c["n"])
    kind = "default" if c["iterable"] else c["sampler"]
    sampler = None if kind == "default" else make_sampler(kind, c["n"], world, rank)
    context = tmp.get_context("spawn") if c["context"] == "context" else c["context"]
    kw: dict[str, Any] = dict(num_workers=c["workers"], prefetch_factor=c["prefetch"], multiprocessing_context=context,
                              worker_init_fn=seed_workers if c["worker_init"] else None, timeout=c["timeout"],
                              collate_fn=tagged_collate if c["collate"] else None, pin_memory=c["pin"])
    cls = FrameworkLoader if c["subclass"] else DataLoader
    shuffle = c["shuffle"] and sampler is None and not c["iterable"]
    if c["batching"] == "size":
        dl = cls(dataset, batch_size=c["batch"], shuffle=shuffle, sampler=sampler, drop_last=c["drop_last"], **kw)
    elif c["batching"] == "none":
        dl = cls(dataset, batch_size=None, shuffle=shuffle, sampler=sampler, **kw)
    elif c["batching"] == "torch_batch_sampler":
        inner = sampler or (RandomSampler(dataset) if shuffle else SequentialSampler(dataset))
        dl = cls(dataset, batch_sampler=BatchSampler(inner, c["batch"], c["drop_last"]), **kw)
    else:
        dl = cls(dataset, batch_sampler=FixedBatches(c["n"]), **kw)
    drawn_from = dl.batch_sampler.sampler if isinstance(dl.batch_sampler, BatchSampler) else None
    return dl, drawn_from


def expected_problems(c: dict[str, Any]) -> set[str]:
    """The fields the conversion must refuse, by the rules in odb_torch/convert.py's docstring."""
    world = c["shard"][0]
    fields = set()
    fields |= {"type"} if c["subclass"] and "type" not in c["ignore"] else set()
    fields |= {"dataset"} if c["iterable"] else set()
    fields |= {"batch_size"} if c["batching"] == "none" else set()
    fields |= {"batch_sampler"} if c["batching"] == "custom_batch_sampler" else set()
    batched = c["batching"] in ("size", "torch_batch_sampler")
    fields |= {"drop_last"} if batched and c["drop_last"] and "drop_last" not in c["ignore"] else set()
    fields |= {"worker_init_fn"} if c["worker_init"] and c["workers"] and "worker_init_fn" not in c["ignore"] else set()
    refused = {"random_replacement", "random_fewer", "distributed_other"} | ({"custom"} if world > 1 else set())
    n = c["n"]
    if c["sampler"] == "random_fewer" and max(n - 1, 1) == n:  # num_samples equal to the dataset's size
        refused.discard("random_fewer")
    if batched and not c["iterable"] and c["sampler"] in refused:
        fields.add("sampler")
    return fields


def shard_counts(keywords: dict[str, Any], dataset: Any, world: int) -> Counter[int]:
    """How often each index is a view over every rank's sampler ODB builds from ``keywords``."""
    views: Counter[int] = Counter()
    for r in range(world):
        loader = ODBDataLoader(dataset, **{**keywords, "rank": r, "world_size": world})
        assert isinstance(loader.sampler, DistributedSampler) and loader.sampler.shuffle == keywords["shuffle"]
        views.update(int(i) for i in loader.sampler)
    return views


@given(configs())
def test_conversion_refuses_exactly_the_unconvertible_fields_and_keeps_the_rest(c):
    dl, drawn_from = build(c)
    world, rank = c["shard"]
    fields_before = dict(vars(dl))
    expected = expected_problems(c)
    try:
        dataset, kw = loader_keywords(dl, ignore=c["ignore"], token_budget=64, rank=rank, world_size=world,
                                      init_method="tcp://127.0.0.1:1")
    except UnsupportedSettingError as exc:
        assert set(exc.fields) == expected and exc.field in expected, (exc.fields, expected, str(exc))
        assert all(f"{f}:" in str(exc) for f in expected)
        return
    finally:
        assert dict(vars(dl)) == fields_before, "the DataLoader was modified"
        assert [dict(vars(cls)) for cls in TORCH_CLASSES] == TORCH_BEFORE, "a torch class was modified"
    assert not expected, f"converted although {expected} cannot be"
    assert dataset is dl.dataset and kw["collate_fn"] is dl.collate_fn and kw["num_workers"] == c["workers"]
    assert kw["prefetch_factor"] == (dl.prefetch_factor if c["workers"] else None)
    assert kw.get("worker_start_method") == ({"context": "spawn"}.get(c["context"], c["context"]) if c["workers"]
                                            else None)
    assert "timeout" not in kw  # a worker's batch deadline is not ODB's peer deadline (ODB's default kept)
    assert kw["pin_memory"] is c["pin"], "pin_memory is kept"
    if type(drawn_from) in (SequentialSampler, RandomSampler):  # mapped to ODB's seeded shards
        assert kw["sampler"] is None and kw["shuffle"] == (type(drawn_from) is RandomSampler)
        views = shard_counts(kw, dataset, world)
        assert set(views) == set(range(c["n"])) and sum(views.values()) == math.ceil(c["n"] / world) * world
        assert sum(views.values()) - c["n"] < world  # DistributedSampler pads fewer than W extra views
        if world == 1:
            assert set(views.values()) == {1}, "every sample exactly once"
    else:
        assert kw["sampler"] is drawn_from, "the DataLoader's sampler is kept"


def test_odb_keywords_replace_fields_and_from_dataloader_builds_the_loader():
    dataset = ToyDataset(10)
    dl = DataLoader(dataset, batch_size=2, batch_sampler=None, num_workers=2, worker_init_fn=seed_workers)
    with pytest.raises(UnsupportedSettingError, match="worker_init_fn") as info:
        from_dataloader(dl, token_budget=64)
    assert info.value.field == "worker_init_fn" and isinstance(info.value, ValueError)
    loader = from_dataloader(dl, token_budget=64, num_workers=0, collate_fn=tagged_collate,
                             init_method="tcp://127.0.0.1:1", rank=0, world_size=1)
    assert isinstance(loader, ODBDataLoader) and loader.config.token_budget == 64
    assert loader.sampler.shuffle is False  # SequentialSampler: ODB's DistributedSampler without shuffling
    with pytest.raises(ValueError, match="can be ignored"):
        from_dataloader(dl, token_budget=64, ignore=("sampler",))


def check_epochs(results: list[dict[str, Any]], n: int, epochs: int) -> None:
    """P2: equal steps per rank; P4: every index once per epoch; batches built by the DataLoader's
    collate_fn from samples its worker loaded."""
    for r in results:
        assert "error" not in r, r
    for epoch in range(epochs):
        per_rank = [r["epochs"][epoch] for r in results]
        assert len({len(steps) for steps in per_rank}) == 1, f"P2: steps per rank {[len(s) for s in per_rank]}"
        ids = sorted(i for steps in per_rank for step in steps for i in step["ids"])
        assert ids == list(range(n)), f"epoch {epoch}: not every index exactly once"
        real = [step for steps in per_rank for step in steps if not step["idle"]]
        assert {step["type"] for step in real} == {"TaggedBatch"}, "the DataLoader's collate_fn did not build a batch"
        assert {w for step in real for w in step["workers"]} == {0}, "samples not loaded by the DataLoader's worker"


def test_converted_shuffled_dataloader_trains_every_sample_once_w1(tmp_path: Path):
    results = run_ranks(1, {"n": 37, "epochs": 2, "sampler": "shuffle", "seed": 0}, tmp_path, timeout=120,
                        target=convert_rank_main)
    check_epochs(results, 37, 2)
    assert results[0]["sampler_kept"] is False  # RandomSampler -> ODB's seeded DistributedSampler


def test_converted_ddp_dataloader_keeps_its_distributed_sampler_w2(tmp_path: Path):
    results = run_ranks(2, {"n": 40, "epochs": 2, "sampler": "distributed", "seed": 5}, tmp_path, timeout=120,
                        target=convert_rank_main)
    check_epochs(results, 40, 2)
    for r in results:
        assert r["sampler_kept"] is True
        for epoch, steps in enumerate(r["epochs"]):
            trained = sorted(i for step in steps for i in step["ids"])
            assert trained == sorted(r["views"][epoch]), f"rank {r['rank']} epoch {epoch}: not its sampler's views"
        assert r["views"][0] != r["views"][1], "the kept sampler's set_epoch was not honoured"
