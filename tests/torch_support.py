"""Module-level helpers for the multi-process torch tests (spawn needs them importable)."""

from __future__ import annotations

import json
import os
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Dataset, IterableDataset

from odb_torch import ODBDataLoader, pad_collate
from odb_torch.ports import await_listener


def sample_length(i: int) -> int:
    """A heavy-tailed, deterministic length for index i (1..300; budget 128 makes some over-budget)."""
    return 1 + (i * 7919) % 97 if i % 11 else 120 + (i * 31) % 180


class ToyDataset(Dataset):  # type: ignore[type-arg]
    """Token samples; ``fail`` maps an index to the failure it triggers."""

    def __init__(self, n: int, fail: dict[int, str] | None = None, length: int | None = None) -> None:
        self.n = n
        self.fail = fail or {}
        self.length = length  # every sample this long; None: sample_length(i)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        if self.fail.get(i) == "getitem":
            raise ValueError(f"corrupt record {i}")
        if self.fail.get(i) == "die" and torch.utils.data.get_worker_info() is not None:
            os.kill(os.getpid(), 9)  # a DataLoader worker dies mid-epoch
        length = 0 if self.fail.get(i) == "empty" else sample_length(i) if self.length is None else self.length
        ids = (torch.arange(length) * (i + 3)) % 50
        labels = ids.clone()
        labels[: length // 3] = -100
        sample = {"input_ids": ids, "labels": labels, "idx": i}
        if self.fail.get(i) == "nolength":
            del sample["input_ids"]
        return sample


class ShardSampler:
    """A fixed shard of indices per rank (shards of any sizes); ``set_epoch`` is a no-op."""

    def __init__(self, indices: list[int]) -> None:
        self.indices = indices

    def __iter__(self) -> Any:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)

    def set_epoch(self, epoch: int) -> None:
        pass


def tuple_collate(samples: list[dict[str, Any]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, idx) as a tuple."""
    batch = pad_collate(samples)
    return batch["input_ids"], batch["idx"]


def tensor_collate(samples: list[dict[str, Any]]) -> torch.Tensor:
    """Just the padded input_ids tensor."""
    return pad_collate(samples)["input_ids"]


def failing_collate(samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Fails on any group containing index 13."""
    if any(s["idx"] == 13 for s in samples):
        raise RuntimeError("cannot collate 13")
    return pad_collate(samples)


class TinyLM(torch.nn.Module):
    """Embedding + linear head in float64: per-token cross-entropy."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(50, 8, dtype=torch.float64)
        self.head = torch.nn.Linear(8, 50, dtype=torch.float64)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Sum of per-token cross-entropy over the batch's loss tokens."""
        logits = self.head(self.emb(batch["input_ids"]))
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 50), batch["labels"].reshape(-1),
                                                 ignore_index=-100, reduction="sum")


def _tail_options(task: dict[str, Any]) -> dict[str, Any]:
    """The task's shared-tail keywords, only where it sets them (the loader's defaults otherwise)."""
    return {k: task[k] for k in ("shared_tail", "reserve_divisor") if k in task}


class ToyStream(IterableDataset):  # type: ignore[type-arg]
    """ToyDataset's samples as a stream (an IterableDataset: the loader reads it in order)."""

    def __init__(self, n: int) -> None:
        self.toy = ToyDataset(n)

    def __iter__(self) -> Any:
        return (self.toy[i] for i in range(len(self.toy)))


def _sampler(task: dict[str, Any], dataset: Any, rank: int) -> Any:
    """The task's own sampler: its fixed shard, or a DistributedSampler with its ``drop_last``; None: the loader's."""
    if "shards" in task:
        return ShardSampler(task["shards"][rank])
    if "drop_last" in task:
        from torch.utils.data import DistributedSampler

        return DistributedSampler(dataset, num_replicas=dist.get_world_size(), rank=rank, seed=task.get("seed", 0),
                                  drop_last=task["drop_last"])
    return None


