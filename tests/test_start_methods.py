"""Scripts as people write them (issue: any script, any start method).

A newcomer's script with the dataset class defined in it, run as a torchrun script
without ``if __name__ == "__main__":``, from standard input (``python - < script``) and
as a notebook cell would be (``python -c``, ``__main__`` without a file): with the
default ``start_method="auto"`` each trains every sample once in lockstep (P2, P4), ends
without a leaked-semaphore warning, and leaves no process or ``/dev/shm`` entry behind.
With ``start_method="spawn"`` the ones a fresh interpreter cannot start fail on every
rank within seconds (not after the timeout) with a ``StartMethodError`` naming the cause.
"""

from __future__ import annotations

import ast
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
from test_fault_matrix import semaphores_left
from torch_support import wait_for_no_leftovers

from odb_torch.ports import free_port
from odb_torch.start_failure import _is_main_guard

pytestmark = pytest.mark.timeout(240)

N = 41
LOADER_TIMEOUT = 120  # a start failure must be reported long before this
SCRIPT = textwrap.dedent(f"""
    import json, os, sys
    import torch
    import torch.distributed as dist
    from torch.utils.data import Dataset
    from odb_torch import ODBDataLoader, pad_collate

    class Lines(Dataset):  # defined in __main__, as in a notebook or a quick script
        def __len__(self):
            return {N}
        def __getitem__(self, i):
            return {{"input_ids": torch.full((1 + i % 13,), i)}}

    world = int(os.environ.get("WORLD_SIZE", 1))
    if world > 1:
        dist.init_process_group("gloo")
    rank = int(os.environ.get("RANK", 0))
    loader = ODBDataLoader(Lines(), token_budget=48, collate_fn=pad_collate, buffer_size=8, num_workers=1,
                           timeout={LOADER_TIMEOUT}, start_method=os.environ["ODB_TEST_START"])
    steps = [[] if loader.step_info.is_idle else list(loader.step_info.indices) for _ in loader]
    with open(os.path.join(os.environ["ODB_TEST_OUT"], f"rank{{rank}}.json"), "w") as fh:
        json.dump(steps, fh)
    loader.close()
    if world > 1:
        dist.destroy_process_group()
""")


def run_script(how: str, start: str, out: Path, world: int = 1) -> tuple[int, str, float]:
    """Run SCRIPT as ``how`` ("torchrun", "stdin", "cell"); (exit code, log, seconds). Fails
    the test if a process or a /dev/shm entry is left behind."""
    tag = uuid.uuid4().hex
    env = {**os.environ, "ODB_TEST_TAG": tag, "ODB_TEST_START": start, "ODB_TEST_OUT": str(out),
           "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    script = out / "train.py"
    script.write_text(SCRIPT)
    if how == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(world),
               "--master-addr", "127.0.0.1", "--master-port", str(free_port(3)), str(script)]
    elif how == "stdin":
        cmd = [sys.executable, "-"]
    else:
        cmd = [sys.executable, "-c", SCRIPT]
    shm_before = set(os.listdir("/dev/shm"))
    began = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdin=script.open() if how == "stdin" else subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        log = proc.communicate(timeout=200)[0].decode(errors="replace")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    elapsed = time.monotonic() - began
    assert not wait_for_no_leftovers(tag), f"processes left behind:\n{log[-3000:]}"
    leaked = sorted(set(os.listdir("/dev/shm")) - shm_before)
    assert not leaked, f"shared memory left behind: {leaked}"
    return proc.returncode, log, elapsed


def trained_once_in_lockstep(out: Path, world: int) -> None:
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    assert len({len(steps) for steps in ranks}) == 1, f"P2: steps per rank {[len(s) for s in ranks]}"
    ids = sorted(i for steps in ranks for batch in steps for i in batch)
    pad = -N % world  # DistributedSampler repeats views to fill the last round
    assert set(ids) == set(range(N)) and len(ids) == N + pad, "P4: not every sample exactly once"


