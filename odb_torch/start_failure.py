"""Why a collate process died before running any of ODB's code, in words.

Under ``spawn`` (and ``forkserver``) the child is a fresh interpreter: it re-imports the
script that started training (as ``__mp_main__``) and unpickles the dataset,
``collate_fn``, ``length_fn`` and sampler. Either can fail before ODB's code runs, and
the reason then goes only to stderr with exit code 1. :func:`explain_start_failure`
runs in the trainer after such a death (never on the happy path) and names the cause
and the fix: the objects defined in ``__main__`` that a fresh interpreter cannot find.
"""

from __future__ import annotations

import os
import pickle
import pickletools
import sys
from typing import Any


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


def explain_start_failure(objects: Any, start_method: str, exitcode: int | None) -> str:
    """Cause and fix of a collate process that exited with ``exitcode`` before starting."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if path is not None and not os.path.isfile(path):  # `python - < file` names it "<stdin>"
        path = None
    names = main_globals(objects)
    if names and path is None:
        return (f"the collate process ({start_method}) could not start (exit code {exitcode}): "
                f"{', '.join(names)} {'is' if len(names) == 1 else 'are'} defined in __main__ (code from standard "
                "input, `python -c` or a notebook), which a fresh interpreter cannot import. Define "
                f"{'it' if len(names) == 1 else 'them'} in a module file and import it, or pass start_method='fork' "
                "(only if this process has not initialised CUDA)")
    where = f"re-importing your script {path} (as __mp_main__)" if path else "starting a fresh interpreter"
    also = f", then unpickling {', '.join(names)} from it" if names else ""
    return (f"the collate process ({start_method}) could not start (exit code {exitcode}): it failed while {where}"
            f"{also}; its traceback is on stderr above. A {start_method} child re-runs everything at the top "
            "level of the script: keep training code under `if __name__ == \"__main__\":` and make the module "
            "importable without side effects")
