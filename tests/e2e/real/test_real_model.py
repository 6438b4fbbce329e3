"""The toolkit on the real SmolLM2-135M-Instruct (its own tokenizer, chat template and end-of-turn token).

Marked `real`: they need the assets of scripts/real_assets.sh and fail (never skip) without them.  Every
run is tiny (a step or two, short sequences, fp32) so the whole file stays within a few minutes on 2 cores.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

IM_START, IM_END = 1, 2  # SmolLM2's <|im_start|> (bos) and <|im_end|> (eos, end of turn, and pad)

CONVERSATION = [{"role": "user", "content": "What is 2+2?"},
                {"role": "assistant", "content": "4"},
                {"role": "user", "content": "And 3+3? Explain."},
                {"role": "assistant", "content": "It is 6, since 3 and 3 make 6."}]

DIGIT_REWARD = '''
def reward_func(queries, prompts, labels):
    return [float(any(c.isdigit() for c in q[len(p):])) for q, p in zip(queries, prompts)]
'''


@pytest.fixture(scope="module")
def tokenizer(real_model):
    from hpc_rlhf.models.loading import load_tokenizer
    return load_tokenizer(real_model)


def _chat_ids(tokenizer, messages, generation_prompt: bool) -> list[int]:
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt)
    return list(out["input_ids"] if not isinstance(out, list) else out)


def _cli(command: list[str], config: dict, root: Path, timeout: int = 400) -> str:
    path = root / f"{command[-1]}.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = subprocess.run([sys.executable, "-m", "hpc_rlhf.cli", *command, "--config", str(path)],
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return proc.stderr


def _metrics(save: Path) -> list[dict]:
    return [json.loads(x) for x in (save / "metrics.jsonl").read_text().splitlines()]


def test_chat_rendering_and_multi_turn_loss_mask(tokenizer):
    """SFT samples are the chat template's own token ids; only assistant turns and their <|im_end|> are trained."""
    from hpc_rlhf.config.sections import DataConfig
    from hpc_rlhf.data.prompts import build_prompts
    from hpc_rlhf.config.rl import PromptDataConfig
    from hpc_rlhf.data.rows import BadRows
    from hpc_rlhf.data.sft import build_sft_samples

    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (IM_START, IM_END, IM_END)
    cfg = DataConfig(dataset=["x"], apply_chat_template=True, input_key="messages", output_key=None, max_len=256)
    bad = BadRows("error")
    [sample] = build_sft_samples([{"messages": CONVERSATION}], "conv", tokenizer, cfg, bad)
    full = _chat_ids(tokenizer, CONVERSATION, False)
    assert sample.input_ids == full
    assert full[:2] == [IM_START, tokenizer.convert_tokens_to_ids("system")]  # the template's default system turn

    # the expected targets: each assistant turn's content and its <|im_end|>, from apply_chat_template's ids
    expected = [0] * len(full)
    for i, m in enumerate(CONVERSATION):
        if m["role"] == "assistant":
            start = len(_chat_ids(tokenizer, CONVERSATION[:i], True))
            end = len(_chat_ids(tokenizer, CONVERSATION[:i + 1], False)) - 1  # the "\n" after <|im_end|> is not
            assert full[end - 1] == IM_END and tokenizer.decode(full[end]) == "\n"
            expected[start:end] = [1] * (end - start)
    assert sample.loss_mask == expected
    trained = [t for t, m in zip(full, sample.loss_mask) if m]
    assert tokenizer.decode(trained) == "4<|im_end|>It is 6, since 3 and 3 make 6.<|im_end|>"
    assert trained.count(IM_END) == 2

    # RL prompts: the conversation so far with the generation prompt, ids as apply_chat_template gives them
    pcfg = PromptDataConfig(prompt_data=["x"], apply_chat_template=True, input_key="q", label_key=None)
    [prompt] = build_prompts([{"q": "What is 2+2?"}], "p", tokenizer, pcfg, bad)
    assert prompt.prompt_ids == _chat_ids(tokenizer, CONVERSATION[:1], True)
    tail = tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    assert tail[0] == IM_START and prompt.prompt_ids[-len(tail):] == tail
    assert bad.total == 0


def test_generation_stops_at_end_of_turn(real_model, tokenizer):
    """Greedy chat answers end with <|im_end|> (finish_reason stop); a short budget ends with "length"."""
    from hpc_rlhf.generation.factory import transformers_engine
    from hpc_rlhf.generation.engine import SamplingParams
    from hpc_rlhf.roles.rollout import stop_token_ids

    stops = stop_token_ids(real_model, tokenizer)
    assert stops == [IM_END]
    engine = transformers_engine(real_model, dtype="fp32")
    questions = ("What is the capital of France? Answer in one word.", "What is 2+3? Answer with just the number.")
    prompts = [_chat_ids(tokenizer, [{"role": "user", "content": q}], True) for q in questions]
    out = engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=32, stop_token_ids=stops), [0, 1])
    for o in out:
        assert o.finish_reason == "stop" and o.token_ids[-1] == IM_END
        assert IM_END not in o.token_ids[:-1] and len(o.logprobs) == len(o.token_ids)
    assert "Paris" in tokenizer.decode(out[0].token_ids) and "5" in tokenizer.decode(out[1].token_ids)
    short = engine.generate(prompts[:1], SamplingParams(temperature=0, max_new_tokens=2, stop_token_ids=stops), [0])
    assert short[0].finish_reason == "length" and short[0].token_ids == out[0].token_ids[:2]


