#!/usr/bin/env bash
# The GPU check: on a CUDA machine, runs in under 10 minutes what its GPU count allows (collectives on NCCL,
# SFT with ZeRO-3 in bf16 and a resume, GRPO colocated with the transformers engine and with vLLM, and with
# two or more GPUs SFT on 2 ranks and the NCCL weights bridge; with one, the bridge over gloo) and prints ONE
# JSON line: what ran, what passed with its key figures, what was not covered and why.  Exit code 1 when a
# check failed; without CUDA the JSON says so and the exit code is 0.
#
#   bash scripts/gpu_check.sh [--work DIR] [--budget-s S] [--only NAME,...]
#
# Nothing is installed from the network.  hpc_rlhf comes from this checkout (PYTHONPATH); packages the
# machine lacks come as wheels in .whl/ (made by scripts/gpu_wheels.sh) and are installed into
# $GPU_CHECK_SITE (default /tmp/hpc_rlhf_gpu_site), which goes on PYTHONPATH.  PYTHON picks the
# interpreter (default python3, the one that holds a CUDA torch).  Logs: WORK/logs; summary: WORK/summary.json.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python3}

if ls "$ROOT"/.whl/*.whl >/dev/null 2>&1 && "$PY" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
  SITE=${GPU_CHECK_SITE:-/tmp/hpc_rlhf_gpu_site}
  echo "gpu_check: installing $(ls "$ROOT"/.whl/*.whl | wc -l) wheels from .whl/ into $SITE" >&2
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "$ROOT"/.whl/*.whl >&2 || { echo '{"gpu_check": "hpc_rlhf", "ok": false, "failed": ["wheels"]}'; exit 1; }
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$ROOT/scripts:$ROOT${PYTHONPATH:+:$PYTHONPATH}"

# No network: every model and data file is local.  DeepSpeed: no op is built (DS_BUILD_OPS=0) and none is
# needed at run time (hpc_rlhf trains with torch's AdamW); the check fails if one is compiled on the fly.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export DS_BUILD_OPS=0 DS_SKIP_CUDA_CHECK=1 PYTHONUNBUFFERED=1
export CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8}  # deterministic cuBLAS (resume equality)
exec "$PY" -m gpu_check "$@"
