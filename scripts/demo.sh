#!/usr/bin/env bash
# The main job on embedded data: installs what it needs, then runs it.
# Until the training demo lands, this simulates an 8-rank epoch on the fitted
# sharegpt4o length distribution and prints the audit.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/bootstrap.sh"
exec "$root/.venv/bin/odb" simulate --world 8 --samples 57284 --lengths sharegpt4o "$@"
