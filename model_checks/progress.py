"""The progress invariants of spec/Progress.tla, by exhaustive TLC on the quick models.

TLC's deadlock check is vacuous on ODB (the skip round is enabled in every state
that is not done), so P6 had only the liveness check. QuiescentProgress and
IterationProgress are state predicates that fail on a stuck protocol; each quick
configuration is re-run safety-only with them (its cfg, SPECIFICATION replaced by
INIT/NEXT), and seeded bugs (:data:`BUGS`) must violate them, while TLC's deadlock
check stays silent on the same bug (``deadlock_check_blind``). The resumed runs of the
tail-resume and elastic configurations (modules TailResume, Elastic: ODB from a resumed
initial state) are checked the same way, in a module extending both theirs and Progress
(:func:`module_text`), with ``ResumeExactlyOnce`` too.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from model_checks.generated import PROGRESS_INVARIANTS, outcome, run_tlc
from model_checks.suites import CFG_DIR, MODULES, configs
from model_checks.tla import ODB_INVARIANTS


@dataclass(frozen=True)
class ProgressCheck:
    """A quick configuration, optional substitutions (a seeded bug), the expected outcome."""

    name: str
    base: str
    """the spec/cfg configuration whose constants it uses"""
    expected: str = "ok"
    substitute: tuple[str, ...] = ()
    invariants: tuple[str, ...] = ODB_INVARIANTS + PROGRESS_INVARIANTS
    why: str = ""

    @property
    def module(self) -> str:
        """``Progress``, or for a resumed run's configuration ``Progress<its module>``."""
        resumed = MODULES.get(self.base.rpartition("/")[0], "MC")
        return "Progress" if resumed == "MC" else f"Progress{resumed}"


@dataclass
class ProgressResult:
    check: ProgressCheck
    outcome: str
    distinct_states: int
    seconds: float
    output: str

    @property
    def passed(self) -> bool:
        return self.outcome == self.check.expected

    def to_json(self) -> dict[str, Any]:
        c = self.check
        return {"name": c.name, "base": c.base, "substitute": list(c.substitute), "expected": c.expected,
                "result": self.outcome, "passed": self.passed, "distinct_states": self.distinct_states,
                "seconds": round(self.seconds, 2), "why": c.why}


def derived_cfg(base: Path, substitute: tuple[str, ...], invariants: tuple[str, ...]) -> str:
    """The base configuration, safety only, with the given invariants and substitutions."""
    lines = []
    for line in base.read_text().splitlines():
        if line.startswith(("SPECIFICATION", "PROPERTIES", "INVARIANTS", "\\*")):
            continue
        lines.append(line)
        if line.startswith("CONSTANTS"):
            lines += [f"    {s}" for s in substitute]
    return "\n".join(lines) + "\nINIT Init\nNEXT Next\nINVARIANTS " + " ".join(invariants) + "\n"


def module_text(module: str) -> dict[str, str]:
    """The wrapper module a resumed run's check runs in (none for ``Progress`` itself)."""
    if module == "Progress":
        return {}
    return {f"{module}.tla": f"---- MODULE {module} ----\nEXTENDS {module.removeprefix('Progress')}, Progress\n====\n"}


def run_progress(c: ProgressCheck, workers: int = 1, timeout: float = 1800) -> ProgressResult:
    """TLC (breadth-first, deadlock check on) on module Progress (or a resumed run's wrapper)
    with the derived cfg."""
    cfg = derived_cfg(CFG_DIR / f"{c.base}.cfg", c.substitute, c.invariants)
    text, seconds = run_tlc(c.module, cfg, module_text(c.module), (), workers=workers, timeout=timeout)
    found = re.findall(r"([\d,]+) distinct states found", text)
    return ProgressResult(c, outcome(text), int(found[-1].replace(",", "")) if found else 0, seconds, text)


#: a resumed run's checks: also every view yielded exactly once across the resume (P4)
RESUMED_INVARIANTS = ODB_INVARIANTS + ("ResumeExactlyOnce",) + PROGRESS_INVARIANTS

#: seeded bugs: the progress invariants must catch them, TLC's deadlock check does not
BUGS = (
    ProgressCheck("finished_blocks", "quick_join_3_uneven", "invariant:QuiescentProgress",
                  ("Target <- MutTargetFinishedBlocks",),
                  why="a target of 0 while any rank is not ready: once a rank finishes, the others wait for ever"),
    ProgressCheck("no_flush", "quick_join_2x4", "invariant:QuiescentProgress", ("Status <- MutStatusNoFlush",),
                  why="a drained rank with a part-filled buffer never reports ready"),
    ProgressCheck("depth_below_buffer", "sanity_depth_below_buffer", "invariant:QuiescentProgress",
                  why="D < buffer_size: the buffer never fills (a sanity configuration)"),
    ProgressCheck("nonjoin_empty_rank", "sanity_nonjoin_empty_rank", "invariant:IterationProgress",
                  why="non-join with an empty rank: every iteration ends at once, before any emission"),
    ProgressCheck("fill_no_fallback", "mutant_fill_no_fallback", "invariant:QuiescentProgress",
                  why="the packed reserve dealt only to a rank with room: ranks whose groups all went out full "
                      "never claim the pool again"),
    ProgressCheck("tail_resume_no_flush", "tail/quick_tail_resume_2", "invariant:QuiescentProgress",
                  ("Status <- MutStatusNoFlush",), RESUMED_INVARIANTS,
                  why="a pooled epoch's resumed run whose drained rank never flushes its part-filled buffer"),
    ProgressCheck("elastic_finished_blocks", "elastic/quick_resume_3_to_2", "invariant:QuiescentProgress",
                  ("Target <- MutTargetFinishedBlocks",), RESUMED_INVARIANTS,
                  why="an elastic resume on 2 ranks whose target waits for a finished rank"),
    ProgressCheck("deadlock_check_blind", "quick_join_3_uneven", "ok", ("Target <- MutTargetFinishedBlocks",),
                  ODB_INVARIANTS,
                  why="the same stuck protocol without the progress invariants: TLC reports no deadlock"),
)

#: quick configurations checked with the progress invariants in CI (the rest with --deep)
CI_QUICK = ("quick_join_2x4_regroup", "quick_join_3_empty_rank", "quick_nonjoin_3_uneven_balanced",
            "quick_nonjoin_2x4_packed", "quick_join_2_pool_packed", "quick_join_3_empty_stream",
            "quick_tail_resume_2", "quick_resume_3_to_2")


def quick_checks(names: tuple[str, ...] | None = None) -> tuple[ProgressCheck, ...]:
    """Every quick configuration (or those named), the streams', tail resumes' and elastic
    resumes' included, with the progress invariants (and ``ResumeExactlyOnce`` for a resumed
    run): must pass."""
    checks = [ProgressCheck(p.stem, p.relative_to(CFG_DIR).with_suffix("").as_posix())
              for p in configs(("quick",), subfolders=True) if names is None or p.stem in names]
    return tuple(c if c.module == "Progress" else dataclasses.replace(c, invariants=RESUMED_INVARIANTS)
                 for c in checks)


def deep_checks() -> tuple[ProgressCheck, ...]:
    """The deep configurations (but deep_nonjoin_3x3, which does not finish) with the progress invariants."""
    return tuple(ProgressCheck(p.stem, p.stem) for p in sorted(CFG_DIR.glob("deep_*.cfg"))
                 if p.stem != "deep_nonjoin_3x3")
