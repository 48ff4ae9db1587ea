#!/usr/bin/env bash
# The main job on embedded data: installs what it needs, then runs `odb demo`:
# a 2-rank CPU DDP fine-tune on real chat data comparing Standard, Sorted, ODB and ODB packed
# batching (about 5 minutes on 2 cores; plots and demo.json land in ./results).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/bootstrap.sh"
exec "$root/.venv/bin/odb" demo "$@"
