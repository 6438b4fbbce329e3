"""`hpc-rlhf plan --estimate` and `--auto` on the seed's four placements against the OpenRLHF paper's Table 5.

For each config examples/scale/llama2-{7b,13b,34b,70b}-ppo.yaml (Table 3's placement, A800-80G, 1024 prompts, one
PPO epoch, at the paper's length caps of 1024 prompt and 1024 response tokens): the seconds per phase predicted
(launch/estimate.py, efficiency factors from this project's records, never fitted to Table 5), the paper's, their
ratio, and the placement `--auto` chooses on the same GPUs with its estimate.  Prints one JSON object
(docs/runs/plan/table5.json; tests/unit/launch/test_estimate.py checks that it is current).
"""
from __future__ import annotations

import json
from pathlib import Path

from hpc_rlhf.commands import load_config, placement_plan
from hpc_rlhf.launch import estimate

ROOT = Path(__file__).resolve().parents[1]
PAPER = {  # seconds: generation, vLLM weight sync, logits and reward, training, total (Table 5)
    "7b": (262.96, 4.32, 32.7, 171.13, 471.11), "13b": (372.14, 10.03, 29.58, 197.18, 608.93),
    "34b": (720.50, 35.47, 326.00, 444.43, 1526.40), "70b": (2252.79, 111.65, 323.38, 1800.71, 4488.53)}


def compare(size: str) -> dict:
    config = ROOT / "examples" / "scale" / f"llama2-{size}-ppo.yaml"
    cfg = load_config("train rl", str(config), [])
    models, layout, work, machine = estimate.from_config(cfg, placement_plan("train rl", cfg))
    predicted = estimate.estimate(models, layout, work, machine)
    paper = dict(zip((*estimate.PHASES, "total"), PAPER[size]))
    chosen, chosen_est = estimate.search(layout.gpus, models, work, machine)
    return {"config": str(config.relative_to(ROOT)), "gpus": layout.gpus,
            "phases": {k: {"predicted_s": round(predicted[k], 1), "paper_s": paper[k],
                           "ratio": round(predicted[k] / paper[k], 2)} for k in paper},
            "auto": {"overrides": chosen.overrides(), "total_s": round(chosen_est["total"], 1),
                     "phases_s": {k: round(v, 1) for k, v in chosen_est.items()}}}


def main() -> None:
    print(json.dumps({"calibration": vars(estimate.CALIBRATION), "rows": {s: compare(s) for s in PAPER}}, indent=1))


if __name__ == "__main__":
    main()
