"""Two ODB loaders in one job on the default rendezvous (``MASTER_PORT + 1``), as scripts build
them: a training and an evaluation loader alive at once, and a loader rebuilt every epoch. The
second live loader used to meet the first's collate-group store on the same port (rank 0:
``PeerError`` EADDRINUSE; rank 1: a wait for the timeout). Each running collate group now holds
a port slot of its own (``odb_torch.loader_options.take_port_slot``) from its start to the
loader's ``close()``, not to the loader's collection (whose time differs between ranks), and a
one-rank loader takes none; real W=2 torchrun runs: every sample of each loader once per epoch
(P4), equal step counts on both ranks (P2), both ranks on one port per loader, no process left
behind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from torch_support import run_torchrun

pytestmark = pytest.mark.timeout(300)

WORKER = Path(__file__).with_name("two_loaders_worker.py")


def _ranks(out: Path, mode: str) -> list[dict]:
    return [json.loads((out / f"{mode}_rank{r}.json").read_text()) for r in range(2)]


def _check(ranks: list[dict], name: str, n: int, epochs: int) -> list[str]:
    for epoch in range(epochs):
        runs = [r[name][epoch] for r in ranks]
        assert sorted(i for run in runs for i in run["indices"]) == list(range(n)), f"P4: {name} epoch {epoch}"
        assert runs[0]["steps"] == runs[1]["steps"], f"P2: {name} epoch {epoch}"
    return [r[name][e]["init_method"] for r in ranks for e in range(epochs)]


def test_a_training_and_an_evaluation_loader_alive_at_once(tmp_path):
    run_torchrun(WORKER, [str(tmp_path), "train_val"], 2)
    ranks = _ranks(tmp_path, "train_val")
    train, val = _check(ranks, "train", 60, 2), _check(ranks, "val", 24, 2)
    assert len(set(train)) == 1 and len(set(val)) == 1 and set(train) != set(val), (train, val)


def test_a_loader_rebuilt_every_epoch_reuses_a_bounded_set_of_ports(tmp_path):
    run_torchrun(WORKER, [str(tmp_path), "rebuild"], 2)
    ports = {m.rsplit(":", 1)[1] for m in _check(_ranks(tmp_path, "rebuild"), "train", 60, 3)}
    assert len(ports) <= 2, ports  # the old loader is closed when its name is rebound: its slot is reused


def test_ranks_whose_pasts_differ_agree_on_the_next_loaders_ports(tmp_path):
    """Rank 0 alone ran a one-rank loader, and alone collected a closed loader kept in a cycle:
    with slots taken at construction and freed at collection, its next loaders took other ports
    than rank 1's and both ranks timed out (a review's reproduction)."""
    run_torchrun(WORKER, [str(tmp_path), "uneven_history"], 2)
    ranks = _ranks(tmp_path, "uneven_history")
    train, val = _check(ranks, "train", 60, 1), _check(ranks, "val", 24, 1)
    assert len(set(train)) == 1 and len(set(val)) == 1, (train, val)
