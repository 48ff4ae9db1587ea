"""Conformance between odb_core and spec/ODB.tla, in both directions.

* State-space equality: for a small scenario, every abstract state the Python core
  reaches under exhaustive enumeration of its choices (which rank fetches, which
  in-flight sample arrives, when the gather runs) equals the set of distinct states
  TLC reports (``-dump dot``), and so do the transition sets.
* Trace validation: simulator runs on many random small configurations are recorded
  as sequences of abstract states and replayed by TLC (spec/TraceCheck.tla) as
  behaviours of the spec, each gather replaying the grouping the core chose;
  traces of a mutated core must be rejected.

The abstraction map (Python -> TLA+) is :func:`abstract`; spec/README.md lists it.
"""

from __future__ import annotations

import pickle
import random
import re
import shutil
import tempfile
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from model_checks.mutants import PACKED_MUTANTS, POOL_MUTANTS, driver
from model_checks.tla import ODB_INVARIANTS, SPEC_DIR, TlcRun, sany, tlc
from odb_core import ODBConfig, RankProtocol
from odb_core.config import BUDGETS, OVERFLOW_POLICIES, TARGET_POLICIES
from odb_core.epoch import EpochDriver
from odb_core.quota import QuotaTracker
from odb_core.sampler import permutation, split_tail
from odb_core.schedules import SCHEDULES, shard
from odb_core.simulator import Cursor, gather_round, simulate

Value = Any  # int | bool | str | tuple[Value, ...] | frozenset[Value]
VARIABLES = ("next", "Q", "B", "E", "H", "consumed", "lastStep", "lastOut", "rounds", "done", "pc", "claimed")


# ---- scenarios and TLA+ text ----------------------------------------------------------
@dataclass(frozen=True)
class Scenario:
    """Constants of one model: per-rank view lengths and the protocol parameters."""

    name: str
    lengths: tuple[tuple[int, ...], ...]
    budget: int = 10
    buffer_size: int = 2
    depth: int = 3
    capacity: int = 0
    join: bool = True
    overflow: str = "largest"
    policy: str = "paper"
    mutant: str | None = None
    seed: int = 0
    dataset_size: int | None = None
    """N, the non-join quota; defaults to the number of views (no sampler padding)."""
    shuffle: bool = True
    """The core's ``shuffle_steps``; the spec admits every order (``Orders``), and a
    scenario without it is compared against the spec's ``InOrder``."""
    regroup: tuple[int, int] = (1, 50)
    """(RegroupNum, RegroupDen): the core's ``regroup_padding`` as a fraction; (0, 0) is off."""
    budget_kind: str = "padded"
    """The core's ``budget`` (spec: ``BudgetKind``): "padded" or "packed"."""
    pool: tuple[int, ...] = ()
    """The shared tail's pool (its views' lengths; spec: ``Pool``): every rank claims from it (join)."""
    reserve_divisor: int = 8
    """The core's ``reserve_divisor`` (spec: ``ReserveDiv``, a constant only with a pool)."""
    stream: bool = False
    """Each rank's views are a stream whose length the core learns only when a fetch reaches past
    it (``EpochDriver(stream=True)``; spec: ``StreamOn <- StreamsOn``, next = NV + 2 once known)."""

    @property
    def quota(self) -> int:
        return sum(map(len, self.lengths)) if self.dataset_size is None else self.dataset_size

    def config(self) -> ODBConfig:
        return ODBConfig(
            token_budget=self.budget, budget=self.budget_kind,  # type: ignore[arg-type]
            buffer_size=self.buffer_size, depth=self.depth,
            mode="join" if self.join else "non-join", output_capacity=self.capacity or None,
            overflow_policy=self.overflow, target_policy=self.policy,  # type: ignore[arg-type]
            seed=self.seed, shuffle_steps=self.shuffle,
            regroup_padding=self.regroup[0] / self.regroup[1] if self.regroup[1] else None,
            shared_tail=0.5 if self.pool else 0.0,  # the pool itself is given (_chain), not cut by the fraction
            reserve_divisor=self.reserve_divisor,
        )

    def constants(self) -> dict[str, Value]:
        return {
            "W": len(self.lengths), "NV": tuple(map(len, self.lengths)), "Length": self.lengths,
            "Budget": self.budget, "BudgetKind": self.budget_kind, "BufSize": self.buffer_size, "Depth": self.depth,
            "Capacity": self.capacity, "JoinMode": self.join, "Quota": self.quota, "Overflow": self.overflow,
            "Policy": self.policy,
            "RegroupNum": self.regroup[0], "RegroupDen": self.regroup[1],
            **({"Pool": self.pool, "ReserveDiv": self.reserve_divisor} if self.pool else {}),
        }


