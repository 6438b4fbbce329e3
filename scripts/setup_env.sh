#!/usr/bin/env bash
# Create (or reuse) the virtual env .venv inside the repo and install hpc_rlhf with its test tools.
# Re-running is cheap: it reinstalls only when pyproject.toml or constraints.txt changed.
# Every pip call goes through constraints.txt, which pins torch: an unpinned resolve would pull a
# CUDA torch and GBs of nvidia packages.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV="$ROOT/.venv"
PYTHON=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV with $($PYTHON --version)" >&2
  "$PYTHON" -m venv "$VENV"
fi
stamp="$VENV/.hpc_rlhf-installed"
want=$(cat "$ROOT/pyproject.toml" "$ROOT/constraints.txt" "$0" | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing hpc_rlhf and its dependencies into $VENV" >&2
  "$VENV/bin/pip" install -q -c "$ROOT/constraints.txt" -e "$ROOT[test]"
  # DeepSpeed compiles its CPU communication op on first use (~35-55 s on a fresh machine);
  # build it into the installed package once instead.
  ds_version=$("$VENV/bin/python" -c "import importlib.metadata as m; print(m.version('deepspeed'))")
  if ! "$VENV/bin/python" -c "import deepspeed.ops.comm.deepspeed_shm_comm_op" 2>/dev/null; then
    echo "setup: prebuilding DeepSpeed's CPU communication op (deepspeed $ds_version)" >&2
    DS_BUILD_SHM_COMM=1 "$VENV/bin/pip" install -q -c "$ROOT/constraints.txt" --no-build-isolation --no-deps \
      --force-reinstall --no-cache-dir "deepspeed==$ds_version"
  fi
  echo "$want" > "$stamp"
fi
