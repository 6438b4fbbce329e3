"""Held-out exact-match accuracy by greedy generation."""
from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from ..agents import Request, make_executor
from ..config.rl import AgentConfig
from ..config.preference import PairDataConfig
from ..data.packing import collate_padded
from ..data.preference import load_pairs
from ..generation.factory import transformers_engine
from ..generation.engine import SamplingParams
from ..models.loading import load_tokenizer
from ..rewards.model import RewardModelScorer
from ..roles.rollout import stop_token_ids
from ..trainers.objectives.common import sequence_logps


@torch.no_grad()
def greedy_answers(model, tokenizer, prompts: list[str], max_new_tokens: int = 6, batch_size: int = 256) -> list[str]:
    model.eval()
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    out: list[str] = []
    try:
        for i in range(0, len(prompts), batch_size):
            enc = tokenizer(prompts[i:i + batch_size], return_tensors="pt", padding=True)
            gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id)
            new = gen[:, enc["input_ids"].shape[1]:]
            out += [t.strip() for t in tokenizer.batch_decode(new, skip_special_tokens=True)]
    finally:
        tokenizer.padding_side = side
    return out


def exact_match_accuracy(model, tokenizer, rows: list[dict]) -> float:
    answers = greedy_answers(model, tokenizer, [r["input"] for r in rows])
    return sum(a == r["label"] for a, r in zip(answers, rows)) / max(len(rows), 1)


def environment_eval(model_dir, rows: list[dict], env_file, max_turns: int, max_context_len: int,
                     max_new_tokens: int = 6) -> dict[str, float]:
    """Greedy episodes of the environment ``env_file`` (feedback appended raw) over ``rows`` (input, label) by
    the executor the RL eval uses, with the transformers engine: the mean of each of the environment's
    ``extra_logs`` over the episodes."""
    tokenizer = load_tokenizer(str(model_dir))
    stop = stop_token_ids(str(model_dir), tokenizer)  # as the RL run's rollout stops
    agent = AgentConfig(agent_func_path=str(env_file), max_turns=max_turns, max_context_len=max_context_len,
                        max_failure_fraction=0.0, feedback_template="raw")
    executor = make_executor(agent, tokenizer, stop)
    requests = [Request(tokenizer(r["input"], add_special_tokens=False)["input_ids"], r["input"], r["label"], seed=i)
                for i, r in enumerate(rows)]
    trajectories = executor.run(transformers_engine(model_dir, max_batch_size=256), requests,
                                SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, stop_token_ids=stop))
    keys = sorted({k for t in trajectories for k in t.extra_logs})
    return {k: sum(t.extra_logs.get(k, 0.0) for t in trajectories) / max(len(trajectories), 1) for k in keys}


def load_heldout_pairs(path, tokenizer) -> list:
    """Held-out pairs tokenized exactly as the preference trainers tokenize them (prompt + response + EOS)."""
    pairs, _, _ = load_pairs(PairDataConfig(dataset=[str(path)], max_len=32, bad_rows="error"), tokenizer, seed=0)
    return pairs


@torch.no_grad()
def response_logps(model, samples: list, pad_id: int, batch_size: int = 256) -> torch.Tensor:
    """Summed log-probs of the response tokens of each sample (the trainers' `sequence_logps`)."""
    model.eval()
    out = []
    for i in range(0, len(samples), batch_size):
        out.append(sequence_logps(model, collate_padded(samples[i:i + batch_size], pad_id))[0].float())
    return torch.cat(out)


def implicit_reward_pair_accuracy(policy_dir, ref_dir, pairs_path) -> dict:
    """Fraction of pairs whose implicit reward log π − log π_ref (β > 0 scales both) is larger for chosen."""
    tokenizer = load_tokenizer(str(policy_dir))
    pairs = load_heldout_pairs(pairs_path, tokenizer)
    pad = tokenizer.pad_token_id
    samples = [p.chosen for p in pairs] + [p.rejected for p in pairs]
    policy = AutoModelForCausalLM.from_pretrained(policy_dir)
    ref = AutoModelForCausalLM.from_pretrained(ref_dir)
    r = response_logps(policy, samples, pad) - response_logps(ref, samples, pad)
    chosen, rejected = r[:len(pairs)], r[len(pairs):]
    return {"heldout_pair_accuracy": round(float((chosen > rejected).float().mean()), 4),
            "heldout_margin": round(float((chosen - rejected).mean()), 4)}


def reward_model_pair_accuracy(rm_dir, pairs_path) -> dict:
    """Fraction of pairs the reward model scores chosen above rejected (scored as `train rl` scores)."""
    tokenizer = load_tokenizer(str(rm_dir))
    pairs = load_heldout_pairs(pairs_path, tokenizer)
    scorer = RewardModelScorer(rm_dir, batch_size=256)
    s = scorer([p.chosen.input_ids for p in pairs] + [p.rejected.input_ids for p in pairs])
    chosen, rejected = s[:len(pairs)], s[len(pairs):]
    return {"heldout_pair_accuracy": round(float((chosen > rejected).float().mean()), 4),
            "heldout_margin": round(float((chosen - rejected).mean()), 4)}