def to_tla(v: Value) -> str:
    """TLA+ text of a value (tuples as sequences, frozensets as sets, dicts as records)."""
    if isinstance(v, bool):
        return "TRUE" if v else "FALSE"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str):
        return '"' + v + '"'
    if isinstance(v, tuple):
        return "<<" + ", ".join(map(to_tla, v)) + ">>"
    if isinstance(v, frozenset):
        return "{" + ", ".join(map(to_tla, sorted(v))) + "}"
    if isinstance(v, dict):
        return "[" + ", ".join(f"{k} |-> {to_tla(x)}" for k, x in v.items()) + "]"
    raise TypeError(f"no TLA+ form for {v!r}")


def wrap_tla(text: str, width: int = 200) -> str:
    """``text`` (TLA+ from :func:`to_tla`) with a line break after a comma wherever a line
    would pass ``width`` characters. SANY's lexer is quadratic in the length of a line: one
    trace of 130 states on one 85 kB line took 7 s to parse, 1.3 s when broken. Values
    hold no strings with commas (names of actions, budgets, policies), so any ", " outside
    a string is between two elements."""
    if any("," in s for s in re.findall(r'"[^"]*"', text)):
        raise ValueError("a string value with a comma")
    out, line = [], 0
    for piece in text.split(", "):
        if line and line + 2 + len(piece) > width:
            out.append(",\n ")
            line = 1
        elif out:
            out.append(", ")
            line += 2
        out.append(piece)
        line += len(piece)
    return "".join(out)


class _Parser:
    """Reads the values TLC prints (sequences, sets and a..b intervals, records, integers,
    booleans, strings)."""

    TOKEN = re.compile(r"\s*(<<|>>|\|->|\.\.|[{}\[\],]|-?\d+|TRUE|FALSE|\"[^\"]*\"|\w+)")

    def __init__(self, text: str) -> None:
        self.tokens: list[str] = self.TOKEN.findall(text)
        self.i = 0

    def take(self) -> str:
        tok = self.tokens[self.i]
        self.i += 1
        return tok

    def items(self, close: str) -> list[Value]:
        out: list[Value] = []
        if self.tokens[self.i] == close:
            self.i += 1
            return out
        while True:
            out.append(self.value())
            tok = self.take()
            if tok == close:
                return out
            assert tok == ",", f"unexpected {tok!r}"

    def value(self) -> Value:
        tok = self.take()
        if tok == "<<":
            return tuple(self.items(">>"))
        if tok == "{":
            return frozenset(self.items("}"))
        if tok == "[":
            rec: dict[str, Value] = {}
            while True:
                key = self.take()
                assert self.take() == "|->"
                rec[key] = self.value()
                if self.take() == "]":
                    return tuple(sorted(rec.items()))
        if tok in ("TRUE", "FALSE"):
            return tok == "TRUE"
        if tok.startswith('"'):
            return tok[1:-1]
        if self.i < len(self.tokens) and self.tokens[self.i] == "..":  # TLC prints a..b for contiguous sets
            self.i += 1
            return frozenset(range(int(tok), int(self.take()) + 1))
        return int(tok)


def parse_state(text: str) -> tuple[Value, ...]:
    """A TLC state (``/\\ x = v`` lines) as a tuple of values in :data:`VARIABLES` order."""
    values = {}
    for line in text.strip().splitlines():
        m = re.match(r"/\\ (\w+) = (.*)$", line.strip())
        assert m, f"unexpected state line {line!r}"
        values[m.group(1)] = _Parser(m.group(2)).value()
    return tuple(values[v] for v in VARIABLES)


