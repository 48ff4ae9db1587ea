"""The B(l) grouping rule of paper Sec. 2.2 and App. C.

Samples are sorted by realized length (ties by index) and walked from the longest
to the shortest with a running size threshold t (initially 1): a group is closed
when it holds t samples, and t becomes B(l) of its shortest sample, where
B(l) = max(floor(L_max / l), 1). Each group is therefore a contiguous run of the
sorted order, and P3 (Budget) follows: the first sample of a group is no longer
than the shortest sample l' of the previous group, so size x max_len <=
floor(L_max / l') x l' <= L_max. A sample longer than L_max is always alone.

Zero-length samples are sized as length 1 (B(0) = B(1) = L_max); they are
grouped and emitted like any other sample, never dropped.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set
from fractions import Fraction

from odb_core.errors import InvalidSampleError


def batch_size_for(length: int, token_budget: int) -> int:
    """B(l) = max(floor(L_max / l), 1); a zero length counts as 1."""
    return max(token_budget // max(length, 1), 1)


MAX_LENGTH = 2**40
"""The longest sample accepted (10^12 tokens): a buffer's lengths and loss tokens travel summed in
int64 header fields, which buffers of up to 2^23 such samples cannot overflow."""


def check_length(length: object, what: str) -> int:
    """Return ``length`` if it is an int in [0, :data:`MAX_LENGTH`], else raise naming ``what``."""
    if isinstance(length, bool) or not isinstance(length, int):
        raise InvalidSampleError(f"{what}: length must be an int, got {type(length).__name__} {length!r}")
    if not 0 <= length <= MAX_LENGTH:
        raise InvalidSampleError(f"{what}: length must be in [0, 2^40], got {length}")
    return length


def require_sequence(lengths: object) -> None:
    """TypeError unless ``lengths`` is a sequence (indices name its positions, so an iterator,
    which the checks would consume, or a set, which has none, is refused)."""
    if not isinstance(lengths, Sequence) or isinstance(lengths, (str, bytes)):
        raise TypeError(f"lengths must be a sequence of ints (a list or tuple; an array: .tolist()), got "
                        f"{type(lengths).__name__}")


def form_groups(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Group sample indices by the B(l) rule with threshold carry-over (paper App. C).

    Returns groups as lists of indices into ``lengths``; groups run from short to
    long, indices inside a group by ascending length, ties broken by index.
    Every index appears in exactly one group (nothing dropped), and every group of
    two or more samples satisfies max_len x size <= token_budget (P3).

    >>> form_groups([100, 200, 500, 800], 1000)
    [[0, 1], [2], [3]]
    """
    if isinstance(token_budget, bool) or not isinstance(token_budget, int) or token_budget < 1:
        raise InvalidSampleError(f"token_budget must be an int >= 1, got {token_budget!r}")
    require_sequence(lengths)
    plain = set(map(type, lengths)) <= {int}  # the fast path: plain ints in [0, MAX_LENGTH]
    if not (plain and (not lengths or 0 <= min(lengths) and max(lengths) <= MAX_LENGTH)):
        for i, length in enumerate(lengths):
            check_length(length, f"sample {i}")
    return group_sorted(sorted(range(len(lengths)), key=lengths.__getitem__), lengths, token_budget)


def group_sorted(order: list[int], lengths: Sequence[int] | Mapping[int, int], token_budget: int) -> list[list[int]]:
    """The grouping walk over ``order`` (keys already sorted by ascending length).

    ``order`` holds keys into ``lengths`` (list indices, or the keys of a mapping
    such as the protocol's buffer); the result holds the same keys, unchecked.
    """
    groups: list[list[int]] = []
    append = groups.append
    end = len(order)
    threshold = 1
    while end > 0:  # batch_size_for inlined: this loop is the protocol's per-round cost
        start = end - threshold if end > threshold else 0
        append(order[start:end])
        length = lengths[order[start]]
        threshold = token_budget // length if length > 1 else token_budget
        if threshold < 1:
            threshold = 1
        end = start
    groups.reverse()
    return groups


def group_buffer(lengths: Mapping[int, int], token_budget: int) -> list[list[int]]:
    """Group a buffer (key -> validated length), keys ordered by (length, key): one round's grouping.

    Two C-level sorts (by key, then stably by length) instead of a tuple key; this is
    what :class:`~odb_core.protocol.RankProtocol` runs every round.
    """
    return group_sorted(sorted(sorted(lengths), key=lengths.__getitem__), lengths, token_budget)


def hold_sparse(groups: list[list[int]], lengths: Mapping[int, int], fraction: Fraction,
                exempt: Set[int], limit: int, area: int | None = None,
                pool: bool = False) -> tuple[list[list[int]], list[list[int]]]:
    """Split a buffer's groups into ``(kept, held)`` (``ODBConfig.regroup_padding``).

    A group is holdable if it has >= 2 samples, none of them in ``exempt`` (held at
    the last round), and its padding fraction exceeds ``fraction``, in integers:
    (A - sum of lengths) x den > num x A, where A is the group's area: max_len x size
    (the padded budget, ``area=None``), or ``area`` (the packed budget passes L_max, so
    its "padding" is the budget a packed group leaves unused). The held groups
    are the longest prefix of the holdable groups, in walk order, whose sizes sum to
    at most ``limit`` samples (the protocol passes the outstanding depth D, so a rank
    never holds more than D samples); holdable groups past that prefix are kept. If
    every group would be held, none is. Both lists keep the walk's order; groups
    must be short to long inside (their last key is the longest), as
    :func:`group_sorted` returns them.

    ``pool``: the rank waits for a shared tail's pool (the packed budget, every view of the rank
    arrived, the pool open): it keeps its part-full groups open for the pool views it claims
    (:func:`~odb_core.tail.tail_claims` deals them to the ranks with the most room), so a
    group of one sample is holdable too, ``exempt`` is ignored (a group may be held again), and
    every group may be held. The pool is finite and drains, so no group is held forever (P6).
    """
    num, den = fraction.numerator, fraction.denominator
    kept: list[list[int]] = []
    held: list[list[int]] = []
    allowance = limit  # samples that may still be held; -1 once the prefix has ended
    least, skip = (1, frozenset[int]()) if pool else (2, exempt)
    for g in groups:
        if allowance >= least and len(g) >= least and skip.isdisjoint(g):
            tokens = lengths[g[-1]] * len(g) if area is None else area
            if (tokens - sum(map(lengths.__getitem__, g))) * den > num * tokens:  # holdable
                if len(g) <= allowance:
                    held.append(g)
                    allowance -= len(g)
                    continue
                allowance = -1  # the first holdable group past the cap ends the prefix
        kept.append(g)
    return (kept, held) if kept or pool else (held, [])


def over_budget(lengths: Sequence[int], token_budget: int) -> int:
    """How many samples are longer than the budget (each travels alone)."""
    return sum(1 for length in lengths if length > token_budget)


def padded_tokens(group_lengths: Sequence[int]) -> int:
    """Tokens a padded batch of these lengths occupies: max_len x size."""
    return max(group_lengths) * len(group_lengths) if group_lengths else 0
