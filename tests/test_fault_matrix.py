"""The fault matrix: every fault we know of, on real spawned Gloo ranks.

For each fault, asserts which typed error each rank raises, within what bound, naming
which rank and dataset indices; that no process, semaphore or ``/dev/shm`` entry
outlives the run (``run_ranks``); that no sample is yielded twice; and that no rank
ends its epoch "normally" after a fault (nothing silently skipped). The README's
failure table is this matrix.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from fault_support import BAD, fault_rank_main
from test_torch_loader import run_ranks
from torch_support import check_real_traces, describe, wait_for_no_leftovers

from odb_torch.ports import free_port

pytestmark = pytest.mark.timeout(300)

T = 10  # the loaders' timeout (s)
SHORT = 6  # the timeout of the cases that wait it out
QUICK = 15  # seconds within which a fault that needs no timeout is reported


def case(task: dict[str, Any], owner: str, peer: str | None, indices: Any, within: float,
         world: int = 2, **kw: Any) -> Any:
    """A fault case: the owner (rank 0) raises ``owner`` naming ``indices`` (a tuple: exactly
    those; ``...``: a chunk holding the bad index; None: none required), every other rank
    ``peer``, each within ``within`` seconds of the fault (or of the loader's creation)."""
    return pytest.param({"timeout": T, **task}, owner, peer, indices, within, world, kw, id=kw.pop("id"))


def bad(value: str) -> dict[str, Any]:
    """Index 14 misbehaves on rank 0's shard (an even index: rank 0 under the unshuffled sampler)."""
    return {"fail": {str(BAD): value}}


CASES = [
    # data: the owner names the sample; its peer sees the collate group fail
    case(bad("getitem"), "SampleLoadError", "PeerError", (BAD,), QUICK, id="getitem-raises"),
    case({**bad("getitem"), "workers": 2}, "SampleLoadError", "PeerError", (BAD,), QUICK, id="getitem-raises-in-worker"),
    case({**bad("die"), "workers": 1}, "SampleLoadError", "PeerError", "some", QUICK, id="worker-killed"),
    case({**bad("stuck"), "workers": 1, "timeout": SHORT}, "SampleLoadError", "PeerError", ..., 2 * SHORT + 5,
         id="worker-stuck"),
    case({"collate": "failing"}, "CollateFnError", "PeerError", ..., QUICK, id="collate-raises"),
    case({"collate": "unpicklable"}, "CollateFnError", "PeerError", ..., QUICK, id="batch-unpicklable"),
    case({"collate": "generator"}, "CollateFnError", "CollateFnError", None, QUICK, id="every-batch-unpicklable"),
    case(bad("nolength"), "InvalidSampleError", "PeerError", (BAD,), QUICK, id="length-missing"),
    case({"length": "float", "workers": 1}, "InvalidSampleError", "PeerError", (BAD,), QUICK, id="length-float"),
    case({"length": "str"}, "InvalidSampleError", "PeerError", (BAD,), QUICK, id="length-str"),
    case({"length": "none", "workers": 1}, "InvalidSampleError", "PeerError", (BAD,), QUICK, id="length-none"),
    case({"length": "nan"}, "InvalidSampleError", "PeerError", (BAD,), QUICK, id="length-nan"),
    case({"tokens": "excess", "workers": 1}, "InvalidSampleError", "PeerError", (BAD,), QUICK, id="loss-tokens-excess"),
    case({"per_rank": {"1": {"seed": 4}}}, "ConfigMismatchError", "ConfigMismatchError", None, QUICK,
         id="seed-differs", field="seed"),
    case({"per_rank": {"1": {"n": 38}}}, "ConfigMismatchError", "ConfigMismatchError", None, QUICK,
         id="dataset-size-differs", field="dataset_size"),
    # processes: the victim is rank 0, faulted at step FAULT_STEP
    case({"fault": "kill_collate", "workers": 2}, "CollateProcessError", "PeerError", None, QUICK,
         id="collate-process-killed", trace=True, needle="killed by SIGKILL"),
    case({"fault": "kill_rank", "workers": 1}, "no result", "PeerError", None, QUICK, id="rank-killed",
         killed=1, trace=True),
    case({"fault": "stall", "timeout": SHORT}, "PeerError", "PeerError", None, 3 * SHORT + 5, id="rank-stalls",
         trace=True),
    case({"fault": "sigint", "workers": 1}, "KeyboardInterrupt", "PeerError", None, QUICK, id="rank-ctrl-c"),
    case({"fault": "close_next"}, "LoaderStateError", None, None, QUICK, world=1, id="next-after-close"),
    case({"fault": "two_iterators"}, "LoaderStateError", None, None, QUICK, world=1, id="two-live-iterators"),
]


@pytest.mark.parametrize(("task", "owner", "peer", "indices", "within", "world", "kw"), CASES)
def test_fault_is_a_typed_error_on_every_rank_in_bounded_time_leaving_nothing(
        task, owner, peer, indices, within, world, kw, tmp_path):
    task = {"n": 40, "shuffle": False, **task}
    results = run_ranks(world, task, tmp_path, timeout=120, killed_ranks=kw.get("killed", 0),
                        trace=kw.get("trace", False), target=fault_rank_main)
    expected = [owner] + [peer] * (world - 1)
    assert [r.get("error") for r in results] == expected, results
    for r in results:
        if r["error"] == "no result":
            assert r["exitcode"] == -9, r  # the SIGKILLed rank
            continue
        assert r["since_fault"] <= within, f"rank {r['rank']}: {r['error']} after {r['since_fault']:.1f}s > {within}s"
        if r["error"] != "KeyboardInterrupt":
            assert r["error_rank"] == r["rank"], f"the error must name its rank: {r}"
        # the process exited by itself (-9: killed by the harness at its timeout); torch.multiprocessing
        # exits 0 on KeyboardInterrupt
        assert r["exitcode"] == 0, r
        seen = Counter(i for batch in r["yielded"] for i in batch)
        assert not [i for i, k in seen.items() if k > 1], f"rank {r['rank']}: a sample was yielded twice"
    if indices is ...:
        assert BAD in results[0]["error_indices"], results[0]
    elif indices == "some":  # a SIGKILLed worker cannot say which sample it was loading
        assert results[0]["error_indices"] and str(results[0]["error_indices"]) in results[0]["message"]
    elif indices is not None:
        assert tuple(results[0]["error_indices"]) == indices, results[0]
        assert f"sample {indices[0]}" in results[0]["message"] or f"index {indices[0]}" in results[0]["message"]
    if "field" in kw:  # a mismatch: every rank names the field and the other rank, before any batch
        for r in results:
            assert r["error_field"] == kw["field"] and r["error_ranks"] == [1 - r["rank"]], r
            assert r["yielded"] == [], f"rank {r['rank']}: a batch before the mismatch was found"
    if "needle" in kw:
        assert kw["needle"] in results[0]["message"], results[0]
    if kw.get("trace"):
        check_real_traces(tmp_path / "traces", require=("fetch", "gather"), cut=None)  # the run up to the fault


SCRIPT = '''
import os, signal, sys, threading
import torch
from torch.utils.data import Dataset
from odb_torch import ODBDataLoader, pad_collate

signal.signal(signal.SIGINT, signal.default_int_handler)  # as at a terminal, even if started in the background

class Lines(Dataset):
    def __len__(self):
        return 60
    def __getitem__(self, i):
        if HOW == "stuck" and i == 5:
            threading.Event().wait()  # a load that never returns
        return {"input_ids": torch.arange(1 + i % 17)}

def big_collate(samples):
    """A batch over the pipe's 64 KiB: travels inline, so an unread one fills the queue's pipe."""
    return {**pad_collate(samples), "payload": torch.zeros(1 << 16)}

def say_ready():
    from odb_torch.ports import await_listener
    await_listener("127.0.0.1", int(os.environ["ODB_TEST_PORT"]), 60)  # rank 0's store waits for rank 1
    print("ready", flush=True)

def main(how):
    global loader
    options = {"num_workers": 1, "timeout": 20}
    if how == "stuck":  # the collate process itself loads (and hangs); the trainer gives up after 2 x 2 s
        options = {"num_workers": 0, "timeout": 2}
    if how in ("alone", "orphan"):  # rank 0 (1) of 2, whose peer never comes: the rendezvous waits out its 3 s
        options = {"num_workers": 0, "timeout": 3, "rank": 0 if how == "alone" else 1, "world_size": 2,
                   "init_method": "tcp://127.0.0.1:" + os.environ["ODB_TEST_PORT"]}
    if how == "waiting":  # rank 0 of 2, whose peer never comes (timeout 60 s): Ctrl-C while its store waits
        options = {"num_workers": 1, "timeout": 60, "rank": 0, "world_size": 2,
                   "init_method": "tcp://127.0.0.1:" + os.environ["ODB_TEST_PORT"]}
        threading.Thread(target=say_ready, daemon=True).start()
    loader = ODBDataLoader(Lines(), token_budget=64, collate_fn=big_collate if how in ("crash", "break") else pad_collate,
                           start_method=os.environ["ODB_TEST_START"], **options)  # never closed
    for k, batch in enumerate(loader):
        if how == "crash" and k == 2:
            print("crashing", flush=True)
            os._exit(3)  # the trainer dies at once (no cleanup), its collate process mid-epoch
        if how == "break" and k == 2:
            break
        if how == "raise" and k == 2:
            raise RuntimeError("the training step failed")
        if how == "sigint" and k == 2:
            print("ready", flush=True)
            signal.pause()  # a long training step, until the test's Ctrl-C
    print("done", flush=True)

HOW = sys.argv[1] if len(sys.argv) > 1 else "stdin"
if HOW == "stdin" or __name__ == "__main__":
    main(HOW)
'''


def run_script(tmp_path: Path, how: str, start: str, timeout: float = 90,
               times: dict[str, float] | None = None) -> tuple[int, str]:
    """Run SCRIPT as a user would (a file, or ``python - < file`` for ``stdin``), its loader
    started with ``start``, under a hard timeout; SIGINT it once it printed ``ready`` (``times``
    gets ``"exit"``: the seconds from the SIGINT to the script's end).
    Returns (exit code, output) and fails if it hangs or leaves a process behind."""
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    tag = uuid.uuid4().hex
    env = {**os.environ, "ODB_TEST_TAG": tag, "OMP_NUM_THREADS": "1", "ODB_TEST_START": start,
           "ODB_TEST_PORT": str(free_port(1))}
    args = [sys.executable, "-"] if how == "stdin" else [sys.executable, str(path), how]
    proc = subprocess.Popen(args, stdin=path.open() if how == "stdin" else subprocess.DEVNULL, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    started = time.monotonic()
    try:
        if how in ("sigint", "waiting"):
            assert proc.stdout is not None
            first = proc.stdout.readline()
            assert first.strip() == "ready", first
            os.kill(proc.pid, signal.SIGINT)  # to the trainer only, as torchrun forwards it
            signalled = time.monotonic()
        out = proc.communicate(timeout=timeout - (time.monotonic() - started))[0]
        if times is not None and how in ("sigint", "waiting"):
            times["exit"] = time.monotonic() - signalled
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out = proc.communicate()[0]
        pytest.fail(f"the script hung at exit ({how}):\n{out[-3000:]}")
    leftovers = wait_for_no_leftovers(tag)
    assert not leftovers, f"processes left behind: {[describe(p) for p in leftovers]}"
    return proc.returncode, out


@pytest.mark.parametrize(("how", "start", "code", "needle"), [
    ("epoch", "auto", 0, "done"),  # a full epoch, the loader left open at module level
    ("break", "spawn", 0, "done"),  # after a break
    ("crash", "auto", 3, "crashing"),  # os._exit mid-epoch, batches waiting in a full queue pipe
    ("raise", "auto", 1, "the training step failed"),  # an uncaught exception
    ("sigint", "spawn", -signal.SIGINT, "KeyboardInterrupt"),  # Ctrl-C (Python exits by the signal)
    ("stdin", "auto", 0, "done"),  # python - < train.py, Lines defined in __main__: fork needs no import
    ("stdin", "spawn", 1, "StartMethodError"),  # spawn cannot re-import code from standard input
    ("orphan", "auto", 1, "no server accepted connections at 127.0.0.1:"),  # rank 1 whose rank 0 never comes
])
def test_script_exits_promptly_whatever_ends_it(how, start, code, needle, tmp_path):
    started = time.monotonic()
    returncode, out = run_script(tmp_path, how, start)
    assert returncode == code and needle in out, out[-3000:]
    assert time.monotonic() - started < 60, "exit took longer than the bound"
    assert not semaphores_left(out), out[-3000:]


def test_ctrl_c_while_waiting_for_an_absent_peer_exits_promptly(tmp_path):
    """Ctrl-C while rank 0's collate process waits in its group's rendezvous for a rank 1 that never
    comes (timeout 60 s): the script ends within a couple of seconds, leaving no process and no
    semaphore. The loader's exit-time close() waited 5 s for the collate process, which reads no
    Stop inside the rendezvous, before terminating it."""
    times: dict[str, float] = {}
    returncode, out = run_script(tmp_path, "waiting", "auto", times=times)
    assert returncode == -signal.SIGINT and "KeyboardInterrupt" in out, out[-3000:]
    assert times["exit"] < 3.0, f"the script took {times['exit']:.1f}s to exit after Ctrl-C"
    assert not semaphores_left(out), out[-3000:]


@pytest.mark.parametrize(("how", "frame", "error"), [
    ("stuck", "in __getitem__", "PeerError: rank 0: no batch for 4s"),  # the trainer's deadline: SIGUSR1
    ("alone", "in _collate_group", "collate group rendezvous"),  # the collate process's start-up watchdog
])
def test_a_hang_leaves_the_collate_process_stacks_on_stderr(how, frame, error, tmp_path):
    """A collate process stuck in a load (the trainer's deadline passes) or before its first
    handshake (its start-up watchdog fires at the timeout) writes every thread's stack to
    stderr before it is stopped: the hang says where it was; the trainer's error is typed."""
    returncode, out = run_script(tmp_path, how, "auto")
    assert returncode == 1 and error in out, out[-3000:]
    assert "most recent call first" in out, f"no stack dump:\n{out[-3000:]}"
    assert frame in out[out.index("most recent call first"):], out[-3000:]


def test_the_loader_runs_where_sys_stderr_has_no_descriptor(monkeypatch):
    """A notebook's or pytest's ``sys.stderr`` has no file descriptor (faulthandler refuses
    it): the forked collate process still starts, its stack dumps armed on descriptor 2, and
    the epoch is whole (P4)."""
    import io

    import torch

    from odb_torch import ODBDataLoader, pad_collate

    monkeypatch.setattr(sys, "stderr", io.StringIO())
    data = [{"input_ids": torch.arange(1 + i % 5)} for i in range(24)]
    loader = ODBDataLoader(data, token_budget=16, collate_fn=pad_collate, num_workers=0, world_size=1, rank=0,
                           timeout=60, start_method="fork")
    try:
        seen = sorted(i for _ in loader for i in loader.step_info.indices)
    finally:
        loader.close()
    assert seen == list(range(24))


def semaphores_left(out: str) -> int:
    """Semaphores the resource tracker found still registered at shutdown, less those it then
    found already unlinked (ENOENT: the owner removed it and the tracker's bookkeeping lagged,
    a CPython shutdown race seen once in CI; nothing was left behind)."""
    reported = sum(int(m) for m in re.findall(r"There appear to be (\d+) leaked semaphore", out))
    gone = len(re.findall(r"resource_tracker: '/mp-[^']+': \[Errno 2\] No such file or directory", out))
    return reported - gone


def test_semaphore_check_counts_only_what_the_tracker_could_still_remove():
    """The exit tests' semaphore check: a tracker warning whose semaphore was already gone
    (ENOENT) is no leftover; one it could remove, or any other failure, is."""
    warned = ("UserWarning: resource_tracker: There appear to be {n} leaked semaphore objects to clean up at shutdown\n"
              "UserWarning: resource_tracker: '/mp-m5e0f3l0': [Errno 2] No such file or directory\n")
    assert semaphores_left("done\n") == 0
    assert semaphores_left(warned.format(n=1)) == 0
    assert semaphores_left(warned.format(n=2)) == 1
    assert semaphores_left(warned.format(n=1).replace("[Errno 2] No such file or directory", "[Errno 13] denied")) == 1
