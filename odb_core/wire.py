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

A round's gathers decode into :class:`HeaderGather` and :class:`StepGather`, immutable
values that a rank builds once per round (O(W) and O(W x T)). The in-process simulator
decodes each gather once and hands the same value to every simulated rank, so a round
costs it O(W x T) rather than O(W^2 x T); each rank still checks that the value is the
decoding of its own gather (its iteration, round, headers and target) and that its own
vector is in it, and decodes the raw vectors itself otherwise.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator, Sequence
from enum import IntEnum
from functools import lru_cache
from itertools import chain
from typing import Any, NamedTuple, TypeVar, overload

from odb_core.errors import PeerInconsistencyError, WireFormatError

HEADER_LEN = 7
TAIL_HEADER_LEN = 10
"""A header under ``shared_tail`` > 0: the seven fields, then ``pending`` (views fetched or to
fetch, not arrived), ``load`` (the sum of the buffer's lengths) and ``room`` (the packed budget
a held group leaves unused, the most over the rank's held groups while it waits for the pool;
0 otherwise), for the pool's claims."""
INT64_BYTES = 8
INT64_MAX = 2**63 - 1


class Status(IntEnum):
    """What a rank says of itself in a round's header."""

    WAITING = 0  # holds too few samples to group (and the sampler is not exhausted)
    READY = 1  # formed ``groups`` > 0 candidate groups
    FINISHED = 2  # R, Q and B are all empty
    IDLE = 3  # a shared tail's pool is open and R, Q and B are empty: nothing to emit now, blocks nobody


_STATUS = {int(s): s for s in Status}
_T = TypeVar("_T")


class Header(NamedTuple):
    """One rank's round header (decoded; immutable)."""

    iteration: int
    round: int
    status: Status
    groups: int
    capacity: int
    samples: int
    tokens: int
    pending: int = 0
    load: int = 0
    room: int = 0

    def encode(self, length: int = HEADER_LEN) -> list[int]:
        """The int64 vector for the header gather (``TAIL_HEADER_LEN``: with pending, load and room)."""
        head = [self.iteration, self.round, int(self.status), self.groups, self.capacity, self.samples, self.tokens]
        return head if length == HEADER_LEN else [*head, self.pending, self.load, self.room]


def _check_ints(vector: Sequence[int], what: str, length: int, rank: int | None = None) -> list[int]:
    """``vector`` as ints: ``length`` integers in [0, 2^63), else :class:`WireFormatError`
    naming the field (``rank``: the rank whose vector it is)."""
    try:
        n = len(vector)
        out = [int(v) for v in vector]
    except (TypeError, ValueError) as exc:  # not a sequence, None, NaN, a string that is no number
        raise WireFormatError(f"{what}: not a vector of integers ({type(exc).__name__}: {exc})",
                              rank=rank) from None
    if n != length:
        raise WireFormatError(f"{what}: expected {length} int64 values, got {n}", rank=rank)
    if out != list(vector):  # a float truncated, a numeric string: name the first such field
        i = next(i for i, (a, b) in enumerate(zip(out, vector)) if a != b or isinstance(b, str))
        raise WireFormatError(f"{what}: field {i} is {vector[i]!r}, not an integer", rank=rank)
    if out and (min(out) < 0 or max(out) > INT64_MAX):  # C-level scan; name the first bad field
        for i, v in enumerate(out):
            if not 0 <= v <= INT64_MAX:
                raise WireFormatError(f"{what}: field {i} is {v}, outside [0, 2^63)", rank=rank)
    return out


