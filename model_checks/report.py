"""``odb check``: SANY and TLC on every configuration, mutants, and conformance.

Exits non-zero when any configuration does not produce its expected outcome, a
mutant survives TLC or hypothesis, a clean trace is rejected or a mutant trace
accepted, a state space differs, or a ``reach`` check fails (simulation at W <= 8,
the progress invariants, inductiveness: :mod:`model_checks.reach`).
"""

from __future__ import annotations

import fnmatch
import sys
import time
from typing import Any

from tqdm import tqdm

from model_checks import conformance
from model_checks import traces as trace_validation
from model_checks.mutants import MUTANTS
from model_checks.mutation import hunt
from model_checks.reach import check_reach, picked_checks
from model_checks.suites import configs, run_config
from model_checks.tla import sany

#: traces per TLC run (amortises the JVM start; one TraceData module each)
TRACE_BATCH = trace_validation.TRACE_BATCH
#: which spec mutant configuration matches each core mutant
SPEC_MUTANT = {m: "mutant_" + m.replace("-", "_") for m in MUTANTS}


def check(
    deep: bool = False,
    select: str = "*",
    traces: int = 520,
    mutant_traces_each: int = 20,
    hunt_examples: int = 2000,
    progress: bool = False,
    scenarios: str = "*",
    real_traces: str | None = None,
) -> dict[str, Any]:
    """Run the model checks; return the ``odb check --json`` object (``ok`` says all passed).

    ``real_traces``: a directory of real runs' trace logs (``ODB_TRACE_DIR`` of the loader;
    one subdirectory per scenario, or the logs themselves) to replay with every invariant.

    ``select`` picks TLC configurations and ``scenarios`` the core-vs-spec state-space
    scenarios by glob; ``state_space_equal`` is None when no scenario was picked. The
    ``reach`` object (simulation at W <= 8, progress, inductiveness:
    :func:`model_checks.reach.check_reach`) holds the ``reach_*`` checks ``select`` picks,
    None when none; ``deep`` runs its longer slice. ``progress``: each result as a line
    on stdout and a bar over the runs on stderr (when it is a terminal)."""
    started = time.perf_counter()
    kinds = ("quick", "sanity", "mutant") + (("deep",) if deep else ())
    paths = [p for p in configs(kinds, subfolders=True) if fnmatch.fnmatch(p.stem, select)]
    picked = [s for s in conformance.STATE_SPACE_SCENARIOS if fnmatch.fnmatch(s.name, scenarios)]
    warnings = _screen_request(deep, select, paths, picked, traces, mutant_traces_each, hunt_examples,
                                       real_traces)
    total = len(paths) + len(MUTANTS) + len(picked) + 3 + (real_traces is not None)
    with _Progress(total, progress) as say:
        sany("MC")
        results = []
        for path in paths:
            say.stage(f"TLC {path.stem}")
            res = run_config(path)
            say(f"  {res.name}: {res.run.outcome} ({res.run.distinct_states} states, {res.run.seconds:.1f}s)"
                f"{'' if res.passed else '  <-- expected ' + res.expected}")
            say.done()
            results.append(res)
        mutants = _mutants({r.name: r for r in results}, hunt_examples, say)
        conf = _conformance(picked, traces, mutant_traces_each, say)
        say.stage("reach")
        reach = check_reach(deep=deep, select=select, say=say)
        say.done()
        if real_traces is not None:
            say.stage("real traces")
            conf["real_traces"] = replay_real_traces(real_traces)
            say.done()
            if conf["real_traces"]["incomplete"]:
                warnings.append(f"{len(conf['real_traces']['incomplete'])} real runs stopped before every rank's end "
                                "(a fault, or a stop to resume): replayed up to the cut, with no end-of-run check: "
                                + ", ".join(conf["real_traces"]["incomplete"]))
    real = conf["real_traces"]
    ok = (
        all(r.passed for r in results)
        and all(m["caught_by_tlc"] is not False and m["caught_by_hypothesis"] is not False for m in mutants)
        and conf["traces_accepted"] == conf["traces_checked"]
        and conf["mutant_traces_rejected"] == conf["mutant_traces"]
        and all(n == mutant_traces_each for n in conf["mutant_traces_found"].values())
        and conf["mutant_traces_wrong_reason"] == 0
        and conf["state_space_equal"] is not False
        and (real is None or real["accepted"] == real["checked"])
        and (reach is None or reach["ok"])
    )
    return {
        "ok": ok,
        "configs": [r.to_json() for r in results],
        "mutants": mutants,
        "conformance": conf,
        "reach": reach,
        "warnings": warnings,
        "seconds": round(time.perf_counter() - started, 1),
    }


