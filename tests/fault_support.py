"""Rank code of the fault matrix (tests/test_fault_matrix.py), importable by spawned ranks.

One rank runs one epoch of an :class:`ODBDataLoader` over :class:`FaultDataset` (index
14 misbehaves as the case says) with the case's collate and length functions, and may
inject an in-loop fault at step :data:`FAULT_STEP`. It records what it yielded and the
error it raised: type, message, its ``rank`` and ``indices`` attributes, and the
seconds from the loader's creation (or from the fault) to the error.
"""

from __future__ import annotations

import json
import math
import os
import signal
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch_support import ToyDataset, init_gloo

from odb_torch import ODBDataLoader, pad_collate

FAULT_STEP = 2
BAD = 14  # the dataset index that misbehaves
_keep: list[Any] = []  # loaders a case leaves open on purpose (as a module-level loader would be)


class FaultDataset(ToyDataset):
    """:class:`ToyDataset` plus ``"stuck"``: ``__getitem__`` never returns (in a worker)."""

    def __getitem__(self, i: int) -> dict[str, Any]:
        if self.fail.get(i) == "stuck" and torch.utils.data.get_worker_info() is not None:
            time.sleep(3600)
        return super().__getitem__(i)


def bad_length(kind: str) -> Any:
    """The value a broken ``length_fn`` returns for sample :data:`BAD`."""
    return {"float": 895.7, "str": "12", "none": None, "nan": math.nan}[kind]


class LengthFn:
    """``len(input_ids)``, except a bad value of ``kind`` for sample :data:`BAD`."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def __call__(self, sample: dict[str, Any]) -> Any:
        return bad_length(self.kind) if sample["idx"] == BAD else len(sample["input_ids"])


def excess_loss_tokens(sample: dict[str, Any]) -> int:
    """Labels != -100, except ten times the length for sample :data:`BAD`."""
    if sample["idx"] == BAD:
        return 10 * len(sample["input_ids"])
    return int((sample["labels"] != -100).sum())


def unpicklable_collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """pad_collate, plus a lambda in the batch of the group holding sample BAD."""
    batch: dict[str, Any] = dict(pad_collate(samples))
    if any(s["idx"] == BAD for s in samples):
        batch["hook"] = lambda: None
    return batch


def generator_collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """pad_collate, plus a generator in every batch."""
    return {**pad_collate(samples), "lazy": (s["idx"] for s in samples)}


def failing_collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Raises on the group holding sample BAD."""
    if any(s["idx"] == BAD for s in samples):
        raise RuntimeError(f"cannot collate {BAD}")
    return pad_collate(samples)


COLLATES = {"unpicklable": unpicklable_collate, "generator": generator_collate, "failing": failing_collate}


def make_loader(task: dict[str, Any], port: int) -> ODBDataLoader:
    """The case's loader (spawn, budget 128)."""
    dataset = FaultDataset(task.get("n", 40), {int(k): v for k, v in task.get("fail", {}).items()})
    return ODBDataLoader(
        dataset, token_budget=128, collate_fn=COLLATES.get(task.get("collate", ""), pad_collate),
        length_fn=LengthFn(task["length"]) if "length" in task else None,
        loss_tokens_fn=excess_loss_tokens if task.get("tokens") == "excess" else None,
        buffer_size=task.get("buffer", 8), num_workers=task.get("workers", 0), seed=task.get("seed", 0),
        shuffle=task.get("shuffle", True),
        init_method=f"tcp://127.0.0.1:{port + 1}", timeout=task["timeout"], queue_size=4)


def inject(fault: str, loader: ODBDataLoader, it: Any, result: dict[str, Any]) -> None:
    """The in-loop fault, on the victim rank at :data:`FAULT_STEP`."""
    result["fault_at"] = time.time()
    if fault == "kill_collate":
        os.kill(loader._proc.pid, signal.SIGKILL)
    elif fault == "kill_rank":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault == "stall":
        time.sleep(loader.timeout * 2.5)
    elif fault == "sigint":
        # as at a terminal (a CI job started in the background inherits SIGINT ignored)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.kill(os.getpid(), signal.SIGINT)  # KeyboardInterrupt here, as Ctrl-C would raise
    elif fault == "close_next":
        loader.close()
    elif fault == "two_iterators":
        second = iter(loader)
        result["second"] = list(loader.step_info.indices) if next(second) is not None else []


def one_epoch(loader: ODBDataLoader, task: dict[str, Any], rank: int, result: dict[str, Any]) -> None:
    """Iterate one epoch, recording yielded indices; inject the case's fault."""
    yielded: list[list[int]] = result.setdefault("yielded", [])
    it = iter(loader)
    while True:
        try:
            next(it)
        except StopIteration:
            return
        info = loader.step_info
        yielded.append([] if info.is_idle else list(info.indices))
        if len(yielded) == FAULT_STEP and rank == task.get("victim", 0) and "fault" in task:
            inject(task["fault"], loader, it, result)


def fault_rank_main(rank: int, world: int, port: int, out_dir: str, task: dict[str, Any]) -> None:
    """One trainer rank of a fault case; writes ``rank<r>.json``."""
    result: dict[str, Any] = {"rank": rank}
    task = {**task, **task.get("per_rank", {}).get(str(rank), {})}
    init_gloo(rank, world, port)
    started = time.time()
    loader = make_loader(task, port)
    _keep.append(loader)
    try:
        one_epoch(loader, task, rank, result)
        result["error"] = None
    except BaseException as exc:
        result.update(error=type(exc).__name__, message=str(exc), error_rank=getattr(exc, "rank", None),
                      error_indices=list(getattr(exc, "indices", ())), error_field=getattr(exc, "field", None),
                      error_ranks=list(getattr(exc, "ranks", None) or ()), after=time.time() - started,
                      since_fault=time.time() - result.get("fault_at", started), trace=traceback.format_exc())
        if isinstance(exc, KeyboardInterrupt):  # exit with the loader still open, as a script would
            Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
            raise
    finally:
        if task.get("fault") != "sigint":
            loader.close()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    try:
        dist.destroy_process_group()
    except Exception:
        pass
