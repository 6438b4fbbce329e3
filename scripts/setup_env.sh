#!/usr/bin/env bash
# Create (or reuse) the virtual env .venv inside the repo and install hpc_rlhf with its test tools.
# Re-running is cheap: it reinstalls only when pyproject.toml, the constraints or this script changed.
# Every pip call goes through the constraints file, which pins torch: an unpinned resolve would pull a
# CUDA torch and GBs of nvidia packages.
# scripts/setup_vllm_env.sh reuses this script for .venv-vllm through the variables below.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${HPC_RLHF_VENV:-$ROOT/.venv}
C=${HPC_RLHF_CONSTRAINTS:-$ROOT/constraints.txt}
EXTRA=${HPC_RLHF_EXTRA_PACKAGES:-}    # installed with hpc_rlhf
REMOVE=${HPC_RLHF_REMOVE_PACKAGES:-}  # uninstalled afterwards
PYTHON=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV with $($PYTHON --version)" >&2
  "$PYTHON" -m venv "$VENV"
fi
stamp="$VENV/.hpc_rlhf-installed"
want=$( (cat "$ROOT/pyproject.toml" "$C" "$0"; echo "$EXTRA $REMOVE") | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing hpc_rlhf ${EXTRA:+and $EXTRA }into $VENV" >&2
  # shellcheck disable=SC2086
  "$VENV/bin/pip" install -q -c "$C" $EXTRA -e "$ROOT[test]"
  if [ -n "$REMOVE" ]; then
    # shellcheck disable=SC2086
    "$VENV/bin/pip" uninstall -q -y $REMOVE 2>/dev/null || true
  fi
  # DeepSpeed compiles its CPU communication op on first use (~35-55 s on a fresh machine);
  # build it into the installed package once instead.
  ds_version=$("$VENV/bin/python" -c "import importlib.metadata as m; print(m.version('deepspeed'))")
  if ! "$VENV/bin/python" -c "import deepspeed.ops.comm.deepspeed_shm_comm_op" 2>/dev/null; then
    echo "setup: prebuilding DeepSpeed's CPU communication op (deepspeed $ds_version)" >&2
    DS_BUILD_SHM_COMM=1 "$VENV/bin/pip" install -q -c "$C" --no-build-isolation --no-deps \
      --force-reinstall --no-cache-dir "deepspeed==$ds_version"
  fi
  echo "$want" > "$stamp"
fi
