"""GRPO seconds per step: hpc_rlhf against TRL's GRPOTrainer, same model, prompts and settings, one run.

Every side: the same random-weight Llama (3.3M parameters: hidden 256, 4 layers, our 260-token
byte-level tokenizer), one prompt per step with a group of 8 samples, 32 new tokens each (no stop token is
sampled before the 32nd: ``min_new_tokens`` on both sides, see MAX_NEW_TOKENS) at temperature 1, no reference
model (beta 0), one optimisation pass per step, fp32 on CPU, the same
reward function, the same prompts in the same order (each side reads the list in order: TRL with
shuffle_dataset off, hpc_rlhf with data.shuffle_prompts off) and the same stop tokens (the tokenizer's eos and
the generation config's: both sides take that set; the JSON lists each side's).  Three sides:

  trl             TRL's GRPOTrainer, one process (on-policy), gradient checkpointing off (TRL turns it on by
                  default: a second forward per micro-batch that hpc_rlhf does not do)
  hpc_rlhf        `hpc-rlhf train rl`, every role on one rank (on-policy, like TRL)
  hpc_rlhf_async  `hpc-rlhf train rl` with train.async_train: actor+reward on one rank, the rollout on
                  another, which generates step t+1's samples while step t trains (one step off-policy)

Each run is a child process, so no side inherits another's threads or caches.  TRL's gets the OpenMP wait
policy that hpc_rlhf's ranks pick on these cores (``hpc_rlhf.distributed.openmp``: ACTIVE when the threads
have cores of their own; ``--trl-omp-default`` leaves it to libgomp's default).  The order of the sides
rotates over ``--rounds`` rounds, so a slow spell of a shared machine does not land on one side only.
A round's figures are means per step after the first ``--warmup`` steps, leaving out the last step (an async
run has no next step to generate then, so its last step is cheaper); each side's result is the median over
rounds.  Per side (``sides``): ``s_per_step`` and the work each step did, from the side's own counters:
``tokens_generated``, ``prompt_tokens_prefilled`` (hpc_rlhf prefills a prompt once for its 8 samples, TRL's
``generate`` each copy), ``positions_trained`` (forward and backward positions, padding left out), and
``tokens_generated_per_s``.  ``speedup`` is TRL's seconds per step over hpc_rlhf's (the like-for-like,
on-policy comparison), ``speedup_per_token`` the ratio of generated tokens per second, ``tokens_ratio``
hpc_rlhf's generated tokens over TRL's (equal work: within 2%, or ``tokens_note`` says why not);
``speedup_async`` is TRL's over hpc_rlhf_async's.  ``phases``: each side's seconds per step by
phase (generation, weight sync, log-probs and reward, training, other; TRL's from timers around its generate
call and its generate-and-score, as in ``grpo_real_vs_trl.py``), each phase's median over rounds of its mean
over the timed steps.  Prints one JSON line.

    python benchmarks/grpo_vs_trl.py --steps 20 --rounds 3
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

PROMPTS = [f"{a}+{b}=" for a in range(10, 40) for b in range(10, 14)]
# Every row runs to the limit on both sides (min_new_tokens = max_new_tokens: no stop token is sampled), so the
# sides generate the same tokens per step: a random model stops early at random (22% of rows of this model
# within 32 tokens, 8 tokens of standard deviation per row), and 8 rows a step cannot average that out.
MAX_NEW_TOKENS = 32


def reward_digits(completions, **kwargs):
    """The shared reward: fraction of digit characters in the completion."""
    return [sum(c.isdigit() for c in text) / max(len(text), 1) for text in completions]


REWARD_FILE = '''
def reward_func(queries, prompts, labels):
    out = []
    for q, p in zip(queries, prompts):
        text = q[len(p):]
        out.append(sum(c.isdigit() for c in text) / max(len(text), 1))
    return out
'''


def build_model(root: Path) -> Path:
    from hpc_rlhf.models.tiny import build_tiny_model
    return build_tiny_model(root / "model", arch="llama", hidden_size=256, num_layers=4, num_heads=4,
                            intermediate_size=688, max_position_embeddings=128, seed=0)


def run_trl(model: str, steps: int, out: str) -> None:
    """The TRL child: trains and writes each optimizer step's seconds, phases and work."""
    from datasets import Dataset
    from grpo_real_vs_trl import timed_grpo_trainer, trl_phase_split, trl_work
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    records: list[dict] = []

    def record(step_s: float, acc: dict) -> None:
        records.append({"step_s": step_s, "phases": trl_phase_split(step_s, acc["collect_s"], acc["generate_s"]),
                        **trl_work(acc["gen_tokens"], acc["prompt_tokens"]), "stop_token_ids": trainer.eos_token_ids})
    Timed, timer = timed_grpo_trainer(GRPOTrainer, TrainerCallback, record)

    tok = AutoTokenizer.from_pretrained(model)
    cfg = GRPOConfig(output_dir=str(Path(out).parent / "trl_out"), per_device_train_batch_size=8, num_generations=8,
                     max_completion_length=MAX_NEW_TOKENS, temperature=1.0, beta=0.0, num_iterations=1,
                     learning_rate=1e-6,
                     max_steps=steps, logging_steps=10 ** 6, save_strategy="no", report_to=[], use_cpu=True,
                     bf16=False, seed=0, dataloader_num_workers=0, gradient_checkpointing=False,
                     shuffle_dataset=False, generation_kwargs={"min_new_tokens": MAX_NEW_TOKENS})
    trainer = Timed(model=AutoModelForCausalLM.from_pretrained(model), reward_funcs=[reward_digits], args=cfg,
                    train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=tok, callbacks=[timer])
    trainer.train()
    Path(out).write_text(json.dumps(records))


