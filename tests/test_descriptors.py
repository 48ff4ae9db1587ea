"""The collate group's open-file descriptors (``odb_torch.descriptors``).

A Gloo full mesh needs one descriptor per peer (two on rank 0, which serves the store):
~2,070 on rank 0 at W = 1024, past the common default soft limit of 1,024. The collate
process raises its soft limit to fit, and fails at once with a typed error naming the
need and the hard limit when even that is too low, instead of an opaque socket error in
the middle of the rendezvous. Each case runs in a child process with its own limits.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from odb_torch.descriptors import HEADROOM, needed

pytestmark = pytest.mark.timeout(120)


def run_child(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_need_grows_by_one_per_peer_and_two_on_rank_zero():
    assert [needed(w, 1) - needed(w - 1, 1) for w in (2, 64, 1024)] == [1, 1, 1]
    assert [needed(w, 0) - needed(w - 1, 0) for w in (2, 64, 1024)] == [2, 2, 2]
    assert needed(1024, 0) == 2 * 1024 + 1 + HEADROOM


def test_soft_limit_is_raised_to_fit_a_thousand_rank_group_and_left_alone_when_it_fits():
    got = run_child("""
        import json, resource
        from odb_torch.descriptors import ensure_descriptors, needed, open_count
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 8192))
        small = ensure_descriptors(8, 1)
        untouched = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        ensure_descriptors(1024, 0)
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        print(json.dumps({"small": small, "untouched": untouched, "soft": soft, "hard": hard,
                          "want": open_count() + needed(1024, 0)}))
    """)
    assert got["small"] == got["untouched"] == 256, got
    assert got["soft"] >= got["want"] - 2 and got["hard"] == 8192, got  # open_count moves by the listdir fd


def test_a_hard_limit_too_low_is_a_typed_error_naming_rank_need_and_limit():
    got = run_child("""
        import json, resource
        from odb_core.errors import DescriptorLimitError
        from odb_torch.descriptors import ensure_descriptors
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 512))
        try:
            ensure_descriptors(1024, 0)
        except DescriptorLimitError as exc:
            print(json.dumps({"rank": exc.rank, "needed": exc.needed, "limit": exc.limit, "message": str(exc)}))
    """)
    assert got["rank"] == 0 and got["limit"] == 512 and got["needed"] > 2048, got
    assert "ulimit -n" in got["message"] and "1024 ranks" in got["message"], got


def test_the_loader_reports_the_collate_process_limit_to_the_trainer_typed():
    """The wiring: a collate process that cannot fit its group fails before the rendezvous,
    and the trainer's iteration raises that error (not a PeerError after a timeout)."""
    got = run_child("""
        import json, resource
        from odb_core.errors import DescriptorLimitError
        from odb_torch import ODBDataLoader
        from odb_torch.descriptors import open_count
        data = [{"input_ids": list(range(1 + i % 7))} for i in range(16)]
        loader = ODBDataLoader(data, token_budget=32, collate_fn=lambda b: b, num_workers=0, world_size=1, rank=0,
                               timeout=60, length_fn=lambda s: len(s["input_ids"]))
        limit = open_count() + 40
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
        try:
            next(iter(loader))
            result = {"error": None}
        except DescriptorLimitError as exc:
            result = {"error": type(exc).__name__, "rank": exc.rank, "limit": exc.limit}
        loader.close()
        print(json.dumps(result))
    """)
    assert got["error"] == "DescriptorLimitError" and got["rank"] == 0, got
