"""The two token budgets of ``ODBConfig.budget``: their grouping rules and what P3 means under each.

* ``"padded"``: a group costs max_len x size (a padded batch); grouped by the B(l) walk
  (:func:`~odb_core.grouping.group_buffer`).
* ``"packed"``: a group costs the sum of its sizes, a zero length counting as 1 (a
  concatenated, padding-free batch); grouped by best-fit decreasing, the samples held back to regroup
  walked first (:func:`~odb_core.packing.pack_buffer`).

P3 (Budget) under either: every group of >= 2 samples costs at most L_max; a sample
longer than L_max travels alone and is counted, never dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet

from odb_core.grouping import form_groups, group_buffer, padded_tokens
from odb_core.packing import pack_buffer, pack_groups, packed_tokens

BufferRule = Callable[[Mapping[int, int], int, AbstractSet[int]], list[list[int]]]
"""One round's grouping of a buffer (key -> length) under a token budget L_max, given the
keys held back to regroup at the last round (a subset of the buffer's keys)."""


def group_buffer_rule(lengths: Mapping[int, int], token_budget: int, held: AbstractSet[int]) -> list[list[int]]:
    """The padded budget's rule: the B(l) walk (:func:`~odb_core.grouping.group_buffer`);
    held keys are walked with the others (the walk depends on lengths only)."""
    return group_buffer(lengths, token_budget)


BUFFER_RULES: dict[str, BufferRule] = {"padded": group_buffer_rule, "packed": pack_buffer}
"""The grouping rule of each budget name (:data:`odb_core.config.BUDGETS`)."""


def group_cost(budget: str, group_lengths: Sequence[int]) -> int:
    """What a group of these lengths costs against L_max under ``budget`` (0 if empty)."""
    if budget == "packed":
        return packed_tokens(group_lengths)
    if budget == "padded":
        return padded_tokens(group_lengths)
    raise ValueError(f"unknown budget {budget!r}")


def within_budget(budget: str, group_lengths: Sequence[int], token_budget: int) -> bool:
    """P3 for one group: a lone sample always passes; a group of >= 2 costs <= L_max."""
    return len(group_lengths) < 2 or group_cost(budget, group_lengths) <= token_budget


def form(budget: str, lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Group sample indices under ``budget`` (:func:`~odb_core.grouping.form_groups` or
    :func:`~odb_core.packing.pack_groups`)."""
    if budget == "packed":
        return pack_groups(lengths, token_budget)
    if budget == "padded":
        return form_groups(lengths, token_budget)
    raise ValueError(f"unknown budget {budget!r}")
