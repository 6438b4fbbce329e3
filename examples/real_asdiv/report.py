"""The real run's report (examples/real_asdiv/run.sh): held-out pass@k from the base model through SFT and GRPO,
stage times, step times and the split of a GRPO step.  Usage: python report.py OUT_DIR"""
import json
import sys
from pathlib import Path

KEYS = ("eval/pass@1", "eval/pass@2", "eval/pass@4", "eval/pass@8", "eval/maj@8", "eval/reward/answer_found")


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else float("nan")


def main(out: Path) -> None:
    base = json.loads((out / "eval_base" / "eval_metrics.json").read_text())["metrics"]
    sft = rows(out / "sft" / "metrics.jsonl")
    grpo = rows(out / "grpo" / "metrics.jsonl")
    times = json.loads((out / "times.json").read_text())
    evals = [("base model", base)] + [(f"GRPO step {r['step']}" if r["step"] else "after SFT (GRPO step 0)", r)
                                      for r in grpo if "eval/pass@1" in r]
    print("## Held-out eval (200 ASDiv problems x 8 samples, temperature 0.7, 32 new tokens)\n")
    print("| model | " + " | ".join(KEYS) + " | eval s |")
    print("|---" * (len(KEYS) + 2) + "|")
    for name, m in evals:
        print(f"| {name} | " + " | ".join(f"{m.get(k, float('nan')):.3f}" for k in KEYS)
              + f" | {m.get('time/eval_s', float('nan')):.0f} |")
    first, last = base, evals[-1][1]
    print(f"\npass@1 {first['eval/pass@1']:.3f} -> {last['eval/pass@1']:.3f} "
          f"({100 * (last['eval/pass@1'] - first['eval/pass@1']):+.1f} points); "
          f"pass@8 {first['eval/pass@8']:.3f} -> {last['eval/pass@8']:.3f}")
    total = sum(times.values())
    print(f"\n## Time: {total / 60:.1f} min in all\n")
    print("| stage | s |\n|---|---|")
    for k, v in times.items():
        print(f"| {k} | {v:.0f} |")
    print(f"\nSFT: {len(sft)} steps, step time mean {mean(r['step_time_s'] for r in sft):.1f} s, "
          f"loss {sft[0]['loss']:.3f} -> {sft[-1]['loss']:.3f}")
    steps = [r for r in grpo if r.get("step", 0) > 0 and "time/step_s" in r]
    split = ("time/generate_score_s", "time/infer_advantages_s", "time/train_s", "time/weight_sync_s")
    print(f"GRPO: {len(steps)} steps, step time mean {mean(r['time/step_s'] for r in steps):.1f} s: "
          + ", ".join(f"{k.split('/')[1][:-2]} {mean(r.get(k, 0.0) for r in steps):.1f} s" for k in split)
          + f"; reward/mean of the first and last step {steps[0].get('reward/mean', float('nan')):.3f}, "
            f"{steps[-1].get('reward/mean', float('nan')):.3f}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
