"""How the collate process starts, and why it could not, in words.

``start_method="auto"`` (the default) forks on Linux, as a plain ``DataLoader`` starts
its workers: the child shares the trainer's memory, so nothing is pickled and the
script that started training is never re-run; a dataset class defined in ``__main__``
(a notebook, ``python - < script``, a script without a main guard) works.

Under ``spawn`` (and ``forkserver``) the child is a fresh interpreter: it re-imports the
script that started training (as ``__mp_main__``) and unpickles the dataset,
``collate_fn``, ``length_fn`` and sampler. :func:`check_spawnable` refuses, on every
rank and before any process starts, what cannot work that way: code from standard
input, objects defined in a ``__main__`` that has no file, and a loader iterated from
the script's top-level code outside ``if __name__ == "__main__":`` (the child would run
the training again). :func:`explain_start_failure` runs in the trainer after a child
died while starting (never on the happy path) and names the cause and the fix.
"""

from __future__ import annotations

import ast
import os
import pickle
import pickletools
import sys
from types import FrameType
from typing import Any, Literal

from odb_core.errors import StartMethodError

StartMethod = Literal["auto", "fork", "spawn", "forkserver"]
FIX = "or use start_method='auto' (fork on Linux, as a plain DataLoader does)"


def resolve_start_method(requested: StartMethod, available: list[str]) -> str:
    """``auto``: ``fork`` on Linux where available, else ``spawn`` (macOS, Windows)."""
    if requested == "auto":
        return "fork" if sys.platform.startswith("linux") and "fork" in available else "spawn"
    if requested not in available:
        raise ValueError(f"start_method={requested!r} is not available here (available: {available})")
    return requested


def main_globals(objects: Any) -> list[str]:
    """Names of the classes and functions from ``__main__`` that pickling ``objects`` refers to."""
    try:
        payload = pickle.dumps(objects, protocol=2)  # protocol 2 names globals inline (GLOBAL opcodes)
    except Exception:
        return []
    found = []
    for op, arg, _ in pickletools.genops(payload):
        if op.name == "GLOBAL" and isinstance(arg, str):
            module, _, name = arg.partition(" ")
            if module == "__main__" and name not in found:
                found.append(name)
    return found


def _main_file() -> tuple[bool, str | None]:
    """(whether ``__main__`` names a file at all, the file if it exists)."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    if path is None:
        return False, None
    return True, path if os.path.isfile(path) else None


def _is_main_guard(node: ast.stmt) -> bool:
    """An ``if`` whose test reads ``__name__`` (``if __name__ == "__main__":`` and its
    variants): the script guards this code, so it is not refused (only sure re-runs are)."""
    return isinstance(node, ast.If) and any(
        isinstance(n, ast.Name) and n.id == "__name__" for n in ast.walk(node.test))


def unguarded_line(path: str, frame: FrameType | None) -> int | None:
    """The line of ``path``'s top-level code that (through calls) runs ``frame``, when that
    line is outside an ``if __name__ == "__main__":`` block; None when guarded or unknown."""
    main = sys.modules.get("__main__")
    while frame is not None and not (frame.f_code.co_name == "<module>"
                                     and main is not None and frame.f_globals is vars(main)):
        frame = frame.f_back
    if frame is None or os.path.abspath(frame.f_code.co_filename) != os.path.abspath(path):
        return None
    line = frame.f_lineno
    try:
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read(), path)
    except (OSError, SyntaxError, ValueError):
        return None
    for node in tree.body:
        if node.lineno <= line <= (node.end_lineno or node.lineno):
            return None if _is_main_guard(node) else line
    return None


def check_spawnable(objects: Any, start_method: str, frame: FrameType | None, *, rank: int | None = None) -> None:
    """Raise :class:`StartMethodError` if a ``start_method`` child could not start with
    ``objects`` (pickled to it) from the call stack ending at ``frame``; fork always can."""
    if start_method == "fork":
        return
    named, path = _main_file()
    where = f"rank {rank}: the collate process ({start_method}) cannot start:"
    if named and path is None:
        raise StartMethodError(f"{where} it re-imports the script that started training, and this one was read "
                               f"from standard input (or a file that is gone); run it from a file, {FIX}", rank=rank)
    if path is None:
        names = main_globals(objects)
        if names:
            raise StartMethodError(
                f"{where} {', '.join(names)} {'is' if len(names) == 1 else 'are'} defined in __main__ (a notebook "
                "or `python -c`), which a fresh interpreter cannot import; define "
                f"{'it' if len(names) == 1 else 'them'} in a module file and import it, {FIX}", rank=rank)
        return
    line = unguarded_line(path, frame)  # a top-level line outside any `if` that reads __name__
    if line is not None:
        raise StartMethodError(
            f"{where} it re-runs everything at the top level of {path}, and this loader is iterated from line "
            f"{line}, outside `if __name__ == \"__main__\":`, so the child would start training again; put the "
            f"training code under that guard, {FIX}", rank=rank)


def unpicklable_error(exc: Exception, start_method: str, rank: int | None) -> StartMethodError:
    """What a ``start_method`` child that could not be given its objects raises instead of the
    pickler's own error (they are pickled before the child is launched: nothing started)."""
    return StartMethodError(
        f"rank {rank}: the collate process ({start_method}) cannot start: pickling what it runs failed with "
        f"{type(exc).__name__}: {exc}. Under {start_method} the dataset, collate_fn, length_fn, loss_tokens_fn "
        "and sampler are pickled to it: define them at module level (no lambdas, local functions or open "
        f"handles), {FIX}", rank=rank)


def explain_start_failure(objects: Any, start_method: str, exitcode: int | None) -> str:
    """Cause and fix of a collate process that exited with ``exitcode`` before starting."""
    _, path = _main_file()
    names = main_globals(objects)
    where = f"re-importing your script {path} (as __mp_main__)" if path else "starting a fresh interpreter"
    also = f", then unpickling {', '.join(names)} from it" if names else ""
    return (f"the collate process ({start_method}) could not start (exit code {exitcode}): it failed while {where}"
            f"{also}; its traceback is on stderr above. A {start_method} child re-runs everything at the top "
            "level of the script: keep training code under `if __name__ == \"__main__\":` and make the module "
            f"importable without side effects, {FIX}")
