"""Checks that reach past the exhaustive toy models (``odb check``'s ``reach`` object).

* **Simulation** (spec/Reach.tla): TLC ``-simulate`` on models of up to 8 ranks with
  20-50 views each, lengths drawn here (seeded: a lognormal body on a per-rank scale,
  zeros, lengths over the budget), buffers and depths of 4-16, capacities 0-4, regroup
  on and off, every target policy, both modes; every ODB invariant and the progress
  invariants on every state, every behaviour must reach done, and a monitor counts the
  gathers that split, overflow, hold, skip, chain (:data:`COVERAGE`).
* **Progress** (:mod:`model_checks.progress`, spec/Progress.tla).
* **Inductiveness** (:mod:`model_checks.inductive`, spec/Inductive.tla).

Every check has seeded bugs it must catch (:data:`SIM_BUGS`, ``progress.BUGS``, the
negative ``inductive`` checks). :func:`check_reach` runs them all.
"""

from __future__ import annotations

import fnmatch
import math
import random
import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from model_checks import inductive, progress
from model_checks.generated import (
    PROGRESS_INVARIANTS,
    Model,
    constants_cfg,
    model_module,
    outcome,
    parallel,
    run_tlc,
)
from model_checks.tla import ODB_ACTION_PROPERTIES, ODB_INVARIANTS
from odb_core.config import TARGET_POLICIES

#: the monitor's counters (spec/Reach.tla CovKeys), summed over behaviours
COVERAGE = ("gathers", "emits", "skips", "chains", "splits", "overflows", "holds", "takebacks", "idle", "capped",
            "flushes", "oversize", "zeros", "quotacut", "claims")


def draw_lengths(rng: random.Random, n: int, budget: int, scale: float = 1.0) -> tuple[int, ...]:
    """``n`` realized lengths: 8% zeros, 7% over the budget (up to 3x), 20% uniform in
    1..budget, the rest lognormal (median ``scale`` x budget/8, sigma 0.9) clipped to the budget."""
    out = []
    for _ in range(n):
        u = rng.random()
        if u < 0.08:
            out.append(0)
        elif u < 0.15:
            out.append(rng.randint(budget + 1, 3 * budget))
        elif u < 0.35:
            out.append(rng.randint(1, budget))
        else:
            out.append(min(budget, max(1, round(rng.lognormvariate(math.log(scale * budget / 8), 0.9)))))
    return tuple(out)


