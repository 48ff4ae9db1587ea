"""TLC on generated models: ODB's constants written as a module extending a spec
module, a cfg, and one TLC run in a temporary copy of ``spec/``.

Shared by the simulation (:mod:`model_checks.reach`), the progress checks
(:mod:`model_checks.progress`) and the inductiveness checks (:mod:`model_checks.inductive`).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from model_checks.conformance import to_tla, wrap_tla
from model_checks.tla import SPEC_DIR, jar_path, java

#: spec/Progress.tla
PROGRESS_INVARIANTS = ("QuiescentProgress", "IterationProgress")
#: the modules a generated model may extend
SPEC_MODULES = ("ODB.tla", "MC.tla", "Progress.tla", "Reach.tla", "Inductive.tla", "TailResume.tla", "Elastic.tla")

T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True)
class Model:
    """Constants of one ODB model (``ODB.tla``'s CONSTANTS)."""

    name: str
    lengths: tuple[tuple[int, ...], ...]
    budget: int = 64
    buffer_size: int = 4
    depth: int = 4
    capacity: int = 0
    join: bool = True
    quota: int | None = None
    """non-join N; defaults to the number of views"""
    overflow: str = "largest"
    policy: str = "paper"
    regroup: tuple[int, int] = (1, 50)
    """(RegroupNum, RegroupDen); (0, 0) is off"""
    budget_kind: str = "padded"
    """BudgetKind: "padded" or "packed" (the core's ``budget``)"""
    pool: tuple[int, ...] = ()
    """the shared tail's pool: its views' lengths (``Pool``; join only); () is none"""
    reserve_divisor: int = 8
    """``ReserveDiv`` (the core's ``reserve_divisor``), a constant only with a pool"""
    stream: bool = False
    """each rank's views a stream (``StreamOn <- StreamsOn``): its count unknown until a fetch passes it"""

    @property
    def world(self) -> int:
        return len(self.lengths)

    @property
    def views(self) -> int:
        return sum(map(len, self.lengths)) + len(self.pool)

    def constants(self) -> dict[str, Any]:
        return {
            "W": self.world, "NV": tuple(map(len, self.lengths)), "Length": self.lengths,
            "Budget": self.budget, "BudgetKind": self.budget_kind, "BufSize": self.buffer_size, "Depth": self.depth,
            "Capacity": self.capacity,
            "JoinMode": self.join, "Quota": self.views if self.quota is None else self.quota,
            "Overflow": self.overflow, "Policy": self.policy,
            "RegroupNum": self.regroup[0], "RegroupDen": self.regroup[1],
            **({"Pool": self.pool, "ReserveDiv": self.reserve_divisor} if self.pool else {}),
        }

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name, "world": self.world, "views_per_rank": [len(x) for x in self.lengths],
            "budget": self.budget, "budget_kind": self.budget_kind, "buffer_size": self.buffer_size,
            "depth": self.depth, "capacity": self.capacity,
            "mode": "join" if self.join else "non-join", "policy": self.policy, "overflow": self.overflow,
            "regroup": f"{self.regroup[0]}/{self.regroup[1]}" if self.regroup[1] else "off",
            "pool": len(self.pool), "reserve_divisor": self.reserve_divisor, "stream": self.stream,
        }


def model_dir(tmp: Path) -> None:
    """Copy the spec modules a generated model extends into ``tmp``."""
    for name in SPEC_MODULES:
        if (SPEC_DIR / name).exists():
            shutil.copy(SPEC_DIR / name, tmp / name)


def run_tlc(module: str, cfg: str, modules: dict[str, str], args: Sequence[str], workers: int = 1,
            timeout: float = 1800, short: bool = True) -> tuple[str, float]:
    """Write ``modules`` and ``cfg`` beside the spec in a temp dir, run TLC; its output and seconds.

    ``short``: the JIT's first tier only, which halves the CPU of runs of seconds (the
    optimising tier compiles more than such a run executes)."""
    with tempfile.TemporaryDirectory(prefix="odb-reach-") as tmpname:
        tmp = Path(tmpname)
        model_dir(tmp)
        for name, text in modules.items():
            (tmp / name).write_text(text)
        (tmp / f"{module}.cfg").write_text(cfg)
        jit = ["-XX:TieredStopAtLevel=1"] if short else []
        # its own java.io.tmpdir: TLC copies its standard modules there (see model_checks.tla.tlc)
        cmd = [java(), "-XX:+UseParallelGC", *jit, "-Xss64m", f"-Djava.io.tmpdir={tmp}", "-cp", str(jar_path()),
               "tlc2.TLC", "-nowarning",
               "-workers", str(workers), "-config", str(tmp / f"{module}.cfg"), "-metadir", str(tmp / "states"),
               *args, module]
        started = time.perf_counter()
        out = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=timeout,
                             env={**os.environ, "JAVA_TOOL_OPTIONS": ""})
        return out.stdout + out.stderr, time.perf_counter() - started


def outcome(text: str) -> str:
    """``ok``, ``invariant:<Name>``, ``action:<Name>``, ``deadlock`` or ``error`` from TLC's output."""
    if m := re.search(r"Invariant (\w+) is violated", text):
        return f"invariant:{m.group(1)}"
    if m := re.search(r"Action property (\w+) is violated", text):
        return f"action:{m.group(1)}"
    if "Deadlock reached" in text:
        return "deadlock"
    if "Error:" in text or "Exception" in text:
        return "error"
    if "Model checking completed. No error has been found." in text or re.search(r"Finished in", text):
        return "ok"
    return "error"


def model_module(name: str, extends: str, m: Model, extra: str = "") -> str:
    return (f"---- MODULE {name} ----\nEXTENDS {extends}\n"
            + "".join(f"{name}_{k} == {wrap_tla(to_tla(v))}\n" for k, v in m.constants().items()) + extra + "====\n")


def constants_cfg(name: str, m: Model) -> str:
    stream = "    StreamOn <- StreamsOn\n" if m.stream else ""
    return "CONSTANTS\n" + "".join(f"    {k} <- {name}_{k}\n" for k in m.constants()) + stream


def parallel(fn: Callable[[T], R], items: Iterable[T], jobs: int | None = None) -> list[R]:
    """``fn`` over ``items``, ``jobs`` TLC processes at a time (default: the CPU count, at most 4)."""
    n = jobs or max(1, min(4, os.cpu_count() or 1))
    with ThreadPoolExecutor(n) as ex:
        return list(ex.map(fn, items))
