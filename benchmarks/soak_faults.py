"""Soak under faults (issue 20): many epochs at W=2 with a fault every few epochs and a
resume after each, on real spawned Gloo ranks. Not a test: its figures go in notes.

    .venv/bin/python benchmarks/soak_faults.py [--epochs 20] [--n 400] [--every 4] [--kinds K,...] [--json]
    .venv/bin/python benchmarks/soak_faults.py --epochs 24 --every 2 --kinds worker_killed  # one fault, 11 times

Each *segment* spawns W=2 trainer ranks (a Gloo trainer group and an ``ODBDataLoader``
each: join mode, budget 2048, buffer 32, one worker, timeout 20 s) that train epochs
(no model: they record what they were given). After every yielded batch a rank appends
one JSON line to its log: the epoch, the step (``state_dict()["steps"]``), the dataset
indices and the loader's ``state_dict()`` (the checkpoint of that step); after every
epoch, the collate process's RSS and the rank's open fds. Every ``--every`` epochs,
mid-epoch, the segment's one fault hits one rank (cycling: the collate process
SIGKILLed, the rank SIGKILLed, SIGINT in the rank, a DataLoader worker SIGKILLed); every
rank must then end with a typed error within seconds. The next segment resumes, on
fresh ranks and loaders, from the latest checkpoint present on every rank: steps after
it were lost with the crash and are trained again.

Reported: per epoch, dataset indices never trained (lost) and trained twice
(duplicated), counting the logs up to each resume checkpoint plus what followed it;
after each segment, processes of the run still alive, new ``/dev/shm`` entries, fd
growth within the segment, the collate process's RSS over epochs; after the whole run
(this script re-runs itself as a child, so that child's multiprocessing resource
tracker has exited and unlinked what a SIGKILLed rank could not), processes and
``/dev/shm`` entries left. Every process of a run carries ``ODB_SOAK_TAG=<uuid>`` in
its environment; a ``/dev/shm`` entry is the run's if one of them mapped it (other runs
on the machine may come and go meanwhile). Exit code 1 if anything is lost, duplicated,
left behind or growing, if a segment hung, or if a rank did not end with the expected
error (the victim: ``CollateProcessError``, ``KeyboardInterrupt`` or ``SampleLoadError``
naming its rank; every other rank: ``PeerError``) within 15 s of the fault.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from collections import Counter
from datetime import timedelta
from multiprocessing import resource_tracker
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp
from torch.utils.data import Dataset

from odb_torch import ODBDataLoader, pad_collate
from odb_torch.ports import free_port

WORLD = 2
BUDGET = 2048
TIMEOUT = 20.0  # the loaders' timeout (s)
QUICK = 15.0  # seconds within which every rank must report a fault (README: "seconds")
TAG = "ODB_SOAK_TAG"
DONE = 10**9  # the step key of an epoch's end
KINDS = ("kill_collate", "kill_rank", "sigint", "worker_killed")
FAULT_STEP = {"kill_collate": 6, "kill_rank": 4, "sigint": 8, "worker_killed": 2}
EXPECTED = {"kill_collate": "CollateProcessError", "kill_rank": "killed", "sigint": "KeyboardInterrupt",
            "worker_killed": "SampleLoadError"}
RSS_SLACK = (0.10, 5 * 1024)  # flat: the last epoch within 10% or 5 MB of the first after warm-up
Key = tuple[int, int]


# ----------------------------------------------------------------------------- data


def sample_length(i: int) -> int:
    """A deterministic heavy-tailed (Pareto, alpha 1.3) token count for index i, 64..3000."""
    u = random.Random(i).random()
    return min(3000, int(64 / (1.0 - u) ** (1 / 1.3)))


class SoakDataset(Dataset):  # type: ignore[type-arg]
    """Token samples. Once the file ``armed`` exists, a DataLoader worker that loads a
    sample SIGKILLs itself (the worker-killed fault; only the faulted segment arms it)."""

    def __init__(self, n: int, armed: str | None = None) -> None:
        self.n = n
        self.armed = armed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        if self.armed and torch.utils.data.get_worker_info() is not None and os.path.exists(self.armed):
            Path(self.armed + ".died").write_text(json.dumps({"at": time.time(), "index": i, "pid": os.getpid()}))
            os.kill(os.getpid(), signal.SIGKILL)
        length = sample_length(i)
        ids = (torch.arange(length) * (i + 3)) % 1000 + 1
        labels = ids.clone()
        labels[: length // 4] = -100
        return {"input_ids": ids, "labels": labels, "idx": i}


# ----------------------------------------------------------------------------- rank side


def append_line(fd: int, obj: dict[str, Any]) -> None:
    """One JSON line in one ``write`` (O_APPEND): a killed rank leaves whole lines only."""
    os.write(fd, (json.dumps(obj) + "\n").encode())


def rss_kb(pid: int) -> int:
    """VmRSS of a process in kB (-1 if it is gone)."""
    try:
        for line in Path("/proc", str(pid), "status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return -1


def open_fds() -> int:
    """File descriptors open in this process."""
    return len(os.listdir("/proc/self/fd"))


def make_loader(rank: int, port: int, seg: dict[str, Any]) -> ODBDataLoader:
    """This segment's loader; restored from the resume checkpoint if there is one."""
    fault = seg["fault"]
    armed = seg["armed"] if fault and fault["kind"] == "worker_killed" and fault["victim"] == rank else None
    loader = ODBDataLoader(SoakDataset(seg["n"], armed), token_budget=BUDGET, collate_fn=pad_collate,
                           buffer_size=32, num_workers=1, timeout=TIMEOUT,
                           init_method=f"tcp://127.0.0.1:{port + 1}")
    if seg["resume"] is not None:
        loader.load_state_dict(seg["resume"][str(rank)])
    return loader