def write_ours_config(model: str, steps: int, root: Path) -> Path:
    """hpc_rlhf's side of the run: prompts, reward file and train config, written once for every round."""
    data = root / "prompts.jsonl"
    data.write_text("".join(json.dumps({"input": p}) + "\n" for p in PROMPTS))
    (root / "reward.py").write_text(REWARD_FILE)
    cfg = {"model": {"pretrain": model, "param_dtype": "fp32"},
           "data": {"prompt_data": [str(data)], "input_key": "input", "label_key": None, "shuffle_prompts": False},
           "reward": {"reward_func": str(root / "reward.py")},
           "rollout": {"n_samples_per_prompt": 8, "rollout_batch_size": 1, "generate_max_len": MAX_NEW_TOKENS,
                       "min_new_tokens": MAX_NEW_TOKENS, "temperature": 1.0},
           "algo": {"advantage_estimator": "group_norm", "init_kl_coef": 0.0},
           "train": {"train_batch_size": 8, "micro_train_batch_size": 8, "actor_learning_rate": 1e-6,
                     "max_steps": steps, "zero_stage": 0, "seed": 0},
           "placement": {"colocate_all": True},
           "ckpt": {"save_path": str(root / "ours_out"), "ckpt_path": str(root / "ours_ckpt")},
           "log": {"logging_steps": 1, "use_tensorboard": False, "progress_bar": "off"}}
    config = root / "ours.yaml"
    config.write_text(yaml.safe_dump(cfg))
    return config


def write_async_config(config: Path) -> Path:
    """The same run one step off-policy: actor and reward function on rank 0, the rollout on rank 1."""
    cfg = yaml.safe_load(config.read_text())
    cfg["train"]["async_train"] = True
    cfg["placement"] = {"colocate_actor_reward": True}
    out = config.with_name("ours_async.yaml")
    out.write_text(yaml.safe_dump(cfg))
    return out


