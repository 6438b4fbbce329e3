#!/usr/bin/env bash
# The real run (docs/real_model.md): SmolLM2-135M-Instruct on ASDiv, on CPU, from the assets to the report.
#   split      validation_split.py: 200 of the 2,005 training problems become the validation split (settings are
#              chosen on it), the other 1,805 train SFT and RL; the 300 held-out problems are evaluated once per
#              final model
#   eval_base  held-out eval of the model as it comes (heldout.yaml: all 300 problems x 8 samples, temperature
#              0.7, 32 new tokens, the same sample seeds for every model; every sample saved)
#   sft        SFT on the training problems for which equations.py finds a one-step equation (sft.yaml)
#   eval_sft   the same held-out eval of the SFT model
#   curriculum the SFT model's pass rate on each SFT problem (8 samples at the rollout temperature, 1.0), then
#              curriculum.py keeps the problems it solves sometimes (0 < pass rate < 1): RL's prompts
#   grpo_seed1, grpo_seed2, rloo, ppo
#              RL from the SFT model on the curriculum's problems (grpo.yaml with train.seed 1 and 2; the same
#              settings with the rloo and the gae estimator, PPO's critic starting from the SFT model), validation pass@1
#              every log.eval_steps steps, then the held-out eval of the final model; the stage's wall time
#              counts both
#   report     report.py: the held-out table with paired 95% intervals of each gain over SFT, summary.json,
#              the learning curves (hpc-rlhf report), samples before and after
# Usage: bash examples/real_asdiv/run.sh [OUT] [--stages a,b,...]   (default OUT runs/real_asdiv, every stage;
#        STAGES=... works too).  SFT_ARGS, CURRICULUM_ARGS, RL_ARGS and HELDOUT_ARGS add key=value overrides to
#        the SFT, the curriculum's eval, every RL and every held-out eval command (tests/e2e/real/test_real_recipe.py runs
#        a shortened recipe that way).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
HERE="$ROOT/examples/real_asdiv"
OUT=runs/real_asdiv
ALL=split,eval_base,sft,eval_sft,curriculum,grpo_seed1,grpo_seed2,rloo,ppo,report
while [ $# -gt 0 ]; do
  case $1 in
    --stages) STAGES=$2; shift 2 ;;
    --stages=*) STAGES=${1#--stages=}; shift ;;
    -*) echo "run.sh: unknown option $1 (usage: run.sh [OUT] [--stages $ALL])" >&2; exit 2 ;;
    *) OUT=$1; shift ;;
  esac
done
STAGES=${STAGES:-$ALL}
for s in ${STAGES//,/ }; do
  case ",$ALL," in *",$s,"*) ;; *) echo "run.sh: unknown stage '$s' (choose from $ALL)" >&2; exit 2 ;; esac
done
cd "$ROOT"
bash scripts/real_assets.sh
PY="$ROOT/.venv/bin/python"
ASSETS=${HPC_RLHF_ASSETS:-$HOME/.cache/hpc_rlhf/real}
export HF_HUB_OFFLINE=1
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
want() { case ",$STAGES," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }
stage() {  # stage NAME command...: run it, record its wall time in $OUT/times.json (added to NAME's earlier time)
  local name=$1; shift
  local t0; t0=$(date +%s.%N)
  "$@"
  "$PY" - "$OUT/times.json" "$name" "$t0" <<'PYEOF'
import json, os, sys, time
path, name, t0 = sys.argv[1], sys.argv[2], float(sys.argv[3])
times = json.load(open(path)) if os.path.exists(path) else {}
times[name] = round(times.get(name, 0.0) + time.time() - t0, 1)
json.dump(times, open(path, "w"), indent=1)
PYEOF
}
heldout() {  # heldout NAME MODEL: the held-out eval of MODEL into $OUT/heldout/NAME
  # shellcheck disable=SC2086
  "$PY" -m hpc_rlhf.cli eval --config "$HERE/heldout.yaml" "model.pretrain=$2" "output_path=$OUT/heldout/$1" \
    "data.eval_prompt_data=$ASSETS/asdiv/heldout.jsonl" ${HELDOUT_ARGS:-}
}
rl() {  # rl NAME CONFIG [overrides]: train from the SFT model, then the held-out eval of the final model
  local name=$1 config=$2; shift 2
  [ -s "$OUT/curriculum.jsonl" ] || { echo "run.sh: $OUT/curriculum.jsonl is missing: run the curriculum stage first" >&2; exit 2; }
  # shellcheck disable=SC2086
  "$PY" -m hpc_rlhf.cli train rl --config "$HERE/$config" "model.pretrain=$OUT/sft" \
    "data.prompt_data=$OUT/curriculum.jsonl" "data.eval_prompt_data=$OUT/validation.jsonl" \
    "ckpt.save_path=$OUT/$name" "ckpt.ckpt_path=$OUT/${name}_checkpoints" "$@" ${RL_ARGS:-}
  heldout "$name" "$OUT/$name"
}
if want split; then
  "$PY" "$HERE/validation_split.py" "$ASSETS/asdiv/train.jsonl" "$OUT/rl_train.jsonl" "$OUT/validation.jsonl"
  "$PY" "$HERE/equations.py" "$OUT/rl_train.jsonl" "$OUT/sft_train.jsonl"
fi
want eval_base && stage eval_base heldout base "$ASSETS/smollm2-135m-instruct"
# shellcheck disable=SC2086
want sft && stage sft "$PY" -m hpc_rlhf.cli train sft --config "$HERE/sft.yaml" "data.dataset=$OUT/sft_train.jsonl" \
  "ckpt.save_path=$OUT/sft" "ckpt.ckpt_path=$OUT/sft_checkpoints" ${SFT_ARGS:-}
want eval_sft && stage eval_sft heldout sft "$OUT/sft"
curriculum() {
  # shellcheck disable=SC2086
  "$PY" -m hpc_rlhf.cli eval --config "$HERE/heldout.yaml" "model.pretrain=$OUT/sft" "output_path=$OUT/sft_pass_rates" \
    "data.eval_prompt_data=$OUT/sft_train.jsonl" eval.eval_temperature=1.0 ${CURRICULUM_ARGS:-}
  "$PY" "$HERE/curriculum.py" "$OUT/sft_train.jsonl" "$OUT"/sft_pass_rates/eval_samples/step_*.jsonl \
    "$OUT/curriculum.jsonl" --summary "$OUT/curriculum_summary.json"
}
want curriculum && stage curriculum curriculum
want grpo_seed1 && stage grpo_seed1 rl grpo_seed1 grpo.yaml train.seed=1
want grpo_seed2 && stage grpo_seed2 rl grpo_seed2 grpo.yaml train.seed=2
want rloo && stage rloo rl rloo grpo.yaml algo.advantage_estimator=rloo
want ppo && stage ppo rl ppo grpo.yaml algo.advantage_estimator=gae
if want report; then
  "$PY" -m hpc_rlhf.cli report $(for r in grpo_seed1 grpo_seed2 rloo ppo; do [ -d "$OUT/$r" ] && echo "$OUT/$r"; done) \
    --out "$OUT/report"
  "$PY" "$HERE/report.py" "$OUT" | tee "$OUT/report.md"
fi
