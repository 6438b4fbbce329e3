"""The efficiency factors of `hpc-rlhf plan --estimate`, computed from this project's own benchmark records.

Reads docs/runs/perf/ and prints one JSON object (docs/runs/plan/calibration.json is its output;
tests/unit/launch/test_estimate.py checks that hpc_rlhf/launch/estimate.py:CALIBRATION equals it):
- matmul: the bf16 matmul FLOP/s measured on the H200 (machine_limits, the CUDA run's `limits`) over the H200 data
  sheet's dense bf16 peak;
- hbm: the H200's measured read bandwidth (twice the copy bandwidth: a read is half of a copy's traffic, as
  machine_limits.decode_limit_s counts it) over the data sheet's HBM bandwidth;
- train: the median, over the CPU runs of `train rl` (grpo_real_vs_trl's hpc_rlhf side, fp32), of the training
  FLOP/s (6 x params x tokens / training seconds) over the machine's measured matmul peak: the share of the peak a
  training step keeps once its non-matmul work is paid;
- link: the median, over the same runs, of the weight sync's bytes per second over the machine's copy bandwidth;
- layer_step_s: the time per layer of one decode step beyond the roofline in the H200 run of the lean engine with
  CUDA graphs (SmolLM2-135M, bf16, 64 rows): (generation seconds - the roofline's) / decode steps / layers.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from hpc_rlhf.config.gpus import GPUS

ROOT = Path(__file__).resolve().parents[1]
PERF = ROOT / "docs" / "runs" / "perf"
H200_RUN = "grpo_real_cuda_h200_bf16_graphs.json"
H200 = GPUS["h200-141g"]
SMOLLM2_LAYERS = 30


def _cpu_runs(perf: Path) -> list[dict]:
    """The hpc_rlhf side of every CPU fp32 grpo_real_vs_trl record."""
    sides = []
    for path in sorted(perf.glob("grpo_real_*.json")):
        record = json.loads(path.read_text())
        if not isinstance(record, dict) or record.get("benchmark", "grpo_real_vs_trl") != "grpo_real_vs_trl":
            continue
        config = record.get("config") or {}
        if config.get("device", "cpu") not in (None, "cpu") or config.get("dtype") != "fp32":
            continue
        side = (record.get("sides") or {}).get("hpc_rlhf")
        if side and side.get("fractions", {}).get("train_vs_peak_fp32"):
            sides.append({"file": path.name, **side["fractions"]})
    return sides


def calibration(perf: Path = PERF) -> dict:
    h200 = json.loads((perf / H200_RUN).read_text())
    side = h200["sides"]["hpc_rlhf"]
    steps = h200["config"]["max_new_tokens"]  # one generate call of all 64 rows a step: the decode steps
    beyond = side["rollout_generate_s"] - side["fractions"]["decode_limit_s"]
    runs = _cpu_runs(perf)
    return {
        "matmul": round(h200["limits"]["matmul_flops_bf16"] / H200.bf16_flops, 3),
        "hbm": round(2 * h200["limits"]["copy_bytes_per_s"] / H200.hbm_bytes_per_s, 3),
        "train": round(statistics.median(r["train_vs_peak_fp32"] for r in runs), 3),
        "link": round(statistics.median(r["weight_sync_vs_copy"] for r in runs if r.get("weight_sync_vs_copy")), 3),
        "layer_step_s": round(beyond / steps / SMOLLM2_LAYERS, 6),
        "cpu_runs": len(runs),
        "sources": [H200_RUN] + [r["file"] for r in runs],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--perf", type=Path, default=PERF, help="the folder of benchmark records")
    print(json.dumps(calibration(ap.parse_args().perf), indent=1))


if __name__ == "__main__":
    main()