def decode_header(vector: Sequence[int], rank: int, length: int = HEADER_LEN) -> Header:
    """Decode and check rank ``rank``'s header of ``length`` values; raise if malformed or
    self-contradicting."""
    values = _check_ints(vector, f"rank {rank} header", length, rank)
    it, rnd, status_code, groups, capacity, samples, tokens = values[:HEADER_LEN]
    pending, load, room = values[HEADER_LEN:] or (0, 0, 0)
    status = _STATUS.get(status_code)
    if status is None:
        raise WireFormatError(f"rank {rank} header: unknown status {status_code}", rank=rank)
    if status in (Status.FINISHED, Status.IDLE) and (groups or samples or tokens or pending or load or room):
        raise PeerInconsistencyError(
            f"rank {rank} reports {status.name.lower()} while holding {samples} samples in {groups} groups "
            f"({pending} pending)", rank=rank)
    if (tokens or load) and not samples:
        raise PeerInconsistencyError(f"rank {rank} reports {tokens} loss tokens and a load of {load} without samples",
                                     rank=rank)
    if room and (pending or not samples):
        raise PeerInconsistencyError(f"rank {rank} reports {room} room in held groups with {samples} samples "
                                     f"and {pending} pending (room is reported only with every view arrived)",
                                     rank=rank)
    if status is Status.WAITING and groups:
        raise PeerInconsistencyError(f"rank {rank} reports waiting with {groups} groups", rank=rank)
    if status is Status.READY and not 1 <= groups <= samples:
        raise PeerInconsistencyError(f"rank {rank} reports ready with {groups} groups over {samples} samples",
                                     rank=rank)
    return Header(it, rnd, status, groups, capacity, samples, tokens, pending, load, room)


def decode_headers(vectors: Sequence[Sequence[int]], world: int, iteration: int, rnd: int,
                   length: int = HEADER_LEN) -> list[Header]:
    """Decode every rank's header (``length`` values each) and check they all belong to this
    iteration and round."""
    if len(vectors) != world:
        raise WireFormatError(f"header gather: expected {world} vectors, got {len(vectors)}")
    try:
        return _headers_fast(vectors, iteration, rnd, length)
    except Exception:  # noqa: BLE001 - the rank-by-rank decoding below names what is wrong
        pass
    headers = [decode_header(v, r, length) for r, v in enumerate(vectors)]
    for r, h in enumerate(headers):
        if (h.iteration, h.round) != (iteration, rnd):
            raise PeerInconsistencyError(
                f"rank {r} is at iteration {h.iteration} round {h.round}, expected iteration {iteration} round {rnd}",
                rank=r)
    return headers


class HeaderGather(Sequence[Header]):
    """Every rank's header of one round, decoded and checked (:func:`decode_headers`): a
    read-only sequence of :class:`Header` with the (iteration, round) it was decoded for.

    Pure functions of the headers (the target policy, the mean tokens per sample) are
    computed once per gather by :meth:`derived`, so ranks that share one gather (the
    simulator) share them; every result is what the function returns on the headers.
    """

    __slots__ = ("headers", "iteration", "round", "finished", "length", "checked", "_derived")

    def __init__(self, headers: Sequence[Header], iteration: int, rnd: int, length: int = HEADER_LEN, *,
                 checked: bool = False) -> None:
        self.headers = tuple(headers)
        self.checked = checked
        """Built by :meth:`decode` (every header checked); only such a gather :meth:`belongs_to` a round."""
        self.iteration = iteration
        self.round = rnd
        self.length = length
        """The header vectors' length (``TAIL_HEADER_LEN`` under a shared tail)."""
        self.finished = sum(1 for h in self.headers if h.status is Status.FINISHED)
        """How many ranks said FINISHED."""
        self._derived: dict[Any, Any] = {}

    @classmethod
    def decode(cls, vectors: Sequence[Sequence[int]], world: int, iteration: int, rnd: int,
               length: int = HEADER_LEN) -> HeaderGather:
        """Decode and check a header gather (:func:`decode_headers`)."""
        return cls(decode_headers(vectors, world, iteration, rnd, length), iteration, rnd, length, checked=True)

    def belongs_to(self, world: int, iteration: int, rnd: int, length: int = HEADER_LEN) -> bool:
        """Whether this is a gather of ``world`` headers of ``length`` decoded (and so checked, not
        built by hand) for ``iteration`` and ``rnd``."""
        return (self.checked and len(self.headers) == world and self.iteration == iteration and self.round == rnd
                and self.length == length)

    def encode(self) -> list[list[int]]:
        """The header vectors again (what was gathered, as ints)."""
        return [h.encode(self.length) for h in self.headers]

    def derived(self, fn: Callable[[Sequence[Header]], _T]) -> _T:
        """``fn(self)``, computed once per gather (``fn`` must be a pure function of the headers)."""
        try:
            return self._derived[fn]  # type: ignore[no-any-return]
        except KeyError:
            value = self._derived[fn] = fn(self)
            return value

    def __len__(self) -> int:
        return len(self.headers)

    @overload
    def __getitem__(self, index: int) -> Header: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[Header, ...]: ...

    def __getitem__(self, index: int | slice) -> Header | tuple[Header, ...]:
        return self.headers[index]

    def __iter__(self) -> Iterator[Header]:
        return iter(self.headers)

    def __repr__(self) -> str:
        return f"HeaderGather(iteration={self.iteration}, round={self.round}, headers={list(self.headers)!r})"