def _screen_request(deep: bool, select: str, paths: list[Any], picked: list[Any], traces: int,
                            mutant_traces: int, hunt_examples: int, real_traces: str | None) -> list[str]:
    """ValueError for a request that would check nothing (no configuration or reach check picked,
    no scenario, no traces, no hunts, no real traces), for a negative count, and for a
    ``real_traces`` directory without trace logs: a check must not report a pass for nothing.
    Returns the warnings of a request that checks less than it names (a ``select`` glob that
    picks no configuration and no reach check while other checks still run)."""
    from pathlib import Path

    for name, value in (("traces", traces), ("mutant traces", mutant_traces), ("hunt examples", hunt_examples)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    if real_traces is not None and not any(Path(real_traces).rglob("*-rank*.jsonl")):
        raise ValueError(f"--real-traces {real_traces!r} holds no trace logs (*-rank*.jsonl): "
                         "is it the run's ODB_TRACE_DIR?")
    selected = bool(paths) or any(picked_checks(deep, select))
    if not (selected or picked or traces or mutant_traces or hunt_examples or real_traces is not None):
        raise ValueError(f"nothing to check: --select {select!r} matches no TLC configuration and no reach_* check"
                         f"{'' if deep else ' (deep ones need --deep)'}, and no scenario, trace or hunt is asked for")
    return [] if selected else [f"--select {select!r} matches no TLC configuration and no reach_* check"]


class _Progress:
    """``say(line)`` prints a result line on stdout; a tqdm bar on stderr counts the runs
    (``stage`` names the one under way, ``done`` ends it). Silent when not enabled."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.enabled = enabled
        self.bar = tqdm(total=total, desc="odb check", unit="runs", file=sys.stderr, dynamic_ncols=True,
                        disable=None if enabled else True)

    def __enter__(self) -> _Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.close()

    def stage(self, name: str) -> None:
        self.bar.set_postfix_str(name)

    def done(self) -> None:
        self.bar.update()

    def __call__(self, msg: str) -> None:
        if self.enabled:
            self.bar.write(msg, file=sys.stdout)


def _mutants(by_name: dict[str, Any], hunt_examples: int, say: _Progress) -> list[dict[str, Any]]:
    """Each core mutant: caught by its spec mutant under TLC, and by hypothesis (None: not run)."""
    mutants = []
    for m in MUTANTS:
        say.stage(f"hunt {m}")
        spec_cfg = by_name.get(SPEC_MUTANT[m])
        caught_hyp = hunt(m, hunt_examples) is not None if hunt_examples else None
        mutants.append({
            "name": m,
            "caught_by_tlc": None if spec_cfg is None else spec_cfg.passed,
            "caught_by_hypothesis": caught_hyp,
            "breaks": spec_cfg.expected if spec_cfg else None,
        })
        say(f"  mutant {m}: tlc={mutants[-1]['caught_by_tlc']} hypothesis={caught_hyp}")
        say.done()
    return mutants


def _conformance(picked: list[Any], traces: int, mutant_traces_each: int, say: _Progress) -> dict[str, Any]:
    """State spaces of core and spec, clean traces replayed under TLC, mutant traces rejected."""
    spaces = []
    for scenario in picked:
        say.stage(f"state space {scenario.name}")
        sp = conformance.compare_state_spaces(scenario)
        spaces.append(sp)
        say(f"  state space {sp.scenario}: {sp.python_states} vs {sp.tlc_states} states, "
            f"{sp.python_transitions} vs {sp.tlc_transitions} transitions")
        say.done()
    say.stage(f"replay {traces} traces")
    clean = conformance.clean_traces(traces)
    verdicts = trace_validation.replay(clean, batch=TRACE_BATCH)
    say.done()
    accepted = {v.index for v in verdicts if v.accepted}
    coverage = trace_validation.coverage_report(clean)["total"] if clean else {}
    say.stage("replay mutant traces")
    per_mutant = conformance.mutant_traces(mutant_traces_each)
    bad = [t for ts in per_mutant.values() for t in ts]
    bad_verdicts = trace_validation.replay(bad, batch=TRACE_BATCH)
    rejected = {v.index for v in bad_verdicts if not v.accepted}
    say.done()
    say(f"  traces: {len(accepted)}/{len(clean)} accepted; mutant traces rejected {len(rejected)}/{len(bad)}")
    for v in verdicts:
        if not v.accepted:
            say(f"    {v.describe()}")
    names = [m for m, ts in per_mutant.items() for _ in ts]
    rejected_by: dict[str, list[str]] = {}
    wrong_reason = 0  # rejected, but not by the invariant the mutant's spec twin breaks
    for m, v in zip(names, sorted(bad_verdicts, key=lambda v: v.index)):
        rejected_by.setdefault(m, [])
        if not v.accepted and ",".join(v.reasons) not in rejected_by[m]:
            rejected_by[m].append(",".join(v.reasons))
        wrong_reason += not v.accepted and conformance.REJECTED_BY[m] not in v.reasons
    return {
        "traces_checked": len(clean),
        "traces_accepted": len(accepted),
        "trace_rejections": [v.describe() for v in verdicts if not v.accepted],
        "trace_coverage": coverage,
        "mutant_traces_rejected_by": rejected_by,
        "mutant_traces_found": {m: len(ts) for m, ts in per_mutant.items()},  # each must reach the count asked
        "mutant_traces_wrong_reason": wrong_reason,
        "mutant_traces": len(bad),
        "mutant_traces_rejected": len(rejected),
        "state_space_equal": all(s.states_equal and s.transitions_equal for s in spaces) if spaces else None,
        "state_spaces": [s.__dict__ for s in spaces],
        "real_traces": None,
    }


def replay_real_traces(directory: str) -> dict[str, Any]:
    """Merge and replay every run under ``directory`` (each subdirectory a scenario): counts
    checked and accepted, per scenario, with the verdicts of rejected runs, the coverage, and
    ``incomplete``: the runs (``scenario/run``) some rank of which never logged ``end`` (cut by
    a fault, or stopped to be resumed), replayed up to the cut only, where no end-of-run
    property (Done, JoinCoverage, QuotaClosure) applies: ``odb check`` warns, naming them."""
    from pathlib import Path

    root = Path(directory)
    by_scenario: dict[str, dict[str, int]] = {}
    traces = []
    incomplete = []
    for folder in sorted({p.parent for p in root.rglob("*-rank*.jsonl")}):
        name = str(folder.relative_to(root)) if folder != root else "."
        merged = trace_validation.merge_directory(folder)
        traces.extend(merged)
        incomplete += [f"{name}/{t.scenario.name}" for t in merged if not t.complete]
        by_scenario[name] = {"runs": len(merged)}
    verdicts = trace_validation.replay(traces) if traces else []
    names = [s for s, v in by_scenario.items() for _ in range(v["runs"])]
    for name, v in zip(names, verdicts):
        by_scenario[name]["accepted"] = by_scenario[name].get("accepted", 0) + int(v.accepted)
    return {"checked": len(traces), "accepted": sum(v.accepted for v in verdicts), "by_scenario": by_scenario,
            "rejections": [v.describe() for v in verdicts if not v.accepted], "incomplete": incomplete,
            "coverage": trace_validation.coverage_report(traces)["total"] if traces else {}}
