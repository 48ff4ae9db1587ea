"""Which online packing rule the packed budget uses (issue 16), on measurements (not a test).

    .venv/bin/python benchmarks/bench_packing_rule.py            # 200,000 samples per distribution
    .venv/bin/python benchmarks/bench_packing_rule.py --samples 50000 --json

**Packing efficiency** = real tokens / (L_max x groups), over-budget singletons (a sample
longer than L_max, alone) left out of both. For each fitted length distribution of
:mod:`odb_core.distributions` (seed 0), L_max 8192 and a buffer of 1024 samples:

* **online rules**, one rank with nothing to align (every group it forms is emitted, as
  the protocol does at W = 1): the buffer fills to 1024 samples in arrival order, the
  rule groups it, the groups leave; with ``+hold`` the groups whose unused budget is
  above 2% are held back one round (the protocol's regroup, :func:`odb_core.grouping.hold_sparse`
  with area L_max: at most D = 1024 samples, never twice in a row) and regroup with the
  next arrivals. Rules: ``nfd`` next-fit decreasing (contiguous runs of the sorted buffer,
  the cheapest), ``ffd`` first-fit decreasing, ``bfd`` best-fit decreasing (the core's
  :func:`odb_core.packing.pack_buffer` with nothing held, checked against this file's own
  best-fit), ``wfd`` worst-fit decreasing, and ``bfd-hf``, best fit walking the samples held
  at the last round first (the core's rule: ``pack_buffer`` given the held set);
* the **offline oracle**: first-fit decreasing over all the distribution's lengths at once,
  and the bound no packing beats, ceil(sum of sizes / L_max) groups;
* **cost**: the median CPU time of one rule on one full buffer (1024 samples, every tenth
  key marked held), and of
  the padded budget's B(l) walk (``blwalk``) for scale;
* **protocol**: ``audit(simulate(...)).budget_fill`` of the real protocol with
  ``budget="packed"`` at W = 1 and W = 8 (balanced target, regroup 0.02 and off), against
  the padded budget's fill; in brackets the alignment overhead (extra steps from splits).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from bisect import bisect_left, insort
from collections.abc import Callable, Sequence
from fractions import Fraction
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from odb_core import ODBConfig, audit, simulate  # noqa: E402
from odb_core.config import BUDGETS  # noqa: E402
from odb_core.distributions import DISTRIBUTIONS, sample_lengths  # noqa: E402
from odb_core.grouping import group_buffer, hold_sparse  # noqa: E402
from odb_core.packing import pack_buffer, size_of  # noqa: E402
from odb_tools.bench_packed import first_fit_in_order  # noqa: E402

L_MAX, BUFFER = 8192, 1024
Rule = Callable[[dict[int, int], int, set[int]], list[list[int]]]
"""A rule over one buffer (key -> length), L_max and the keys held back at the last round."""


def _descending(lengths: dict[int, int]) -> list[int]:
    return list(reversed(sorted(sorted(lengths), key=lengths.__getitem__)))


def next_fit(lengths: dict[int, int], budget: int) -> list[list[int]]:
    groups: list[list[int]] = []
    load = budget + 1
    for k in _descending(lengths):
        size = size_of(lengths[k])
        if load + size > budget:
            groups.append([])
            load = 0
        groups[-1].append(k)
        load += size
    return groups


def first_fit(lengths: dict[int, int] | Sequence[int], budget: int, keys: Sequence[int] | None = None) -> list[list[int]]:
    """First-fit decreasing with a max segment tree over the groups' room (O(n log n))."""
    order = keys if keys is not None else _descending(lengths)  # type: ignore[arg-type]
    return first_fit_in_order(lengths, order, budget)


def best_fit(lengths: dict[int, int], budget: int) -> list[list[int]]:
    groups: list[list[int]] = []
    rooms: list[tuple[int, int]] = []
    for k in _descending(lengths):
        size = size_of(lengths[k])
        at = bisect_left(rooms, (size, -1))
        if at < len(rooms):
            room, g = rooms.pop(at)
            groups[g].append(k)
            if room - size > 0:
                insort(rooms, (room - size, g))
        else:
            groups.append([k])
            if budget - size > 0:
                insort(rooms, (budget - size, len(groups) - 1))
    return groups


def worst_fit(lengths: dict[int, int], budget: int) -> list[list[int]]:
    groups: list[list[int]] = []
    rooms: list[tuple[int, int]] = []  # (-room, group): the emptiest first
    for k in _descending(lengths):
        size = size_of(lengths[k])
        if rooms and -rooms[0][0] >= size:
            room, g = rooms.pop(0)
            groups[g].append(k)
            if -room - size > 0:
                insort(rooms, (room + size, g))
        else:
            groups.append([k])
            if budget - size > 0:
                insort(rooms, (size - budget, len(groups) - 1))
    return groups


def short_to_long(rule: Callable[[dict[int, int], int], list[list[int]]]) -> Rule:
    """The rule's groups in the core's layout (short to long, keys ascending), as hold_sparse
    expects; the rule walks held keys with the others."""
    return lambda lengths, budget, held: [list(reversed(g)) for g in reversed(rule(lengths, budget))]


#: ``bfd-hf``: best fit walking the held keys first (the core's rule, pack_buffer with its held set)
RULES: dict[str, Rule] = {"nfd": short_to_long(next_fit), "ffd": short_to_long(first_fit),
                          "bfd": short_to_long(best_fit), "wfd": short_to_long(worst_fit), "bfd-hf": pack_buffer}


