"""Progress bars of the long ``odb`` commands (tqdm, on stderr).

A bar shows only when asked for (the commands turn it off with ``--json``), when stderr
is a terminal, and once its command has run for ``delay`` seconds; stdout is never
written to, so the commands' output parses the same with or without it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from tqdm import tqdm

Observer = Callable[[Sequence[Any]], None]


def bar(total: int | None, desc: str, unit: str, enabled: bool = True, delay: float = 0.0, **kwargs: Any) -> Any:
    """A tqdm bar on stderr; off unless ``enabled`` and stderr is a terminal."""
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=None if enabled else True,
                delay=delay, dynamic_ncols=True, **kwargs)


@contextmanager
def simulation_bar(samples: int, world: int, enabled: bool = True) -> Iterator[Observer | None]:
    """An observer for :func:`odb_core.simulate` that advances a bar by the views the
    ranks have fetched (shown after a second: only large simulations); None when off."""
    with bar(samples, "simulate", "views", enabled, delay=1.0) as b:
        if b.disable:
            yield None
            return
        rounds = 0

        def observe(protocols: Sequence[Any]) -> None:
            nonlocal rounds
            rounds += 1
            fetched = min(samples, sum(p.next_position for p in protocols))
            b.update(max(0, fetched - b.n))  # a chained (non-join) iteration starts again at 0
            if rounds % 64 == 0:
                b.set_postfix_str(f"W={world}, round {rounds}", refresh=False)

        yield observe
