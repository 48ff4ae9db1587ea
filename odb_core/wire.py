"""The per-round int64 vectors ranks exchange, and their validating decoders.

Two all_gathers per emitting round, both of lengths every rank knows in advance
(so a collective never mismatches, P2/P6):

* the header, ``HEADER_LEN`` int64 per rank, every round:
  ``[iteration, round, status, groups, capacity, samples, tokens]``;
* the step vector, ``2 x T`` int64 per rank, only when the target T > 0:
  ``[samples_0, tokens_0, samples_1, tokens_1, ...]``, one pair per emitted item
  (idle items are ``0, 0``).

So the payload is 8 x (7 + 2T) bytes per rank per round: it grows with the number
of groups emitted, not with buffer_size (the paper's sends 2 + 2 x buffer_size).
``capacity`` 0 means "no constraint"; C_min+ takes positive values only (Eq. 3).

Peer data is never trusted: decoders raise :class:`WireFormatError` on malformed
vectors and :class:`PeerInconsistencyError` on self-contradicting ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

from odb_core.errors import PeerInconsistencyError, WireFormatError

HEADER_LEN = 7
INT64_BYTES = 8
INT64_MAX = 2**63 - 1


class Status(IntEnum):
    """What a rank says of itself in a round's header."""

    WAITING = 0  # holds too few samples to group (and the sampler is not exhausted)
    READY = 1  # formed ``groups`` > 0 candidate groups
    FINISHED = 2  # R, Q and B are all empty


@dataclass(frozen=True, slots=True)
class Header:
    """One rank's round header (decoded)."""

    iteration: int
    round: int
    status: Status
    groups: int
    capacity: int
    samples: int
    tokens: int

    def encode(self) -> list[int]:
        """The int64 vector for the header gather."""
        return [self.iteration, self.round, int(self.status), self.groups, self.capacity, self.samples, self.tokens]


def _check_ints(vector: Sequence[int], what: str, length: int) -> list[int]:
    if len(vector) != length:
        raise WireFormatError(f"{what}: expected {length} int64 values, got {len(vector)}")
    out = [int(v) for v in vector]
    for i, v in enumerate(out):
        if not 0 <= v <= INT64_MAX:
            raise WireFormatError(f"{what}: field {i} is {v}, outside [0, 2^63)")
    return out


def decode_header(vector: Sequence[int], rank: int) -> Header:
    """Decode and check rank ``rank``'s header; raise if malformed or self-contradicting."""
    it, rnd, status_code, groups, capacity, samples, tokens = _check_ints(vector, f"rank {rank} header", HEADER_LEN)
    try:
        status = Status(status_code)
    except ValueError:
        raise WireFormatError(f"rank {rank} header: unknown status {status_code}") from None
    if status is Status.FINISHED and (groups or samples or tokens):
        raise PeerInconsistencyError(
            f"rank {rank} reports finished while holding {samples} samples in {groups} groups"
        )
    if status is Status.WAITING and groups:
        raise PeerInconsistencyError(f"rank {rank} reports waiting with {groups} groups")
    if status is Status.READY and not 1 <= groups <= samples:
        raise PeerInconsistencyError(f"rank {rank} reports ready with {groups} groups over {samples} samples")
    return Header(it, rnd, status, groups, capacity, samples, tokens)


def decode_headers(vectors: Sequence[Sequence[int]], world: int, iteration: int, rnd: int) -> list[Header]:
    """Decode every rank's header and check they all belong to this iteration and round."""
    if len(vectors) != world:
        raise WireFormatError(f"header gather: expected {world} vectors, got {len(vectors)}")
    headers = [decode_header(v, r) for r, v in enumerate(vectors)]
    for r, h in enumerate(headers):
        if (h.iteration, h.round) != (iteration, rnd):
            raise PeerInconsistencyError(
                f"rank {r} is at iteration {h.iteration} round {h.round}, expected iteration {iteration} round {rnd}"
            )
    return headers


def encode_steps(items: Sequence[tuple[int, int]]) -> list[int]:
    """Flatten ``(samples, tokens)`` pairs into a step vector."""
    return [v for pair in items for v in pair]


def decode_steps(
    vectors: Sequence[Sequence[int]], headers: Sequence[Header], target: int
) -> list[list[tuple[int, int]]]:
    """Decode every rank's step vector into ``(samples, tokens)`` per item.

    Checks: each vector has 2 x ``target`` values; an active rank's items each hold
    >= 1 sample and together no more than it buffered; an inactive rank's are idle.
    """
    if len(vectors) != len(headers):
        raise WireFormatError(f"step gather: expected {len(headers)} vectors, got {len(vectors)}")
    decoded: list[list[tuple[int, int]]] = []
    for r, (vector, header) in enumerate(zip(vectors, headers)):
        flat = _check_ints(vector, f"rank {r} step vector", 2 * target)
        pairs = list(zip(flat[0::2], flat[1::2]))
        if header.status is Status.READY:
            if any(n < 1 for n, _ in pairs):
                raise PeerInconsistencyError(f"rank {r} was ready but sent an empty item")
            if sum(n for n, _ in pairs) > header.samples:
                raise PeerInconsistencyError(f"rank {r} emitted more samples than the {header.samples} it held")
        elif any(n or t for n, t in pairs):
            raise PeerInconsistencyError(f"rank {r} was not ready but sent a non-idle item")
        decoded.append(pairs)
    return decoded


def payload_bytes(target: int) -> int:
    """Bytes one rank sends in a round with target ``target`` (0 for a skip round)."""
    return INT64_BYTES * (HEADER_LEN + (2 * target if target else 0))