def test_sft_step_with_lora(real_model, tmp_path):
    """One LoRA SFT step through `hpc-rlhf train sft` on chat data: finite loss, the adapter moved, the base did not."""
    from safetensors.torch import load_file
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": CONVERSATION[:2 * (i % 2 + 1)]}) + "\n" for i in range(4)))
    save = tmp_path / "sft"
    config = {"model": {"pretrain": real_model, "param_dtype": "fp32", "lora_rank": 4, "lora_alpha": 8},
              "data": {"dataset": [str(data)], "apply_chat_template": True, "input_key": "messages",
                       "output_key": None, "max_len": 96},
              "train": {"train_batch_size": 2, "micro_train_batch_size": 2, "max_steps": 1, "learning_rate": 1e-3,
                        "zero_stage": 2, "seed": 1},
              "ckpt": {"save_path": str(save), "ckpt_path": str(tmp_path / "sft_ckpt")},
              "log": {"logging_steps": 1, "progress_bar": "off"}}
    _cli(["train", "sft"], config, tmp_path)
    [row] = [r for r in _metrics(save) if "loss" in r]
    assert math.isfinite(row["loss"]) and 0 < row["loss"] < 10
    adapter = load_file(str(next(save.rglob("adapter_model.safetensors"))))
    assert adapter and all("lora_" in k for k in adapter)  # only the adapter is saved: the base was frozen
    lora_b = [t for k, t in adapter.items() if "lora_B" in k]
    assert lora_b and any(float(t.abs().max()) > 0 for t in lora_b)  # B starts at zero: one step moved it


def test_grpo_step_with_lora(real_model, tmp_path):
    """One GRPO step (2 chat prompts x 2 samples, 16 new tokens) with a LoRA actor and a reward file."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input": q, "label": a}) + "\n" for q, a in
                               (("What is 2+3? Answer with just the number.", "5"),
                                ("Name a color.", "red"))))
    reward = tmp_path / "reward.py"
    reward.write_text(DIGIT_REWARD)
    save = tmp_path / "grpo"
    config = {"model": {"pretrain": real_model, "param_dtype": "fp32", "lora_rank": 4, "lora_alpha": 8},
              "data": {"prompt_data": [str(prompts)], "apply_chat_template": True, "input_key": "input",
                       "label_key": "label", "prompt_max_len": 96},
              "reward": {"reward_func": str(reward)},
              "rollout": {"n_samples_per_prompt": 2, "rollout_batch_size": 2, "generate_max_len": 16,
                          "temperature": 1.0},
              "algo": {"advantage_estimator": "group_norm"},
              "train": {"train_batch_size": 4, "micro_train_batch_size": 2, "actor_learning_rate": 1e-4,
                        "max_steps": 1, "zero_stage": 2, "seed": 5},
              "ckpt": {"save_path": str(save), "ckpt_path": str(tmp_path / "grpo_ckpt")},
              "log": {"logging_steps": 1, "progress_bar": "off", "check_weight_sync": True}}
    _cli(["train", "rl"], config, tmp_path)
    [row] = [r for r in _metrics(save) if "reward/mean" in r]
    assert row["step"] == 1 and 0 <= row["reward/mean"] <= 1
    assert all(math.isfinite(v) for v in row.values() if isinstance(v, float))
    assert row["sync/checksum_loaded/0"] == pytest.approx(row["sync/checksum_sent"], rel=1e-12)
    assert (save / "adapter_model.safetensors").is_file() or any(save.rglob("adapter_model.safetensors"))


def test_reward_model_step_and_export(real_model, tokenizer, tmp_path):
    """One `train rm` step on chat pairs; the export loads with AutoModelForSequenceClassification and scores a
    text as the toolkit's scorer does."""
    from transformers import AutoModelForSequenceClassification

    from hpc_rlhf.rewards.model import RewardModelScorer
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": f"What is {i}+{i}?", "chosen": str(2 * i),
                                         "rejected": str(2 * i + 1)}) + "\n" for i in range(4)))
    save = tmp_path / "rm"
    config = {"model": {"pretrain": real_model, "param_dtype": "fp32"},
              "data": {"dataset": [str(pairs)], "apply_chat_template": True, "max_len": 64},
              "train": {"train_batch_size": 2, "micro_train_batch_size": 2, "max_steps": 1, "learning_rate": 1e-5,
                        "zero_stage": 2, "seed": 2},
              "ckpt": {"save_path": str(save), "ckpt_path": str(tmp_path / "rm_ckpt")},
              "log": {"logging_steps": 1, "progress_bar": "off"}}
    _cli(["train", "rm"], config, tmp_path)
    [row] = [r for r in _metrics(save) if "loss" in r]
    assert math.isfinite(row["loss"])

    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 7+7?"}], tokenize=False,
                                         add_generation_prompt=True) + "14"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    ours = RewardModelScorer(save, dtype="fp32", normalize=False).score_tokens([ids]).tolist()
    hf = AutoModelForSequenceClassification.from_pretrained(str(save), dtype=torch.float32).eval()
    assert hf.config.num_labels == 1
    with torch.no_grad():
        theirs = hf(**tokenizer(text, add_special_tokens=False, return_tensors="pt")).logits[:, 0].tolist()
    assert theirs == pytest.approx(ours, abs=1e-4)
