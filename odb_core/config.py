"""Validated protocol configuration (pydantic v2).

Every rank must hold the same :class:`ODBConfig`; the protocol's lockstep (P2) and
determinism (P8) rest on every rank evaluating the same pure functions over the same
gathered data with the same parameters.
"""

from __future__ import annotations

import numbers
from fractions import Fraction
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

Mode = Literal["join", "non-join"]
LossScaling = Literal["none", "sample", "approx", "exact"]
TargetPolicyName = Literal["paper", "all-ready", "balanced", "min"]
OverflowPolicyName = Literal["largest", "oldest"]
BudgetName = Literal["padded", "packed"]

MODES: tuple[Mode, ...] = get_args(Mode)
TARGET_POLICIES: tuple[TargetPolicyName, ...] = get_args(TargetPolicyName)
"""The one list of target policy names: the core's strategies, the CLI, the hypothesis
strategies, the conformance scenarios and the spec's ``Policy`` constant are checked
against it (``tests/test_policy_names.py``)."""
OVERFLOW_POLICIES: tuple[OverflowPolicyName, ...] = get_args(OverflowPolicyName)
BUDGETS: tuple[BudgetName, ...] = get_args(BudgetName)


def _integral(value: Any) -> Any:
    """An integer field's input: a Python or NumPy integer, or a float with an integral value
    (``8192.0``, YAML's ``8e3``), as an int; a bool, a string or a fractional float is refused
    rather than coerced (pydantic's lax mode reads ``True`` as 1 and ``"8192"`` as 8192)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"must be an integer, got {type(value).__name__} {value!r}")
    return int(value)


Integer = Annotated[int, BeforeValidator(_integral)]


class ODBConfig(BaseModel):
    """Parameters of the ODB protocol.

    Attributes:
        token_budget: L_max, the token budget of one group (P3); >= 1.
        budget: how a group's tokens count against L_max (P3). ``"padded"`` (default): max
            length x size, groups formed by the B(l) walk (:mod:`odb_core.grouping`);
            ``"packed"``: the sum of the lengths (a padding-free, concatenated batch), groups
            formed by best-fit decreasing over the buffer (:mod:`odb_core.packing`). Under
            both a zero length counts as 1, and a sample longer than L_max travels alone
            and is counted (``Step.over_budget``), never dropped (spec: ``BudgetKind``).
        buffer_size: samples a rank buffers before it forms groups; >= 1.
        depth: outstanding depth D: a rank fetches while |Q| + |B \\ H| < D (H: the
            samples held back to regroup), so it holds at most D samples in Q and B
            with ``regroup_padding=None``, and at most 2D with regroup on, at most D of
            them held back; defaults to ``buffer_size`` and must be >= ``buffer_size``
            (a smaller D can never fill the buffer, and every rank would wait forever).
        mode: ``"join"`` drains every view before global finish (P4);
            ``"non-join"`` ends a logical iteration when any rank finishes and
            chains iterations up to the sample quota (P5).
        loss_scaling: how step weights are computed (P7); ``"exact"`` is per-token.
        seed: base seed of the sampler permutation (P8).
        target_policy: left out, ``"balanced"`` under the padded budget and ``"min"``
            under the packed one. ``"balanced"`` aims each round at the ceiling of the
            mean group count over ready ranks, overflowing surplus groups to the next
            round, and skips rounds while any rank is still filling its buffer;
            ``"all-ready"`` aims at the max (Eq. 3) with the same skip; ``"paper"`` is
            Eq. 3 as published, under which filling ranks emit idle items; ``"min"``
            aims at the fewest groups of a ready rank with the same skip, so no rank
            splits a group to reach it (see :mod:`odb_core.alignment`). All four are
            model-checked.
        overflow_policy: which groups a rank keeps when it has more than T:
            ``"largest"`` (paper Alg. 1; ties to the oldest) or ``"oldest"``
            (group holding the longest-waiting sample first; bounds waits by D rounds, 2D
            with regroup on, whose held samples count toward neither the buffer nor D; plus
            up to 2 rounds per pool view under the packed budget's shared tail).
        output_capacity: output slots a rank can fill in one round (C_r); ``None``
            means unbounded.
        regroup_padding: a rank that is not drained holds back groups of >= 2
            samples, none of them held at its last round, whose padding fraction
            (1 - real / padded tokens; packed budget: 1 - real tokens / L_max, the budget
            the group leaves unused) exceeds this: such a group stays in the buffer
            and regroups with the next arrivals, where lengths are denser. A round
            holds them in walk order only while they total at most D samples (a
            prefix; later ones are kept), and nothing if it would hold every group;
            held samples do not count toward ``buffer_size`` or the depth until the
            next emitting round, so a rank holds at most 2D samples in Q and B, at
            most D of them held back (D in all with regroup off), and a rank short
            of T groups emits held groups before it splits any. Nothing is dropped
            (P1) and a drained rank never holds (P6). Under the packed budget with a
            shared tail, a rank whose views have all arrived holds every part-full group
            (single samples and groups held last round too) until the pool is dealt
            (:mod:`odb_core.tail`'s reserve).
            ``None`` turns it off (the paper's behaviour). The default 0.02 brings the
            padding at buffer 1024 and budget 8192 under 1% on the fitted distributions
            with fewer steps; under the packed budget it lifts best-fit packing there from
            98.7-99.8% to 99.5-99.9% of L_max, within 0.1 pp of offline first-fit decreasing
            (``benchmarks/bench_packing_rule.py``, README "Packed budget") (spec: ``RegroupNum / RegroupDen``, ``H``).
        shuffle_steps: each rank emits a round's T items in a seeded order of its own
            (seed, iteration, round, rank: deterministic, P8), chosen before the step
            vectors are gathered, so step k still pairs every rank's k-th item and its
            loss weights (P2, P7). Groups form short to long; in order, every global step
            would pair the ranks' k-th shortest groups and each round would run from
            short to long samples. Shuffled, a step mixes lengths across ranks (demo,
            seeds 0-2, measured before regroup landed: mean final loss 5.656 against 5.702
            with one order for all ranks).
            The spec admits every order (``Orders`` in spec/ODB.tla).
        shared_tail: the fraction f of each epoch's sampler order kept out of the shards as a
            pool the ranks claim from as their own views run out, the ranks with the least
            work left first (:mod:`odb_core.tail`; join mode, views given as lists). 0 (the
            default): no pool, every view on its shard's rank.
        reserve_divisor: under the packed budget with a pool, each round of the reserve deals one
            view to each of the ceil(W / reserve_divisor) roomiest ranks with nothing pending
            (:mod:`odb_core.tail`). The default 8 deals one view a round at W <= 8 (the chat
            data at W=8: 438 rows, first-fit decreasing over every length 437) and keeps the
            reserve's rounds from growing in step with W (ultrachat, simulated: 72 rounds at
            W=64, not 420, the same rows; 142 at W=256, not 1,571); 1 deals to every roomy rank
            at once (fewest rounds, fuller rows lost).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    token_budget: Integer = Field(ge=1, lt=2**63)  # a room of up to L_max travels in an int64 header field
    budget: BudgetName = "padded"
    buffer_size: Integer = Field(default=1024, ge=1)
    depth: Integer | None = Field(default=None, ge=1)
    mode: Mode = "join"
    loss_scaling: LossScaling = "exact"
    seed: Integer = Field(default=0, ge=-(2**63), lt=2**63)  # seed + epoch seeds a torch.Generator
    target_policy: TargetPolicyName = "balanced"
    overflow_policy: OverflowPolicyName = "largest"
    output_capacity: Integer | None = Field(default=None, ge=1, lt=2**63)  # an int64 header field
    regroup_padding: Annotated[float, Field(strict=True)] | None = Field(default=0.02, ge=0, lt=1)
    shuffle_steps: Annotated[bool, Field(strict=True)] = True
    shared_tail: Annotated[float, Field(strict=True)] = Field(default=0.0, ge=0, lt=1)
    reserve_divisor: Integer = Field(default=8, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _policy_follows_budget(cls, data: Any) -> Any:
        """``target_policy`` left out: ``"min"`` under the packed budget (no split adds a
        part-full row: 99.4-99.9% packing efficiency at W = 2-8 against balanced's
        98.4-99.3%, README "Packed rows"), ``"balanced"`` under the padded one."""
        if isinstance(data, dict) and "target_policy" not in data:
            return {**data, "target_policy": "min" if data.get("budget") == "packed" else "balanced"}
        return data

    @model_validator(mode="after")
    def _tail_needs_join(self) -> ODBConfig:
        if self.shared_tail and self.mode != "join":
            raise ValueError("shared_tail needs mode='join' (non-join ends its epoch at a quota, not when the "
                             "ranks' views run out, so a pool has nothing to balance)")
        return self

    @model_validator(mode="after")
    def _depth_covers_buffer(self) -> ODBConfig:
        if self.depth is not None and self.depth < self.buffer_size:
            raise ValueError(
                f"depth ({self.depth}) must be >= buffer_size ({self.buffer_size}): "
                "a smaller outstanding depth can never fill the buffer"
            )
        return self

    @property
    def regroup_fraction(self) -> Fraction | None:
        """``regroup_padding`` as an exact fraction (denominator <= 10**6), compared in integers."""
        return None if self.regroup_padding is None else Fraction(self.regroup_padding).limit_denominator(10**6)

    @property
    def outstanding_depth(self) -> int:
        """D: the effective bound on |Q| + |B| per rank."""
        return self.depth if self.depth is not None else self.buffer_size