def inject(kind: str, loader: ODBDataLoader, seg: dict[str, Any], out: Path, epoch: int, step: int) -> None:
    """The segment's fault, on the victim rank (the time is written first: a killed rank says nothing after)."""
    (out / "fault.json").write_text(json.dumps({"at": time.time(), "epoch": epoch, "step": step}))
    if kind == "kill_collate":
        os.kill(loader._proc.pid, signal.SIGKILL)
    elif kind == "kill_rank":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "sigint":
        os.kill(os.getpid(), signal.SIGINT)  # KeyboardInterrupt here, as Ctrl-C would raise
    elif kind == "worker_killed":
        Path(seg["armed"]).touch()  # the worker's next __getitem__ kills it


def train(loader: ODBDataLoader, rank: int, seg: dict[str, Any], fd: int, out: Path) -> None:
    """Train (record) the segment's epochs; inject the fault when due."""
    fault, injected = seg["fault"], False
    for epoch in range(seg["start_epoch"], seg["epochs"]):
        loader.set_epoch(epoch)
        for batch in loader:
            info, state = loader.step_info, loader.state_dict()
            indices = [] if info.is_idle else [int(i) for i in info.indices]
            same = info.is_idle or batch["idx"].tolist() == indices
            append_line(fd, {"epoch": epoch, "step": state["steps"], "indices": indices, "state": state,
                             "batch_matches": same})
            due = fault and fault["victim"] == rank and fault["epoch"] == epoch and state["steps"] >= fault["step"]
            if due and not injected:
                injected = True
                inject(fault["kind"], loader, seg, out, epoch, state["steps"])
        append_line(fd, {"epoch": epoch, "done": True, "steps": loader.state_dict()["steps"],
                         "rss_kb": rss_kb(loader._proc.pid), "fds": open_fds()})


def describe_error(exc: BaseException, started: float) -> dict[str, Any]:
    """What a rank reports about the exception that ended it."""
    return {"error": type(exc).__name__, "mro": [c.__name__ for c in type(exc).__mro__],
            "message": str(exc)[:500], "error_rank": getattr(exc, "rank", None),
            "error_indices": list(getattr(exc, "indices", ()))[:32], "error_at": time.time(),
            "after_s": time.time() - started, "trace": traceback.format_exc()[-3000:]}


