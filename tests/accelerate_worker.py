"""The Accelerate guide's loops run by the adapter tests under torchrun (W = 1 or 2).

    torchrun ... tests/accelerate_worker.py OUT lockstep|resume|join [BUDGET]

lockstep: run A checkpoints after update 5 and stops (a crash), run B resumes and finishes
2 epochs; every micro-batch is recorded, and at A's first update the DDP gradient is
compared with a single-process per-token-mean gradient over the same batches (the same
samples re-collated: one padded batch, or under the packed budget each group's row again).
resume: run B again from A's checkpoint, on another number of ranks (elastic resume).
join: skip_idle batches under torch Join; every yielded step is recorded.
no_cpu_flag: ``Accelerator()`` without ``cpu=True`` on this GPU-less machine, then ``odb_loader``.
Writes OUT/<mode>_rank{r}.json.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "docs" / "examples"))
import accelerate_loop as guide  # noqa: E402

from odb_tools.demo.synthetic import TokenDataset  # noqa: E402
from odb_torch import packed_collate, pad_collate  # noqa: E402

N = 96


def record(micro: Any, update: int, out: list[dict[str, Any]]) -> None:
    out.append({"update": update, "epoch": micro.info.epoch, "indices": list(micro.info.indices),
                "padding": micro.is_padding, "idle": micro.info.is_idle, "multiplier": micro.loss_multiplier,
                "local_tokens": micro.info.local_tokens, "row": list(micro.batch["input_ids"].shape)})


def no_cpu_flag(result: dict[str, Any]) -> None:
    """``Accelerator()`` on a machine without GPUs (it counts 1 process on each rank), then ``odb_loader``."""
    from accelerate import Accelerator

    from odb_core.errors import UnsupportedSettingError
    from odb_torch.integrations.accelerate import odb_loader

    accelerator = Accelerator()
    result["counted"] = accelerator.num_processes
    try:
        loader = odb_loader(accelerator, TokenDataset(N), token_budget=256, num_workers=0)
        result["loader_world"] = loader.world_size
    except UnsupportedSettingError as exc:
        result["refused"] = {"field": exc.field, "rank": exc.rank, "message": str(exc)}


def main() -> None:
    out, mode = sys.argv[1], sys.argv[2]
    budget = sys.argv[3] if len(sys.argv) > 3 else "padded"
    result: dict[str, Any] = {"budget": budget}
    if mode == "lockstep":
        runs: dict[str, list[dict[str, Any]]] = {"a": [], "b": []}
        grad_check: dict[str, float] = {}

        def before_step(model: Any, micro: Any) -> None:
            if grad_check:
                return
            mine = [rec["indices"] for rec in runs["a"] if rec["update"] == 0 and not rec["padding"]
                    and not rec["idle"]]
            world = dist.get_world_size() if dist.is_initialized() else 1
            gathered: list[Any] = [None] * world
            if world > 1:
                dist.all_gather_object(gathered, mine)
            else:
                gathered = [mine]
            groups = [g for part in gathered for g in part]
            ids = [i for g in groups for i in g]
            inner = model.module if hasattr(model, "module") else model
            ref = copy.deepcopy(inner)
            ref.zero_grad()
            if budget == "packed":  # a row's attention spans the row in this toy model: rebuild each row
                rows = [packed_collate([TokenDataset(N)[i] for i in g]) for g in groups]
            else:
                rows = [pad_collate([TokenDataset(N)[i] for i in ids])]
            sums = [ref(b["input_ids"], b["labels"]) for b in rows]
            (sum(s for s, _ in sums) / sum(c for _, c in sums)).backward()
            diffs = [((p.grad - q.grad).abs().max() / q.grad.abs().max().clamp_min(1e-12)).item()
                     for p, q in zip(inner.parameters(), ref.parameters())]
            grad_check.update({"max_rel_err": max(diffs), "samples": len(ids)})

        result["updates_a"] = guide.train_lockstep(out, save_at=5, on_micro=lambda m, u: record(m, u, runs["a"]),
                                                   before_step=before_step, budget=budget)
        result["updates_b"] = guide.train_lockstep(out, resume=True, on_micro=lambda m, u: record(m, u, runs["b"]),
                                                   budget=budget)
        result.update(runs=runs, grad_check=grad_check)
    elif mode == "resume":  # on another world size, from run A's checkpoint (every rank's ODB state merged)
        records: list[dict[str, Any]] = []
        result["updates"] = guide.train_lockstep(out, resume=True, budget=budget, on_micro=lambda m, u: records.append(
            {**dict(zip(("update", "epoch"), (u, m.info.epoch))), "indices": list(m.info.indices),
             "padding": m.is_padding, "idle": m.info.is_idle, "multiplier": m.loss_multiplier,
             "local_tokens": m.info.local_tokens}))
        result["records"] = records
    elif mode == "no_cpu_flag":
        no_cpu_flag(result)
    else:
        steps: list[dict[str, Any]] = []
        guide.train_join(on_batch=lambda info: steps.append(
            {"epoch": info.epoch, "step": info.step, "indices": list(info.indices)}))
        result["steps"] = steps
    rank = dist.get_rank() if dist.is_initialized() else 0
    Path(out, f"{mode}_rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
