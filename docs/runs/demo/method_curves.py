"""One tiny GRPO-style run per 2026 method on the demo task (seed 1's SFT model), beside GRPO's: reward curves.

usage: python method_curves.py DEMO_DIR OUT_DIR RECORD_JSON PLOT_PNG [names...]
Each run: the demo's grpo stage config with 4 optimizer steps per rollout batch (train_batch_size 32 of 128
samples), so that the ratio moves away from 1 and the trust regions act; 40 RL steps; one run each (seed 1).
"""
import json, subprocess, sys, time, copy
from pathlib import Path
import yaml

demo, out, record, plot = map(Path, sys.argv[1:5])
names = sys.argv[5:]
base = yaml.safe_load((demo / "grpo.yaml").read_text())
base["train"].update({"train_batch_size": 32, "micro_train_batch_size": 32})
VARIANTS = {
    "grpo": {},
    "sapo": {"algo": {"policy_loss": "sapo"}},
    "dppo_tv": {"algo": {"policy_loss": "dppo_tv"}},
    "dppo_kl": {"algo": {"policy_loss": "dppo_kl"}},
    "maxrl": {"algo": {"advantage_estimator": "maxrl"}},
    "gdpo": {"algo": {"advantage_estimator": "gdpo"}},
    "m2po_async": {"algo": {"token_mask": "m2po"}, "train": {"async_train": True},
                   "placement": {"colocate_all": False, "colocate_actor_reward": True}},
    "grpo_async": {"train": {"async_train": True},
                   "placement": {"colocate_all": False, "colocate_actor_reward": True}},
}


def merged(a, b):
    a = copy.deepcopy(a)
    for k, v in b.items():
        a[k] = merged(a.get(k, {}), v) if isinstance(v, dict) else v
    return a


out.mkdir(parents=True, exist_ok=True)
results = json.loads(record.read_text()) if record.exists() else {"runs": {}}
for name in names or list(VARIANTS):
    cfg = merged(base, VARIANTS[name])
    if "colocate_all" in cfg["placement"] and cfg["placement"]["colocate_all"] is False:
        cfg["placement"].pop("colocate_all")
    cfg["ckpt"] = {"save_path": str(out / name), "ckpt_path": str(out / f"{name}_ckpt")}
    path = out / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    t0 = time.time()
    code = subprocess.call([sys.executable, "-m", "hpc_rlhf.cli", "train", "rl", "--config", str(path)],
                           stdout=open(out / f"{name}.log", "w"), stderr=subprocess.STDOUT)
    rows = [json.loads(x) for x in (out / name / "metrics.jsonl").read_text().splitlines()] if code == 0 else []
    results["runs"][name] = {"exit": code, "seconds": round(time.time() - t0, 1), "overrides": VARIANTS[name],
                             "reward_mean": [round(m["reward/mean"], 4) for m in rows]}
    print(name, code, results["runs"][name]["reward_mean"][:3], "...", results["runs"][name]["reward_mean"][-3:],
          flush=True)
results["settings"] = ("demo task seed 1, the demo's SFT model; the demo's grpo stage config (16 prompts x 8 samples, "
                       "40 steps, lr 5e-5) with train_batch_size 32: 4 optimizer steps per rollout batch; one run "
                       "per method (a sanity check that each learns, not a comparison of methods)")
record.write_text(json.dumps(results, indent=1) + "\n")
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
fig, ax = plt.subplots(figsize=(8, 4.5))
for name, r in results["runs"].items():
    if r["reward_mean"]:
        k = 5
        ys = r["reward_mean"]
        sm = [sum(ys[max(0, i - k + 1):i + 1]) / len(ys[max(0, i - k + 1):i + 1]) for i in range(len(ys))]
        ax.plot(range(1, len(ys) + 1), sm, label=name, lw=2 if name == "grpo" else 1.2,
                color="black" if name == "grpo" else None)
ax.set_xlabel("RL step"); ax.set_ylabel("reward/mean (5-step running mean)")
ax.set_title("Demo task, one run per method (seed 1)"); ax.legend(fontsize=8, ncol=2); ax.grid(alpha=0.3)
fig.tight_layout(); fig.savefig(plot, dpi=110)
