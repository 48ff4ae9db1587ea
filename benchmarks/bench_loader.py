"""ODBDataLoader against torch's DataLoader with a fixed batch size, W=2 on CPU, in one run.

    .venv/bin/python benchmarks/bench_loader.py [--samples 4000] [--workers 2]

Both loaders read the same dataset (lengths from the `sharegpt4o` fit, capped at
4096) with the same per-sample work (a tokenizer-like pass proportional to the
length), over one epoch on each of 2 Gloo ranks; the fixed batch size is ODB's
mean samples per step, so both make about the same number of steps. Prints
samples/s of each, their ratio, ODB's per-sample overhead, padding fraction and
gather payload per round. Not a test: figures go in notes.
"""

from __future__ import annotations

import argparse
import json
import socket
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from odb_core.distributions import sample_lengths
from odb_core.wire import payload_bytes
from odb_torch import ODBDataLoader, pad_collate as pad


class WorkDataset(Dataset):  # type: ignore[type-arg]
    """Samples whose realized length is only known after some per-sample work."""

    def __init__(self, n: int) -> None:
        self.lengths = [min(4096, x) for x in sample_lengths("sharegpt4o", n, seed=1)]

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict[str, Any]:
        length = self.lengths[i]
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, 32000, (length,), generator=g)
        ids = (ids * 31 + 7) % 32000  # stand-in for templating/tokenization work
        return {"input_ids": ids, "labels": ids.clone(), "idx": i}


def run_rank(rank: int, world: int, port: int, out: str, args: dict[str, Any]) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))
    ds = WorkDataset(args["samples"])
    res: dict[str, Any] = {}
    for name in args["order"]:
        dist.barrier()
        t0 = time.perf_counter()
        samples = steps = real = padded = 0
        rounds: dict[int, int] = {}
        first = None
        if name == "odb":
            loader = ODBDataLoader(ds, token_budget=args["budget"], collate_fn=pad, num_workers=args["workers"],
                                   buffer_size=args["buffer"], init_method=f"tcp://127.0.0.1:{port + 1}")
            for batch in loader:
                first = first or time.perf_counter() - t0
                info = loader.step_info
                steps += 1
                rounds[info.round] = rounds.get(info.round, 0) + 1
                if not info.is_idle:
                    samples += info.local_samples
                    real += int((batch["labels"] != -100).sum())
                    padded += batch["input_ids"].numel()
            loader.close()
        else:
            sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=0, drop_last=False)
            loader2 = DataLoader(ds, batch_size=args["batch_size"], sampler=sampler, collate_fn=pad,
                                 num_workers=args["workers"], prefetch_factor=2, multiprocessing_context="spawn")
            for batch in loader2:
                first = first or time.perf_counter() - t0
                steps += 1
                samples += batch["input_ids"].shape[0]
                real += int((batch["labels"] != -100).sum())
                padded += batch["input_ids"].numel()
        dist.barrier()
        seconds = time.perf_counter() - t0
        res[name] = {"seconds": seconds, "first": first, "samples": samples, "steps": steps, "padding": 1 - real / padded,
                     "payload": sum(payload_bytes(t) for t in rounds.values()) / max(len(rounds), 1)}
    Path(out, f"{rank}.json").write_text(json.dumps(res))
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=4000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--budget", type=int, default=16384)
    ap.add_argument("--buffer", type=int, default=256)
    a = ap.parse_args()
    mean = sum(WorkDataset(a.samples).lengths) / a.samples
    batch_size = max(1, round(a.budget / mean * 0.8))
    args = {"samples": a.samples, "workers": a.workers, "budget": a.budget, "buffer": a.buffer,
            "batch_size": batch_size, "order": ["plain", "odb", "plain", "odb"][:2]}
    with tempfile.TemporaryDirectory() as out:
        port = free_port()
        tmp.start_processes(run_rank, args=(2, port, out, args), nprocs=2, start_method="spawn")
        ranks = [json.loads(Path(out, f"{r}.json").read_text()) for r in range(2)]
    agg = {k: {"samples": sum(r[k]["samples"] for r in ranks), "seconds": max(r[k]["seconds"] for r in ranks),
               "steps": ranks[0][k]["steps"], "padding": sum(r[k]["padding"] for r in ranks) / 2,
               "payload": ranks[0][k]["payload"], "first": max(r[k]["first"] for r in ranks)}
           for k in ("plain", "odb")}
    print(f"W=2, {a.samples} samples, {a.workers} workers/rank, budget {a.budget}, buffer {a.buffer}; "
          f"plain batch size {batch_size} (ODB mean samples/step: "
          f"{agg['odb']['samples'] / 2 / max(agg['odb']['steps'], 1):.1f})")
    print("| loader | samples/s | samples/s after first batch | first batch (s) | steps/rank | padding | gather B/rank/round |")
    print("|---|---|---|---|---|---|---|")
    for k in ("plain", "odb"):
        v = agg[k]
        steady = v["samples"] / (v["seconds"] - v["first"])
        print(f"| {k} | {v['samples'] / v['seconds']:.0f} | {steady:.0f} | {v['first']:.2f} | {v['steps']} | "
              f"{v['padding']:.1%} | {v['payload'] if k == 'odb' else 0:.0f} |")
    ratio = (agg["odb"]["samples"] / agg["odb"]["seconds"]) / (agg["plain"]["samples"] / agg["plain"]["seconds"])
    overhead = (agg["odb"]["seconds"] - agg["plain"]["seconds"]) / (agg["odb"]["samples"] / 2) * 1e6
    print(f"ODB / plain samples/s: {ratio:.3f}; ODB per-sample overhead: {overhead:.0f} us")
    print(f"paper package payload at this buffer: {(2 + 2 * a.buffer) * 8} B/rank/round")


if __name__ == "__main__":
    main()
