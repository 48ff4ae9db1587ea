"""The packed budget's grouping rule: best-fit decreasing over one buffer (``ODBConfig.budget="packed"``).

Under the packed budget a group's cost is the sum of its lengths, not max_len x size: a
packed (padding-free) batch concatenates its samples. Each length is sized as
``max(l, 1)`` (a zero-length sample counts as 1, as in B(l), so a group holds at most
L_max samples), and P3 for the packed budget reads: every group of >= 2 samples has
sum of sizes <= L_max; a sample longer than L_max travels alone and is counted, never
dropped.

The rule (chosen on measurements: ``benchmarks/bench_packing_rule.py``): walk the buffer's
held samples first (those regroup held back at the last round, ``first``), then the rest,
each part from the longest sample to the shortest (keys sorted by (length, key), walked
backwards), and put each sample into the fullest open group it fits in (ties: the group
opened first), else open a new group. Walking the held samples first gives them the first
choice of partners: walked last, being short, they would fill the last part-full group
again and be emitted part-full there (four such batches on the chat data at W=1: 0.74 pp).
The result is deterministic (P8) and costs one sort plus a bisection and a list insertion
per sample. The groups are laid out as the B(l) walk lays them out: each group's keys by
ascending (length, key), the groups by their longest key, so the alignment's split takes a
group's longest sample off (a split piece of a group within the budget is within it, P3).
spec/ODB.tla: ``PackRule``.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from itertools import chain

from odb_core.errors import InvalidSampleError
from odb_core.grouping import check_length, require_sequence


def size_of(length: int) -> int:
    """A sample's size under the packed budget: its length, a zero length counting as 1."""
    return length if length > 1 else 1


def packed_tokens(group_lengths: Sequence[int]) -> int:
    """The packed budget's cost of a group: the sum of its sizes (:func:`size_of`)."""
    return sum(map(size_of, group_lengths))


def pack_sorted(order: Sequence[int], lengths: Sequence[int] | Mapping[int, int], token_budget: int,
                first: AbstractSet[int] = frozenset()) -> list[list[int]]:
    """Best-fit decreasing over ``order`` (keys sorted by ascending (length, key)), the keys in
    ``first`` walked before the others (see the module).

    Returns the groups short to long, each group's keys short to long (see the module).
    ``open_`` holds (room left, opening number) of every group something may still fit
    in, sorted, so the fullest group a sample fits in is the first entry with room >= its
    size; groups with no room left (or opened by a sample over the budget) leave it.
    """
    walk = chain((k for k in reversed(order) if k in first),
                 (k for k in reversed(order) if k not in first)) if first else reversed(order)
    groups: list[list[int]] = []
    open_: list[tuple[int, int]] = []
    for key in walk:
        size = size_of(lengths[key])
        at = bisect_left(open_, (size, -1))
        if at < len(open_):
            room, number = open_.pop(at)
            groups[number].append(key)
            room -= size
            if room > 0:
                insort(open_, (room, number))
            continue
        groups.append([key])
        if token_budget - size > 0:
            insort(open_, (token_budget - size, len(groups) - 1))
    if not first:  # opened longest first, each group's keys placed longest first: reversing lays them out
        for g in groups:
            g.reverse()
        groups.reverse()
        return groups
    rank = {k: i for i, k in enumerate(order)}  # (length, key) order
    laid = [sorted(g, key=rank.__getitem__) for g in groups]
    laid.sort(key=lambda g: rank[g[-1]])
    return laid


def pack_buffer(lengths: Mapping[int, int], token_budget: int, held: AbstractSet[int] = frozenset()) -> list[list[int]]:
    """Pack a buffer (key -> validated length) by best-fit decreasing, its ``held`` keys (held
    back to regroup at the last round, a subset of its keys) walked first: one round's grouping
    under the packed budget (keys ordered by (length, key), as :func:`~odb_core.grouping.group_buffer`)."""
    return pack_sorted(sorted(sorted(lengths), key=lengths.__getitem__), lengths, token_budget, held)


def pack_groups(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Pack sample indices under the packed budget (the packed twin of
    :func:`~odb_core.grouping.form_groups`): every index in one group, every group of >= 2
    samples with sum of sizes <= ``token_budget`` (P3).

    >>> pack_groups([100, 200, 500, 800], 1000)
    [[0, 2], [1, 3]]
    """
    if isinstance(token_budget, bool) or not isinstance(token_budget, int) or token_budget < 1:
        raise InvalidSampleError(f"token_budget must be an int >= 1, got {token_budget!r}")
    require_sequence(lengths)
    for i, length in enumerate(lengths):
        check_length(length, f"sample {i}")
    return pack_sorted(sorted(range(len(lengths)), key=lengths.__getitem__), lengths, token_budget)
