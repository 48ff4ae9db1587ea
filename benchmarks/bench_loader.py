"""ODBDataLoader against torch's DataLoader (fixed batch size) and against the paper
authors' package (``online-dynamic-batching==0.1.2``, import ``odb``), W=2 on CPU, one run.

    .venv/bin/python benchmarks/bench_loader.py [--data both|chat|synthetic] [--samples N] [--repeats 2]

All loaders read the same dataset with the same per-sample work: ``chat`` is the real
chit-chat conversations, chat-templated and tokenized with the Qwen tokenizer inside
``__getitem__``; ``synthetic`` is lengths from the ``sharegpt4o`` fit with a cheap
per-token pass. The same ``pad_collate`` is used by all; the fixed batch size is ODB's
expected samples per step, so all make about the same number of steps. Loaders run in
turn, ``--repeats`` times. Per data set it prints each loader's best pass: samples/s, the
ratio to ODB, when the first sample started loading and when the first batch arrived,
padding, gather payload, CPU per sample (all of a rank's processes, start-up included),
the dataset's ``__getitem__`` CPU per sample (measured where it runs, in the workers) and
the cores kept busy (CPU per sample x samples/s); for ODB also its CPU per sample by process
(the trainer, the collate process, the DataLoader workers and their own work beyond
``__getitem__``; from /proc, Linux only). Then, side by side for both data sets
(``--data both``, the default): ODB's overhead per sample per rank once running (its
steady-state seconds per sample per rank minus the plain loader's), the steady-state
ratio (samples/s after the first batch, ODB / plain), the end-to-end ratio (best pass
against best pass; and pass by pass, each ODB pass over the plain pass just before it,
which a machine whose speed drifts disturbs less), the CPU per sample ODB spends beyond
the plain loader's, and the end-to-end ceiling when CPU-bound, pass by pass like the
ratio: the plain loader's CPU per sample over ODB's ``__getitem__`` CPU per sample in the
pass just after, the ratio ODB would reach were all of its own work free with the cores
still busy. Each trainer rank runs one torch thread (``--trainer-threads 0``: torch's
default, one per core, as a script that sets none). The plain loader's workers start as
ODB's do (``fork``; ``--plain-start spawn`` for a spawned pool, whose start-up lengthens
its first batch). Not a test: figures go in notes. The reference package runs only when
installed (``pip install -e .[bench]``); it uses its default (fork) start method, since
its cross-rank sync is off under spawn.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import statistics
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
from odb_torch import ODBDataLoader
from odb_torch import pad_collate as pad
from odb_torch.ports import free_port


class SyntheticDataset(Dataset):  # type: ignore[type-arg]
    """Samples whose realized length is only known after some per-sample work."""

    def __init__(self, n: int) -> None:
        self.lengths = [min(4096, x) for x in sample_lengths("sharegpt4o", n, seed=1)]

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict[str, Any]:
        length = self.lengths[i]
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, 32000, (length,), generator=g)
        ids = (ids * 31 + 7) % 31999 + 1  # stand-in for tokenization work; 0 is the pad id
        return {"input_ids": ids, "labels": ids.clone(), "idx": i}


class TimedDataset(Dataset):  # type: ignore[type-arg]
    """``inner`` whose ``__getitem__`` CPU time (the calling thread's) adds up in shared
    memory, inherited by forked workers (plain) and by the forked collate process and its
    workers (ODB): the per-sample work every loader must do, measured where it runs."""

    def __init__(self, inner: Dataset[Any]) -> None:
        self.inner = inner
        self.spent = mp.RawArray("d", 3)  # CPU seconds, samples, when the first load started
        self.lock = mp.Lock()

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]

    def __getitem__(self, i: int) -> Any:
        started, t0 = time.perf_counter(), time.thread_time()  # perf_counter: CLOCK_MONOTONIC, one per machine
        sample = self.inner[i]
        spent = time.thread_time() - t0
        with self.lock:
            self.spent[0] += spent
            self.spent[1] += 1
            self.spent[2] = min(self.spent[2] or started, started)
        return sample

    def take(self) -> tuple[float, int, float]:
        """(CPU seconds, samples, the first load's perf_counter or 0) since the last take."""
        with self.lock:
            spent, n, first = self.spent[0], int(self.spent[1]), self.spent[2]
            self.spent[0] = self.spent[1] = self.spent[2] = 0.0
        return spent, n, first


def make_dataset(kind: str, n: int) -> TimedDataset:
    if kind == "chat":
        from odb_tools.demo.chat_data import ChatDataset

        full = ChatDataset()
        return TimedDataset(full.subset([i % len(full) for i in range(n)]) if n != len(full) else full)
    return TimedDataset(SyntheticDataset(n))


def has_reference() -> bool:
    try:
        import odb  # noqa: F401
    except ImportError:
        return False
    return True


def cpu_seconds() -> float:
    """CPU seconds of this process and of its reaped descendants (a loader's workers and
    collate process count once the loader has shut them down)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _proc_stat(pid: int) -> tuple[int, float, float]:
    """(parent pid, own CPU seconds, reaped children's CPU seconds) of a live process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / tick, (int(fields[13]) + int(fields[14])) / tick


def odb_process_cpu() -> tuple[float, float]:
    """CPU seconds so far of this rank's ODB collate process and of its DataLoader workers (live ones
    from /proc, exited ones as the collate process's reaped children); (0, 0) without /proc."""
    if not Path("/proc/self/stat").exists():
        return 0.0, 0.0
    table: dict[int, tuple[int, float, float]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if "resource_tracker" not in (entry / "cmdline").read_text():
                    table[int(entry.name)] = _proc_stat(int(entry.name))
            except OSError:  # gone meanwhile
                continue
    collate = [p for p, (parent, _, _) in table.items() if parent == os.getpid()]
    workers = sum(own for parent, own, _ in table.values() if parent in collate)
    return sum(table[p][1] for p in collate), workers + sum(table[p][2] for p in collate)


class Tally:
    """What one pass of a loader yields on one rank: steps, samples, real and padded tokens."""

    def __init__(self, t0: float) -> None:
        self.t0, self.first, self.last = t0, 0.0, 0.0
        self.samples = self.steps = self.real = self.padded = 0
        self.rounds: dict[int, int] = {}

    def add(self, batch: Any, samples: int) -> None:
        """Count one step of ``samples`` samples (0: an idle step, whose tokens do not count)."""
        self.first = self.first or time.perf_counter() - self.t0
        self.steps += 1
        if samples:
            self.samples += samples
            self.real += int((batch["input_ids"] != 0).sum())
            self.padded += batch["input_ids"].numel()

    def end(self) -> None:
        """The pass's last batch is in (before its loader closes)."""
        self.last = time.perf_counter() - self.t0


def odb_pass(ds: TimedDataset, args: dict[str, Any], port: int, tally: Tally) -> dict[str, float]:
    """One epoch of ODBDataLoader; ODB's CPU seconds by process (trainer, collate process, workers)."""
    own0 = resource.getrusage(resource.RUSAGE_SELF)
    loader = ODBDataLoader(ds, token_budget=args["budget"], collate_fn=pad, num_workers=args["workers"],
                           buffer_size=args["buffer"], init_method=f"tcp://127.0.0.1:{port}")
    for batch in loader:
        info = loader.step_info
        tally.rounds[info.round] = tally.rounds.get(info.round, 0) + 1
        tally.add(batch, 0 if info.is_idle else info.local_samples)
    tally.end()
    own = resource.getrusage(resource.RUSAGE_SELF)
    collate_cpu, workers_cpu = odb_process_cpu()
    loader.close()  # after the reading above: the split is of the epoch, before the loader closes
    return {"trainer_cpu": own.ru_utime + own.ru_stime - own0.ru_utime - own0.ru_stime, "collate_cpu": collate_cpu,
            "workers_cpu": workers_cpu}


def reference_pass(ds: TimedDataset, args: dict[str, Any], rank: int, world: int, tally: Tally) -> None:
    """One epoch of the reference package's loader (installed only with ``[bench]``)."""
    import odb

    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=0, drop_last=False)
    ref = odb.ODBDataLoader(ds, token_budget=args["budget"], batch_size=1, sampler=sampler, collate_fn=pad,
                            num_workers=args["workers"], prefetch_factor=2, buffer_size=args["buffer"],
                            loss_scaling="exact", join=True)
    for batch in ref:
        info = odb.pop_step_info(batch, loss_scaling="exact")
        n = int(batch["input_ids"].shape[0])
        tally.add(batch, n if n and int(info.local_batch_size if hasattr(info, "local_batch_size") else n) else 0)
    tally.end()
    del ref


def plain_pass(ds: TimedDataset, args: dict[str, Any], rank: int, world: int, tally: Tally) -> None:
    """One epoch of a plain DataLoader with fixed batches over a DistributedSampler."""
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=0, drop_last=False)
    plain = DataLoader(ds, batch_size=args["batch_size"], sampler=sampler, collate_fn=pad,
                       num_workers=args["workers"], prefetch_factor=2, multiprocessing_context=args["plain_start"])
    for batch in plain:
        tally.add(batch, batch["input_ids"].shape[0])
    tally.end()


def run_rank(rank: int, world: int, port: int, out: str, args: dict[str, Any]) -> None:
    if args["trainer_threads"]:
        torch.set_num_threads(args["trainer_threads"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=900))
    ds = make_dataset(args["data"], args["samples"])
    res: dict[str, list[dict[str, Any]]] = {}
    for k, name in enumerate(args["order"]):
        dist.barrier()
        ds.take()
        t0, cpu0 = time.perf_counter(), cpu_seconds()
        tally, split = Tally(t0), {}
        if name == "odb":
            split = odb_pass(ds, args, port + 1 + k, tally)
        elif name == "reference":
            reference_pass(ds, args, rank, world, tally)
        else:
            plain_pass(ds, args, rank, world, tally)
        cpu = cpu_seconds() - cpu0
        getitem, loaded, first_load = ds.take()
        dist.barrier()
        res.setdefault(name, []).append({
            "seconds": time.perf_counter() - t0, "cpu": cpu, "first": tally.first, "last": tally.last,
            "samples": tally.samples, "steps": tally.steps, "real": tally.real, "padded": tally.padded,
            "getitem": getitem, "loaded": loaded, "first_load": first_load - t0, **split,
            "payload": sum(payload_bytes(t) for t in tally.rounds.values()) / max(len(tally.rounds), 1)})
    Path(out, f"{rank}.json").write_text(json.dumps(res))
    dist.destroy_process_group()


def fixed_batch_size(a: argparse.Namespace, data: str) -> int:
    """The plain loader's batch size: the mean samples of the groups ODB's grouping forms over
    ``data``'s lengths, buffer by buffer."""
    from odb_core.grouping import form_groups

    if data == "chat":
        from odb_tools.demo.chat_data import ChatDataset

        full = ChatDataset().lengths()
        lengths = [full[i % len(full)] for i in range(a.samples)]
    else:
        lengths = SyntheticDataset(a.samples).lengths
    groups = [g for k in range(0, len(lengths), a.buffer) for g in form_groups(lengths[k:k + a.buffer], a.budget)]
    return max(1, round(len(lengths) / len(groups)))


def run_ranks(args: dict[str, Any]) -> list[dict[str, Any]]:
    """Both ranks' results of every pass in ``args["order"]``."""
    with tempfile.TemporaryDirectory() as out:
        ctx = tmp.start_processes(run_rank, args=(2, free_port(16), out, args), nprocs=2, start_method="spawn",
                                  join=False)
        for p in ctx.processes:
            p.join()
        # the reference package's DataLoader workers can be SIGTERMed while its rank process
        # exits (torch's SIGCHLD handler then makes the exit code 1): results written count
        codes = [p.exitcode for p in ctx.processes]
        ranks = [json.loads(Path(out, f"{r}.json").read_text()) for r in range(2)]
    if any(codes) and not args.get("raw"):
        print(f"note: rank exit codes {codes} after writing their results")
    return ranks


def passes(ranks: list[dict[str, Any]], name: str, repeats: int) -> list[dict[str, Any]]:
    """``name``'s passes, both ranks together: rates, first batch, padding, CPU per sample."""
    out = []
    for k in range(repeats):
        rs = [r[name][k] for r in ranks]
        seconds = max(x["seconds"] for x in rs)
        samples = sum(x["samples"] for x in rs)
        out.append({"seconds": seconds, "samples": samples, "rate": samples / seconds,
                    "steady": samples / (seconds - max(x["first"] for x in rs)),
                    "steps": rs[0]["steps"], "padding": 1 - sum(x["real"] for x in rs) / sum(x["padded"] for x in rs),
                    "payload": rs[0]["payload"], "first": max(x["first"] for x in rs),
                    "first_load": max(x["first_load"] for x in rs),
                    "cpu": sum(x["cpu"] for x in rs) / samples * 1e6,
                    "getitem": sum(x["getitem"] for x in rs) / max(sum(x["loaded"] for x in rs), 1) * 1e6,
                    # ODB only: CPU per sample by process (trainer, collate process, its workers)
                    **{key: sum(x.get(key, 0.0) for x in rs) / samples * 1e6
                       for key in ("trainer_cpu", "collate_cpu", "workers_cpu")},
                    "getitem_total": sum(x["getitem"] for x in rs) / samples * 1e6})
    return out


def print_loaders(agg: dict[str, dict[str, Any]], names: list[str], buffer: int) -> None:
    """The per-loader table (best pass of each) and ODB's CPU by process."""
    print("| loader | samples/s | vs ODB | samples/s after first batch | first load (s) | first batch (s) | steps/rank "
          "| samples/step "
          "| padding | gather B/rank/round | CPU us/sample | __getitem__ CPU us/sample | cores busy |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for k in names:
        v = agg[k]
        print(f"| {k} | {v['rate']:.0f} | {v['rate'] / agg['odb']['rate']:.2f} | {v['steady']:.0f} | "
              f"{v['first_load']:.2f} | {v['first']:.2f} | "
              f"{v['steps']} | {v['samples'] / 2 / max(v['steps'], 1):.1f} | {v['padding']:.1%} | "
              f"{v['payload'] if k == 'odb' else (2 + 2 * buffer) * 8 if k == 'reference' else 0:.0f} | {v['cpu']:.0f} | "
              f"{v['getitem']:.0f} | {v['cpu'] * v['rate'] / 1e6:.2f} |")
    odb = agg["odb"]
    if odb["collate_cpu"]:
        print(f"ODB CPU per sample per rank by process (best pass, us; from /proc, before the loader closes): "
              f"trainer {odb['trainer_cpu']:.0f}, collate process {odb['collate_cpu']:.0f}, DataLoader workers "
              f"{odb['workers_cpu']:.0f} (__getitem__ {odb['getitem_total']:.0f}, their own work "
              f"{odb['workers_cpu'] - odb['getitem_total']:.0f})")
    if "reference" in agg:
        print(f"ODB / reference samples/s: {odb['rate'] / agg['reference']['rate']:.3f}")


def run_data(a: argparse.Namespace, data: str) -> dict[str, Any]:
    """Every loader over ``data`` in one W=2 run; prints its table, returns the ratios."""
    batch_size = fixed_batch_size(a, data)
    names = ["plain", "odb"] + (["reference"] if has_reference() and not a.no_reference else [])
    args = {"samples": a.samples, "workers": a.workers, "budget": a.budget, "buffer": a.buffer, "data": data,
            "batch_size": batch_size, "order": a.raw.split(",") if a.raw else names * a.repeats,
            "plain_start": a.plain_start, "trainer_threads": a.trainer_threads, "raw": a.raw}
    ranks = run_ranks(args)
    if a.raw:
        print(json.dumps(ranks, indent=0))
        return {}
    runs = {k: passes(ranks, k, a.repeats) for k in names}
    agg = {k: max(v, key=lambda p: p["rate"]) for k, v in runs.items()}
    print(f"W=2, data {data}, {a.samples} samples, {a.workers} workers/rank, budget {a.budget}, buffer {a.buffer}; "
          f"fixed batch size {batch_size}; plain workers by {a.plain_start}; "
          f"trainer threads {a.trainer_threads or 'torch default'}; best of {a.repeats} passes")
    print_loaders(agg, names, a.buffer)
    print()
    odb, plain = agg["odb"], agg["plain"]
    return {"overhead_us": (2 / odb["steady"] - 2 / plain["steady"]) * 1e6, "steady": odb["steady"] / plain["steady"],
            "end_to_end": odb["rate"] / plain["rate"], "cpu_us": odb["cpu"] - plain["cpu"],
            "pairs": sorted(o["rate"] / p["rate"] for o, p in zip(runs["odb"], runs["plain"])),
            # pass by pass too: the machine's speed drifts, and both figures must come from one moment
            "ceilings": sorted(p["cpu"] / o["getitem"] for o, p in zip(runs["odb"], runs["plain"]))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", choices=["both", "chat", "synthetic"], default="both")
    ap.add_argument("--samples", type=int, default=7168)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--budget", type=int, default=8192)
    ap.add_argument("--buffer", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--plain-start", choices=["fork", "spawn", "forkserver"], default="fork")
    ap.add_argument("--no-reference", action="store_true")
    ap.add_argument("--trainer-threads", type=int, default=1,
                    help="torch intra-op threads of each trainer rank (0: torch's default, one per core, as a "
                         "training script that sets none runs; the collate process and the workers it forks "
                         "inherit the setting unless they set their own)")
    ap.add_argument("--raw", default="", help="comma-separated loaders to run once; print per-rank raw figures")
    a = ap.parse_args()
    results = {d: run_data(a, d) for d in (["chat", "synthetic"] if a.data == "both" else [a.data])}
    if a.raw:
        return
    print("| data | ODB overhead per sample per rank, once running (us) | steady state ODB / plain "
          "| end to end ODB / plain | end to end, pass by pass (median; range) | ODB CPU per sample beyond plain's (us) "
          "| end-to-end ceiling when CPU-bound, pass by pass (median; range) |")
    print("|---|---|---|---|---|---|---|")
    for d, r in results.items():
        pairs, ceilings = r["pairs"], r["ceilings"]
        print(f"| {d} | {r['overhead_us']:.0f} | {r['steady']:.3f} | {r['end_to_end']:.3f} | "
              f"{statistics.median(pairs):.3f}; {pairs[0]:.3f}-{pairs[-1]:.3f} | {r['cpu_us']:.0f} | "
              f"{statistics.median(ceilings):.3f}; {ceilings[0]:.3f}-{ceilings[-1]:.3f} |")
    print("targets: overhead <= 50 us, steady state >= 0.95, end to end >= 1.2")


if __name__ == "__main__":
    main()
