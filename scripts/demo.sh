#!/usr/bin/env bash
# The main job: set up .venv if needed, then run the tiny end-to-end demo (arguments go to `hpc-rlhf demo`).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
exec "$ROOT/.venv/bin/hpc-rlhf" demo "$@"
