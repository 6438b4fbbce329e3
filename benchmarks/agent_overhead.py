"""The cost of the multi-turn executor: GRPO steps single-turn against multi-turn at equal action tokens.

Both sides run `hpc-rlhf train rl` (every role on one rank, fp32 on CPU) with the same random-weight
Llama (hidden 256, 4 layers, our byte-level tokenizer), the same prompts, 8 prompts x 4 samples per step
and temperature 1:

  single  one generation of up to T new tokens per sample, scored by a reward function
  multi   the multi-turn executor with an environment that returns empty feedback for K-1 turns, then
          the same reward; K turns of up to T/K tokens each

With empty feedback the multi-turn context is the single-turn one cut into K generate calls, so the
difference is what the executor adds: an engine call (and a prefill of the whole context) per turn, the
environment's reset and step calls, and the asyncio machinery.  Equal work: no stop token is sampled before a
turn's last token (``rollout.min_new_tokens`` = the turn's limit), so every sample of both sides takes exactly
T action tokens (``action_tokens_per_step`` shows it); the figures are also given per action token.  Sides
alternate over ``--rounds`` rounds; each round's figure is the mean over the steps after ``--warmup``; a side's
result is the median over rounds, with every round's value beside it.  Prints one JSON line.

    python benchmarks/agent_overhead.py --steps 6 --rounds 3
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REWARD_FILE = '''
def reward_func(queries, prompts, labels):
    return [sum(c.isdigit() for c in q[len(p):]) / max(len(q) - len(p), 1) for q, p in zip(queries, prompts)]
'''

ENV_FILE = '''
from hpc_rlhf.agents import AgentInstanceBase, MultiTurnAgentExecutor

TURNS = {turns}


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.turn, self.text = 0, ""

    def step(self, states, **kwargs):
        self.turn += 1
        self.text += states["action_text"]
        done = self.turn == TURNS
        reward = sum(c.isdigit() for c in self.text) / max(len(self.text), 1) if done else 0.0
        return {{"rewards": reward, "done": done, "environment_feedback": ""}}


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
'''


def write_configs(root: Path, steps: int, tokens: int, turns: int) -> dict[str, Path]:
    from hpc_rlhf.models.tiny import build_tiny_model
    model = build_tiny_model(root / "model", arch="llama", hidden_size=256, num_layers=4, num_heads=4,
                             intermediate_size=512, max_position_embeddings=tokens + 32, seed=0)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input": f"{a}+{b}="}) + "\n" for a in range(10, 40) for b in range(10, 14)))
    (root / "reward.py").write_text(REWARD_FILE)
    (root / "env.py").write_text(ENV_FILE.format(turns=turns))
    base = {"model": {"pretrain": str(model), "param_dtype": "fp32"},
            "data": {"prompt_data": [str(prompts)], "input_key": "input", "label_key": None},
            "rollout": {"n_samples_per_prompt": 4, "rollout_batch_size": 8, "temperature": 1.0},
            "algo": {"advantage_estimator": "group_norm"},
            "train": {"train_batch_size": 32, "micro_train_batch_size": 32, "actor_learning_rate": 1e-5,
                      "max_steps": steps, "zero_stage": 0, "seed": 1},
            "placement": {"colocate_all": True},
            "log": {"logging_steps": 1, "progress_bar": "off", "use_tensorboard": False}}
    sides = {"single": {"reward": {"reward_func": str(root / "reward.py")},
                        "rollout": {**base["rollout"], "generate_max_len": tokens, "min_new_tokens": tokens}},
             "multi": {"reward": {}, "agent": {"agent_func_path": str(root / "env.py"), "max_turns": turns,
                                               "max_context_len": tokens + 32},
                       "rollout": {**base["rollout"], "generate_max_len": tokens // turns,
                                   "min_new_tokens": tokens // turns}}}
    out = {}
    for name, extra in sides.items():
        cfg = {**base, **extra}
        path = root / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        out[name] = path
    return out


def run_side(config: Path, root: Path, tag: str) -> list[dict]:
    save = root / tag
    subprocess.run([sys.executable, "-m", "hpc_rlhf.cli", "train", "rl", "--config", str(config),
                    f"ckpt.save_path={save}", f"ckpt.ckpt_path={root / (tag + '_ckpt')}", "ckpt.save_steps=-1"],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return [json.loads(x) for x in (save / "metrics.jsonl").read_text().splitlines()]


def round_figures(rows: list[dict], warmup: int, samples: int) -> dict[str, float]:
    rows = rows[warmup:]
    tokens = sum(r["response_length/mean"] * samples for r in rows)
    return {"step_s": statistics.mean(r["time/step_s"] for r in rows),
            "generate_s": statistics.mean(r["time/rollout_generate_s"] for r in rows),
            "action_tokens_per_step": tokens / len(rows),
            "step_ms_per_action_token": 1000 * sum(r["time/step_s"] for r in rows) / tokens,
            "generate_ms_per_action_token": 1000 * sum(r["time/rollout_generate_s"] for r in rows) / tokens,
            "turns": statistics.mean(r.get("rollout/turns", 1.0) for r in rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64, help="action tokens per sample at most")
    ap.add_argument("--turns", type=int, default=2)
    a = ap.parse_args()
    results: dict[str, list[dict]] = {"single": [], "multi": []}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        configs = write_configs(root, a.steps, a.tokens, a.turns)
        for r in range(a.rounds):
            for name in (["single", "multi"] if r % 2 == 0 else ["multi", "single"]):
                rows = run_side(configs[name], root, f"{name}_{r}")
                results[name].append(round_figures(rows, a.warmup, 32))
                print(name, r, json.dumps({k: round(v, 4) for k, v in results[name][-1].items()}), file=sys.stderr)
    med = {name: {k: statistics.median(x[k] for x in rounds) for k in rounds[0]} for name, rounds in results.items()}
    out = {"tokens": a.tokens, "turns": a.turns, "steps": a.steps, "warmup": a.warmup, "rounds": a.rounds,
           **{f"{name}_{k}": round(v, 4) for name, m in med.items() for k, v in m.items()},
           **{f"{name}_step_ms_per_action_token_per_round": [round(x["step_ms_per_action_token"], 4) for x in rounds]
              for name, rounds in results.items()},
           "overhead_step_per_token": round(med["multi"]["step_ms_per_action_token"]
                                            / med["single"]["step_ms_per_action_token"] - 1, 4),
           "overhead_generate_per_token": round(med["multi"]["generate_ms_per_action_token"]
                                                / med["single"]["generate_ms_per_action_token"] - 1, 4)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
