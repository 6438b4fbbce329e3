#!/usr/bin/env bash
# The real run (docs/real_model.md): SmolLM2-135M-Instruct on ASDiv, on CPU.
#   1. held-out eval of the model as it comes (eval.yaml: 200 problems x 8 samples, pass@1..8, maj@k)
#   2. SFT on the training rows for which equations.py finds a one-step equation giving the answer (sft.yaml)
#   3. GRPO from the SFT model with the math verifier's reward (grpo.yaml), whose eval (same problems, same
#      sampling settings and seeds) runs before the first step, every eval_steps and at the end
#   4. report.py: the curve, the start and end figures, the step times and where the time goes
# Usage: bash examples/real_asdiv/run.sh [OUT]   (default runs/real_asdiv; key=value overrides are not taken)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
HERE="$ROOT/examples/real_asdiv"
OUT=${1:-runs/real_asdiv}
cd "$ROOT"
bash scripts/real_assets.sh
PY="$ROOT/.venv/bin/python"
export HF_HUB_OFFLINE=1
mkdir -p "$OUT"
stage() {  # stage NAME command...: run it, record its wall time in $OUT/times.json
  local name=$1; shift
  local t0; t0=$(date +%s.%N)
  "$@"
  "$PY" - "$OUT/times.json" "$name" "$t0" <<'PYEOF'
import json, sys, time, os
path, name, t0 = sys.argv[1], sys.argv[2], float(sys.argv[3])
times = json.load(open(path)) if os.path.exists(path) else {}
times[name] = round(time.time() - t0, 1)
json.dump(times, open(path, "w"), indent=1)
PYEOF
}
rm -f "$OUT/times.json"
stage eval_base "$PY" -m hpc_rlhf.cli eval --config "$HERE/eval.yaml" "output_path=$OUT/eval_base"
"$PY" "$HERE/equations.py" "${HPC_RLHF_ASSETS:-$HOME/.cache/hpc_rlhf/real}/asdiv/train.jsonl" "$OUT/sft_train.jsonl"
stage sft "$PY" -m hpc_rlhf.cli train sft --config "$HERE/sft.yaml" "data.dataset=$OUT/sft_train.jsonl" \
  "ckpt.save_path=$OUT/sft" "ckpt.ckpt_path=$OUT/sft_checkpoints"
stage grpo "$PY" -m hpc_rlhf.cli train rl --config "$HERE/grpo.yaml" "model.pretrain=$OUT/sft" \
  "ckpt.save_path=$OUT/grpo" "ckpt.ckpt_path=$OUT/grpo_checkpoints"
"$PY" "$HERE/report.py" "$OUT" | tee "$OUT/report.md"
