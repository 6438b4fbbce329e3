#!/usr/bin/env bash
# The performance benchmarks on a CUDA machine without network, in one command there (docs/performance.md,
# "On a GPU").  The model's weights (538 MB) cannot travel with a working tree of 64 MiB, so both benchmarks run
# SmolLM2-135M's shape and tokenizer with random weights (--random-init): speed at the real shape, not learning.
#
#   bash scripts/gpu_bench.sh prepare            # here, with network and the real assets: fills .gpu_bench/
#   bash scripts/gpu_bench.sh run OUT [ROUNDS]   # there: OUT gets profile_generation.json, grpo_real_vs_trl.json,
#                                                # its log, phases_cuda.png and runs.tgz (rounds.jsonl, metrics)
#
# prepare: the wheels of scripts/gpu_wheels.sh (.whl/) plus TRL's (the version in .venv), and the model's
# config, tokenizer and chat template with ASDiv's training split (under .gpu_bench/, which git ignores through
# .git/info/exclude); name both folders in the device call's carry.
# run: installs the wheels into $GPU_BENCH_SITE (default /tmp/hpc_rlhf_gpu_site), then (1) grpo_real_vs_trl.py with
# the sides trl, hpc_rlhf and hpc_rlhf_async in bf16, ROUNDS rounds (default 2) of 4 steps; (2) profile_generation.py
# on the GPU in bf16, the engine against transformers' generate, 64 new tokens.  About 10 minutes
# on one H200 with 2 rounds.  GPU_BENCH_PROFILE_S and GPU_BENCH_GRPO_S bound the two (default 150 and 560 s; a
# GPU_BENCH_PROFILE_S of 0 skips the profile), so
# that the run fits a device call with other work in it; a cut-off benchmark keeps its finished rounds in runs.tgz.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BENCH=$ROOT/.gpu_bench
ASSETS=${HPC_RLHF_ASSETS:-$HOME/.cache/hpc_rlhf/real}

prepare() {
  set -e
  [ -f "$ASSETS/smollm2-135m-instruct/config.json" ] || { echo "gpu_bench: no real assets in $ASSETS: run scripts/real_assets.sh" >&2; exit 1; }
  ls "$ROOT"/.whl/*.whl >/dev/null 2>&1 || bash "$ROOT/scripts/gpu_wheels.sh"
  mkdir -p "$ROOT/.git/info" "$BENCH/smollm2-135m-instruct" "$BENCH/asdiv"
  grep -qx '/.gpu_bench/' "$ROOT/.git/info/exclude" 2>/dev/null || echo '/.gpu_bench/' >> "$ROOT/.git/info/exclude"
  trl=$("$ROOT/.venv/bin/python" -c 'import importlib.metadata as m; print(m.version("trl"))')
  "$ROOT/.venv/bin/pip" download -q --no-deps --only-binary=:all: -d "$BENCH" "trl==$trl"
  find "$ASSETS/smollm2-135m-instruct" -maxdepth 1 -type f ! -name '*.safetensors' -exec cp {} "$BENCH/smollm2-135m-instruct/" \;
  cp "$ASSETS/asdiv/train.jsonl" "$BENCH/asdiv/"
  du -sh "$ROOT/.whl" "$BENCH"
  echo "gpu_bench: ready; carry .whl and .gpu_bench, then run: bash scripts/gpu_bench.sh run \$OUT"
}

run() {
  local out=${1:?usage: gpu_bench.sh run OUT [ROUNDS]} rounds=${2:-2}
  local site=${GPU_BENCH_SITE:-/tmp/hpc_rlhf_gpu_site} keep=/tmp/hpc_rlhf_gpu_bench
  local py=${PYTHON:-python3}
  mkdir -p "$out"
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
    "$ROOT"/.whl/*.whl "$BENCH"/*.whl || { echo "gpu_bench: the wheels did not install" >&2; return 1; }
  export PYTHONPATH="$site:$ROOT" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 DS_BUILD_OPS=0 \
    DS_SKIP_CUDA_CHECK=1 TOKENIZERS_PARALLELISM=false
  local model=$BENCH/smollm2-135m-instruct data=$BENCH/asdiv/train.jsonl rc=0
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  rm -rf "$keep"
  timeout "${GPU_BENCH_GRPO_S:-560}" "$py" "$ROOT/benchmarks/grpo_real_vs_trl.py" --device cuda --dtype bf16 --random-init \
    --model "$model" --data "$data" --sides trl,hpc_rlhf,hpc_rlhf_async --steps 4 --warmup 1 --rounds "$rounds" \
    --plot "$out/phases_cuda.png" --keep "$keep" > "$out/grpo_real_vs_trl.json" 2> "$out/grpo_real_vs_trl.log" || rc=1
  tail -20 "$out/grpo_real_vs_trl.log"
  if [ "${GPU_BENCH_PROFILE_S:-150}" != 0 ]; then  # 0: no profile (timeout 0 would mean no limit)
    timeout "${GPU_BENCH_PROFILE_S:-150}" "$py" "$ROOT/benchmarks/profile_generation.py" --device cuda --dtype bf16 --random-init \
      --compare-hf --model "$model" --data "$data" --max-new-tokens 64 > "$out/profile_generation.json" \
      2> "$out/profile_generation.log" || rc=1
  fi
  (cd "$keep" 2>/dev/null && tar czf "$out/runs.tgz" --exclude random_model --exclude '*_out' --exclude '*_ckpt' \
    --exclude trl_out .)
  return $rc
}

case "${1:-}" in
  prepare) prepare ;;
  run) shift; run "$@" ;;
  *) echo "usage: bash scripts/gpu_bench.sh prepare | run OUT [ROUNDS]" >&2; exit 2 ;;
esac