def random_model(seed: int, world: int, join: bool, policy: str, regroup: bool, capacity: int | None = None,
                 views: tuple[int, int] = (20, 50), budget_kind: str = "padded", pool: int = 0,
                 reserve_divisor: int = 8) -> Model:
    """A model with seeded lengths: ``views`` per rank (uneven), each rank's lengths on a
    scale of its own (shards differ: short-heavy and long-heavy ranks), buffer size in
    4..16 and depth in buffer..16 (equal two times in five), capacity 0-4, under the
    padded or the packed budget (``budget_kind``); ``pool`` views of a shared tail (join),
    drawn last, so the other draws are those of the same model without one."""
    rng = random.Random(seed)
    budget = rng.choice([32, 64, 100])
    lengths = tuple(draw_lengths(rng, rng.randint(*views), budget, rng.lognormvariate(0, 0.7)) for _ in range(world))
    buffer_size = rng.randint(4, 16)
    depth = buffer_size if rng.random() < 0.4 else rng.randint(buffer_size, 16)
    cap = rng.randint(0, 4) if capacity is None else capacity
    reg = rng.choice([(1, 50), (1, 5), (1, 10)]) if regroup else (0, 0)
    overflow = rng.choice(["largest", "oldest"])
    quota = None if join else rng.randint(max(1, sum(map(len, lengths)) // 2), sum(map(len, lengths)))
    name = (f"w{world}_{'join' if join else 'nonjoin'}_{policy}_{'regroup' if regroup else 'plain'}"
            f"_cap{cap}{'_packed' if budget_kind == 'packed' else ''}_s{seed}")
    shared = draw_lengths(rng, pool, budget) if pool else ()
    name += f"_pool{pool}_div{reserve_divisor}" if pool else ""
    return Model(name, lengths, budget, buffer_size, depth, cap, join, quota, overflow, policy, reg, budget_kind,
                 shared, reserve_divisor)


#: the CI slice: the largest at W = 8, every policy, both modes, regroup on and off, capacities 0-4,
#: both budgets (the packed one in a join and a non-join model)
CI_MODELS = (
    random_model(11, 8, True, "balanced", True, capacity=0),
    random_model(12, 8, False, "paper", False, capacity=2),
    random_model(13, 5, True, "min", False, capacity=1, budget_kind="packed"),
    random_model(14, 4, False, "balanced", True, capacity=4, budget_kind="packed"),
    random_model(15, 3, False, "all-ready", True, capacity=3),
    random_model(16, 6, True, "paper", True, capacity=0),
    # the shared tail under the packed budget, its reserve dealt to ceil(6 / 2) = 3 ranks a round
    random_model(17, 6, True, "min", True, capacity=0, budget_kind="packed", pool=16, reserve_divisor=2),
)


def deep_models() -> tuple[Model, ...]:
    """``odb check --deep``: W in {2, 4, 8} x every policy x both modes x regroup on/off; the
    packed budget in every other model; three W=8 models with a shared tail."""
    out = []
    seed = 100
    for world in (2, 4, 8):
        for policy in TARGET_POLICIES:
            for join in (True, False):
                for regroup in (True, False):
                    seed += 1
                    out.append(random_model(seed, world, join, policy, regroup,
                                            budget_kind="packed" if seed % 2 else "padded"))
    # the shared tail: both budgets, the packed reserve dealt to one rank a round and to several
    out += [random_model(201, 8, True, "balanced", True, budget_kind="padded", pool=24),
            random_model(202, 8, True, "min", True, budget_kind="packed", pool=24),
            random_model(203, 8, True, "min", True, budget_kind="packed", pool=24, reserve_divisor=2)]
    return tuple(out)


@dataclass
class SimResult:
    """One model's simulation."""

    model: Model
    behaviours: int
    requested: int
    states: int
    max_level: int
    longest: int
    seconds: float
    outcome: str
    coverage: dict[str, int] = field(default_factory=dict)
    output: str = ""

    @property
    def passed(self) -> bool:
        """No invariant broke and every requested behaviour reached done."""
        return self.outcome == "ok" and self.behaviours == self.requested

    def to_json(self) -> dict[str, Any]:
        return {**self.model.describe(), "behaviours": self.behaviours, "requested": self.requested,
                "states": self.states, "longest_behaviour": self.longest, "max_level": self.max_level,
                "seconds": round(self.seconds, 2), "result": self.outcome, "passed": self.passed,
                "coverage": self.coverage}


REACH_LINE = re.compile(r'<<\s*"ODB-REACH",\s*\[(.*?)\],\s*(\d+)\s*>>', re.DOTALL)


def simulate(m: Model, behaviours: int, seed: int = 1, substitute: Iterable[str] = (),
             invariants: Sequence[str] = ODB_INVARIANTS + PROGRESS_INVARIANTS, workers: int = 1,
             timeout: float = 1800, short: bool = True) -> SimResult:
    """Simulate ``behaviours`` random behaviours of model ``m`` (TLC ``-simulate``).

    ``substitute`` adds cfg lines (``Op <- Other``: a seeded bug). The depth bound is
    generous (every behaviour must reach done before it, ``ReachedDone``)."""
    max_level = 40 * (m.views + 10)
    extra = f"Sim_MaxLevel == {max_level}\n"
    module = model_module("ReachModel", "Reach", m, extra)
    cfg = constants_cfg("ReachModel", m) + "    MaxLevel <- Sim_MaxLevel\n    PermTable <- NoPerms\n"
    cfg += "    Orders <- " + ("InOrder" if m.join else "RandomOrder") + "\n"
    cfg += "".join(f"    {s}\n" for s in substitute)
    cfg += "INIT SimInit\nNEXT SimNext\nINVARIANTS " + " ".join((*invariants, "ReachedDone")) + "\n"
    cfg += "PROPERTIES " + " ".join(ODB_ACTION_PROPERTIES) + "\n"  # checked on every simulated step
    # done states have no successor in SimNext (no stuttering to the depth), hence -deadlock;
    # a behaviour that stops short of done prints no ODB-REACH line and is counted missing
    text, seconds = run_tlc("ReachModel", cfg, {"ReachModel.tla": module},
                            ("-simulate", f"num={behaviours}", "-depth", str(max_level + 1), "-seed", str(seed),
                             "-deadlock"), workers=workers, timeout=timeout, short=short)
    cov = dict.fromkeys(COVERAGE, 0)
    lines = REACH_LINE.findall(text)
    longest = 0
    for body, level in lines:
        for k, v in re.findall(r"(\w+) \|-> (\d+)", body):
            cov[k] += int(v)
        longest = max(longest, int(level))
    states = re.findall(r"Progress: ([\d,]+) states checked", text)
    return SimResult(m, len(lines), behaviours, int(states[-1].replace(",", "")) if states else 0, max_level,
                     longest, seconds, outcome(text), cov, text)


@dataclass(frozen=True)
class SimBug:
    """A seeded bug the simulation must catch: TLC must report ``expected``."""

    name: str
    model: Model
    substitute: tuple[str, ...]
    expected: str
    invariants: tuple[str, ...] = ODB_INVARIANTS + PROGRESS_INVARIANTS
    behaviours: int = 20
    why: str = ""


SMALL = random_model(21, 2, True, "paper", False, capacity=0, views=(20, 24))
SIM_BUGS = (
    SimBug("split3", CI_MODELS[5], ("AlignOp <- MutAlignSplit3",), "invariant:Lockstep",
           why="a rank splits at most 3 times: every quick configuration passes with it (--deep checks)"),
    SimBug("keep4", CI_MODELS[0], ("Rest <- MutRestKeep4",), "invariant:NoLeak",
           why="a ready rank keeps at most 4 samples of overflow and held groups: missed by the 2x4 models"),
    SimBug("no_flush_never_done", SMALL, ("Status <- MutStatusNoFlush",), "invariant:ReachedDone", ODB_INVARIANTS,
           behaviours=5, why="without the progress invariants a stuck behaviour runs to the depth bound undone"),
    SimBug("no_flush_progress", SMALL, ("Status <- MutStatusNoFlush",), "invariant:QuiescentProgress",
           behaviours=5, why="the progress invariant sees the stuck state at once"),
    SimBug("claim_prev_only", CI_MODELS[6], ("ClaimWith <- MutClaimWithPrevOnly",), "invariant:PoolOnce",
           behaviours=6, why="a claim's pool indices offset by the rank just before only: the real rule at two "
                             "ranks (every quick pool configuration); at W=6 two claiming ranks with a third "
                             "between them are dealt the same views"),
)


@dataclass
class BugResult:
    name: str
    expected: str
    outcome: str
    seconds: float
    why: str

    @property
    def passed(self) -> bool:
        return self.outcome == self.expected

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "expected": self.expected, "result": self.outcome, "caught": self.passed,
                "seconds": round(self.seconds, 2), "why": self.why}


def run_bug(b: SimBug) -> BugResult:
    r = simulate(b.model, b.behaviours, substitute=b.substitute, invariants=b.invariants)
    return BugResult(b.name, b.expected, r.outcome, r.seconds, b.why)


#: behaviours per model: the CI slice and --deep
CI_BEHAVIOURS = 6
DEEP_BEHAVIOURS = 40


def all_models(deep: bool) -> tuple[Model, ...]:
    """The simulated models of the CI slice, and with ``deep`` the long slice's too."""
    return CI_MODELS + (deep_models() if deep else ())


def picked_checks(deep: bool, select: str) -> tuple[list[Any], list[Any], list[Any], list[Any]]:
    """The simulated models, simulation bugs, progress and inductiveness checks whose
    ``reach_<kind>_<name>`` matches the glob ``select`` (see :func:`check_reach`)."""

    def picked(kind: str, name: str) -> bool:
        return fnmatch.fnmatch(f"reach_{kind}_{name}", select)

    models = [m for m in all_models(deep) if picked("sim", m.name)]
    sim_bugs = [b for b in SIM_BUGS if picked("simbug", b.name)]
    prog_checks = [c for c in (progress.quick_checks(None if deep else progress.CI_QUICK) + progress.BUGS
                               + (progress.deep_checks() if deep else ())) if picked("progress", c.name)]
    ind_checks = [c for c in inductive.CI_CHECKS + (inductive.deep_checks() if deep else ())
                  if picked("inductive", c.name)]
    return models, sim_bugs, prog_checks, ind_checks


def check_reach(deep: bool = False, select: str = "*", say: Callable[[str], None] = lambda _: None,
                jobs: int | None = None) -> dict[str, Any] | None:
    """Simulation, progress and inductiveness, with their seeded bugs: ``odb check``'s ``reach``.

    ``select`` picks checks by glob over their names: ``reach_sim_<model>``,
    ``reach_simbug_<bug>``, ``reach_progress_<check>``, ``reach_inductive_<check>``;
    None when it picks nothing."""
    started = time.perf_counter()
    models, sim_bugs, prog_checks, ind_checks = picked_checks(deep, select)
    if not (models or sim_bugs or prog_checks or ind_checks):
        return None

    n = DEEP_BEHAVIOURS if deep else CI_BEHAVIOURS
    sims = parallel(lambda m: simulate(m, n, short=not deep), models, jobs)
    for r in sims:
        say(f"  simulate {r.model.name}: {r.outcome}, {r.behaviours}/{r.requested} behaviours done, "
            f"{r.states} states, {r.seconds:.1f}s")
    bugs = parallel(run_bug, sim_bugs, jobs)
    for b in bugs:
        say(f"  simulate bug {b.name}: {b.outcome} ({'caught' if b.passed else 'expected ' + b.expected})")
    coverage = {k: sum(r.coverage.get(k, 0) for r in sims) for k in COVERAGE}
    # every counter non-zero over the whole slice: the simulation exercised every branch
    covered = len(models) < len(all_models(deep)) or all(coverage.values())
    simulation: dict[str, Any] = {
        "models": [r.to_json() for r in sims],
        "behaviours": sum(r.behaviours for r in sims),
        "states": sum(r.states for r in sims),
        "largest": None,
        "coverage": coverage,
        "every_branch_covered": covered,
        "bugs": [b.to_json() for b in bugs],
        "ok": all(r.passed for r in sims) and all(b.passed for b in bugs) and covered,
    }
    if sims:
        largest = max(sims, key=lambda r: (r.model.world, r.model.views))
        simulation["largest"] = {**largest.model.describe(), "views": largest.model.views,
                                 "behaviours": largest.behaviours, "states": largest.states,
                                 "seconds": round(largest.seconds, 2)}

    prog = parallel(progress.run_progress, prog_checks, jobs)
    for p in prog:
        say(f"  progress {p.check.name}: {p.outcome} ({p.distinct_states} states)"
            f"{'' if p.passed else '  <-- expected ' + p.check.expected}")
    missed = []
    if deep and sim_bugs:  # the exhaustive quick configurations do not catch split3 (informational)
        split3 = [progress.ProgressCheck(c.name, c.base, "ok", SIM_BUGS[0].substitute)
                  for c in progress.quick_checks()]
        missed = parallel(progress.run_progress, split3, jobs)
        say(f"  split3 under the quick configurations: caught by {[m.check.name for m in missed if not m.passed]}")

    ind = parallel(inductive.run_check, ind_checks, jobs)
    for i in ind:
        say(f"  inductive {i.check.name}: {i.outcome} ({i.initial_states} initial states)"
            f"{'' if i.passed else '  <-- expected ' + i.check.expected}")
    return {
        "ok": simulation["ok"] and all(p.passed for p in prog) and all(i.passed for i in ind),
        "simulation": simulation,
        "progress": [p.to_json() for p in prog],
        "split3_under_quick": {m.check.name: m.outcome for m in missed},
        "inductive": [i.to_json() for i in ind],
        "seconds": round(time.perf_counter() - started, 1),
    }