def run_ours(config: Path) -> list[dict]:
    """One training run; its metrics rows.  The output folders are removed so the next round starts afresh."""
    cfg = yaml.safe_load(config.read_text())["ckpt"]
    subprocess.run([sys.executable, "-m", "hpc_rlhf.cli", "train", "rl", "--config", str(config)],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = [json.loads(x) for x in (Path(cfg["save_path"]) / "metrics.jsonl").read_text().splitlines()]
    shutil.rmtree(cfg["save_path"])
    shutil.rmtree(cfg["ckpt_path"], ignore_errors=True)  # else the next round would resume from it
    return rows


def timed_mean(times: list[float], warmup: int) -> float:
    """Mean of the steps after the warm-up, without the last one."""
    timed = times[warmup:-1]
    if not timed:
        raise SystemExit(f"--steps must exceed --warmup + 1 ({warmup + 1}): only {len(times)} steps were run")
    return sum(timed) / len(timed)


def run_trl_child(model: str, steps: int, root: Path, omp_default: bool) -> list[dict]:
    """TRL's run in a process of its own, with the OpenMP wait policy hpc_rlhf's ranks get on these cores
    (``openmp.alone_policy``) unless ``omp_default``."""
    from hpc_rlhf.distributed.openmp import alone_policy
    out = root / "trl_records.json"
    subprocess.run([sys.executable, __file__, "--_trl", model, str(steps), str(out)],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   env=os.environ if omp_default else {**os.environ, **alone_policy()})
    return json.loads(out.read_text())


def side_figures(rounds: list[dict]) -> dict:
    """A side's medians over rounds of its per-round means (``round_figures``), and its seconds per step in
    every round."""
    keys = [k for k in rounds[0] if k != "phases"]
    out = {k: round(statistics.median([r[k] for r in rounds]), 4) for k in keys}
    out["s_per_step_per_round"] = [round(r["s_per_step"], 4) for r in rounds]
    return out


def round_figures(times: list[float], work: list[dict], warmup: int) -> dict:
    """One round of one side: means over the timed steps of the step time and of each ``WORK`` counter, and the
    generated tokens per second (the mean tokens over the mean seconds)."""
    from grpo_real_vs_trl import WORK
    out = {"s_per_step": timed_mean(times, warmup)}
    out |= {k: timed_mean([w[k] for w in work], warmup) for k in WORK}
    out["tokens_generated_per_s"] = out["tokens_generated"] / out["s_per_step"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3, help="runs of each side, the order rotating every round")
    ap.add_argument("--trl-omp-default", action="store_true",
                    help="TRL's process with libgomp's default OMP_WAIT_POLICY, not the one hpc_rlhf's ranks get")
    ap.add_argument("--breakdown", action="store_true", help="print each round and hpc_rlhf's time per phase to stderr")
    args = ap.parse_args()
    if args.steps < args.warmup + 2:
        ap.error(f"--steps must exceed --warmup + 1 ({args.warmup + 1}): the last step is left out too")
    if args.steps > len(PROMPTS):
        ap.error(f"--steps {args.steps}: one prompt a step, and the list holds {len(PROMPTS)}")
    from grpo_real_vs_trl import PHASES, equal_work, median_phases, ours_work

    from hpc_rlhf.reports.summary import phase_split
    w = args.warmup
    sides = ("trl", "hpc_rlhf", "hpc_rlhf_async")
    rounds: dict[str, list[dict]] = {side: [] for side in sides}
    phases: dict[str, list[dict]] = {side: [] for side in sides}  # per round: each phase's mean over timed steps
    stops: dict[str, list[int]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = str(build_model(root))
        from grpo_real_vs_trl import hpc_stop_tokens
        stops["hpc_rlhf"] = stops["hpc_rlhf_async"] = hpc_stop_tokens(model)
        configs = {"hpc_rlhf": write_ours_config(model, args.steps, root)}
        configs["hpc_rlhf_async"] = write_async_config(configs["hpc_rlhf"])
        for r in range(args.rounds):
            for side in sides[r % 3:] + sides[:r % 3]:
                if side == "trl":
                    records = run_trl_child(model, args.steps, root, args.trl_omp_default)
                    times, splits, work = [x["step_s"] for x in records], [x["phases"] for x in records], records
                    stops["trl"] = records[0]["stop_token_ids"]
                else:
                    rows = run_ours(configs[side])
                    times, splits = [row["time/step_s"] for row in rows], [phase_split(row) for row in rows]
                    work = [ours_work(row) for row in rows]
                    if args.breakdown:
                        timers = sorted(k for k in rows[-1] if k.startswith("time/"))
                        print(f"{side} phases", {k: round(timed_mean([row.get(k, 0.0) for row in rows], w), 4)
                                                 for k in timers}, file=sys.stderr)
                rounds[side].append(round_figures(times, work, w))
                phases[side].append({k: timed_mean([s[k] for s in splits], w) for k in PHASES})
                if args.breakdown:
                    print(f"round {r} {side} step times", [round(t, 3) for t in times], file=sys.stderr)
    out = {side: side_figures(v) | {"phases": {k: round(x, 4) for k, x in median_phases(phases[side]).items()}}
           for side, v in rounds.items()}
    trl, ours, asy = out["trl"], out["hpc_rlhf"], out["hpc_rlhf_async"]
    work = equal_work(ours, trl)
    print(json.dumps({"benchmark": "grpo_vs_trl", "rounds": args.rounds, "steps": args.steps,
                      "steps_timed": args.steps - w - 1, "group_size": 8, "max_new_tokens": MAX_NEW_TOKENS,
                      "min_new_tokens": MAX_NEW_TOKENS,
                      "stop_token_ids": stops, "sides": out,
                      "speedup": round(trl["s_per_step"] / ours["s_per_step"], 3),
                      "speedup_per_token": round(ours["tokens_generated_per_s"] / trl["tokens_generated_per_s"], 3),
                      "tokens_ratio": round(work["tokens_ratio"], 4),
                      **({"tokens_note": work["tokens_note"]} if "tokens_note" in work else {}),
                      "speedup_per_round": [round(t["s_per_step"] / o["s_per_step"], 3)
                                            for t, o in zip(rounds["trl"], rounds["hpc_rlhf"])],
                      "speedup_async": round(trl["s_per_step"] / asy["s_per_step"], 3),
                      "speedup_async_per_token": round(asy["tokens_generated_per_s"] / trl["tokens_generated_per_s"],
                                                       3),
                      "tokens_ratio_async": round(asy["tokens_generated"] / trl["tokens_generated"], 4),
                      "speedup_async_per_round": [round(t["s_per_step"] / o["s_per_step"], 3)
                                                  for t, o in zip(rounds["trl"], rounds["hpc_rlhf_async"])]}))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--_trl":
        run_trl(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    else:
        main()
