"""Seeded bugs in odb_core, hunted with hypothesis.

Each mutant of :data:`~model_checks.mutants.MUTANTS` is the core's twin of a spec mutant
(spec/cfg/mutant_*.cfg); :data:`EXTRA_HUNTS` are the shared tail's claim bugs that lose or
repeat pool views (spec ``PoolOnce``; their spec twin is the reach simulation's
``MutClaimWithPrevOnly``) and the adapter's quota counted per rank (its sibling, the
quota checked once per round, is caught by replaying a real run's traces). A hunt
searches random simulation cases for one whose epoch violates the property the mutant
breaks; finding one means the hypothesis suite catches the bug.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, find, settings
from hypothesis.errors import NoSuchExample

from model_checks.mutants import MUTANTS, PACKED_MUTANTS, POOL_MUTANTS, POOLED_MUTANTS, driver
from model_checks.strategies import Case, cases
from odb_core import ODBError, RankProtocol, simulate
from odb_core.budgets import within_budget
from odb_core.config import BUDGETS
from odb_core.errors import RoundBoundError

#: mutants hunted besides :data:`MUTANTS`: the shared tail's that lose or repeat pool views, and an adapter's
EXTRA_HUNTS = ("double-deal", "drop-last-claim", "local-quota")

#: the property each mutant breaks, as :func:`violations` names them
BREAKS = {
    "no-cmin": "capacity",
    "max-groups": "wire",  # a step vector longer than the round's target: the peers' decode refuses it
    "drop-overflow": "P1",
    "early-finish": "P4",
    "merge-overflow": "P3",
    "no-chain": "P5",
    "pack-overfill": "P3",
    "fill-no-fallback": "P6",
    "split-dup": "wire",  # a step vector emits more samples than its header holds: the peers' decode refuses it
    "reemit": "P4",
    "double-deal": "P4",
    "drop-last-claim": "P4",
    "local-quota": "P2",
}
#: the cases a hunt draws from: (modes, need_capacity); PACKED_MUTANTS draw the packed budget only
SEARCH = {
    "no-cmin": (("join", "non-join"), True),
    "max-groups": (("join", "non-join"), False),
    "drop-overflow": (("join", "non-join"), True),
    "early-finish": (("join",), False),
    "merge-overflow": (("join", "non-join"), True),
    "no-chain": (("non-join",), False),
    "pack-overfill": (("join", "non-join"), False),
    "fill-no-fallback": (("join",), False),
    "split-dup": (("join",), False),
    "reemit": (("join",), False),
    "double-deal": (("join",), False),
    "drop-last-claim": (("join",), False),
    "local-quota": (("non-join",), False),
}


def violations(case: Case) -> set[str]:
    """Names of the properties this simulated epoch violates.

    ``P1`` partition at every round, ``P2`` equal item counts, ``wire`` the core's own checks
    of its peers' vectors raised a typed :class:`~odb_core.ODBError` (a wrong-length step
    vector, more samples than a header holds: the epoch stops before a property can break,
    so no property is observed), ``P6`` a logical
    iteration past the simulator's round bound (it would never end), ``P3``
    budget (the configured one: padded or packed), ``P4`` join coverage (each rank emits its
    views, and over all ranks every dataset index is emitted: a pool view dealt to two ranks
    leaves another undealt, and the rank-by-rank check, which takes each rank's views with its
    claims as given, sees neither), ``P5`` quota closure,
    ``capacity`` items per round within the output capacity.
    """
    found: set[str] = set()

    def observe(protos: list[RankProtocol]) -> None:
        for p in protos:
            parts = [*p.remaining, *p.in_flight, *p.buffered, *p.emitted]
            if sorted(parts) != list(range(len(p.views))):
                found.add("P1")

    try:
        result = simulate(case.lengths, case.world, case.config, case.schedule, observer=observe,
                          driver_cls=driver(case.mutant))
    except RoundBoundError:
        return found | {"P6"}
    except ODBError:
        return found | {"wire"}
    cfg = case.config
    rounds = [Counter((s.iteration, s.round) for s in steps) for steps in result.steps]
    if any(c != rounds[0] for c in rounds):
        found.add("P2")
    if cfg.output_capacity and any(v > cfg.output_capacity for c in rounds for v in c.values()):
        found.add("capacity")
    for steps in result.steps:
        for s in steps:
            if not within_budget(cfg.budget, s.lengths, cfg.token_budget):
                found.add("P3")
    if cfg.mode == "join":
        for r, steps in enumerate(result.steps):
            if Counter(i for s in steps for i in s.identities) != Counter(result.shards[0][r]):
                found.add("P4")
        emitted = {i for steps in result.steps for s in steps for i in s.identities}
        if emitted != set(range(len(case.lengths))):
            found.add("P4")  # the rank-by-rank check trusts each rank's views, claims included
    else:
        n = len(case.lengths)
        if not n <= result.quota_emitted <= n + result.max_step_samples:
            found.add("P5")
    return found


def mutated(case: Case, mutant: str) -> Case:
    """The same case run by the mutant's driver."""
    return Case(case.world, case.lengths, case.config, case.schedule, mutant)


def hunt(mutant: str, max_examples: int = 2000) -> Case | None:
    """A case on which ``mutant`` violates the property it breaks, or None if hypothesis finds none."""
    if mutant not in MUTANTS and mutant not in EXTRA_HUNTS:
        raise ValueError(f"unknown mutant {mutant!r}")
    modes, need_capacity = SEARCH[mutant]
    budgets = ("packed",) if mutant in PACKED_MUTANTS else BUDGETS
    try:
        return find(
            cases(modes=modes, max_n=300, need_capacity=need_capacity, budgets=budgets,
                  pooled=mutant in POOLED_MUTANTS or mutant in POOL_MUTANTS),
            lambda c: BREAKS[mutant] in violations(mutated(c, mutant)),
            # derandomized: the same search every run (a random one took 2-26 s for one mutant in CI)
            settings=settings(max_examples=max_examples, database=None, deadline=None, derandomize=True,
                              suppress_health_check=list(HealthCheck)),
        )
    except NoSuchExample:
        return None
