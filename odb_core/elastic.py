"""Elastic resume (join mode), sans-IO: W ranks' loader states -> one global state -> W' ranks' views.

An epoch's **global order** is the padded ``DistributedSampler`` order of the run that
started it, on ``order_world`` ranks: ``total`` positions, rank r holding r, r + W, r + 2W, ...
(its sampler position p is global position r + p x W). Padding duplicates (``drop_last=False``)
are positions of their own: each is yielded once, like any other view (P4). A rank resumed
elastically holds an explicit list of global positions (``views``) instead of its stride.

:func:`merge_states` checks that W states describe one step boundary of one epoch (every rank
present once, the same epoch, steps, seed and order, no position consumed twice) and returns
the consumed global positions; :func:`assign_views` hands rank r' of W' its share of the rest:
every remaining position exactly once over the W' ranks, in global order, at most one more
on some ranks than on others (join mode tolerates uneven view counts, P2/P4, so nothing is padded).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from odb_core.errors import LoaderStateError, ResumeStateError, UnsupportedSettingError
from odb_core.tail import TailPosition

AGREED_FIELDS = ("epoch", "steps", "seed", "total", "order_world")
"""The fields every rank's state must share for a merge."""
ORDER_FIELDS = ("shuffle", "sampler_seed")
"""What, besides the epoch and the dataset size, fixes the global order (a ``DistributedSampler``'s
shuffle flag and seed): recorded by loaders that know the order; when one state has a field every
state must have it, with the same value, and a resume checks it against its sampler."""


@dataclass(frozen=True, slots=True)
class GlobalState:
    """One step boundary of one epoch, over every rank: what a resume at any W' needs."""

    epoch: int
    steps: int
    """Steps (idle included) every rank consumed in the epoch so far; a resume continues the count."""
    seed: int
    total: int
    """Positions in the epoch's global order."""
    order_world: int
    """The world size whose padded ``DistributedSampler`` order is the global order."""
    consumed: tuple[int, ...]
    """Global positions already yielded, sorted."""
    order: tuple[tuple[str, int], ...] = ()
    """The :data:`ORDER_FIELDS` the states recorded, as (name, value) pairs (empty: not recorded)."""

    def remaining(self) -> list[int]:
        """The global positions not yet yielded, in global order."""
        done = set(self.consumed)
        return [g for g in range(self.total) if g not in done]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able form, accepted by :func:`global_state_from` and ``ODBDataLoader.load_state_dict``."""
        return {"kind": "odb-global", "epoch": self.epoch, "steps": self.steps, "seed": self.seed,
                "total": self.total, "order_world": self.order_world, "consumed": list(self.consumed),
                **dict(self.order)}


def rank_positions(state: Mapping[str, Any]) -> list[int]:
    """The global positions of one rank's sampler order, indexed by its sampler position."""
    if state.get("views") is not None:
        return [int(g) for g in state["views"]]
    world, order_world = int(state["world_size"]), int(state.get("order_world", state["world_size"]))
    if world != order_world:
        raise ResumeStateError(f"rank {state['rank']}: a state at world size {world} over an order of "
                               f"{order_world} ranks must list its views", field="views", ranks=[state["rank"]])
    return list(range(int(state["rank"]), int(state["total"]), world))


