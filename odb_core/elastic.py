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

A pooled epoch (``shared_tail`` f > 0) has its own global order: the sharded part padded over
W ranks, then the pool (``GlobalState.order_tail``); its states' positions (own views, then
claimed pool views) merge into it. A rank's own pooled state resumes on the same world size
with its :class:`~odb_core.tail.TailPosition` (:func:`tail_resume`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from odb_core.errors import LoaderStateError, ODBError, ResumeStateError, UnsupportedSettingError
from odb_core.tail import TailPosition, resumed_positions

OWN_FIELDS = ("rank", "world_size", "epoch", "steps", "seed", "consumed")
"""What every rank state holds (``ODBDataLoader.state_dict``)."""
AGREED_FIELDS = ("epoch", "steps", "seed", "total", "order_world")
"""The fields every rank's state must share for a merge."""
ORDER_FIELDS = ("shuffle", "sampler_seed", "dataset_size")
"""What, besides the epoch, fixes the global order (a ``DistributedSampler``'s shuffle flag and
seed, and its dataset's size: ``total``, the padded order's length, is the same for sizes that
pad to one multiple of W): recorded by loaders that know the order; when one state has a field
every state must have it, with the same value, and a resume checks it against its sampler."""


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
    order_tail: float = 0.0
    """The shared tail's fraction f of the epoch's layout (0: none). With f > 0 the global order
    is the pooled one: the sharded part padded over ``order_world`` ranks (rank r at r, r + W,
    ...), then the pool's floor(f x N) views (:func:`odb_core.sampler.tail_views`)."""

    def remaining(self) -> list[int]:
        """The global positions not yet yielded, in global order."""
        done = set(self.consumed)
        return [g for g in range(self.total) if g not in done]

    def digest(self) -> str:
        """A short hash of :meth:`to_dict`: ranks that resume one state agree on it, so comparing it
        at the epoch's handshake finds ranks handed different checkpoints (P4 across the resume)."""
        import json

        return _short_hash(json.dumps(self.to_dict(), sort_keys=True).encode())

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able form, accepted by :func:`global_state_from` and ``ODBDataLoader.load_state_dict``."""
        return {"kind": "odb-global", "epoch": self.epoch, "steps": self.steps, "seed": self.seed,
                "total": self.total, "order_world": self.order_world, "consumed": list(self.consumed),
                **dict(self.order), **({"order_tail": self.order_tail} if self.order_tail else {})}


def rank_positions(state: Mapping[str, Any]) -> list[int]:
    """The global positions of one rank's sampler order, indexed by its sampler position."""
    if state.get("views") is not None:
        return [int(g) for g in state["views"]]
    world, order_world = int(state["world_size"]), int(state.get("order_world", state["world_size"]))
    if world != order_world:
        raise ResumeStateError(f"rank {state['rank']}: a state at world size {world} over an order of "
                               f"{order_world} ranks must list its views", field="views", ranks=[state["rank"]])
    return list(range(int(state["rank"]), int(state["total"]), world))


def _require(states: Sequence[Mapping[str, Any]]) -> None:
    """:class:`ResumeStateError` naming the first field some states lack (``ranks``: their places in the list)."""
    for key in (*OWN_FIELDS, "total"):
        missing = [i for i, s in enumerate(states) if key not in s]
        if missing:
            raise ResumeStateError(f"loader states {missing} lack {key!r} (a state_dict of an older ODB "
                                   "cannot be resumed on another world size)", field=key, ranks=missing)


def _is_int(value: Any, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _require_ints(state: Mapping[str, Any], least: Mapping[str, int], lists: Sequence[str], where: str,
                  rank: int | None = None) -> None:
    """:class:`ResumeStateError` naming the first key of ``least`` present in ``state`` that is not an
    integer of at least its value, or of ``lists`` that is not a list of integers >= 0 (``where``:
    the state, as the message names it): not strings, floats or bools that ``int()`` would quietly
    read (``"012"`` as 12, 1.9 as 1)."""
    ranks = [] if rank is None else [rank]
    for key, low in least.items():
        if key in state and not _is_int(state[key], low):
            raise ResumeStateError(f"{where}: {key}={state[key]!r} is not an integer >= {low}", field=key,
                                   ranks=ranks, rank=rank)
    for key in lists:
        values = state.get(key)
        if values is not None and (not isinstance(values, (list, tuple)) or not all(_is_int(v, 0) for v in values)):
            raise ResumeStateError(f"{where}: {key}={str(values)[:60]} is not a list of integers >= 0", field=key,
                                   ranks=ranks, rank=rank)


def _check_field_types(state: Mapping[str, Any], place: int) -> None:
    """A rank state (``place``: its index in the list) holds what a loader's ``state_dict`` writes
    (:func:`_require_ints`, :func:`check_counts`)."""
    rank = state["rank"] if _is_int(state["rank"], 0) else None
    where = f"loader state {place}" + ("" if rank is None else f" (rank {rank})")
    _require_ints(state, {"rank": 0, "world_size": 1, "epoch": 0, "steps": 0, "total": 0, "order_world": 1,
                          "pool": 0, "pool_size": 0, "seed": -(2**63)}, ("views", "claimed"), where, rank)
    check_counts(state, state["rank"])  # a valid rank: checked above


def _agreed(states: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """The fields every state shares; :class:`ResumeStateError` naming the first that differs."""
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


def _pooled(state: Mapping[str, Any]) -> bool:
    """A state of a pooled epoch (not an elastic share of one): its positions index the pooled
    order, own shard then pool indices (:meth:`odb_core.epoch.EpochDriver.start_iteration`). An
    epoch-start state of an older ODB (no ``pool_size``, nothing consumed) recorded the plain
    order's ``total`` and indexes nothing: it merges as a plain one."""
    return bool(state.get("shared_tail")) and state.get("views") is None and (
        "pool_size" in state or bool(state.get("consumed")) or bool(state.get("steps")))


def _layout(state: Mapping[str, Any]) -> float:
    """The shared-tail fraction of the global order a state's positions are in (0: the plain one)."""
    if state.get("views") is not None:
        return float(state.get("order_tail", 0.0))
    return float(state["shared_tail"]) if _pooled(state) else 0.0


def _agreed_layout(states: Sequence[Mapping[str, Any]]) -> float:
    """The one global order layout of the states (:class:`ResumeStateError` if they differ)."""
    seen = [_layout(s) for s in states]
    common = Counter(seen).most_common(1)[0][0]
    differ = [int(s["rank"]) for s, v in zip(states, seen) if v != common]
    if differ:
        raise ResumeStateError(f"ranks {differ} index another global order (shared_tail) than the others",
                               field="shared_tail", ranks=differ)
    return common


def _pooled_consumed(states: Sequence[Mapping[str, Any]], agreed: Mapping[str, int]) -> tuple[int, ...]:
    """The consumed positions of pooled states in the pooled global order (P4: a rank's own
    position p is r + p x W, its claimed pool view j is ``total - pool_size + j``);
    :class:`ResumeStateError` for a position outside the rank's own views and claims, or consumed twice."""
    missing = [int(s["rank"]) for s in states if "pool_size" not in s or "claimed" not in s]
    if missing:
        raise ResumeStateError(f"ranks {missing}: pooled states without the pool's layout (pool_size, claimed), "
                               "from an older ODB; resume on the same world size", field="pool_size", ranks=missing)
    world, total, pool = agreed["order_world"], agreed["total"], int(states[0]["pool_size"])
    own = (total - pool) // world
    out: list[int] = []
    for s in sorted(states, key=lambda s: int(s["rank"])):
        rank, claimed = int(s["rank"]), {int(j) for j in s["claimed"]}
        bad = [p for p in map(int, s["consumed"]) if not (0 <= p < own or p - own in claimed and p - own < pool)]
        if int(s["pool_size"]) != pool:
            raise ResumeStateError(f"rank {rank}: a pool of {s['pool_size']} views, rank {states[0]['rank']}'s has "
                                   f"{pool}", field="pool_size", ranks=[rank], rank=rank)
        if bad:
            raise ResumeStateError(f"rank {rank}: consumed positions {bad[:8]} are neither its own {own} views nor "
                                   "pool views it claimed", field="consumed", ranks=[rank], indices=bad, rank=rank)
        out.extend(rank + p * world if p < own else total - pool + p - own for p in map(int, s["consumed"]))
    twice = sorted(g for g, c in Counter(out).items() if c > 1)
    if twice:
        raise ResumeStateError(f"global positions {twice[:8]} were consumed twice (a pool view on two ranks?)",
                               field="consumed", indices=twice)
    return tuple(sorted(out))


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
    _require(states)
    for place, state in enumerate(states):
        _check_field_types(state, place)
    _check_ranks(states)
    agreed = _agreed(states)
    layout = _agreed_layout(states)
    if any(_pooled(s) for s in states):
        return GlobalState(agreed["epoch"], agreed["steps"], agreed["seed"], agreed["total"], agreed["order_world"],
                           _pooled_consumed(states, agreed), _agreed_order(states), layout)
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
                       tuple(sorted(done)), _agreed_order(states), layout)


def global_state_from(state: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> GlobalState:
    """A :class:`GlobalState` from a merged state's :meth:`GlobalState.to_dict` or a list of every rank's state."""
    if isinstance(state, Mapping):
        if state.get("kind") != "odb-global":
            raise ResumeStateError("a single rank's state cannot resume another world size: pass the list of "
                                   "every rank's state_dict, or their merge_states(...).to_dict()", field="kind")
        _check_global_types(state)
        consumed = tuple(sorted(state["consumed"]))
        if len(set(consumed)) != len(consumed) or any(not 0 <= g < int(state["total"]) for g in consumed):
            raise ResumeStateError("the global state's consumed positions repeat or fall outside its order",
                                   field="consumed", indices=consumed)
        return GlobalState(int(state["epoch"]), int(state["steps"]), int(state["seed"]), int(state["total"]),
                           int(state["order_world"]), consumed,
                           tuple((k, int(state[k])) for k in ORDER_FIELDS if k in state),
                           float(state.get("order_tail", 0.0)))
    return merge_states(list(state))


def _check_global_types(state: Mapping[str, Any]) -> None:
    """:class:`ResumeStateError` naming the first field of a merged state that
    :meth:`GlobalState.to_dict` would not have written (a missing one, a string, a float, a bool)."""
    least = {"epoch": 0, "steps": 0, "total": 0, "order_world": 1, "seed": -(2**63)}
    missing = [key for key in (*least, "consumed") if key not in state]
    if missing:
        raise ResumeStateError(f"the global state lacks {missing[0]!r}", field=missing[0])
    _require_ints(state, {**least, **dict.fromkeys(ORDER_FIELDS, -(2**63))}, ("consumed",), "the global state")
    tail = state.get("order_tail", 0.0)
    if isinstance(tail, bool) or not isinstance(tail, (int, float)) or not 0 <= tail < 1:
        raise ResumeStateError(f"the global state's order_tail={tail!r} is not a fraction in [0, 1)",
                               field="order_tail")


def assign_views(state: GlobalState, world: int, rank: int) -> list[int]:
    """Rank ``rank`` of ``world``'s views for the rest of the epoch: global positions, every remaining
    one on exactly one rank (the remaining order dealt round-robin; counts differ by at most one)."""
    if not 0 <= rank < world:
        raise UnsupportedSettingError(f"rank {rank} outside world of size {world}", field="rank", rank=rank)
    return state.remaining()[rank::world]


def deals_views(merged: GlobalState, shared_tail: float) -> bool:
    """Whether a resume from every rank's states (``merged``) runs the rest of its epoch over
    dealt views (:func:`assign_views`): always, except a loader with a shared tail at the
    epoch's very start, which runs the whole epoch with its pool cut anew."""
    return not shared_tail or bool(merged.consumed) or merged.steps > 0


def epoch_pool(shared_tail: float, dealt: bool) -> float:
    """The pool fraction an epoch runs with: none over dealt views (an elastic resume's rest of
    an epoch: the remaining views are dealt evenly, claimed pool views included, so every view
    is on exactly one rank, P4), else the configured ``shared_tail``."""
    return 0.0 if dealt else shared_tail


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


def check_single_state(state: Mapping[str, Any], rank: int, world: int) -> None:
    """``state``, a mapping that is not a merged global state, must be a rank state of this
    world (then :func:`check_own_state` applies); :class:`ResumeStateError` when it is not: an
    adapter's windows state (``field="loader"``: it holds the loader's state under
    ``"loader"``), a mapping without ``world_size`` or ``rank`` (that field: not a state_dict),
    or one rank's state of another world size (``field="kind"``, naming both sizes: another
    world needs every rank's states)."""
    if "world_size" not in state and isinstance(state.get("loader"), Mapping):
        raise ResumeStateError(
            f"rank {rank}: the state is an accumulation-windows state (an adapter's odb_state_rank*.json, the loader's "
            "own under 'loader'): load it with odb_torch.windows.load_windows_state or the adapter's loading, or "
            "pass its 'loader' entry", field="loader", rank=rank)
    missing = [k for k in ("world_size", "rank") if k not in state]
    if missing:
        raise ResumeStateError(f"rank {rank}: the state lacks {missing}: not an ODBDataLoader.state_dict() (its keys: "
                               f"{sorted(map(str, state))[:8]})", field=missing[0], rank=rank)
    if state["world_size"] != world:
        raise ResumeStateError(
            f"rank {rank}: the state is rank {state['rank']!r}'s of a world of {state['world_size']!r} ranks, this "
            f"loader's world has {world}: a single rank's state cannot resume another world size; pass the list "
            "of every rank's state_dict, or their merge_states(...).to_dict()", field="kind", rank=rank)


def check_own_state(state: Mapping[str, Any], rank: int, seed: int) -> None:
    """A rank's own state resumed on its world size: :class:`ResumeStateError` naming the field
    unless it holds every :data:`OWN_FIELDS` entry, is this ``rank``'s and ``seed``'s, its
    consumed positions are distinct and non-negative (``indices``: the bad ones) and, for an
    elastic share, its views lie inside its order (P4: a position twice, or one the epoch does not
    have, would repeat a sample or be dropped silently). Whether the positions fit this loader's
    sampler is the caller's check (:func:`check_positions`)."""
    missing = [k for k in OWN_FIELDS if k not in state]
    if missing:
        raise ResumeStateError(f"rank {rank}: the state lacks {missing}", field=missing[0], rank=rank)
    for key, mine in (("rank", rank), ("seed", seed)):
        if state[key] != mine:
            raise ResumeStateError(f"rank {rank}: the state's {key}={state[key]!r} is not this loader's {mine!r}",
                                   field=key, ranks=[int(state["rank"])], rank=rank)
    consumed = check_counts(state, rank)
    if not isinstance(state.get("order_digest", ""), (str, type(None))):
        raise ResumeStateError(f"rank {rank}: the state's order_digest is not a string", field="order_digest",
                               rank=rank)
    if state.get("views") is not None:
        views, total = [int(g) for g in state["views"]], int(state.get("total", -1))
        outside = sorted({g for g in views if not 0 <= g < total} | {g for g, c in Counter(views).items() if c > 1})
        if outside:
            raise ResumeStateError(f"rank {rank}: views {outside[:8]} repeat or lie outside the order of {total}",
                                   field="views", ranks=[rank], indices=outside, rank=rank)
        check_positions(consumed, len(views), rank)


def _short_hash(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()[:16]


def resumed_order(recorded: str | None, views: Sequence[int], pool: Sequence[int], consumed: Collection[int],
                  rank: int) -> str:
    """The digest of an epoch's sampler order (this rank's views, then the pool's), which a state's
    positions index: recorded with the state, and for a resumed epoch with views left (a pool, or
    fewer ``consumed`` positions than views) compared with the ``recorded`` one (None: nothing
    recorded). Another order would train some samples twice and others never (P4):
    :class:`ResumeStateError` (``field="sampler"``). At the epoch's end nothing is left to order."""
    from array import array

    found = _short_hash(array("q", [*views, -1, *pool]).tobytes())
    if recorded is not None and recorded != found and (pool or len(consumed) < len(views)):
        raise ResumeStateError(
            f"rank {rank}: the sampler's order of the resumed epoch is not the one the checkpoint's positions "
            "index (a sampler that draws from a random generator whose state the restart does not restore, "
            "such as SubsetRandomSampler or WeightedRandomSampler, or another dataset): resuming would train "
            "some samples twice and others never; resume at an epoch boundary, or give the sampler an order "
            "fixed by its epoch (set_epoch)", field="sampler", ranks=[rank], rank=rank)
    return found


def check_positions(consumed: Iterable[int], positions: int, rank: int) -> None:
    """:class:`ResumeStateError` (``field="consumed"``, ``indices``) unless every consumed position
    indexes one of the epoch's ``positions`` sampler positions (P4: one outside would be skipped
    by nothing and mean the checkpoint is of another dataset or sampler)."""
    bad = sorted({int(p) for p in consumed if not 0 <= int(p) < positions})
    if bad:
        raise ResumeStateError(f"rank {rank}: consumed positions {bad[:8]} are outside this rank's {positions} "
                               "sampler positions (a checkpoint of another dataset, sampler or drop_last?)",
                               field="consumed", ranks=[rank], indices=bad, rank=rank)


def check_resumed_epoch(loaded: int | None, epoch: int, rank: int) -> None:
    """A loaded position belongs to epoch ``loaded``: iterating another ``epoch`` would discard it
    silently, so it is a :class:`LoaderStateError` (the position stays loaded). ``loaded`` None:
    nothing was loaded."""
    if loaded is not None and loaded != epoch:
        raise LoaderStateError(
            f"rank {rank}: load_state_dict() loaded a position in epoch {loaded}, but the loader is iterating "
            f"epoch {epoch}, which would discard it; call set_epoch({loaded}) (loader.epoch right after "
            "load_state_dict) to resume, or build a new loader to start over", rank=rank)


def tail_resume(state: Mapping[str, Any] | Sequence[Mapping[str, Any]], shared_tail: float, rank: int,
                world: int) -> TailPosition | None:
    """How a loader with ``shared_tail`` resumes ``state``: the :class:`TailPosition` of this
    rank's own mid-epoch state of a pooled epoch at this world size (P4 across the resume:
    :func:`odb_core.tail.resumed_positions` serves its claimed, unyielded views again; the pool
    goes on from the cursor), else None: every rank's states, a merged state, another world's
    state (all merged into the epoch's global order, pooled or not: :func:`merge_states`), an
    elastic share's state, an epoch's start, or no pool on either side. An own mid-epoch state
    whose positions index another layout than this loader's (another ``shared_tail``, or one
    without the pool's position, from an older ODB) is :class:`UnsupportedSettingError`
    (``field="shared_tail"``) rather than a silent loss."""
    if not isinstance(state, Mapping) or state.get("kind") == "odb-global" or state.get("views") is not None or (
            int(state.get("world_size", -1)) != world or not (state.get("consumed") or state.get("steps"))):
        return None
    recorded = float(state.get("shared_tail") or 0.0)
    if recorded != shared_tail:
        why = (f"it was taken with shared_tail={recorded}, this loader has shared_tail={shared_tail}, and its "
               "positions index that epoch's layout; build the loader with the first run's shared_tail, or resume "
               "from the list of every rank's state_dict")
    elif not recorded:
        return None
    elif "pool_cursor" not in state or "claimed" not in state:
        why = "it lacks the pool's position (pool_cursor, claimed): a state_dict of an older ODB"
    else:
        tail = TailPosition(int(state["pool_cursor"]), tuple(int(j) for j in state["claimed"]))
        if "pool_size" in state and "total" in state:  # a position that does not fit: typed, before anything starts
            pool = int(state["pool_size"])
            resumed_positions((int(state["total"]) - pool) // world, pool, frozenset(map(int, state["consumed"])),
                              tail, rank)
        return tail
    raise UnsupportedSettingError(f"rank {rank}: this mid-epoch state_dict cannot be resumed here: {why}",
                                  field="shared_tail", rank=rank)


@contextmanager
def typed_state_errors(rank: int) -> Iterator[None]:
    """Reading a loader state: a malformed one (a missing key, a value of the wrong type or
    shape) is a :class:`ResumeStateError` naming the missing key (``field``) or ``"state"``,
    never a bare ``KeyError``/``TypeError``/``ValueError``; ODB's own typed errors go on, with
    ``rank`` (and a ``rank N:`` prefix) where they named none (a check of every rank's states)."""
    try:
        yield
    except ODBError as exc:
        if exc.rank is None:
            exc.rank = rank
            exc.args = (f"rank {rank}: {exc.args[0] if exc.args else ''}", *exc.args[1:])
        raise
    except KeyError as exc:
        key = str(exc.args[0]) if exc.args else ""
        raise ResumeStateError(f"rank {rank}: the loader state lacks {key!r}", field=key, rank=rank) from exc
    except (TypeError, ValueError, AttributeError, ZeroDivisionError, IndexError) as exc:
        raise ResumeStateError(f"rank {rank}: a malformed loader state: {type(exc).__name__}: {exc}", field="state",
                               rank=rank) from exc


def check_counts(state: Mapping[str, Any], rank: int, keys: Sequence[str] = ("epoch", "steps")) -> list[int]:
    """The state's ``consumed`` positions, after :class:`ResumeStateError` naming the field unless
    each of ``keys`` is an integer >= 0 and ``consumed`` a list of distinct integers >= 0
    (``indices``: the bad ones)."""
    for key in keys:
        value = state.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ResumeStateError(f"rank {rank}: the state's {key}={value!r} is not an integer >= 0", field=key,
                                   rank=rank)
    consumed = state.get("consumed")
    if not isinstance(consumed, (list, tuple)) or not all(isinstance(p, int) and not isinstance(p, bool)
                                                          for p in consumed):
        raise ResumeStateError(f"rank {rank}: the state's consumed={str(consumed)[:60]} is not a list of integers",
                               field="consumed", rank=rank)
    bad = sorted({p for p in consumed if p < 0} | {p for p, c in Counter(consumed).items() if c > 1})
    if bad:
        raise ResumeStateError(f"rank {rank}: consumed positions {bad[:8]} are negative or listed twice",
                               field="consumed", ranks=[rank], indices=bad, rank=rank)
    return list(consumed)