# ---- the abstraction map --------------------------------------------------------------
def abstract(protos: list[RankProtocol], cursor: Cursor) -> tuple[Value, ...]:
    """The spec's view of the core's state (1-based ranks and positions), :data:`VARIABLES` order."""
    quota = cursor.quota or QuotaTracker(0)
    return (
        tuple(p.next_position + (2 if p.streamed and p.ended else 1) for p in protos),
        tuple(frozenset(q + 1 for q in p.in_flight) for p in protos),
        tuple(tuple(b + 1 for b in p.buffered) for p in protos),
        tuple(frozenset(e + 1 for e in p.emitted) for p in protos),
        tuple(frozenset(h + 1 for h in p.held) for p in protos),
        quota.emitted,
        quota.last_step,
        tuple(tuple(tuple(x + 1 for x in item) for item in out) for out in cursor.last_out),
        cursor.rounds,
        cursor.done,
        cursor.pool_claimed,
        tuple(tuple(j + 1 for j in claims) for claims in cursor.claims),
    )


# ---- exhaustive enumeration of the core ------------------------------------------------
@dataclass
class _Node:
    drivers: list[EpochDriver]
    lengths: tuple[tuple[int, ...], ...]
    pool: tuple[int, ...] = ()

    def length(self, r: int, pos: int) -> int:
        """The length of rank r's view at ``pos`` (its own, or a claimed pool view)."""
        ident = self.drivers[r].views[pos]
        return self.pool[ident - POOL_ID] if ident >= POOL_ID else self.lengths[r][ident]

    @property
    def protos(self) -> list[RankProtocol]:
        return [d.protocol for d in self.drivers if d.protocol is not None]

    @property
    def cursor(self) -> Cursor:
        return Cursor.of(self.drivers)


def _initial(s: Scenario) -> _Node:
    """Every rank's epoch driver (the one the simulator and the collate process run) at Init."""
    cfg, world = s.config(), len(s.lengths)
    drivers = [driver(s.mutant)(cfg, r, world, quota=s.quota, stream=s.stream) for r in range(world)]
    _chain(drivers, s.lengths, s.pool)
    return _Node(drivers, s.lengths, s.pool)


POOL_ID = 1 << 20
"""Identity of pool view j in the enumeration: POOL_ID + j (a rank's own views are 0..NV-1)."""


def _chain(drivers: list[EpochDriver], lengths: tuple[tuple[int, ...], ...], pool: tuple[int, ...] = ()) -> None:
    """Start the logical iteration each driver asks for, over the same views (the spec's shards)."""
    if drivers[0].sampler_epoch is not None:
        for d, ls in zip(drivers, lengths):
            d.start_iteration(() if d.stream else list(range(len(ls))), [POOL_ID + j for j in range(len(pool))])


def _copy(node: _Node) -> _Node:
    """A deep copy of every driver: a pickle round trip (a few times faster than ``copy.deepcopy``)."""
    copied: _Node = pickle.loads(pickle.dumps(node, pickle.HIGHEST_PROTOCOL))
    return copied


def _successors(node: _Node) -> Iterable[_Node]:
    if node.drivers[0].done:
        yield node  # Terminating
        return
    for r, p in enumerate(node.protos):
        if (p.next_position < len(p.views) or (p.streamed and not p.ended)) and p.fetch_room() > 0:
            nxt = _copy(node)
            d = nxt.drivers[r]
            fetched = d.stream_positions(d.fetch())
            if d.stream and any(s >= len(node.lengths[r]) for s in fetched):
                d.end_stream(len(node.lengths[r]))  # a read past the stream's end reveals it
            yield nxt
    for r, p in enumerate(node.protos):
        for pos in sorted(p.in_flight):
            nxt = _copy(node)
            nxt.drivers[r].arrive(pos, node.length(r, pos))
            yield nxt
    nxt = _copy(node)
    gather_round(nxt.drivers)
    _chain(nxt.drivers, nxt.lengths, nxt.pool)  # non-join: the drivers chain the next logical iteration
    yield nxt


def enumerate_core(s: Scenario) -> tuple[set[tuple[Value, ...]], set[tuple[tuple[Value, ...], tuple[Value, ...]]]]:
    """Every abstract state and transition the core reaches in scenario ``s``."""
    start = _initial(s)
    first = abstract(start.protos, start.cursor)
    seen = {first: start}
    edges: set[tuple[tuple[Value, ...], tuple[Value, ...]]] = set()
    frontier = [start]
    while frontier:
        node = frontier.pop()
        here = abstract(node.protos, node.cursor)
        for nxt in _successors(node):
            there = abstract(nxt.protos, nxt.cursor)
            edges.add((here, there))
            if there not in seen:
                seen[there] = nxt
                frontier.append(nxt)
    return set(seen), edges


