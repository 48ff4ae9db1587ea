"""What the packed budget's shared-tail reserve costs a real loader: W Gloo ranks read the
chat data (chat-templated and tokenized in ``__getitem__``) with ``budget="packed"`` and
``packed_collate``, without a pool and with ``shared_tail`` f, in turn, in one run.

    .venv/bin/python benchmarks/bench_packed_tail_loader.py [--world 2] [--tail 0.02] [--repeats 2] [--workers 2]

Per setting it prints the best pass's epoch seconds, samples/s, real rows per epoch (every
rank's non-idle steps), steps per rank, rounds and the mean real tokens per row over L_max;
then the pool's ratios (seconds, rows). ``rounds`` counts the rounds that delivered a step (the
reserve's skip rounds deliver none). The reserve deals one view a round at the epoch's
end, each round a header gather that waits for one sample's loading: this measures that
wait against what the fuller rows save. Not a test: the figures go in notes.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from odb_torch import ODBDataLoader, packed_collate
from odb_torch.ports import free_port

BUDGET = 8192


def run_rank(rank: int, world: int, port: int, out: str, args: dict[str, Any]) -> None:
    """One trainer rank: every setting's passes, in turn; its figures to ``out``."""
    from odb_tools.demo.chat_data import ChatDataset

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=900))
    ds = ChatDataset(max_length=args["max_length"])
    res: list[dict[str, Any]] = []
    for k, (tail, rep) in enumerate((t, r) for r in range(args["repeats"]) for t in (0.0, args["tail"])):
        dist.barrier()
        t0 = time.perf_counter()
        loader = ODBDataLoader(ds, token_budget=BUDGET, budget="packed", collate_fn=packed_collate,
                               num_workers=args["workers"], buffer_size=args["buffer"], shared_tail=tail,
                               init_method=f"tcp://127.0.0.1:{port + 1 + k}")
        rows = steps = tokens = samples = fill_rows = 0
        rounds: set[int] = set()
        for batch in loader:
            info = loader.step_info
            steps += 1
            rounds.add(info.round)
            if not info.is_idle:
                rows += 1
                samples += info.local_samples
                if not info.over_budget:  # the fill leaves out a lone sample longer than L_max
                    fill_rows += 1
                    tokens += int(batch["input_ids"].numel())  # one packed row: its real tokens
        loader.close()
        res.append({"tail": tail, "repeat": rep, "seconds": time.perf_counter() - t0, "rows": rows, "steps": steps,
                    "rounds": len(rounds), "samples": samples, "tokens": tokens, "fill_rows": fill_rows})
    Path(out, f"rank{rank}.json").write_text(json.dumps(res))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--tail", type=float, default=0.02)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--buffer", type=int, default=1024)
    ap.add_argument("--max-length", type=int, default=16384, help="conversations cut to this many tokens "
                    "(16,384: none is cut; odb bench batching's chat lengths)")
    a = ap.parse_args()
    args = {"tail": a.tail, "repeats": a.repeats, "workers": a.workers, "buffer": a.buffer,
            "max_length": a.max_length}
    with tempfile.TemporaryDirectory() as out:
        tmp.start_processes(run_rank, args=(a.world, free_port(), out, args), nprocs=a.world, join=True,
                            start_method="spawn")
        per_rank = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(a.world)]
    best: dict[float, dict[str, Any]] = {}
    for passes in zip(*per_rank):
        p = {"tail": passes[0]["tail"], "seconds": max(x["seconds"] for x in passes),
             "rows": sum(x["rows"] for x in passes), "steps": passes[0]["steps"], "rounds": passes[0]["rounds"],
             "samples": sum(x["samples"] for x in passes), "tokens": sum(x["tokens"] for x in passes),
             "fill_rows": sum(x["fill_rows"] for x in passes)}
        if p["tail"] not in best or p["seconds"] < best[p["tail"]]["seconds"]:
            best[p["tail"]] = p
    print(f"W={a.world}, chat data (cut at {a.max_length} tokens), L_max {BUDGET}, buffer {a.buffer}, "
          f"{a.workers} workers per rank, best of {a.repeats}")
    print("| shared_tail | epoch s | samples/s | rows | steps/rank | rounds | fill |\n|---|---|---|---|---|---|---|")
    for tail, p in sorted(best.items()):
        print(f"| {tail:g} | {p['seconds']:.2f} | {p['samples'] / p['seconds']:.0f} | {p['rows']} | {p['steps']} | "
              f"{p['rounds']} | {p['tokens'] / (p['fill_rows'] * BUDGET):.2%} |")
    none, pool = best[0.0], best[a.tail]
    print(f"pool / none: epoch seconds {pool['seconds'] / none['seconds']:.3f}x, rows {pool['rows'] / none['rows']:.3f}x, "
          f"rounds +{pool['rounds'] - none['rounds']}")


if __name__ == "__main__":
    main()