def rank_main(rank: int, world: int, port: int, out_dir: str, seg: dict[str, Any]) -> None:
    """One trainer rank of one segment; writes ``rank<r>.log`` (steps) and ``rank<r>.json`` (outcome)."""
    torch.set_num_threads(1)
    out, started = Path(out_dir), time.time()
    result: dict[str, Any] = {"rank": rank, "pid": os.getpid(), "error": None}
    fd = os.open(out / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    loader: ODBDataLoader | None = None
    interrupted = False
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
        loader = make_loader(rank, port, seg)
        train(loader, rank, seg, fd, out)
    except BaseException as exc:
        result.update(describe_error(exc, started))
        if isinstance(exc, KeyboardInterrupt):  # exit with the loader still open, as a script would
            interrupted = True
            (out / f"rank{rank}.json").write_text(json.dumps(result))
            raise
    finally:
        if loader is not None and not interrupted:
            loader.close()
        os.close(fd)
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    try:
        dist.destroy_process_group()
    except Exception:
        pass


# ----------------------------------------------------------------------------- processes


def tagged_processes(tag: str, exclude: set[int]) -> list[int]:
    """Live (non-zombie) processes whose environment carries ``ODB_SOAK_TAG=tag``."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in exclude:
            continue
        try:
            env = Path("/proc", name, "environ").read_bytes().split(b"\0")
            state = Path("/proc", name, "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if f"{TAG}={tag}".encode() in env and state != "Z":
            found.append(int(name))
    return found


def cmdline(pid: int) -> str:
    """A process's command line, shortened."""
    try:
        return Path("/proc", str(pid), "cmdline").read_bytes().replace(b"\0", b" ").decode()[:160]
    except OSError:
        return "?"


def reap_leftovers(tag: str, exclude: set[int], grace: float = 15.0) -> list[str]:
    """Wait up to ``grace`` s for the run's processes to exit; kill and describe any that did not."""
    deadline = time.monotonic() + grace
    while (left := tagged_processes(tag, exclude)) and time.monotonic() < deadline:
        time.sleep(0.2)
    described = [f"{pid}: {cmdline(pid)}" for pid in left]
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return described


def shm_entries() -> set[str]:
    """Names in /dev/shm."""
    return set(os.listdir("/dev/shm"))


def shm_mapped(pids: list[int]) -> set[str]:
    """/dev/shm names these processes have mapped (named semaphores are mapped by every user):
    which entries are this run's, as other runs on the machine may create and leave their own."""
    names: set[str] = set()
    for pid in pids:
        try:
            maps = Path("/proc", str(pid), "maps").read_text()
        except OSError:
            continue
        names.update(line.split("/dev/shm/")[1].split()[0] for line in maps.splitlines() if "/dev/shm/" in line)
    return names


# ----------------------------------------------------------------------------- logs


def read_lines(path: Path) -> list[dict[str, Any]]:
    """The JSON lines of a rank's log (a torn last line is skipped)."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return rows


def key_of(row: dict[str, Any]) -> Key:
    """(epoch, step) of a step line, (epoch, DONE) of an epoch's end."""
    return (row["epoch"], DONE if row.get("done") else row["step"])


def common_checkpoint(logs: list[list[dict[str, Any]]], start: Key) -> Key:
    """The latest checkpoint every rank wrote (``start`` when there is none)."""
    keys = [{key_of(r) for r in rows} for rows in logs]
    common = set.intersection(*keys) if keys else set()
    return max(common | {start})


def resume_states(logs: list[list[dict[str, Any]]], ckpt: Key) -> dict[str, Any] | None:
    """Each rank's state_dict at ``ckpt`` (JSON round-tripped), or None at an epoch boundary."""
    if ckpt[1] == DONE:
        return None
    states = {}
    for rank, rows in enumerate(logs):
        row = next(r for r in rows if key_of(r) == ckpt)
        states[str(rank)] = json.loads(json.dumps(row["state"]))
    return states


def continuity_errors(rows: list[dict[str, Any]], start: Key) -> list[str]:
    """Steps that do not follow one another by one (from the resume point, or 1 in a fresh epoch)."""
    errors, prev = [], start
    for r in rows:
        k = key_of(r)
        if k[1] == DONE:
            prev = k
            continue
        want = prev[1] + 1 if prev[0] == k[0] else 1
        if k[1] != want:
            errors.append(f"epoch {k[0]}: step {k[1]} after {prev}")
        prev = k
    return errors


# ----------------------------------------------------------------------------- segments


def schedule(epochs: int, every: int, kinds: tuple[str, ...] = KINDS) -> list[dict[str, Any]]:
    """The faults: one every ``every`` epochs from epoch 3, cycling ``kinds`` and victims."""
    faults = []
    for j, epoch in enumerate(range(3, epochs, every)):
        kind = kinds[j % len(kinds)]
        faults.append({"epoch": epoch, "kind": kind, "victim": j % WORLD, "step": FAULT_STEP[kind] + j // len(kinds)})
    return faults


def spawn_and_wait(seg: dict[str, Any], out: Path, limit: float, tag: str,
                   exclude: set[int]) -> tuple[list[int | None], bool, set[str]]:
    """Spawn the segment's ranks; wait at most ``limit`` s (noting the /dev/shm entries the
    run's processes map); kill what is left. (exit codes, hung, /dev/shm names seen)."""
    ctx = tmp.start_processes(rank_main, args=(WORLD, free_port(3), str(out), seg),  # type: ignore[attr-defined,no-untyped-call]
                              nprocs=WORLD, join=False, start_method="spawn")
    deadline, seen = time.monotonic() + limit, set()
    while any(p.is_alive() for p in ctx.processes) and time.monotonic() < deadline:
        seen |= shm_mapped(tagged_processes(tag, exclude))
        time.sleep(0.5)
    hung = any(p.is_alive() for p in ctx.processes)
    for p in ctx.processes:
        if p.is_alive():
            p.kill()
        p.join(10)
    return [p.exitcode for p in ctx.processes], hung, seen


def rank_outcome(out: Path, rank: int, code: int | None, fault_at: float | None) -> dict[str, Any]:
    """A rank's error, whether it is typed, and its latency from the fault."""
    path = out / f"rank{rank}.json"
    gone = {"rank": rank, "error": "killed" if code == -9 else "no result"}
    res: dict[str, Any] = json.loads(path.read_text()) if path.exists() else gone
    res["exitcode"] = code
    res["typed"] = "ODBError" in res.get("mro", []) or res["error"] in ("KeyboardInterrupt", "killed")
    if fault_at is not None and "error_at" in res:
        res["latency_s"] = round(res["error_at"] - fault_at, 2)
    return res


def expected_errors(fault: dict[str, Any] | None) -> list[str | None]:
    """What each rank must end with: the victim's typed error, PeerError elsewhere (None: no fault)."""
    if fault is None:
        return [None] * WORLD
    return [EXPECTED[fault["kind"]] if r == fault["victim"] else "PeerError" for r in range(WORLD)]


def run_segment(no: int, seg: dict[str, Any], work: Path, tag: str, exclude: set[int]) -> dict[str, Any]:
    """One segment: spawn, wait, check what is left, read the logs and outcomes."""
    out = work / f"seg{no}"
    out.mkdir()
    shm_before, t0 = shm_entries(), time.time()
    limit = 90.0 + 20.0 * (seg["epochs"] - seg["start_epoch"])
    codes, hung, seen = spawn_and_wait(seg, out, limit, tag, exclude)
    left = reap_leftovers(tag, exclude)
    new_shm = shm_entries() - shm_before
    ours = sorted(new_shm & seen)
    fault_file = out / "fault.json"
    fault_hit = json.loads(fault_file.read_text()) if fault_file.exists() else None
    died = Path(seg["armed"] + ".died")
    if fault_hit and died.exists():  # the worker-killed fault happens when the worker dies, not when armed
        fault_hit = {**fault_hit, "armed_at": fault_hit["at"], "worker": json.loads(died.read_text())}
        fault_hit["at"] = fault_hit["worker"]["at"]
    outcomes = [rank_outcome(out, r, codes[r], fault_hit["at"] if fault_hit else None) for r in range(WORLD)]
    return {"no": no, "start_epoch": seg["start_epoch"], "resumed": seg["resume"] is not None,
            "fault": seg["fault"], "fault_hit": fault_hit, "seconds": round(time.time() - t0, 1), "hung": hung,
            "outcomes": outcomes, "expected": expected_errors(seg["fault"] if fault_hit else None),
            "processes_left": left, "seen": sorted(seen),
            "semaphores_new": [x for x in ours if x.startswith("sem.mp-")],
            "shm_new": [x for x in ours if not x.startswith("sem.mp-")], "others_new": sorted(new_shm - seen),
            "logs": [read_lines(out / f"rank{r}.log") for r in range(WORLD)]}


def accept(seg: dict[str, Any], start: Key) -> Key:
    """Pick the segment's resume checkpoint and keep, per rank, the steps up to it (the rest
    died with the crash and are trained again); records how many steps are replayed."""
    ckpt = common_checkpoint(seg["logs"], start)
    seg["checkpoint"] = list(ckpt)
    seg["continuity"] = [continuity_errors(rows, start) for rows in seg["logs"]]
    seg["replayed_steps"] = [sum(1 for r in rows if key_of(r) > ckpt and not r.get("done")) for rows in seg["logs"]]
    seg["accepted"] = [[r for r in rows if key_of(r) <= ckpt] for rows in seg["logs"]]
    return ckpt


def soak(args: argparse.Namespace, work: Path, tag: str) -> dict[str, Any]:
    """All segments until every epoch is done (or the segment cap is reached)."""
    resource_tracker.ensure_running()
    exclude = {os.getpid(), resource_tracker._resource_tracker._pid}  # type: ignore[attr-defined]
    faults, ckpt, states = schedule(args.epochs, args.every, args.kinds), (-1, DONE), None
    segments: list[dict[str, Any]] = []
    while ckpt < (args.epochs - 1, DONE) and len(segments) < len(faults) + 3:
        start_epoch = ckpt[0] + 1 if ckpt[1] == DONE else ckpt[0]
        fault = next((f for f in faults if f["epoch"] >= start_epoch and not f.get("used")), None)
        if fault:
            fault["used"] = True
        seg_in = {"n": args.n, "epochs": args.epochs, "start_epoch": start_epoch, "resume": states,
                  "fault": fault, "armed": str(work / f"armed{len(segments)}")}
        seg = run_segment(len(segments), seg_in, work, tag, exclude)
        seg["resumed_from"] = list(ckpt)
        ckpt = accept(seg, ckpt)
        states = resume_states(seg["logs"], ckpt)
        segments.append(seg)
        progress(seg)
    now = shm_entries()
    for seg in segments:  # a SIGKILLed rank's semaphores stay until this process's resource tracker exits
        seg["semaphores_at_end"] = sorted(set(seg["semaphores_new"]) & now)
    seen = sorted(set().union(*(s["seen"] for s in segments)))
    return {"segments": segments, "faults": faults, "finished": ckpt >= (args.epochs - 1, DONE), "seen": seen}


def progress(seg: dict[str, Any]) -> None:
    """A line per segment, as it ends."""
    f = seg["fault"]
    what = f"{f['kind']} on rank {f['victim']} at epoch {f['epoch']} step >= {f['step']}" if f else "no fault"
    errs = ", ".join(f"r{o['rank']}: {o['error']} ({o.get('latency_s', '-')} s)" for o in seg["outcomes"])
    print(f"segment {seg['no']}: from {fmt_key(seg['resumed_from'])} {what} -> {errs}; checkpoint "
          f"{fmt_key(seg['checkpoint'])}; {seg['seconds']} s{'; HUNG' if seg['hung'] else ''}", flush=True)


def fmt_key(key: list[int] | Key) -> str:
    """(epoch, step) as text."""
    if key[0] < 0:
        return "start"
    return f"end of epoch {key[0]}" if key[1] == DONE else f"epoch {key[0]} step {key[1]}"


# ----------------------------------------------------------------------------- figures


def coverage(segments: list[dict[str, Any]], n: int, epochs: int) -> list[dict[str, Any]]:
    """Per epoch: indices trained (accepted steps of every segment and rank), lost, duplicated."""
    rows = []
    for epoch in range(epochs):
        seen: Counter[int] = Counter()
        steps = [0] * WORLD
        for seg in segments:
            for rank, acc in enumerate(seg["accepted"]):
                for r in acc:
                    if r["epoch"] == epoch and not r.get("done"):
                        seen.update(r["indices"])
                        steps[rank] = max(steps[rank], r["step"])
        rows.append({"epoch": epoch, "steps": steps, "trained": sum(seen.values()), "unique": len(seen),
                     "lost": sorted(set(range(n)) - set(seen))[:50], "n_lost": len(set(range(n)) - set(seen)),
                     "n_duplicated": sum(1 for k in seen.values() if k > 1),
                     "duplicated": sorted(i for i, k in seen.items() if k > 1)[:50]})
    return rows


def epoch_resources(segments: list[dict[str, Any]], epochs: int) -> dict[int, dict[str, Any]]:
    """Per epoch: the segment that finished it, and per rank the collate RSS (MB) and fds after it."""
    res: dict[int, dict[str, Any]] = {}
    for seg in segments:
        for rank, acc in enumerate(seg["accepted"]):
            for r in acc:
                if r.get("done"):
                    e = res.setdefault(r["epoch"], {"segment": seg["no"], "rss_mb": [None] * WORLD,
                                                    "fds": [None] * WORLD})
                    e["rss_mb"][rank] = round(r["rss_kb"] / 1024, 1)
                    e["fds"][rank] = r["fds"]
    return res


def segment_trends(seg: dict[str, Any]) -> dict[str, Any]:
    """Within one segment, per rank: fd growth after the first epoch, collate RSS series and flatness."""
    fd_growth, rss, flat = [], [], []
    for rows in seg["logs"]:
        done = [r for r in rows if r.get("done")]
        fds = [r["fds"] for r in done]
        series = [r["rss_kb"] for r in done]
        fd_growth.append(max(fds) - fds[0] if fds else 0)
        rss.append([round(x / 1024, 1) for x in series])
        if len(series) >= 3:  # the first epoch is warm-up
            base, last = series[1], series[-1]
            flat.append(abs(last - base) <= max(RSS_SLACK[0] * base, RSS_SLACK[1]))
        else:
            flat.append(True)
    return {"fd_growth": fd_growth, "rss_mb": rss, "rss_flat": flat}


def fault_rows(segments: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per faulted segment: what each rank raised, how fast, as expected or not."""
    rows = []
    for seg in segments:
        if seg["fault"] is None:
            continue
        ranks = []
        for o, want in zip(seg["outcomes"], seg["expected"]):
            ok = (o["error"] == want and o["typed"] and o.get("latency_s", 0) <= QUICK
                  and o["exitcode"] in (0, -9) and o.get("error_rank", o["rank"]) in (o["rank"], None))
            ranks.append({"rank": o["rank"], "error": o["error"], "expected": want, "latency_s": o.get("latency_s"),
                          "exitcode": o["exitcode"], "error_rank": o.get("error_rank"), "ok": ok,
                          "message": o.get("message", "")[:500]})
        rows.append({**seg["fault"], "segment": seg["no"], "hit": seg["fault_hit"], "ranks": ranks,
                     "resume_from": seg["checkpoint"], "replayed_steps": seg["replayed_steps"]})
    return rows


def summarise(run: dict[str, Any], args: argparse.Namespace, seconds: float) -> dict[str, Any]:
    """The report: figures, problems and a verdict (the outer process adds what was left after the run)."""
    segments = run["segments"]
    cov = coverage(segments, args.n, args.epochs)
    trends = [segment_trends(s) for s in segments]
    faults = fault_rows(segments)
    problems = problem_list(run, cov, trends, faults)
    res = epoch_resources(segments, args.epochs)
    for row in cov:
        row.update(res.get(row["epoch"], {"segment": None, "rss_mb": [None] * WORLD, "fds": [None] * WORLD}))
    seg_rows = [{"segment": s["no"], "from": fmt_key(s["resumed_from"]), "to": fmt_key(s["checkpoint"]),
                 "seconds": s["seconds"], "hung": s["hung"], "processes_left": s["processes_left"],
                 "shm_new": s["shm_new"], "semaphores_new": len(s["semaphores_new"]),
                 "others_new": len(s["others_new"]),
                 "semaphores_at_end": len(s["semaphores_at_end"]),
                 "continuity": s["continuity"], **t} for s, t in zip(segments, trends)]
    return {"config": {"world": WORLD, "epochs": args.epochs, "n": args.n, "token_budget": BUDGET, "buffer_size": 32,
                       "num_workers": 1, "timeout": TIMEOUT, "every": args.every, "kinds": list(args.kinds)},
            "seconds": round(seconds, 1), "finished": run["finished"], "epochs": cov, "faults": faults,
            "segments": seg_rows, "problems": problems, "shm_seen": run["seen"],
            "totals": {"lost": sum(r["n_lost"] for r in cov), "duplicated": sum(r["n_duplicated"] for r in cov),
                       "processes_left": sum(len(s["processes_left"]) for s in segments),
                       "shm_left": sum(len(s["shm_new"]) for s in segments)}}


def problem_list(run: dict[str, Any], cov: list[dict[str, Any]], trends: list[dict[str, Any]],
                 faults: list[dict[str, Any]]) -> list[str]:
    """Everything that breaks a promise, one line each."""
    p = [] if run["finished"] else ["the run did not finish every epoch"]
    p += [f"epoch {r['epoch']}: {r['n_lost']} lost {r['lost'][:10]}" for r in cov if r["n_lost"]]
    p += [f"epoch {r['epoch']}: {r['n_duplicated']} duplicated {r['duplicated'][:10]}" for r in cov if r["n_duplicated"]]
    p += [f"epoch {r['epoch']}: unequal step counts {r['steps']}" for r in cov if len(set(r["steps"])) > 1]
    for s, t in zip(run["segments"], trends):
        p += [f"segment {s['no']}: hung (killed after the limit)"] * s["hung"]
        p += [f"segment {s['no']}: processes left {s['processes_left']}"] * bool(s["processes_left"])
        p += [f"segment {s['no']}: /dev/shm entries left {s['shm_new']}"] * bool(s["shm_new"])
        killed = sum(o["exitcode"] == -9 for o in s["outcomes"])
        if len(s["semaphores_new"]) > 6 * killed:
            p.append(f"segment {s['no']}: {len(s['semaphores_new'])} semaphores left with {killed} rank(s) killed")
        p += [f"segment {s['no']} rank {r}: {e}" for r, errs in enumerate(s["continuity"]) for e in errs]
        p += [f"segment {s['no']} rank {r}: fds grew by {g}" for r, g in enumerate(t["fd_growth"]) if g > 0]
        p += [f"segment {s['no']} rank {r}: collate RSS not flat {t['rss_mb'][r]}"
              for r, ok in enumerate(t["rss_flat"]) if not ok]
        p += [f"segment {s['no']} rank {r}: a batch's idx differs from step_info.indices"
              for r, rows in enumerate(s["logs"]) if not all(x.get("batch_matches", True) for x in rows)]
        if s["fault"] is None and any(o["error"] for o in s["outcomes"]):
            p.append(f"segment {s['no']}: error without a fault {[o['error'] for o in s['outcomes']]}")
    for f in faults:
        if f["hit"] is None:
            p.append(f"fault {f['kind']} at epoch {f['epoch']} was never injected")
        p += [f"fault {f['kind']} at epoch {f['epoch']}, rank {r['rank']}: {r['error']} (expected {r['expected']}, "
              f"{r['latency_s']} s, exit {r['exitcode']}, names rank {r['error_rank']}): {r['message'][:240]!r}"
              for r in f["ranks"] if not r["ok"]]
    return p


# ----------------------------------------------------------------------------- report


def print_report(rep: dict[str, Any]) -> None:
    """The tables and the verdict."""
    c = rep["config"]
    print(f"\nODB soak under faults: W={c['world']}, {c['epochs']} epochs of {c['n']} samples, budget "
          f"{c['token_budget']}, buffer {c['buffer_size']}, {c['num_workers']} worker, timeout {c['timeout']:.0f} s")
    print("\nfault           epoch victim at-step  each rank's error (s from the fault)               resume from       "
          "replayed steps")
    for f in rep["faults"]:
        at = f["hit"]["step"] if f["hit"] else "-"
        errs = "; ".join(f"r{r['rank']} {r['error']} ({r['latency_s']})" + ("" if r["ok"] else " !")
                         for r in f["ranks"])
        print(f"{f['kind']:<15} {f['epoch']:>5} {f['victim']:>6} {at!s:>7}  {errs:<52} "
              f"{fmt_key(f['resume_from']):<17} {f['replayed_steps']}")
    print("\nepoch seg  steps   trained unique lost dup  collate RSS MB (r0, r1)  fds (r0, r1)")
    for r in rep["epochs"]:
        print(f"{r['epoch']:>5} {r['segment']!s:>3}  {str(r['steps']):<8} {r['trained']:>6} {r['unique']:>6} "
              f"{r['n_lost']:>4} {r['n_duplicated']:>3}  {str(r['rss_mb']):<24} {r['fds']}")
    print("\nsegment  from                to                 s     procs left  shm left  sems  fd growth  RSS flat")
    for s in rep["segments"]:
        print(f"{s['segment']:>7}  {s['from']:<19} {s['to']:<18} {s['seconds']:>5}  {len(s['processes_left']):>10}  "
              f"{len(s['shm_new']):>8}  {s['semaphores_new']:>4}  {str(s['fd_growth']):<9}  {s['rss_flat']}")
    print("(sems: this run's named semaphores left after the segment: a SIGKILLed rank cannot unlink its loader's\n"
          " queues' 6; the run's resource tracker does when it exits, checked below)")
    print_rss(rep)
    after = rep.get("after_run", {})
    print(f"\nafter the run: processes left {len(after.get('processes', []))}, /dev/shm entries left "
          f"{len(after.get('shm', []))} {after.get('shm', [])[:6]}")
    for p in rep["problems"]:
        print(f"PROBLEM: {p}")
    print(verdict(rep))


def print_rss(rep: dict[str, Any]) -> None:
    """The collate process's RSS over the run, per rank (a new process per segment)."""
    for rank in range(rep["config"]["world"]):
        series = [r["rss_mb"][rank] for r in rep["epochs"] if r["rss_mb"][rank] is not None]
        if series:
            print(f"collate RSS rank {rank} (MB, per epoch): first {series[0]}, last {series[-1]}, "
                  f"min {min(series)}, max {max(series)}")


def verdict(rep: dict[str, Any]) -> str:
    """One line."""
    t, after = rep["totals"], rep.get("after_run", {})
    left = len(after.get("processes", [])) + len(after.get("shm", []))
    head = "PASS" if not rep["problems"] else "FAIL"
    return (f"{head}: {len(rep['faults'])} faults over {rep['config']['epochs']} epochs in {rep['seconds']:.0f} s; "
            f"lost {t['lost']}, duplicated {t['duplicated']}, processes left {t['processes_left']}, "
            f"shm left {t['shm_left']}, left after the run {left}; {len(rep['problems'])} problem(s)")


def inner(args: argparse.Namespace) -> None:
    """The run itself (a child of :func:`outer`, tagged): writes the report to ``args.inner``."""
    tag = os.environ[TAG]
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="odb-soak-") as tmpdir:
        run = soak(args, Path(tmpdir), tag)
    Path(args.inner).write_text(json.dumps(summarise(run, args, time.time() - t0)))


def outer(args: argparse.Namespace) -> int:
    """Run :func:`inner` as a tagged child, then check what outlived it (its resource tracker
    included, which unlinks a SIGKILLed rank's semaphores when it exits)."""
    tag, shm_before, t0 = uuid.uuid4().hex, shm_entries(), time.time()
    with tempfile.TemporaryDirectory(prefix="odb-soak-report-") as tmpdir:
        report_path = Path(tmpdir, "report.json")
        cmd = [sys.executable, __file__, "--inner", str(report_path), "--epochs", str(args.epochs),
               "--n", str(args.n), "--every", str(args.every), "--kinds", ",".join(args.kinds)]
        env = {**os.environ, TAG: tag, "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen(cmd, env=env, stdout=sys.stderr if args.json else None, start_new_session=True)
        try:
            proc.wait(timeout=args.limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        left = reap_leftovers(tag, {os.getpid()})
        new_shm = shm_entries() - shm_before
        if not report_path.exists():
            print(f"FAIL: the soak run ended without a report (exit code {proc.returncode}); left {left} "
                  f"{sorted(new_shm)}")
            return 1
        rep = json.loads(report_path.read_text())
    shm_left = sorted(new_shm & set(rep["shm_seen"]))  # the run's own; others' runs may come and go meanwhile
    rep["after_run"] = {"processes": left, "shm": shm_left, "others_shm": sorted(new_shm - set(rep["shm_seen"])),
                        "seconds": round(time.time() - t0, 1)}
    rep["problems"] += [f"after the run: process left {p}" for p in left]
    rep["problems"] += [f"after the run: /dev/shm entry left {s}" for s in shm_left]
    rep["verdict"] = verdict(rep)
    print(json.dumps(rep)) if args.json else print_report(rep)
    return 1 if rep["problems"] else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--n", type=int, default=400, help="dataset size (a multiple of W: no sampler padding)")
    parser.add_argument("--every", type=int, default=4, help="a fault every this many epochs, from epoch 3")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"faults to cycle through (of {', '.join(KINDS)})")
    parser.add_argument("--limit", type=float, default=1800.0, help="hard limit for the whole run (s)")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    parser.add_argument("--inner", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.n % WORLD:
        parser.error(f"--n must be a multiple of {WORLD}")
    args.kinds = tuple(k for k in args.kinds.split(",") if k)
    if not args.kinds or not set(args.kinds) <= set(KINDS):
        parser.error(f"--kinds: a comma-separated list of {', '.join(KINDS)}")
    if args.inner:
        inner(args)
        return
    sys.exit(outer(args))


if __name__ == "__main__":
    main()
