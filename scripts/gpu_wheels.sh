#!/usr/bin/env bash
# Wheels for a GPU machine without network (scripts/gpu_check.sh installs .whl/*.whl there).  Run here, where
# pip reaches the package index: it fills .whl/ (or the folder given) with what hpc_rlhf needs and such a
# machine lacks (its image has python 3.12, a CUDA torch, transformers, peft, accelerate, tensorboard...;
# not deepspeed, datasets, submitit), for CPython 3.12 on manylinux x86_64, without dependencies, and prints
# the total size: the working tree that travels to the machine is limited to 64 MiB.
#
#   bash scripts/gpu_wheels.sh [FOLDER]        # PYTHON: an interpreter with torch (default .venv/bin/python)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=${1:-$ROOT/.whl}
PY=${PYTHON:-$ROOT/.venv/bin/python}
LIMIT=$((64 * 1024 * 1024))

# Pins: the versions pyproject.toml (deepspeed>=0.17,<0.20, datasets>=3,<6, submitit>=1.5) and
# constraints.txt resolve to in .venv, and the dependencies of these three that the machine lacks.
WHEELS=(
  datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19                        # datasets and its own deps
  submitit==1.5.4                                                          # cloudpickle is there
  hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  typing-extensions==4.16.0                                                # deepspeed's deps; pydantic wants >=4.16
  transformers==5.23.0                 # the version the tests run with here (the image's 5.17 predates it)
)
DEEPSPEED=deepspeed==0.19.8

mkdir -p "$OUT"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$OUT" "${WHEELS[@]}"
# DeepSpeed publishes a source distribution only: build a pure-Python wheel here with no op compiled into it
# (DS_BUILD_OPS=0; hpc_rlhf trains with torch's AdamW, so the machine compiles none either).  Its setup.py
# imports torch, hence --no-build-isolation with an interpreter that has it.
if ! ls "$OUT"/deepspeed-*.whl >/dev/null 2>&1; then
  DS_BUILD_OPS=0 DS_ACCELERATOR=cuda "$PY" -m pip wheel -q --no-deps --no-build-isolation --no-cache-dir \
    --no-binary=deepspeed -w "$OUT" "$DEEPSPEED"
fi

total=0
for f in "$OUT"/*.whl; do
  size=$(stat -c %s "$f")
  total=$((total + size))
  awk -v s="$size" -v f="$(basename "$f")" 'BEGIN { printf "%8.2f MiB  %s\n", s / 1048576, f }'
done
awk -v s="$total" -v d="$OUT" \
  'BEGIN { printf "total %.2f MiB of wheels in %s (the whole travelling working tree may hold 64 MiB)\n", s / 1048576, d }'
cat <<'EOF'
left out, as they do not fit or are not needed there:
  vllm         its CUDA wheel alone is several hundred MiB and pins its own torch: the vLLM check reports
               "not covered: vllm not installed" unless the machine has vllm
  bitsandbytes QLoRA only (model.load_in_4bit), which the check does not use; its CUDA wheel is tens of MiB
EOF
if [ "$total" -gt "$LIMIT" ]; then
  echo "gpu_wheels: the wheels exceed 64 MiB: they cannot travel with the working tree" >&2
  exit 1
fi
