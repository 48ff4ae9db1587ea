"""The core stays sans-IO: it imports neither torch nor anything that does I/O."""

import ast
import pathlib
import subprocess
import sys

import odb_core

FORBIDDEN = {"torch", "socket", "subprocess", "multiprocessing", "threading", "asyncio", "os", "io", "pathlib",
             "shutil", "tempfile", "select", "selectors", "signal", "urllib", "http", "numpy", "odb_torch"}


def test_core_sources_import_nothing_forbidden():
    root = pathlib.Path(odb_core.__file__).parent
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                assert name.split(".")[0] not in FORBIDDEN, f"{path.name} imports {name}"


def test_importing_the_core_loads_no_torch():
    code = "import sys, odb_core; odb_core.simulate([3, 5], 2, odb_core.ODBConfig(token_budget=8)); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"