# ---- the same scenario under TLC ---------------------------------------------------------
def _model_dir(tmp: Path, modules: dict[str, str]) -> None:
    shutil.copy(SPEC_DIR / "ODB.tla", tmp / "ODB.tla")
    for name, text in modules.items():
        (tmp / name).write_text(text)


def explore_spec(s: Scenario) -> tuple[TlcRun, set[tuple[Value, ...]], set[tuple[tuple[Value, ...], tuple[Value, ...]]]]:
    """Run TLC on scenario ``s`` (safety only, so each state is dumped once) and read its graph."""
    consts = s.constants()
    module = "---- MODULE Conf ----\nEXTENDS ODB\n" + "".join(
        f"Conf_{k} == {wrap_tla(to_tla(v))}\n" for k, v in consts.items()) + "====\n"
    cfg = "CONSTANTS\n" + "".join(f"    {k} <- Conf_{k}\n" for k in consts)
    cfg += "" if s.shuffle else "    Orders <- InOrder\n"
    cfg += "    StreamOn <- StreamsOn\n" if s.stream else ""
    cfg += "INIT Init\nNEXT Next\n"
    cfg += "INVARIANTS " + " ".join(ODB_INVARIANTS) + "\n"
    with tempfile.TemporaryDirectory(prefix="odb-conf-") as tmpname:
        tmp = Path(tmpname)
        _model_dir(tmp, {"Conf.tla": module, "Conf.cfg": cfg})
        sany("Conf", cwd=tmp)
        run = tlc("Conf", tmp / "Conf.cfg", cwd=tmp, extra=("-dump", "dot,actionlabels", str(tmp / "graph")))
        dot = (tmp / "graph.dot").read_text() if (tmp / "graph.dot").exists() else ""
    states, edges = parse_dot(dot)
    return run, states, edges


def _unescape(label: str) -> str:
    return re.sub(r'\\(.)', lambda m: "\n" if m.group(1) == "n" else m.group(1), label)


def parse_dot(dot: str) -> tuple[set[tuple[Value, ...]], set[tuple[tuple[Value, ...], tuple[Value, ...]]]]:
    """States and transitions of TLC's ``-dump dot`` output."""
    nodes: dict[str, tuple[Value, ...]] = {}
    raw_edges = []
    for line in dot.splitlines():
        if m := re.match(r'^(-?\d+) -> (-?\d+) ', line):
            raw_edges.append((m.group(1), m.group(2)))
        elif m := re.match(r'^(-?\d+) \[label="(.*)"(,style = filled)?\];?$', line):
            nodes[m.group(1)] = parse_state(_unescape(m.group(2)))
    return set(nodes.values()), {(nodes[a], nodes[b]) for a, b in raw_edges}