@pytest.mark.parametrize(("how", "world"), [("torchrun", 2), ("stdin", 1), ("cell", 1)])
def test_newcomer_script_trains_with_the_default_start_method(how, world, tmp_path):
    code, log, _ = run_script(how, "auto", tmp_path, world)
    assert code == 0, log[-4000:]
    trained_once_in_lockstep(tmp_path, world)
    assert not semaphores_left(log) and "Traceback" not in log, log[-4000:]


@pytest.mark.parametrize(("how", "world", "cause"), [
    ("torchrun", 2, "outside `if __name__ == \"__main__\":`"),
    ("stdin", 1, "standard input"),
    ("cell", 1, "Lines is defined in __main__"),
])
def test_spawn_refuses_what_cannot_start_on_every_rank_within_seconds(how, world, cause, tmp_path):
    code, log, elapsed = run_script(how, "spawn", tmp_path, world)
    assert code != 0, log[-4000:]
    for rank in range(world):
        assert f"StartMethodError: rank {rank}: the collate process (spawn) cannot start" in log, log[-4000:]
    assert cause in log, log[-4000:]
    assert elapsed < LOADER_TIMEOUT / 2, f"the start failure took {elapsed:.0f}s: a timeout, not a check"


@pytest.mark.parametrize(("source", "guard"), [
    ('if __name__ == "__main__":\n    pass', True),
    ('if "__main__" == __name__:\n    pass', True),
    ('if how == "stdin" or __name__ == "__main__":\n    pass', True),  # may be guarded: not refused
    ('if name == "__main__":\n    pass', False),
    ('if main:\n    pass', False),
    ('for _ in range(1):\n    pass', False),
])
def test_main_guard_is_recognised_exactly(source, guard):
    assert _is_main_guard(ast.parse(source).body[0]) is guard


def test_a_spawn_child_that_dies_while_importing_the_script_is_explained(tmp_path):
    """What the pre-start check cannot see (the script fails when re-imported as
    ``__mp_main__``) is reported after the child's death with the cause and the fix."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import torch
        from odb_torch import ODBDataLoader, pad_collate
        if __name__ == "__mp_main__":
            raise RuntimeError("an import-time side effect")
        if __name__ == "__main__":
            data = [{"input_ids": torch.arange(1 + i % 5)} for i in range(12)]
            loader = ODBDataLoader(data, token_budget=16, collate_fn=pad_collate, num_workers=0, timeout=60,
                                   start_method="spawn", rank=0, world_size=1)
            list(loader)
    """))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    shm_before = set(os.listdir("/dev/shm"))
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert not set(os.listdir("/dev/shm")) - shm_before, "shared memory left behind"
    assert proc.returncode != 0
    assert "CollateProcessError: rank 0: the collate process (spawn) could not start (exit code 1)" in proc.stderr
    assert f"re-importing your script {script}" in proc.stderr, proc.stderr[-3000:]


@pytest.mark.timeout(120)
def test_spawn_with_an_unpicklable_collate_fn_is_a_start_method_error_every_time():
    """Under spawn what the collate process runs is pickled to it; a local lambda cannot be. That
    is a StartMethodError naming the rank and what to do, raised before any process starts, and
    again on the next try (not a raw pickling error, then "the collate process is gone")."""
    from odb_core.errors import StartMethodError
    from odb_torch import ODBDataLoader, pad_collate

    data = [{"input_ids": [1, 2, 3]}] * 8
    loader = ODBDataLoader(data, token_budget=16, collate_fn=lambda s: pad_collate(s), rank=0, world_size=1,
                           num_workers=0, start_method="spawn")
    try:
        for _ in range(2):
            with pytest.raises(StartMethodError, match="pickling") as err:
                next(iter(loader))
            assert err.value.rank == 0 and "collate_fn" in str(err.value) and loader._proc is None
    finally:
        loader.close()
