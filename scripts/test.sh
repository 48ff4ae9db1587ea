#!/usr/bin/env bash
# The whole test suite, on a fresh machine or not: installs what it needs, type-checks, then runs pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/bootstrap.sh"
cd "$root"
export HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-ci}"
.venv/bin/python -m mypy
.venv/bin/python -m ruff check "$root"
exec .venv/bin/python -m pytest "$@"
