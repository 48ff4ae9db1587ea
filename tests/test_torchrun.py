"""ODBDataLoader under ``torchrun``: one node with 2 processes, and two "nodes" on localhost.

The trainer script (tests/torchrun_worker.py) uses only torchrun's environment: an
``env://`` Gloo group and the loader's default collate rendezvous. Checks lockstep (P2)
and exactly-once coverage (P4) over two epochs, and that nothing is left running.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from test_torch_loader import free_port_triple
from torch_support import wait_for_no_leftovers

pytestmark = pytest.mark.timeout(300)

WORKER = Path(__file__).with_name("torchrun_worker.py")
N = 57


def torchrun(args: list[str], out: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "torch.distributed.run", *args, str(WORKER), str(out), str(N)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


def finish(procs: list[subprocess.Popen[bytes]], timeout: float = 200) -> list[str]:
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0].decode(errors="replace"))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]
    return logs


@pytest.mark.parametrize("layout", ["one_node_x2", "two_nodes_x1"])
def test_torchrun_lockstep_and_coverage(layout, tmp_path):
    tag = uuid.uuid4().hex
    env = {**os.environ, "ODB_TEST_TAG": tag, "OMP_NUM_THREADS": "1"}
    port = free_port_triple()
    common = ["--master-addr", "127.0.0.1", "--master-port", str(port)]
    if layout == "one_node_x2":
        procs = [torchrun(["--nnodes", "1", "--nproc-per-node", "2", *common], tmp_path, env)]
    else:
        procs = [torchrun(["--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1", *common], tmp_path, env)
                 for node in (0, 1)]
    finish(procs)
    leftovers = wait_for_no_leftovers(tag)
    assert not leftovers, f"processes left behind: {leftovers}"
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(r["world"] == 2 for r in results)
    for epoch in range(2):
        steps = [len(r["epochs"][epoch]) for r in results]
        assert steps[0] == steps[1] > 0, f"P2: ranks yielded {steps} steps in epoch {epoch}"
        ids = [i for r in results for batch in r["epochs"][epoch] for i in batch]
        # DistributedSampler pads 57 views to 58: one index twice, nothing missing
        assert set(ids) == set(range(N)) and len(ids) == N + 1, f"P4 coverage failed in epoch {epoch}"
