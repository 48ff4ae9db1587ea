"""The collate process runs torch with one intra-op thread, whatever the trainer set, and keeps the
objects a fork gave it out of its garbage collections.

A trainer that sets no thread count runs one torch thread per core; a forked collate process
inherited that, and its small batch copies then cost a thread wake-up each (on 2 busy cores
the ODB loader fell to 0.76x the plain DataLoader's samples/s on the chat data and 0.55x on
the synthetic data: ``benchmarks/bench_loader.py --trainer-threads 0``). DataLoader workers
set one thread themselves; the collate process now does too.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(120)

CHILD = """
    import json, torch
    from odb_torch import ODBDataLoader

    def collate(samples):
        return {"threads": torch.tensor([torch.get_num_threads()])}

    torch.set_num_threads(3)
    data = [{"input_ids": list(range(1 + i % 5))} for i in range(24)]
    loader = ODBDataLoader(data, token_budget=16, collate_fn=collate, num_workers=NUM_WORKERS, world_size=1,
                           rank=0, timeout=60, start_method="START")
    seen = [int(b["threads"][0]) for b in loader if not loader.step_info.is_idle]
    loader.close()
    print(json.dumps({"trainer": torch.get_num_threads(), "collate": sorted(set(seen)), "batches": len(seen)}))
"""


@pytest.mark.parametrize("num_workers", [0, 2])
def test_collate_fn_runs_on_one_torch_thread_although_the_trainer_runs_three(num_workers):
    code = textwrap.dedent(CHILD).replace("NUM_WORKERS", str(num_workers)).replace("START", "fork")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["trainer"] == 3, "the trainer's own setting is left as it set it"
    assert got["batches"] > 0 and got["collate"] == [1], got


GC_CHILD = """
    import gc, json, torch
    from odb_torch import ODBDataLoader

    inherited = [[k] for k in range(50_000)]  # the trainer's heap: 50,000 more objects the collector tracks
    gc.disable()  # the trainer's own choice (some frameworks collect by hand)

    def collate(samples):
        cycle = [];  cycle.append(cycle)  # garbage made here is still collected
        del cycle
        return {"frozen": torch.tensor([gc.get_freeze_count()]), "enabled": torch.tensor([gc.isenabled()]),
                "collected": torch.tensor([gc.collect()])}

    tracked = len(gc.get_objects())  # what the fork below hands the collate process
    data = [{"input_ids": list(range(1 + i % 5))} for i in range(24)]
    loader = ODBDataLoader(data, token_budget=16, collate_fn=collate, num_workers=0, world_size=1, rank=0,
                           timeout=60, start_method="fork")
    got = [{k: int(v[0]) for k, v in b.items()} for b in loader if not loader.step_info.is_idle]
    loader.close()
    print(json.dumps({"tracked": tracked, "trainer_frozen": gc.get_freeze_count(), "trainer_enabled": gc.isenabled(),
                      "collate": got}))
"""


def test_forked_collate_process_keeps_the_trainers_objects_out_of_its_collections():
    """A forked collate process freezes what it inherited (``gc.freeze``): its collections never walk
    the trainer's heap, whose pages they would copy on write; its own garbage is still collected,
    also when the trainer disabled its collector."""
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(GC_CHILD)], capture_output=True, text=True,
                         timeout=100)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["trainer_frozen"] == 0 and not got["trainer_enabled"], "the trainer's own collector is left as it was"
    assert got["tracked"] > 50_000 and got["collate"], got
    for batch in got["collate"]:
        # every tracked object the trainer had when it forked is frozen there (more: the loader's own)
        assert batch["frozen"] >= got["tracked"] and batch["enabled"] == 1, batch
        assert batch["collected"] >= 1, batch  # the cycle made in collate_fn