STATE_SPACE_SCENARIOS = (  # in aligned order, so the core's state space equals the spec's
    Scenario("join_2x4", ((2, 3, 6, 9), (1, 1, 5, 12)), shuffle=False),
    Scenario("nonjoin_2x4", ((2, 3, 6, 9), (1, 1, 5, 12)), join=False, shuffle=False),
    Scenario("join_3_uneven_cap1_oldest", ((1, 4, 8), (2, 2), (7,)), capacity=1, overflow="oldest", shuffle=False,
             regroup=(0, 0)),
    Scenario("nonjoin_2x3_all_ready_cap1", ((0, 4, 11), (2, 2, 9)), join=False, capacity=1, policy="all-ready",
             shuffle=False),
    Scenario("join_3_uneven_balanced", ((1, 4, 8), (2, 2, 3), (7,)), policy="balanced", shuffle=False),
    # min G: the rank with more groups overflows instead of its peer splitting (1,318 states; balanced: 1,337)
    Scenario("join_2x4_min", ((2, 3, 6, 9), (1, 1, 5, 12)), policy="min", shuffle=False),
    # buffers of 3 with padded pairs: groups are held back (H) and regrouped
    Scenario("join_2x4_regroup", ((1, 3, 2, 4), (2, 2, 5, 1)), buffer_size=3, shuffle=False),
    Scenario("nonjoin_2x4_regroup", ((1, 3, 2, 4), (2, 2, 5, 1)), buffer_size=3, join=False, shuffle=False),
    # the packed budget: best-fit groups, an over-budget sample, under-filled groups held back
    Scenario("join_2x4_packed", ((1, 8, 5, 7), (3, 3, 4, 11)), budget_kind="packed", shuffle=False),
    Scenario("nonjoin_2x4_packed", ((1, 8, 5, 7), (3, 3, 4, 11)), budget_kind="packed", join=False,
             policy="balanced", shuffle=False),
    Scenario("nonjoin_2x4_packed_min", ((1, 8, 5, 7), (3, 3, 4, 11)), budget_kind="packed", join=False,
             policy="min", shuffle=False),
    # one buffer where best fit and first fit differ (spec/MC.tla Len_1b)
    Scenario("join_1_best_fit", ((1, 9, 12, 10),), budget=20, buffer_size=4, depth=4, policy="balanced",
             regroup=(0, 0), budget_kind="packed", shuffle=False),
    # regroup holds the packed pair (3, 4); the next buffer walks it first, so 5 does not split it
    Scenario("join_1_held_first", ((3, 9, 4, 5),), buffer_size=3, depth=4, policy="balanced", budget_kind="packed",
             shuffle=False),
    # the shared tail (spec/MC.tla NV_2t, Pool_2t): the short rank runs out first and claims the pool
    Scenario("join_2_pool", ((6, 7), (1, 2)), pool=(3, 1, 4, 2), policy="balanced", shuffle=False),
    # the packed budget's pool (quick_join_2_pool_packed): part-full groups held open while the pool
    # is open, the reserve's views claimed one a gather by the rank with the most room
    Scenario("join_2_pool_packed", ((6, 7), (1, 2)), pool=(3, 1, 4, 2), policy="min", budget_kind="packed",
             shuffle=False),
    # the same with the reserve dealt to every rank with room at once (quick_join_2_pool_packed_spread)
    Scenario("join_2_pool_packed_spread", ((6, 7), (1, 2)), pool=(3, 1, 4, 2), policy="min", budget_kind="packed",
             shuffle=False, reserve_divisor=1),
)
SHUFFLED_SCENARIOS = (  # shuffled steps: one seeded order per round, inside the spec's every order
    # 3 views per rank: 2,712 core states, 440 of them reached only by shuffling (17 s; the 4-view
    # version, 11,344 core states inside 18,978, took 70 s of the suite)
    Scenario("nonjoin_2x3_shuffled", ((2, 3, 6), (1, 5, 12)), join=False, seed=3),
)


@dataclass
class StateSpaceResult:
    """Python core vs TLC on one scenario."""

    scenario: str
    python_states: int
    tlc_states: int
    python_transitions: int
    tlc_transitions: int
    states_equal: bool
    transitions_equal: bool
    states_included: bool
    """Every state the core reaches is a spec state (also when the spec has more)."""
    transitions_included: bool
    only_python: list[str] = field(default_factory=list)
    only_tlc: list[str] = field(default_factory=list)
    holds_back: bool = False
    """Some state the core reaches holds a group back (``H`` non-empty: regroup or packing)."""


def compare_state_spaces(s: Scenario) -> StateSpaceResult:
    """Enumerate the core and run TLC on the same constants; compare states and transitions.
    TLC runs in its own process while the core is enumerated here."""
    with ThreadPoolExecutor(1) as pool:
        spec = pool.submit(explore_spec, s)
        py_states, py_edges = enumerate_core(s)
        run, tlc_states, tlc_edges = spec.result()
    if run.outcome != "ok":
        raise RuntimeError(f"TLC on conformance scenario {s.name}: {run.outcome}\n{run.output[-3000:]}")
    return StateSpaceResult(
        s.name, len(py_states), len(tlc_states), len(py_edges), len(tlc_edges),
        py_states == tlc_states, py_edges == tlc_edges, py_states <= tlc_states, py_edges <= tlc_edges,
        [str(x) for x in list(py_states - tlc_states)[:3]], [str(x) for x in list(tlc_states - py_states)[:3]],
        any(any(st[VARIABLES.index("H")]) for st in py_states),
    )


