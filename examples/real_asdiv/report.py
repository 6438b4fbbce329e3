"""The real run's report (examples/real_asdiv/run.sh): held-out pass@1, pass@8 and maj@8 of every model, each gain
over the SFT model with its paired 95% interval, the stages' wall times (the curriculum stage's apart: it serves
every RL stage), and samples before and after RL.

The gain of a model over SFT is the mean over the 300 held-out problems of (the model's fraction of correct samples
on the problem - the SFT model's), both from 8 samples with the same sample seeds; its interval is the percentile
bootstrap over problems (``hpc_rlhf.algorithms.eval_metrics.paired_bootstrap``, 10,000 resamples).  ``grpo`` is
the mean of ``grpo_seed1`` and ``grpo_seed2``: its per-problem rate is the mean of the two seeds' rates, its
pass@8 and maj@8 the mean of theirs.  Writes OUT/summary.json; prints the markdown report.

Usage: python report.py OUT_DIR
"""
import json
import sys
from pathlib import Path

from hpc_rlhf.algorithms.eval_metrics import paired_bootstrap, pass_rates

MODELS = ("base", "sft", "grpo_seed1", "grpo_seed2", "rloo", "ppo")
NAMES = {"base": "SmolLM2-135M-Instruct as it comes", "sft": "SFT", "grpo_seed1": "GRPO, seed 1",
         "grpo_seed2": "GRPO, seed 2", "grpo": "GRPO (mean of the two seeds)", "rloo": "RLOO", "ppo": "PPO (critic)"}
METRICS = ("eval/pass@1", "eval/pass@8", "eval/maj@8")


def samples(out: Path, name: str) -> list[dict]:
    [path] = sorted((out / "heldout" / name / "eval_samples").glob("step_*.jsonl"))
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def heldout(out: Path) -> tuple[dict, dict]:
    """({model: its eval metrics}, {model: {problem: pass rate}}) of the models whose held-out eval exists."""
    metrics, rates = {}, {}
    for name in MODELS:
        if (out / "heldout" / name / "eval_metrics.json").is_file():
            metrics[name] = json.loads((out / "heldout" / name / "eval_metrics.json").read_text())["metrics"]
            rates[name] = pass_rates(samples(out, name))
    if "grpo_seed1" in rates and "grpo_seed2" in rates:
        a, b = rates["grpo_seed1"], rates["grpo_seed2"]
        rates["grpo"] = {p: (a[p] + b[p]) / 2 for p in a}
        metrics["grpo"] = {k: (metrics["grpo_seed1"][k] + metrics["grpo_seed2"][k]) / 2 for k in METRICS}
    return metrics, rates


def summary(out: Path) -> dict:
    metrics, rates = heldout(out)
    times = json.loads((out / "times.json").read_text()) if (out / "times.json").is_file() else {}
    # a model's wall time: the stages that made and evaluated it (base: its eval; SFT: training and eval; an RL
    # stage holds both; GRPO: the mean of its seeds'); times_s keeps each stage's own time
    seeds = [times[k] for k in ("grpo_seed1", "grpo_seed2") if k in times]
    wall = {**times, "base": times.get("eval_base"),
            "sft": times["sft"] + times.get("eval_sft", 0.0) if "sft" in times else None,
            "grpo": sum(seeds) / len(seeds) if seeds else None}
    table = {}
    for name in [*MODELS[:4], "grpo", *MODELS[4:]]:
        if name not in metrics:
            continue
        row = {"pass@1": metrics[name]["eval/pass@1"], "pass@8": metrics[name]["eval/pass@8"],
               "maj@8": metrics[name]["eval/maj@8"], "wall_s": wall.get(name)}
        if "sft" in rates and name != "sft":
            problems = sorted(rates["sft"])
            boot = paired_bootstrap([rates["sft"][p] for p in problems], [rates[name][p] for p in problems])
            row |= {"gain_pass@1": boot["gain"], "gain_ci95": boot["ci"]}
        table[name] = row
    return {"heldout": table, "problems": len(rates.get("sft", {})), "times_s": times}


def before_after(out: Path, first: str, then: str, count: int = 3) -> list[tuple[dict, dict]]:
    """Problems the ``first`` model never solved and ``then`` solved in most samples, and the reverse: one sample
    of each model per problem (``count`` of each kind)."""
    a, b = ({s["prompt_id"]: s for s in samples(out, m) if s["sample"] == 0} for m in (first, then))
    ra, rb = pass_rates(samples(out, first)), pass_rates(samples(out, then))
    gained = [p for p in sorted(ra) if ra[p] == 0 and rb[p] >= 0.5][:count]
    lost = [p for p in sorted(ra) if ra[p] >= 0.5 and rb[p] == 0][:count]
    return [(a[p], b[p]) for p in gained + lost]


def main(out: Path) -> None:
    s = summary(out)
    (out / "summary.json").write_text(json.dumps(s, indent=1) + "\n")
    table = s["heldout"]
    print(f"## Held-out ASDiv ({s['problems']} problems x 8 samples, temperature 0.7, 32 new tokens)\n")
    print("| model | pass@1 | pass@8 | maj@8 | gain in pass@1 over SFT (paired 95% interval) | stage wall time |")
    print("|---|---|---|---|---|---|")
    for name, row in table.items():
        gain = (f"{100 * row['gain_pass@1']:+.1f} points ({100 * row['gain_ci95'][0]:+.1f}, "
                f"{100 * row['gain_ci95'][1]:+.1f})" if "gain_pass@1" in row else "")
        wall = f"{row['wall_s'] / 60:.1f} min" if row.get("wall_s") else ""
        print(f"| {NAMES[name]} | {row['pass@1']:.3f} | {row['pass@8']:.3f} | {row['maj@8']:.3f} | {gain} | {wall} |")
    if "curriculum" in s["times_s"]:
        print(f"\nThe curriculum stage (the SFT model's pass rates on the RL problems), run once for every RL stage: "
              f"{s['times_s']['curriculum'] / 60:.1f} min.")
    for rl in ("grpo_seed1", "rloo", "ppo"):
        if rl in table and "sft" in table:
            print(f"\n### Samples: SFT against {NAMES[rl]} (sample 0 of each problem)\n")
            for x, y in before_after(out, "sft", rl):
                print(f"- label {x['label']!r}: SFT {x['response']!r} ({'right' if x['correct'] else 'wrong'}); "
                      f"{NAMES[rl]} {y['response']!r} ({'right' if y['correct'] else 'wrong'})")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