def _headers_fast(vectors: Sequence[Sequence[int]], iteration: int, rnd: int, length: int = HEADER_LEN) -> list[Header]:
    """:func:`decode_headers` of a well-formed, consistent gather, checked in one pass: the
    values packed as uint64 (ints in [0, 2^64)) with no top bit set (< 2^63), then each
    header's status and counts as :func:`decode_header` checks them. Raises on anything
    else, for the rank-by-rank decoder to report."""
    if any(len(v) != length for v in vectors):
        raise _Slow
    if length != HEADER_LEN:
        raise _Slow  # the shared tail's headers take the rank-by-rank path
    count = HEADER_LEN * len(vectors)
    packed = struct.pack(f"<{count}Q", *chain.from_iterable(vectors))
    if not packed[7::8].isascii():  # a value >= 2^63
        raise _Slow
    values = iter(struct.unpack(f"<{count}Q", packed))  # the ints int() gives
    headers = []
    for it, rn, code, groups, capacity, samples, tokens in zip(*[values] * HEADER_LEN):
        status = _STATUS.get(code)
        if it != iteration or rn != rnd or status is None:
            raise _Slow
        if status is Status.READY:
            if not 1 <= groups <= samples:
                raise _Slow
        elif groups or (status in (Status.FINISHED, Status.IDLE) and (samples or tokens)):
            raise _Slow
        if tokens and not samples:  # loss tokens without samples: decode_header names it
            raise _Slow
        headers.append(Header(it, rn, status, groups, capacity, samples, tokens))
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
        flat = _check_ints(vector, f"rank {r} step vector", 2 * target, r)
        pairs = list(zip(flat[0::2], flat[1::2]))
        if header.status is Status.READY:
            if any(n < 1 for n, _ in pairs):
                raise PeerInconsistencyError(f"rank {r} was ready but sent an empty item", rank=r)
            if sum(n for n, _ in pairs) > header.samples:
                raise PeerInconsistencyError(f"rank {r} emitted more samples than the {header.samples} it held",
                                             rank=r)
            if sum(t for _, t in pairs) > header.tokens:
                raise PeerInconsistencyError(f"rank {r} emitted more loss tokens than the {header.tokens} it held",
                                             rank=r)
        elif any(n or t for n, t in pairs):
            raise PeerInconsistencyError(f"rank {r} was not ready but sent a non-idle item", rank=r)
        decoded.append(pairs)
    return decoded


@lru_cache(maxsize=32)
def _packer(n: int) -> tuple[struct.Struct, int]:
    """Packs ``n`` values as little-endian uint64 (ints in [0, 2^64), or ``struct.error``);
    with the mask of the top 16 bits of each 64-bit slot of the big integer they make."""
    return struct.Struct(f"<{n}Q"), int.from_bytes(b"\0\0\0\0\0\0\xff\xff" * n, "little")