def build_loader(task: dict[str, Any], rank: int, port: int) -> tuple[ODBDataLoader, Any]:
    """The task's loader over its ToyDataset (or its stream), and a factory of the same loader class for a resume."""
    dataset: Any = ToyDataset(task["n"], {int(k): v for k, v in task.get("fail", {}).items()}, task.get("length"))
    if task.get("stream"):
        dataset = ToyStream(task["n"])
    collate = {"failing": failing_collate, "tuple": tuple_collate, "tensor": tensor_collate}.get(
        task.get("collate", ""), pad_collate)
    loader_cls = ODBDataLoader
    if "driver" in task:  # a seeded bug of the epoch loop (model_checks.mutants)
        from model_checks.mutants import driver

        loader_cls = type("MutantLoader", (ODBDataLoader,), {"driver_cls": driver(task["driver"])})
    loader = loader_cls(dataset, token_budget=128, collate_fn=collate, buffer_size=task.get("buffer", 16),
                        budget=task.get("budget", "padded"),
                        num_workers=task.get("workers", 0), seed=task.get("seed", 0),
                        init_method=f"tcp://127.0.0.1:{port + 1}", timeout=task.get("timeout", 60),
                        start_method=task.get("start_method", "auto"), mode=task.get("mode", "join"),
                        sampler=_sampler(task, dataset, rank),
                        skip_idle=task.get("skip_idle", False), shuffle=task.get("shuffle", True),
                        target_policy=task.get("target_policy", "balanced"),
                        queue_size=task.get("queue_size", 8), **_tail_options(task))

    def resumed() -> ODBDataLoader:  # the resume's fresh loader: no workers, a port of its own
        return loader_cls(dataset, token_budget=128, collate_fn=collate, buffer_size=task.get("buffer", 16),
                          budget=task.get("budget", "padded"), num_workers=0,
                          init_method=f"tcp://127.0.0.1:{port + 2}", timeout=60,
                          **({"shared_tail": task["shared_tail"]} if "shared_tail" in task else {}))

    return loader, resumed


def audit_epochs(loader: ODBDataLoader, task: dict[str, Any], result: dict[str, Any]) -> None:
    """Every step of ``task["epochs"]`` epochs (ids, idle, shapes, budgets), and the open file
    descriptors after each epoch."""
    result["epochs"] = []
    for epoch in range(task["epochs"]):
        loader.set_epoch(epoch)
        steps = []
        for batch in loader:
            info = loader.step_info
            if task.get("collate") in ("tuple", "tensor"):
                ids = [] if info.is_idle else list(info.indices)
                width = (batch[0] if isinstance(batch, tuple) else batch).shape
                steps.append({"ids": ids, "idle": info.is_idle, "shape": list(width)})
                continue
            ids = [] if info.is_idle else batch["idx"].tolist()
            assert ids == list(info.indices)
            steps.append({"ids": ids, "idle": info.is_idle, "step": info.step, "global": info.global_samples,
                          "tokens": int(batch["input_ids"].numel()), "size": len(batch["idx"]),
                          "longest": int(batch["input_ids"].shape[1]), "over": info.over_budget})
        result["epochs"].append(steps)
        result.setdefault("fds_after_epoch", []).append(len(os.listdir("/proc/self/fd")))


def resume_run(loader: ODBDataLoader, task: dict[str, Any], resumed: Any, result: dict[str, Any]) -> None:
    """Epoch 1 cut after ``task["stop_after"]`` steps (or the first pool claim), its state through
    JSON as a checkpoint stores it, and the rest of the epoch from a fresh loader."""
    loader.set_epoch(1)
    before = []
    for k, _batch in enumerate(loader):
        before.append(list(loader.step_info.indices))
        if k + 1 == task["stop_after"] or task["stop_after"] == "pool" and pool_claimed(loader):
            break
    state = json.loads(json.dumps(loader.state_dict()))
    loader.close()
    again = resumed()
    try:
        again.load_state_dict(state)
        after = [list(again.step_info.indices) for _ in again]
    finally:
        again.close()
    result.update(before=before, after=after, state=state)


