"""Hypothesis profiles: ``ci`` (default, bounded for a 2-core CI box), ``dev``, ``deep``; ``odb tune``'s checked run."""

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
settings.register_profile("dev", max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile(
    "deep", max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def tune_checked() -> dict[str, Any]:
    """``tests/tune_check.py``'s report (``odb tune`` on a tiny model in a fresh process): the CLI's
    result, the seeded bugs' and the replays', each with the oracle's objections."""
    script = Path(__file__).with_name("tune_check.py")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)