def _step_sums(vectors: Sequence[Sequence[int]], headers: Sequence[Header], target: int) -> list[int]:
    """Check every rank's step vector as :func:`decode_steps` does; return the sum over ranks
    of each of the 2T fields (``[samples_0, tokens_0, samples_1, ...]``).

    O(W x T) at C speed: each vector is packed as uint64 (which checks each value's type
    and range), its sample counts checked against its header, and it is added to the
    others as one big integer of 2T 64-bit slots: with every value below 2^48 and
    W <= 2^16 no slot carries into the next, so the big sum holds each field's sum. On any
    failure (or larger values or worlds) :func:`_step_sums_checked` decides, which
    raises exactly :func:`decode_steps`'s error (and names the same rank).
    """
    n = 2 * target
    try:
        if not n or len(vectors) != len(headers) or len(vectors) > 1 << 16 or any(len(v) != n for v in vectors):
            raise _Slow
        packer, high = _packer(n)
        pack, from_bytes = packer.pack, int.from_bytes
        total = 0
        for vector, header in zip(vectors, headers):
            value = from_bytes(pack(*vector), "little")
            if value & high:
                raise _Slow  # a value >= 2^48: slots could carry (and >= 2^63 is an error)
            if header.status is Status.READY:
                samples = vector[0::2]
                held, tokens = sum(samples), sum(vector[1::2])
                if type(held) is not int or held > header.samples or 0 in samples or tokens > header.tokens:
                    raise _Slow
            elif value:
                raise _Slow
            total += value
    except Exception:  # noqa: BLE001 - the checked path decides and names what is wrong
        return _step_sums_checked(vectors, headers, target)
    return list(struct.unpack(f"<{n}Q", total.to_bytes(8 * n, "little")))


def _step_sums_checked(vectors: Sequence[Sequence[int]], headers: Sequence[Header], target: int) -> list[int]:
    """:func:`_step_sums` by :func:`decode_steps` itself (any world, any values)."""
    pairs = decode_steps(vectors, headers, target)
    return [sum(column) for column in zip(*([v for pair in rank for v in pair] for rank in pairs))]


class _Slow(Exception):
    """A fast decoder found something its checked twin must look at."""


GatheredBytes = bytes | bytearray | memoryview
"""A step gather as the collective wrote it: every rank's 2T int64 in rank order,
little-endian (8 x W x 2T bytes); the adapter hands it over without decoding it."""


@lru_cache(maxsize=32)
def _sample_masks(target: int) -> tuple[int, int, tuple[tuple[int, int], ...]]:
    """For one rank's step vector read as a little-endian integer of 2T 64-bit slots (every
    value below 2^48): 2^48 - 1 in each sample slot (the mask of the sample counts), bit 48
    of each sample slot, and the (shift, mask) folds that sum the sample slots into slot 0."""
    pair = b"\xff\xff\xff\xff\xff\xff\0\0" + bytes(8)
    samples = int.from_bytes(pair * target, "little")
    bit48 = int.from_bytes((bytes(6) + b"\x01" + bytes(9)) * target, "little")
    folds, slots = [], target
    while slots > 1:
        half = (slots + 1) // 2
        folds.append((128 * half, (1 << (128 * half)) - 1))
        slots = half
    return samples, bit48, tuple(folds)


def _step_sums_bytes(data: GatheredBytes, headers: Sequence[Header], target: int) -> list[int]:
    """:func:`_step_sums` of a gather's raw bytes (:data:`GatheredBytes`), with the same checks
    and errors, without making a Python int of each value (P6: peer data is checked).

    Every value below 2^48 (the two top bytes of each slot zero, one scan of the bytes), each
    rank's vector is read as one integer: a ready rank's sample slots all >= 1 (adding
    2^48 - 1 to each sets its bit 48) and their sum (folded into slot 0) at most its header's
    samples, its token slots' sum at most its header's tokens, an inactive rank's vector zero;
    the ranks' integers add up to the field sums.
    Anything else is decoded to int64 lists and decided by :func:`_step_sums_checked`."""
    data = data if type(data) is bytes else bytes(data)
    n, world = 2 * target, len(headers)
    size = INT64_BYTES * n
    if len(data) != world * size:
        raise WireFormatError(f"step gather: expected {world} x {n} int64 values ({world * size} bytes), "
                              f"got {len(data)} bytes")
    try:
        high = data[6::8] + data[7::8]
        if not n or world > 1 << 16 or target >= 1 << 15 or high.count(0) != len(high):
            raise _Slow
        samples_mask, bit48, folds = _sample_masks(target)
        from_bytes, total = int.from_bytes, 0
        for r, header in enumerate(headers):
            value = from_bytes(data[r * size:(r + 1) * size], "little")
            if header.status is Status.READY:
                held = value & samples_mask
                if (held + samples_mask) & bit48 != bit48:
                    raise _Slow  # an empty item
                tokens = (value >> 64) & samples_mask  # the token slots, moved onto the sample slots
                for shift, mask in folds:
                    held = (held & mask) + (held >> shift)
                    tokens = (tokens & mask) + (tokens >> shift)
                if held > header.samples or tokens > header.tokens:
                    raise _Slow
            elif value:
                raise _Slow
            total += value
    except _Slow:
        return _step_sums_checked(_int64_vectors(data, world, n), headers, target)
    return list(struct.unpack(f"<{n}Q", total.to_bytes(size, "little")))