# ---- trace validation ------------------------------------------------------------------
@dataclass
class Trace:
    """One recorded run: its constants, states, and the grouping of each step
    (:mod:`model_checks.traces` replays it, every invariant on every state)."""

    scenario: Scenario
    schedule: str
    states: list[tuple[Value, ...]]
    packs: list[tuple[Value, ...]]
    actions: list[str] = field(default_factory=list)
    """The spec action of each state (``Init``, ``Fetch``, ``Drain``, ``Gather``); empty:
    inferred from the states (:func:`model_checks.traces.actions_of`)."""
    complete: bool = True
    """The run completed, so its last state must be ``done``; False for a run cut by a fault."""


def record(s: Scenario, dataset: list[int], schedule: str) -> Trace:
    """Run the simulator (unshuffled, so chained iterations see the same shards) on
    ``dataset``; ``s`` must hold the per-rank lengths of its shards. Records every state change."""
    states: list[tuple[Value, ...]] = []
    packs: list[tuple[Value, ...]] = []
    actions: list[str] = []
    cfg, world = s.config(), len(s.lengths)

    def tracer(label: str, protos: list[RankProtocol], cursor: Cursor, packing: list[list[list[int]]]) -> None:
        if len(protos) < world:  # no iteration started (a quota of 0 ends the epoch at Init): the spec's Init
            protos = [RankProtocol(cfg, r, world, range(len(ls))) for r, ls in enumerate(s.lengths)]
        states.append(abstract(protos, cursor))
        packs.append(tuple(tuple(tuple(x + 1 for x in g) for g in groups) for groups in packing)
                     if packing else tuple(() for _ in protos))
        actions.append(label)

    simulate(dataset, world, cfg, schedule, shuffle=False, tracer=tracer, driver_cls=driver(s.mutant))
    return Trace(s, schedule, states, packs, actions)


def random_scenario(rng: random.Random, seed: int, mutant: str | None = None) -> tuple[Scenario, list[int], str]:
    """A small random configuration: the scenario (per-rank lengths of the shards the
    simulator will make), the dataset lengths, and the schedule."""
    regroup = rng.choice([(0, 0), (1, 50), (1, 5)])
    world = rng.randint(1, 3)
    n = rng.randint(5, 12) if regroup[1] else rng.randint(0, 7)
    budget = rng.choice([1, 4, 10, 16])
    buffer_size = rng.randint(3, 4) if regroup[1] else rng.randint(1, 3)  # holds need a pair in a full buffer
    schedule = rng.choice(SCHEDULES)
    join = rng.random() < 0.5 if mutant is None else mutant not in ("no-chain",)
    if not join and schedule == "empty_rank":
        schedule = "uneven"
    lengths = [rng.choice([0, rng.randint(1, budget), rng.randint(1, 3 * budget + 1)]) for _ in range(n)]
    shards = shard(permutation(n, seed, 0, shuffle=False), world, schedule, seed)
    # drawn from a generator of its own, so the other draws match the padded-only scenarios
    kind = "packed" if mutant in PACKED_MUTANTS else random.Random(f"odb-budget:{seed}").choice(BUDGETS)
    scenario = Scenario(
        name="trace", lengths=tuple(tuple(lengths[i] for i in views) for views in shards), budget=budget,
        buffer_size=buffer_size, depth=buffer_size + rng.randint(0, 2), capacity=rng.choice([0, 0, 1, 2]),
        join=join, overflow=rng.choice(OVERFLOW_POLICIES), policy=rng.choice(TARGET_POLICIES),
        mutant=mutant, seed=seed, dataset_size=n, regroup=regroup, budget_kind=kind,
    )
    return scenario, lengths, schedule


