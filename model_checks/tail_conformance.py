"""Conformance between odb_core.tail and spec/TailResume.tla: the resumed views, checked by TLC.

TailResume.tla runs ODB unchanged from the initial state its ``ResumedOp`` builds: rank r's
own positions not yielded, then its claimed pool views not yielded, the pool going on from
the cursor. What links it to the core is that ``ResumedOp`` is
:func:`odb_core.tail.resumed_positions` (1-based there, 0-based here: own position p and pool
index j at ``own + j`` both shift by one). This module draws random cases (W ranks' own
views, a pool, a cursor, claims dealt in order, yielded positions among a rank's own and
claimed ones), computes each implementation's views (the core's and seeded wrong ones), and
has TLC evaluate ``ResumedOp`` of every case through a parameterised ``INSTANCE
TailResume``: one TLC run, whose ASSUME prints the cases where the spec differs from each.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from model_checks.elastic_conformance import tla_value
from model_checks.tla import SPEC_DIR, TlcRun, mismatches
from odb_core.tail import TailPosition, resumed_positions

Resume = Callable[[int, int, frozenset[int], TailPosition, int], list[int]]
Case = tuple[list[list[int]], list[int], int, list[list[int]], list[set[int]]]


def _forget_claims(own: int, pool: int, skip: frozenset[int], tail: TailPosition, rank: int) -> list[int]:
    """Seeded bug (TailResume.tla's MutForgetClaims): claimed views not yielded are not served again."""
    return [p for p in resumed_positions(own, pool, skip, tail, rank) if p < own]


def _claims_first(own: int, pool: int, skip: frozenset[int], tail: TailPosition, rank: int) -> list[int]:
    """Seeded bug: the same views, claims first (exactly once too, but not the spec's order)."""
    out = resumed_positions(own, pool, skip, tail, rank)
    return [p for p in out if p >= own] + [p for p in out if p < own]


IMPLEMENTATIONS: dict[str, Resume] = {"core": resumed_positions, "forget_claims": _forget_claims,
                                      "claims_first": _claims_first}


def random_case(rng: random.Random) -> Case:
    """(own lengths per rank, pool lengths, cursor, claims per rank (0-based), yielded positions per rank)."""
    world = rng.randint(1, 3)
    own = [[rng.randint(1, 9) for _ in range(rng.randint(0, 4))] for _ in range(world)]
    pool = [rng.randint(1, 9) for _ in range(rng.randint(0, 5))]
    cursor = rng.randint(0, len(pool))
    claims: list[list[int]] = [[] for _ in range(world)]
    for j in range(cursor):
        claims[rng.randrange(world)].append(j)
    used = [{p for p in [*range(len(own[r])), *(len(own[r]) + j for j in claims[r])] if rng.random() < 0.4}
            for r in range(world)]
    return own, pool, cursor, claims, used


def conformance_module(cases: Sequence[Case], impls: dict[str, Resume]) -> str:
    """The TLA+ module: every case's spec views against each implementation's (1-based positions)."""
    rows = []
    for own, pool, cursor, claims, used in cases:
        views = {name: [[p + 1 for p in resume(len(own[r]), len(pool), frozenset(used[r]),
                                               TailPosition(cursor, tuple(claims[r])), r)]
                        for r in range(len(own))] for name, resume in impls.items()}
        fields = ", ".join(f"{name} |-> {tla_value(v)}" for name, v in views.items())
        rows.append(f"[o |-> {tla_value(own)}, l |-> {tla_value(pool)}, c |-> {cursor}, "
                    f"k |-> {tla_value([[j + 1 for j in cl] for cl in claims])}, "
                    f"u |-> {tla_value([{p + 1 for p in u} for u in used])}, w |-> {len(own)}, {fields}]")
    at = "TailAt(Cases[k].o, Cases[k].l, Cases[k].c, Cases[k].k, Cases[k].u, Cases[k].w)"
    checks = "\n".join(
        f'ASSUME PrintT(<<"mismatch", "{name}", {{k \\in 1..Len(Cases) : '
        f"[r \\in 1..Cases[k].w |-> {at}!ResumedOp(r)] # Cases[k].{name}}}>>)" for name in impls)
    return ("---- MODULE TailConformance ----\nEXTENDS TailResume, TLC\n"
            "TailAt(o, l, c, k, u, w) == INSTANCE TailResume WITH OwnLen <- o, PoolLen <- l, Cursor0 <- c, "
            "Claimed0 <- k, Used0 <- u, W <- w\n"
            f"Cases == <<{', '.join(rows)}>>\n{checks}\nStutter == UNCHANGED vars\n====\n")


def run_conformance(seed: int = 0, n: int = 60, impls: dict[str, Resume] | None = None
                    ) -> tuple[dict[str, set[int]], TlcRun]:
    """Each implementation's mismatching case numbers (1-based; empty: it resumes as the spec) and the TLC run."""
    impls = impls or IMPLEMENTATIONS
    rng = random.Random(seed)
    cases = [random_case(rng) for _ in range(n)]
    cfg = SPEC_DIR / "cfg" / "tail" / "quick_tail_resume_2.cfg"
    return mismatches("TailConformance", conformance_module(cases, impls), cfg)