def abandon_run(loader: ODBDataLoader, result: dict[str, Any]) -> None:
    """Epoch 0 left after two steps (as ``max_steps`` does), then the whole of epoch 1."""
    loader.set_epoch(0)
    for k, _ in enumerate(loader):
        if k == 1:
            break
    loader.set_epoch(1)
    result["epoch1"] = [(loader.step_info.epoch, list(loader.step_info.indices)) for _ in loader]


def fault_run(loader: ODBDataLoader, task: dict[str, Any], rank: int) -> None:
    """The victim rank's fault at its third step: its collate process killed, itself killed, or stalled."""
    loader.set_epoch(0)
    for k, _ in enumerate(loader):
        if k == 2 and rank == task["victim"]:
            if task["fault"] == "kill_collate":
                os.kill(loader._proc.pid, 9)
            elif task["fault"] == "kill_rank":
                os.kill(os.getpid(), 9)
            elif task["fault"] == "stall":
                import time
                time.sleep(task["timeout"] * 3)


def run_task(loader: ODBDataLoader, task: dict[str, Any], rank: int, world: int, resumed: Any,
             result: dict[str, Any]) -> None:
    """The task's loop over ``loader`` (its ``kind``), its findings put into ``result``."""
    kind = task["kind"]
    if kind == "audit":
        audit_epochs(loader, task, result)
    elif kind == "join":
        result["epochs"], result["states"] = join_epochs(loader, task["epochs"])
    elif kind == "grad":
        result["max_err"] = grad_check(loader, world)
    elif kind == "resume":
        resume_run(loader, task, resumed, result)
    elif kind == "elastic":
        result.update(elastic_stage(loader, task, rank))
    elif kind == "abandon":
        abandon_run(loader, result)
    elif kind == "fault":
        fault_run(loader, task, rank)


def rank_main(rank: int, world: int, port: int, out_dir: str, task: dict[str, Any]) -> None:
    """One trainer rank: a Gloo trainer group, an ODBDataLoader, and the task's loop."""
    result: dict[str, Any] = {"rank": rank}
    task = {**task, **task.get("per_rank", {}).get(str(rank), {})}  # ranks that disagree, on purpose
    try:
        init_gloo(rank, world, port)
        loader, resumed = build_loader(task, rank, port)
        try:
            run_task(loader, task, rank, world, resumed, result)
        finally:
            loader.close()
    except Exception as exc:
        record_error(result, exc)
    finish_rank(result, out_dir, rank)


def init_gloo(rank: int, world: int, port: int, seconds: float = 60) -> None:
    """The ranks' Gloo trainer group at ``tcp://127.0.0.1:port``; the other ranks first wait for
    rank 0's store to listen (its client's connect retries would otherwise add 0.3-0.8 s to a
    start that finds no server yet, ``odb_torch.ports.await_listener``)."""
    if rank:
        await_listener("127.0.0.1", port, seconds)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=seconds))


