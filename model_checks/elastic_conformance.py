"""Conformance between odb_core.elastic and spec/Elastic.tla: the merge and the deal, checked by TLC.

Elastic.tla runs ODB unchanged from the initial state its ``DealOp`` builds: rank r of W'
holds ``Unyielded[r], Unyielded[r + W'], ...`` of the global positions the run before
the resume did not yield. ODB.tla itself is linked to the core by ``conformance.py``
(state-space equality on small scenarios, trace replay of random ones); what links Elastic.tla
is that its deal, from the consumed set its ``YieldedOf`` maps every rank's yielded sampler
positions to, is :func:`odb_core.elastic.assign_views` over the
:class:`~odb_core.elastic.GlobalState` that :func:`~odb_core.elastic.merge_states`
returns from the same states. This module draws random cases (an epoch's global order of
lengths, W ranks' state_dict-shaped states with random consumed sets, W'), merges and deals
with the core, and has TLC merge and deal through a parameterised ``INSTANCE Elastic``: one
TLC run, whose ASSUME prints the cases where the spec's deal differs from each
implementation's (the core's and seeded wrong ones, of the merge or of the deal).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

from model_checks.tla import SPEC_DIR, TlcRun, mismatches
from odb_core.elastic import assign_views, merge_states

States = list[dict[str, Any]]
Deal = Callable[[States, int, int], list[int]]


def _core(states: States, world: int, rank: int) -> list[int]:
    return assign_views(merge_states(states), world, rank)


def _forget_buffered(states: States, world: int, rank: int) -> list[int]:
    """Seeded bug (Elastic.tla's MutDealForget): the first remaining view counted as consumed."""
    return merge_states(states).remaining()[1:][rank::world]


def _blocks(states: States, world: int, rank: int) -> list[int]:
    """Seeded bug: contiguous blocks instead of the round-robin deal (exactly once too, but not the spec's)."""
    rest = merge_states(states).remaining()
    return rest[rank * len(rest) // world:(rank + 1) * len(rest) // world]


def _merge_forgets_last_rank(states: States, world: int, rank: int) -> list[int]:
    """Seeded bug of the merge: the last rank's yielded views are not counted (dealt and trained again)."""
    return assign_views(merge_states([*states[:-1], {**states[-1], "consumed": []}]), world, rank)


IMPLEMENTATIONS: dict[str, Deal] = {"core": _core, "forget_buffered": _forget_buffered, "blocks": _blocks,
                                    "merge_forgets_last_rank": _merge_forgets_last_rank}


def random_case(rng: random.Random) -> tuple[list[int], States, int]:
    """(lengths of the global order, W ranks' states of one step boundary, W')."""
    world, per_rank = rng.randint(1, 4), rng.randint(1, 4)
    total = world * per_rank
    states = []
    for rank in range(world):
        consumed = sorted(rng.sample(range(per_rank), rng.randint(0, per_rank)))
        states.append({"rank": rank, "world_size": world, "epoch": 1, "steps": 3, "seed": 0, "total": total,
                       "order_world": world, "consumed": consumed})
    return [rng.randint(1, 12) for _ in range(total)], states, rng.randint(1, 4)


def tla_value(value: Any) -> str:
    """TLA+ text of ints, sets (sorted) and sequences (lists, tuples), nested."""
    if isinstance(value, (set, frozenset)):
        return "{" + ", ".join(map(tla_value, sorted(value))) + "}"
    if isinstance(value, (list, tuple)):
        return "<<" + ", ".join(map(tla_value, value)) + ">>"
    return str(value)


def conformance_module(cases: Sequence[tuple[list[int], States, int]], impls: dict[str, Deal]) -> str:
    """The TLA+ module: every case's spec merge and deal against each implementation's (1-based
    positions). The spec merges the raw states itself (``YieldedOf``), so a wrong merge differs too."""
    rows = []
    for lengths, states, world in cases:
        deals = {name: [[g + 1 for g in deal(states, world, r)] for r in range(world)] for name, deal in impls.items()}
        fields = ", ".join(f"{name} |-> {tla_value(d)}" for name, d in deals.items())
        yielded = [{p + 1 for p in s["consumed"]} for s in sorted(states, key=lambda s: s["rank"])]
        rows.append(f"[g |-> {tla_value(lengths)}, y |-> {tla_value(yielded)}, ow |-> {len(states)}, w |-> {world}, "
                    f"{fields}]")
    checks = "\n".join(
        f'ASSUME PrintT(<<"mismatch", "{name}", {{k \\in 1..Len(Cases) : '
        f"[r \\in 1..Cases[k].w |-> ElasticAt(Cases[k].g, YieldedOf(Cases[k].y, Cases[k].ow), Cases[k].w)!DealOp(r)]"
        f" # Cases[k].{name}}}>>)"
        for name in impls)
    return ("---- MODULE ElasticConformance ----\nEXTENDS Elastic, TLC\n"
            "ElasticAt(g, c, w) == INSTANCE Elastic WITH GLen <- g, Consumed <- c, W <- w\n"
            f"Cases == <<{', '.join(rows)}>>\n{checks}\nStutter == UNCHANGED vars\n====\n")


def run_conformance(seed: int = 0, n: int = 60, impls: dict[str, Deal] | None = None) -> tuple[dict[str, set[int]], TlcRun]:
    """Each implementation's mismatching case numbers (1-based; empty: it deals as the spec) and the TLC run."""
    impls = impls or IMPLEMENTATIONS
    rng = random.Random(seed)
    cases = [random_case(rng) for _ in range(n)]
    cfg = SPEC_DIR / "cfg" / "elastic" / "quick_resume_3_to_2.cfg"
    return mismatches("ElasticConformance", conformance_module(cases, impls), cfg)