def _int64_vectors(data: bytes, world: int, n: int) -> list[list[int]]:
    """The gather's bytes as ``world`` lists of ``n`` int64 (what ``tolist()`` gives)."""
    unpack = struct.Struct(f"<{n}q").unpack_from
    return [list(unpack(data, INT64_BYTES * n * r)) for r in range(world)]


class StepGather:
    """Every rank's step vector of one round, checked as :func:`decode_steps` checks them
    against the round's :class:`HeaderGather` and target, with the global sums of each item
    (what every rank's steps need); a rank reads its own vector with :meth:`vector`.

    ``gathered`` is the list of vectors or the gather's raw bytes (:data:`GatheredBytes`):
    the same checks, sums and errors either way (the bytes are never made into lists
    unless a check fails or :attr:`vectors` / :meth:`columns` is asked for)."""

    __slots__ = ("headers", "target", "_raw", "_vectors", "global_samples", "global_tokens", "_derived")

    def __init__(self, gathered: Sequence[Sequence[int]] | GatheredBytes, headers: HeaderGather, target: int) -> None:
        if isinstance(gathered, (bytes, bytearray, memoryview)):
            self._raw: bytes | None = bytes(gathered) if type(gathered) is not bytes else gathered
            self._vectors: Sequence[Sequence[int]] | None = None
            sums = _step_sums_bytes(self._raw, headers, target)
        else:
            self._raw, self._vectors = None, gathered
            sums = _step_sums(gathered, headers, target)
        self.headers = headers
        self.target = target
        self.global_samples = sums[0::2]
        """Per item, the sum of every rank's sample count."""
        self.global_tokens = sums[1::2]
        """Per item, the sum of every rank's loss-token count."""
        self._derived: dict[Any, Any] = {}

    @property
    def vectors(self) -> Sequence[Sequence[int]]:
        """Per rank, its step vector as gathered (decoded from the bytes on first use)."""
        if self._vectors is None:
            assert self._raw is not None
            self._vectors = _int64_vectors(self._raw, len(self.headers), 2 * self.target)
        return self._vectors

    def belongs_to(self, headers: HeaderGather, target: int) -> bool:
        """Whether this gather was decoded against ``headers`` (the same object) and ``target``."""
        return self.headers is headers and self.target == target

    @property
    def gathered(self) -> Sequence[Sequence[int]] | bytes:
        """What it was built from: the raw bytes, or the vectors."""
        return self._raw if self._raw is not None else self.vectors

    def vector(self, rank: int) -> list[int]:
        """Rank ``rank``'s step vector (ints)."""
        if self._vectors is None and self._raw is not None:
            n = 2 * self.target
            return list(struct.unpack_from(f"<{n}q", self._raw, INT64_BYTES * n * rank))
        return [int(v) for v in self.vectors[rank]]

    def columns(self) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
        """Per item, every rank's sample counts and every rank's loss-token counts (O(W x T))."""
        columns = list(zip(*(self.vector(r) for r in range(len(self.headers)))))
        return columns[0::2], columns[1::2]

    def derived(self, key: Any, fn: Callable[[], _T]) -> _T:
        """``fn()`` computed once per gather under ``key`` (``fn`` must be a pure function of the gather)."""
        try:
            return self._derived[key]  # type: ignore[no-any-return]
        except KeyError:
            value = self._derived[key] = fn()
            return value


def payload_bytes(target: int, pooled: bool = False) -> int:
    """Bytes one rank sends in a round with target ``target`` (0 for a skip round); ``pooled``:
    under a shared tail, whose header has ``TAIL_HEADER_LEN`` fields."""
    return INT64_BYTES * ((TAIL_HEADER_LEN if pooled else HEADER_LEN) + (2 * target if target else 0))