def _agreed(states: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """The fields every state shares; :class:`ResumeStateError` naming the first that differs."""
    for key in ("rank", "world_size", "epoch", "steps", "seed", "consumed", "total"):
        missing = [i for i, s in enumerate(states) if key not in s]
        if missing:
            raise ResumeStateError(f"loader states {missing} lack {key!r} (a state_dict of an older ODB "
                                   "cannot be resumed on another world size)", field=key, ranks=missing)
    values: dict[str, int] = {}
    for key in AGREED_FIELDS:
        seen = [int(s.get(key, s["world_size"]) if key == "order_world" else s[key]) for s in states]
        common = Counter(seen).most_common(1)[0][0]
        differ = [int(s["rank"]) for s, v in zip(states, seen) if v != common]
        if differ:
            raise ResumeStateError(f"ranks {differ} have another {key} than the others ({common}): the states "
                                   "are not one step boundary of one run", field=key, ranks=differ)
        values[key] = common
    return values


def _agreed_order(states: Sequence[Mapping[str, Any]]) -> tuple[tuple[str, int], ...]:
    """The :data:`ORDER_FIELDS` the states record; :class:`ResumeStateError` naming the field if only
    some states record it or they differ (the ranks' global orders would differ)."""
    out: list[tuple[str, int]] = []
    for key in ORDER_FIELDS:
        have = [s for s in states if key in s]
        if not have:
            continue
        seen = [int(s[key]) if key in s else None for s in states]
        common = Counter(seen).most_common(1)[0][0]
        differ = [int(s["rank"]) for s, v in zip(states, seen) if v != common]
        if differ:
            raise ResumeStateError(f"ranks {differ} have another {key} (or none) than the others: their samplers' "
                                   "global orders differ", field=key, ranks=differ)
        out.append((key, int(have[0][key])))
    return tuple(out)


def _check_ranks(states: Sequence[Mapping[str, Any]]) -> int:
    """The world size W of the states; every rank 0..W-1 present exactly once."""
    worlds = sorted({int(s["world_size"]) for s in states})
    if len(worlds) != 1:
        raise ResumeStateError(f"the states come from world sizes {worlds}", field="world_size")
    world = worlds[0]
    ranks = Counter(int(s["rank"]) for s in states)
    twice = sorted(r for r, c in ranks.items() if c > 1)
    missing = sorted(set(range(world)) - set(ranks))
    stray = sorted(set(ranks) - set(range(world)))
    if twice or missing or stray:
        raise ResumeStateError(f"a world of {world} ranks needs every rank's state once: missing {missing}, "
                               f"twice {twice}, outside the world {stray}", field="rank", ranks=missing + twice + stray)
    return world


def _check_pool(states: Sequence[Mapping[str, Any]], held: int) -> None:
    """States of an elastically resumed epoch: their views together are the whole remaining pool
    of that resume (``pool``), so no view is lost by a state that lists too few."""
    pools = {int(s["pool"]) for s in states if s.get("views") is not None}
    if not pools:
        return
    if len(pools) != 1 or any(s.get("views") is None for s in states) or held != pools.pop():
        raise ResumeStateError(f"the ranks' views hold {held} positions, not the pool of their resume "
                               f"({sorted({s.get('pool') for s in states}, key=str)})", field="views")


def stream_world_error(what: str, *, ranks: Sequence[int] = (), rank: int | None = None) -> ResumeStateError:
    """Why a stream checkpoint cannot resume on another world size (the one rule, for the core's
    merge and the loader's stream resume): each rank's stream is its shard at that world size."""
    return ResumeStateError(
        f"{what}: a stream checkpoint resumes only on the world size it was taken on: each rank's stream is its "
        "shard at that world size, and the shards at another one hold other elements; resume on the same number "
        "of ranks, or at an epoch boundary", field="world_size", ranks=ranks, rank=rank)


def merge_states(states: Sequence[Mapping[str, Any]]) -> GlobalState:
    """Merge every rank's ``ODBDataLoader.state_dict()`` of one step boundary into a :class:`GlobalState`.

    Raises :class:`ResumeStateError` (``field``, ``ranks``, ``indices``) unless the states are
    W distinct ranks of one world, agree on epoch, steps, seed and global order, their orders
    are disjoint and their consumed positions in range and each consumed once.
    """
    if not states:
        raise ResumeStateError("no loader state to merge", field="rank")
    streamed = [int(s.get("rank", -1)) for s in states if s.get("stream")]
    if streamed:
        raise stream_world_error(f"the states of ranks {streamed} come from streams", ranks=streamed)
    pooled = tail_pooled(states)
    if pooled:
        raise ResumeStateError(f"ranks {pooled}: their states lie inside a pooled epoch (shared_tail > 0), whose "
                               "positions no merge can redistribute; resume each rank from its own state_dict on "
                               "the same world size, or from an epoch's start",
                               field="shared_tail", ranks=pooled)
    _check_ranks(states)
    agreed = _agreed(states)
    owner: dict[int, int] = {}  # global position -> the rank whose order holds it
    consumed: list[int] = []
    for s in sorted(states, key=lambda s: int(s["rank"])):
        rank, positions = int(s["rank"]), rank_positions(s)
        clash = sorted({g for g in positions if g in owner or not 0 <= g < agreed["total"]})
        if clash:
            raise ResumeStateError(f"rank {rank}: global positions {clash[:8]} are held by another rank or "
                                   f"outside the order of {agreed['total']}", field="views", ranks=[rank],
                                   indices=clash, rank=rank)
        owner.update((g, rank) for g in positions)
        local = [int(p) for p in s["consumed"]]
        bad = sorted({p for p in local if not 0 <= p < len(positions)} | {p for p, c in Counter(local).items() if c > 1})
        if bad:
            raise ResumeStateError(f"rank {rank}: consumed positions {bad[:8]} are out of its {len(positions)} "
                                   "views or listed twice", field="consumed", ranks=[rank], indices=bad, rank=rank)
        consumed.extend(positions[p] for p in local)
    _check_pool(states, len(owner))
    done = set(consumed) | (set(range(agreed["total"])) - set(owner))  # an elastic epoch's earlier share
    return GlobalState(agreed["epoch"], agreed["steps"], agreed["seed"], agreed["total"], agreed["order_world"],
                       tuple(sorted(done)), _agreed_order(states))


def global_state_from(state: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> GlobalState:
    """A :class:`GlobalState` from a merged state's :meth:`GlobalState.to_dict` or a list of every rank's state."""
    if isinstance(state, Mapping):
        if state.get("kind") != "odb-global":
            raise ResumeStateError("a single rank's state cannot resume another world size: pass the list of "
                                   "every rank's state_dict, or their merge_states(...).to_dict()", field="kind")
        consumed = tuple(sorted(int(g) for g in state["consumed"]))
        if len(set(consumed)) != len(consumed) or any(not 0 <= g < int(state["total"]) for g in consumed):
            raise ResumeStateError("the global state's consumed positions repeat or fall outside its order",
                                   field="consumed", indices=consumed)
        return GlobalState(int(state["epoch"]), int(state["steps"]), int(state["seed"]), int(state["total"]),
                           int(state["order_world"]), consumed,
                           tuple((k, int(state[k])) for k in ORDER_FIELDS if k in state))
    return merge_states(list(state))


def assign_views(state: GlobalState, world: int, rank: int) -> list[int]:
    """Rank ``rank`` of ``world``'s views for the rest of the epoch: global positions, every remaining
    one on exactly one rank (the remaining order dealt round-robin; counts differ by at most one)."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside world of size {world}")
    return state.remaining()[rank::world]


def check_order(recorded: Mapping[str, Any], current: Mapping[str, int], rank: int) -> None:
    """:class:`ResumeStateError` (``field`` the first that differs) if the checkpoint recorded an
    :data:`ORDER_FIELDS` value other than the resuming loader's sampler has (``current``): the
    checkpoint's positions would name other samples, some twice and some never. Fields the
    checkpoint did not record (an older ODB) or the sampler does not have are not checked."""
    for key in ORDER_FIELDS:
        if key in recorded and key in current and int(recorded[key]) != current[key]:
            raise ResumeStateError(
                f"rank {rank}: the checkpoint's sampler had {key}={int(recorded[key])}, this loader's has "
                f"{key}={current[key]}: the epoch's order differs, so resuming would repeat some samples and skip "
                f"others; build the loader with the first run's {key}", field=key, rank=rank)


def check_resumed_epoch(loaded: int | None, epoch: int, rank: int) -> None:
    """A loaded position belongs to epoch ``loaded``: iterating another ``epoch`` would discard it
    silently, so it is a :class:`LoaderStateError` (the position stays loaded). ``loaded`` None:
    nothing was loaded."""
    if loaded is not None and loaded != epoch:
        raise LoaderStateError(
            f"rank {rank}: load_state_dict() loaded a position in epoch {loaded}, but the loader is iterating "
            f"epoch {epoch}, which would discard it; call set_epoch({loaded}) (loader.epoch right after "
            "load_state_dict) to resume, or build a new loader to start over", rank=rank)


def tail_pooled(states: Sequence[Mapping[str, Any]], shared_tail: float = 0.0) -> list[int]:
    """The ranks of ``states`` that hold a position inside a pooled epoch (the state, or the
    loader resuming it, has ``shared_tail`` > 0, and it consumed a view or took a step)."""
    return [int(s.get("rank", -1)) for s in states
            if (shared_tail or s.get("shared_tail")) and (s.get("consumed") or s.get("steps"))]


def tail_resume(state: Mapping[str, Any] | Sequence[Mapping[str, Any]], shared_tail: float, rank: int,
                world: int) -> TailPosition | None:
    """How a loader with ``shared_tail`` resumes ``state`` (one rank's state_dict, every rank's,
    or a merged global state): None if no pooled epoch is under way in it (an epoch's start, or
    no pool on either side); the :class:`TailPosition` of a pooled mid-epoch state of this
    rank, taken at this world size with the same ``shared_tail`` (P4 across the resume:
    :func:`odb_core.tail.resumed_positions`). Otherwise :class:`UnsupportedSettingError`
    (``field="shared_tail"``), rather than a silent loss: the pool views a rank claimed and
    had not yet yielded are in its own state alone, and its positions index the pooled order."""
    states = [state] if isinstance(state, Mapping) else list(state)
    if not tail_pooled(states, shared_tail):
        return None
    own = states[0] if isinstance(state, Mapping) and state.get("kind") != "odb-global" else None
    if own is not None and own.get("shared_tail") == shared_tail and int(own.get("world_size", -1)) == world and (
            "pool_cursor" in own and "claimed" in own):
        return TailPosition(int(own["pool_cursor"]), tuple(int(j) for j in own["claimed"]))
    recorded = own.get("shared_tail") if own is not None else None
    if recorded and recorded != shared_tail:
        why = (f"it was taken with shared_tail={recorded}, this loader has shared_tail={shared_tail}; build the "
               "loader with the first run's shared_tail")
    elif own is not None and not recorded:
        why = "it was taken without a pool, whose positions index another order; resume with shared_tail=0"
    elif own is not None and int(own.get("world_size", -1)) == world:
        why = "it lacks the pool's position (pool_cursor, claimed): a state_dict of an older ODB"
    else:
        why = ("a pooled epoch resumes mid-epoch on the same world size only, each rank from its own state_dict: "
               "the pool views a rank claimed and had not yet yielded are in its state alone")
    raise UnsupportedSettingError(
        f"rank {rank}: a state_dict taken inside a pooled epoch cannot be resumed here: {why}. Or checkpoint "
        "after set_epoch(e + 1), where nothing is consumed", field="shared_tail", rank=rank)