def fork_two_ranks(target: Any, out: Path, timeout: float = 120) -> list[Any]:
    """Run ``target(rank, port, str(out))`` in two forked processes (a W=2 group on a free port);
    each must exit 0 within ``timeout`` (killed otherwise); their ``out/rank{r}.json``, loaded."""
    import json
    import multiprocessing

    from odb_torch.ports import free_port

    port, ctx = free_port(), multiprocessing.get_context("fork")
    procs = [ctx.Process(target=target, args=(r, port, str(out))) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def record_error(result: dict[str, Any], exc: Exception) -> None:
    """Put the rank's error (type, message, traceback) into its result, for the test to check."""
    result["error"] = type(exc).__name__
    result["message"] = str(exc)
    result["trace"] = traceback.format_exc()


def finish_rank(result: dict[str, Any], out_dir: str, rank: int) -> None:
    """Write the rank's result to ``out_dir/rank<r>.json`` and leave the process group."""
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    try:
        dist.destroy_process_group()
    except Exception:
        pass


def pool_claimed(loader: ODBDataLoader) -> bool:
    """The step after the last claim of the pool: the same step on every rank (the pool's cursor
    is every rank's at a step); some claimed views are usually yielded by then, the last not yet."""
    state = loader.state_dict()
    return bool(state["pool_size"]) and state["pool_cursor"] == state["pool_size"]


def elastic_stage(loader: ODBDataLoader, task: dict[str, Any], rank: int) -> dict[str, Any]:
    """One run of an epoch cut across world sizes: resume from every rank's state in
    ``task["load"]`` (if given; a single rank's state of the other world is refused first), run
    to ``stop_after`` steps or the end, save this rank's state into ``task["save"]`` (if given)."""
    from odb_core.errors import ResumeStateError

    out: dict[str, Any] = {}
    loader.set_epoch(1)
    if task.get("load"):
        states = [json.loads(p.read_text()) for p in sorted(Path(task["load"]).glob("state_rank*.json"))]
        try:
            loader.load_state_dict(states[0])
        except ResumeStateError as exc:
            out["single_state_refused"] = exc.field
        loader.load_state_dict(states)
    steps = []
    for k, _ in enumerate(loader):
        steps.append([loader.step_info.step, list(loader.step_info.indices)])
        if k + 1 == task.get("stop_after") or task.get("stop_after") == "pool" and pool_claimed(loader):
            break
    if task.get("save"):
        state = loader.state_dict()
        Path(task["save"], f"state_rank{rank}.json").write_text(json.dumps(state))
        out["saved_steps"] = state["steps"]
    return {**out, "steps": steps}


def join_epochs(loader: ODBDataLoader, epochs: int) -> tuple[list[list[list[int]]], list[dict[str, Any]]]:
    """Train a DDP TinyLM under torch's ``Join`` with ``skip_idle`` batches; per epoch, the
    indices of every batch this rank trained, and the loader's state after the epoch."""
    from torch.distributed.algorithms.join import Join

    ddp = torch.nn.parallel.DistributedDataParallel(TinyLM())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    trained: list[list[list[int]]] = []
    states: list[dict[str, Any]] = []
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        steps: list[list[int]] = []
        with Join([ddp]):
            for batch in loader:
                info = loader.step_info
                assert not info.is_idle, "skip_idle yields no idle batch"
                (ddp(batch) / max(info.local_tokens, 1) * info.loss_scale).backward()
                opt.step()
                opt.zero_grad()
                steps.append(batch["idx"].tolist())
        trained.append(steps)
        states.append(loader.state_dict())  # after the Join: every rank's loop is over
    return trained, states


def grad_check(loader: ODBDataLoader, world: int) -> float:
    """Per step: DDP gradient of (local mean loss x loss_scale) vs the single-process
    per-token-mean gradient over every rank's batch of that step; returns the max error."""
    model = TinyLM()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    reference = TinyLM()
    worst = 0.0
    for batch in loader:
        info = loader.step_info
        ddp.zero_grad()
        local_mean = ddp(batch) / max(info.local_tokens, 1)  # idle steps: 0 tokens, loss_scale 0
        (local_mean * info.loss_scale).backward()
        batches: list[Any] = [None] * world
        dist.all_gather_object(batches, None if info.is_idle else batch)
        reference.zero_grad()
        total = sum(reference(b) for b in batches if b is not None)
        (total / info.global_tokens).backward()  # type: ignore[operator]
        for p, q in zip(model.parameters(), reference.parameters()):
            worst = max(worst, float((p.grad - q.grad).abs().max()))
        with torch.no_grad():  # keep both models identical
            for p, q in zip(model.parameters(), reference.parameters()):
                p -= 0.1 * p.grad
                q.copy_(p)
    return worst


def forked_rank(rank: int, target: Any, env: dict[str, str], cwd: str, log_dir: str, *args: Any) -> None:
    """Run ``target(rank, *args)`` in a rank forked from the forkserver as if it had been spawned
    now: this process's environment and working directory, in a session of its own (so that
    :func:`leftover_processes` finds what it forks, whose ``/proc`` environment is the
    forkserver's), its output in ``log_dir/rank<r>.log``."""
    from multiprocessing import forkserver

    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    os.setsid()
    # the forkserver exits when every copy of its "alive" pipe is closed: drop the rank's copy (its
    # children would inherit it), so that if pytest dies the forkserver does, and the rank gets the
    # SIGINT torch's start_processes asks for on its parent's death, as a spawned rank did
    alive = forkserver._forkserver._forkserver_alive_fd  # type: ignore[attr-defined]
    if alive is not None:
        os.close(alive)
        forkserver._forkserver._forkserver_alive_fd = None  # type: ignore[attr-defined]
    log = os.open(os.path.join(log_dir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    target(rank, *args)


def leftover_processes(tag: str, sessions: frozenset[int] = frozenset()) -> list[int]:
    """PIDs of live processes whose environment carries ``ODB_TEST_TAG=tag`` or that belong to
    one of ``sessions`` (session ids: the PIDs of :func:`forked_rank` ranks)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            env = Path("/proc", pid, "environ").read_bytes()
            stat = Path("/proc", pid, "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        state, session = stat[0], int(stat[3])
        if (f"ODB_TEST_TAG={tag}".encode() in env.split(b"\0") or session in sessions) and state != "Z":
            found.append(int(pid))
    return found


def describe(pid: int) -> str:
    """The command line of a process, for failure messages."""
    try:
        return Path("/proc", str(pid), "cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
    except OSError:
        return "?"


def wait_for_no_leftovers(tag: str, grace: float = 15.0, sessions: frozenset[int] = frozenset()) -> list[int]:
    """Poll until no tagged process (nor one in ``sessions``) is alive, up to ``grace`` seconds
    (helper processes such as multiprocessing's resource tracker exit just after their parent)."""
    import time

    deadline = time.monotonic() + grace
    while True:
        found = leftover_processes(tag, sessions)
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def run_torchrun(script: Path, args: list[str], nproc: int, timeout: float = 240, fails: bool = False) -> str:
    """Run ``script`` under torchrun on one node with ``nproc`` processes (a fresh port, a tag in
    the environment); fail with its log unless it exits 0 (``fails``: not 0) and leaves no
    process behind."""
    import signal
    import subprocess
    import sys
    import uuid

    from odb_torch.ports import free_port

    tag = uuid.uuid4().hex
    env = {**os.environ, "ODB_TEST_TAG": tag, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port(3)), str(script), *args]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        log = proc.communicate(timeout=timeout)[0].decode(errors="replace")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert (proc.returncode != 0) == fails, log[-6000:]
    leftovers = wait_for_no_leftovers(tag)
    assert not leftovers, f"processes left behind: {leftovers}"
    return log


def trained(ranks: list[dict[str, Any]], keep: Any = lambda rec: True) -> dict[int, list[int]]:
    """Dataset indices trained per epoch over every rank's micro-batch records (padding and idle excluded)."""
    from collections import defaultdict

    per_epoch: dict[int, list[int]] = defaultdict(list)
    for records in ranks:
        for rec in records:
            if not rec["padding"] and not rec["idle"] and keep(rec):
                per_epoch[rec["epoch"]].extend(rec["indices"])
    return per_epoch


def check_windows(ranks: list[list[dict[str, Any]]], accum: int | None = None) -> None:
    """P2: every rank trains the same number of micro-batches per update (``accum`` when given);
    P7: the loss weights of each update, over every rank, sum to exactly one."""
    import math
    from collections import defaultdict

    world = len(ranks)
    by_update: dict[int, list[list[dict[str, Any]]]] = defaultdict(lambda: [[] for _ in ranks])
    for r, records in enumerate(ranks):
        for rec in records:
            by_update[rec["update"]][r].append(rec)
    for update, per_rank in by_update.items():
        sizes = [len(recs) for recs in per_rank]
        assert len(set(sizes)) == 1 and (accum is None or sizes[0] == accum), (
            f"P2: update {update} had micro-batches {sizes} per rank")
        share = sum(rec["local_tokens"] * rec["multiplier"] for recs in per_rank for rec in recs) / world
        assert math.isclose(share, 1.0, rel_tol=1e-12), f"P7: update {update} weights sum to {share}, not 1"


def every_token_counts(sample: dict[str, Any]) -> int:
    """Every position as a loss token (a wrong count for a causal loss over masked labels, on purpose)."""
    return len(sample["input_ids"])


def check_resume_exactly_once(before: dict[int, list[int]], after: dict[int, list[int]], n: int,
                              epochs: tuple[int, ...] = (0, 1)) -> None:
    """P4 across a crash and a resume: per epoch, the indices trained before the checkpoint plus
    those trained after the resume are each of ``range(n)`` exactly once."""
    for epoch in epochs:
        ids = before.get(epoch, []) + after.get(epoch, [])
        twice = sorted({i for i in ids if ids.count(i) > 1})
        missing = sorted(set(range(n)) - set(ids))
        assert not twice and not missing, f"P4 across the resume, epoch {epoch}: twice {twice}, lost {missing}"


def check_linear_lr_by_samples(points: list[dict[str, Any]], lr: float, total: int, warmup: int) -> None:
    """The LR after every update is a linear warmup-then-decay schedule evaluated at the samples seen."""
    import math

    for point in points:
        seen = point["samples_seen"]
        factor = seen / warmup if seen < warmup else max(0.0, (total - seen) / (total - warmup))
        assert math.isclose(point["lr"], lr * factor, rel_tol=1e-9, abs_tol=1e-15), (
            f"LR after update {point['update']} is {point['lr']}, the linear schedule at {seen} samples "
            f"is {lr * factor}")


def check_real_traces(directory: Path, require: tuple[str, ...] = ("fetch", "drain", "gather"),
                      cut: int | None = 0) -> dict[str, Any]:
    """Merge the per-rank trace logs a traced run wrote (``ODB_TRACE_DIR``) into spec
    behaviours and replay them with TLC, every invariant on every state; fail unless every
    trace is accepted, exactly ``cut`` runs (None: any number; a fault's) have a rank that
    never logged ``end`` (stopped mid-epoch, replayed up to the cut) and the traces together
    exercise ``require``. Returns the coverage."""
    from model_checks.traces import coverage_report, merge_directory, replay

    traces = merge_directory(directory)
    assert traces, f"no trace was written to {directory}"
    stopped = [t.scenario.name for t in traces if not t.complete]
    assert cut is None or len(stopped) == cut, f"{len(stopped)} runs some rank of which never logged 'end', not {cut}: {stopped}"
    verdicts = replay(traces)
    rejected = [v.describe() for v in verdicts if not v.accepted]
    assert not rejected, f"real-run traces rejected by TLC: {rejected}"
    report = coverage_report(traces)
    missing = [k for k in require if not report["total"].get(k)]
    assert not missing, f"the traced runs never exercised {missing}: {report['total']}"
    return report


def leaking_rank_main(rank: int, world: int, port: int, out_dir: str, task: dict[str, Any]) -> None:
    """A seeded bug for the harness: the rank forks a child that outlives it (a fork's
    ``/proc`` environment is the forkserver's, so only the rank's session names it)."""
    import time

    if os.fork() == 0:
        time.sleep(120)
        os._exit(0)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"rank": rank}))