def pooled_scenario(rng: random.Random, seed: int, mutant: str | None = None) -> tuple[Scenario, list[int], str]:
    """A small random join-mode configuration with a shared tail (W = 2-3, 6-10 views, the last
    half of them the pool: ``Scenario.config()``'s ``shared_tail`` 0.5): the scenario (the
    per-rank lengths of the shards and the pool's lengths), the dataset lengths, the schedule."""
    world = rng.randint(2, 3)
    n = rng.randint(6, 10)
    budget = rng.choice([4, 10, 16])
    buffer_size = rng.randint(1, 3)
    schedule = rng.choice(SCHEDULES)
    lengths = [rng.choice([0, rng.randint(1, budget), rng.randint(1, 3 * budget + 1)]) for _ in range(n)]
    own, pool = split_tail(permutation(n, seed, 0, shuffle=False), 0.5)  # Scenario.config()'s shared_tail
    shards = shard(own, world, schedule, seed)
    scenario = Scenario(
        name="pooled", lengths=tuple(tuple(lengths[i] for i in views) for views in shards), budget=budget,
        buffer_size=buffer_size, depth=buffer_size + rng.randint(0, 2), capacity=rng.choice([0, 0, 1, 2]),
        overflow=rng.choice(OVERFLOW_POLICIES), policy=rng.choice(TARGET_POLICIES), mutant=mutant, seed=seed,
        regroup=rng.choice([(0, 0), (1, 50), (1, 5)]), budget_kind=rng.choice(BUDGETS),
        pool=tuple(lengths[i] for i in pool),
        reserve_divisor=1 if seed % 2 else 8,  # not drawn from rng, so the other draws stay as they were
    )
    return scenario, lengths, schedule


def trace_module(traces: list[Trace]) -> str:
    """The TraceData module of ``traces`` (moved to :func:`model_checks.traces.trace_module`)."""
    from model_checks import traces as tv

    return tv.trace_module(traces)


def check_traces(traces: list[Trace]) -> tuple[set[int], set[int]]:
    """Replay traces with TLC, every invariant on every state, the B(l) grouping at every
    gather, the last state done; return (accepted, rejected) indices into ``traces``
    (moved to :mod:`model_checks.traces`: :func:`~model_checks.traces.replay` says why)."""
    from model_checks import traces as tv

    return tv.check_traces(traces)


#: mutants whose runs complete and can be replayed; max-groups trips the core's own
#: wire check (a peer's step vector has the wrong length) before the bad step is traced.
TRACEABLE_MUTANTS = ("no-cmin", "drop-overflow", "early-finish", "merge-overflow", "no-chain", "pack-overfill")
#: what must reject each traced mutant (besides Step): the invariant its spec twin breaks; BRule,
#: the recorded grouping is not the rule's; Step alone for the claim rules that only deal otherwise
REJECTED_BY = {"no-cmin": "WithinCapacity", "drop-overflow": "NoLeak", "early-finish": "BRule",
               "merge-overflow": "BudgetOK", "no-chain": "QuotaClosure", "pack-overfill": "BRule",
               "double-deal": "PoolOnce", "drop-last-claim": "PoolOnce", "fill-least-room": "Step",
               "fill-one-rank": "Step"}


def clean_traces(count: int, seed: int = 0) -> list[Trace]:
    """``count`` traces of the unmutated core on random small configurations, the last eighth
    (``count // 8``) of them with a shared tail (:func:`pooled_scenario`)."""
    rng, pool_rng = random.Random(f"odb-traces:{seed}"), random.Random(f"odb-pooled-traces:{seed}")
    pooled = count // 8
    return ([record(*random_scenario(rng, k)) for k in range(count - pooled)]
            + [record(*pooled_scenario(pool_rng, k)) for k in range(pooled)])


def mutant_traces(per_mutant: int, seed: int = 0, tries: int = 4000) -> dict[str, list[Trace]]:
    """Per traceable mutant (the shared tail's on pooled configurations), traces on which the
    mutation changed the behaviour (the mutated run's trace differs from the clean run's on
    the same inputs)."""
    rng = random.Random(f"odb-mutant-traces:{seed}")
    out: dict[str, list[Trace]] = {}
    for mutant in (*TRACEABLE_MUTANTS, *POOL_MUTANTS):
        draw = pooled_scenario if mutant in POOL_MUTANTS else random_scenario
        found: list[Trace] = []
        for k in range(tries):
            if len(found) == per_mutant:
                break
            scenario, data, schedule = draw(rng, k, mutant)
            bad = record(scenario, data, schedule)
            good = record(Scenario(**{**scenario.__dict__, "mutant": None}), data, schedule)
            if bad.states != good.states:
                found.append(bad)
        out[mutant] = found
    return out
