"""The TLC configurations in spec/cfg/ and what each must produce.

``quick_*`` and ``deep_*`` must pass every invariant and Termination; ``sanity_*``
must FAIL Termination (restated fairness would be vacuous otherwise); ``mutant_*``
must FAIL the invariant named in its first-line comment, ``(must fail X)``. The top
level's configurations instance module MC; those of a subfolder the module
:data:`MODULES` names (streams: MC; a pooled epoch's resume: TailResume; an elastic
resume: Elastic).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from model_checks.tla import ODB_ACTION_PROPERTIES, SPEC_DIR, TlcRun, tlc

CFG_DIR = SPEC_DIR / "cfg"
#: the module each subfolder's configurations instance
MODULES = {"streams": "MC", "tail": "TailResume", "elastic": "Elastic"}


@dataclass
class ConfigResult:
    """One configuration's run against its expectation."""

    name: str
    kind: str
    mode: str
    world: int
    expected: str
    run: TlcRun

    @property
    def passed(self) -> bool:
        """The run produced exactly the expected outcome."""
        return self.run.outcome == self.expected

    def to_json(self) -> dict[str, object]:
        """The ``configs`` entry of ``odb check --json``."""
        return {
            "name": self.name, "kind": self.kind, "mode": self.mode, "world": self.world,
            "distinct_states": self.run.distinct_states, "depth": self.run.depth,
            "seconds": round(self.run.seconds, 2), "result": self.run.outcome,
            "expected": self.expected, "passed": self.passed,
        }


def expectation(path: Path) -> str:
    """What TLC must report for this configuration."""
    kind = path.stem.split("_", 1)[0]
    if kind in ("quick", "deep"):
        return "ok"
    m = re.search(r"must fail (\w+)", path.read_text().splitlines()[0])
    if not m:
        raise ValueError(f"{path.name}: first line must say '(must fail <Property>)'")
    if m.group(1) == "Termination":
        return "temporal"
    return f"action:{m.group(1)}" if m.group(1) in ODB_ACTION_PROPERTIES else f"invariant:{m.group(1)}"


def configs(kinds: tuple[str, ...], subfolders: bool = False) -> list[Path]:
    """The configuration files of the given kinds, sorted by name (the top level's, then with
    ``subfolders`` those of :data:`MODULES`' folders)."""
    top = sorted(p for p in CFG_DIR.glob("*.cfg") if p.stem.split("_", 1)[0] in kinds)
    nested = sorted(p for folder in MODULES for p in (CFG_DIR / folder).glob("*.cfg")
                    if p.stem.split("_", 1)[0] in kinds)
    return top + (nested if subfolders else [])


def run_config(path: Path) -> ConfigResult:
    """Run TLC on one configuration, in module MC (the top level) or its folder's module."""
    text = path.read_text()
    world = int(re.search(r"\bW = (\d+)", text).group(1))  # type: ignore[union-attr]
    mode = "join" if "JoinMode = TRUE" in text else "non-join"
    kind = path.stem.split("_", 1)[0]
    module = "MC" if path.parent == CFG_DIR else MODULES[path.parent.name]
    name = path.relative_to(CFG_DIR).with_suffix("").as_posix()
    return ConfigResult(name, kind, mode, world, expectation(path), tlc(module, path, short=kind != "deep"))