def efficiency(groups: list[list[int]], lengths: Sequence[int] | dict[int, int], budget: int) -> tuple[float, int]:
    """(real tokens / (L_max x groups), groups), over-budget singletons left out."""
    within = [sum(lengths[k] for k in g) for g in groups if not (len(g) == 1 and lengths[g[0]] > budget)]
    return (sum(within) / (len(within) * budget) if within else 0.0), len(within)


def online(lengths: list[int], rule: Rule, hold: bool) -> list[list[int]]:
    """One rank: fill the buffer to BUFFER (held samples not counted), group, hold, emit."""
    emitted: list[list[int]] = []
    buffer: dict[int, int] = {}
    held: set[int] = set()
    nxt = 0
    while nxt < len(lengths) or buffer:
        while len(buffer) - len(held) < BUFFER and nxt < len(lengths):
            buffer[nxt] = lengths[nxt]
            nxt += 1
        groups = rule(buffer, L_MAX, held)
        kept, holding = (hold_sparse(groups, buffer, Fraction(1, 50), held, BUFFER, area=L_MAX)
                         if hold and nxt < len(lengths) else (groups, []))
        held = {k for g in holding for k in g}
        for g in kept:
            emitted.append(g)
            for k in g:
                del buffer[k]
    return emitted


def rule_cpu(rule: Rule, lengths: list[int], reps: int = 21) -> float:
    """Median CPU seconds of ``rule`` on one full buffer."""
    times = []
    for r in range(reps):
        buf = {k: lengths[(r * BUFFER + k) % len(lengths)] for k in range(BUFFER)}
        t0 = time.process_time()
        rule(buf, L_MAX, set(range(0, BUFFER, 10)))
        times.append(time.process_time() - t0)
    return statistics.median(times)


def oracle(lengths: list[int]) -> dict[str, float]:
    """Offline first-fit decreasing over every length, and the ceil(sum / L_max) bound."""
    within = [x for x in lengths if x <= L_MAX]
    order = sorted(range(len(within)), key=lambda k: (-within[k], k))
    eff, groups = efficiency(first_fit(within, L_MAX, order), within, L_MAX)
    total = sum(map(size_of, within))
    bound = -(-total // L_MAX)
    return {"ffd": eff, "ffd_groups": groups, "bound": sum(within) / (bound * L_MAX), "bound_groups": bound}


def protocol(lengths: list[int]) -> dict[str, float]:
    """budget_fill of the real protocol (each budget's default target: balanced padded, min
    packed) at W = 1 and 8, packed and padded."""
    out = {}
    for world in (1, 8):
        for budget in BUDGETS:
            for regroup in (0.02, None):
                cfg = ODBConfig(token_budget=L_MAX, buffer_size=BUFFER, budget=budget,
                                regroup_padding=regroup)
                report = audit(simulate(lengths, world, cfg, "in_order"))
                key = f"W{world}_{budget}_{'regroup' if regroup else 'off'}"
                out[key] = report.budget_fill
                out[key + "_overhead"] = report.alignment_overhead
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=200_000)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    probe = sample_lengths("sharegpt4o", 4 * BUFFER, 1)
    assert RULES["bfd"]({k: probe[k] for k in range(BUFFER)}, L_MAX, set()) == pack_buffer(
        {k: probe[k] for k in range(BUFFER)}, L_MAX), "the core's pack_buffer is not this file's best fit"
    results: dict[str, dict[str, float]] = {}
    for name in DISTRIBUTIONS:
        lengths = sample_lengths(name, args.samples, 0)
        row: dict[str, float] = {}
        for rule_name, rule in RULES.items():
            for hold in (False, True):
                eff, groups = efficiency(online(lengths, rule, hold), lengths, L_MAX)
                row[rule_name + ("+hold" if hold else "")] = eff
            row[rule_name + "_cpu_ms"] = 1000 * rule_cpu(rule, lengths)
        row["blwalk_cpu_ms"] = 1000 * rule_cpu(lambda lengths, budget, held: group_buffer(lengths, budget), lengths)
        row.update({f"oracle_{k}": v for k, v in oracle(lengths).items()})
        row.update(protocol(lengths))
        results[name] = row
        if not args.json:
            print(name, json.dumps({k: round(v, 5) for k, v in row.items()}), flush=True)
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        table(results)


def table(results: dict[str, dict[str, float]]) -> None:
    """The markdown table of online rules against the oracle."""
    cols = [f"{r}{h}" for r in RULES for h in ("", "+hold")]
    print("\n| distribution | " + " | ".join(cols) + " | offline FFD | bound |")
    print("|---" * (len(cols) + 3) + "|")
    for name, row in results.items():
        cells = " | ".join(f"{100 * row[c]:.2f}%" for c in cols)
        print(f"| {name} | {cells} | {100 * row['oracle_ffd']:.2f}% | {100 * row['oracle_bound']:.2f}% |")
    names = [*RULES, "blwalk"]
    print("\n| distribution | " + " | ".join(f"{r} ms/buffer" for r in names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for name, row in results.items():
        print(f"| {name} | " + " | ".join(f"{row[r + '_cpu_ms']:.2f}" for r in names) + " |")
    print("\n| distribution | " + " | ".join(f"W={w} {b} {g}" for w in (1, 8) for b in ("packed", "padded")
                                           for g in ("regroup", "off")) + " |")
    print("|---" * 9 + "|")
    for name, row in results.items():
        fills = [f"{100 * row[f'W{w}_{b}_{g}']:.2f}% ({100 * row[f'W{w}_{b}_{g}_overhead']:.2f}%)"
                 for w in (1, 8) for b in ("packed", "padded") for g in ("regroup", "off")]
        print(f"| {name} | " + " | ".join(fills) + " |")


if __name__ == "__main__":
    main()
