"""The CLI tools: `hpc-rlhf tiny-model`, `hpc-rlhf options`, and config errors (exit code 2, key named)."""
from __future__ import annotations

import subprocess
import sys

import pytest


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hpc_rlhf.cli", *args], capture_output=True, text=True,
                          timeout=300)


def test_tiny_model_writes_a_loadable_folder(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    out = tmp_path / "qwen"
    proc = _cli("tiny-model", str(out), "--arch", "qwen2", "--hidden-size", "32", "--layers", "2", "--heads", "4",
                "--kv-heads", "2", "--intermediate-size", "48", "--max-position", "64", "--seed", "1")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"wrote qwen2 model to {out}" in proc.stdout
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    c = model.config
    assert (c.model_type, c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
            c.intermediate_size, c.max_position_embeddings) == ("qwen2", 32, 2, 4, 2, 48, 64)
    assert c.vocab_size == len(tok) and tok.eos_token is not None and tok.pad_token is not None
    ids = tok(["1+2=3"], return_tensors="pt").input_ids
    assert tok.decode(ids[0]) == "1+2=3"
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], len(tok)) and torch.isfinite(logits).all()
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert "hi" in chat


def test_options_prints_the_reference():
    from hpc_rlhf.commands import option_reference
    proc = _cli("options")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout == option_reference() + "\n"
    for key in ("model.pretrain", "model.lora_rank", "data.micro_batch_tokens", "train.zero_stage",
                "train.adam_offload", "launch.nproc"):
        assert f"| `{key}` |" in proc.stdout


@pytest.mark.parametrize("args, needle", [
    (["learning_rte=1e-5"], "unknown option 'learning_rte' for SFTConfig. Did you mean learning_rate"),
    (["load_in_4bit=true"], "model.load_in_4bit=true trains a 4-bit base through LoRA only: set lora_rank > 0"),
], ids=["unknown-key", "validation"])
def test_config_error_exits_2_naming_the_key(tmp_path, args, needle):
    proc = _cli("train", "sft", f"pretrain={tmp_path}", f"dataset={tmp_path / 'x.jsonl'}", *args)
    assert proc.returncode == 2, proc.stderr[-4000:]
    assert f"hpc-rlhf: config error: {needle}" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_every_row_of_the_command_table_resolves():
    import dataclasses

    from hpc_rlhf import commands
    for name, c in commands.COMMANDS.items():
        assert dataclasses.is_dataclass(commands.resolve(c.config)), name
        assert callable(commands.resolve(c.run)), name
        assert c.plan is None or callable(commands.resolve(c.plan)), name
    assert commands.trainers() == ["dpo", "kd", "kto", "orpo", "prm", "rl", "rm", "sft", "simpo"]


@pytest.mark.parametrize("command,row,needle", [
    ("best-of-n", {"question": "a", "response": "x", "reward": 1.0},
     "row 2: 'prompt' is missing or not a string (the column is set by --prompt-key; the row has ['question', "),
    ("make-pairs", {"prompt": "a", "reward": 1.0},
     "row 2: 'response' is missing or not a string (the column is set by --response-key; the row has ['prompt', "),
    ("csft-data", {"prompt": "a", "response": "x", "reward": "high"},
     "row 2: 'reward' is 'high', expected a finite number (the column is set by --reward-key)"),
])
def test_a_builder_refuses_a_bad_row_naming_the_file_row_and_flag(tmp_path, command, row, needle):
    import json
    good = {"prompt": "b", "response": "y", "reward": 0.0}
    src = tmp_path / "scored.jsonl"
    src.write_text(json.dumps(good) + "\n" + json.dumps(row) + "\n")
    proc = _cli(command, "--input", str(src), "--output", str(tmp_path / "out.jsonl"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"hpc-rlhf {command}: {src}: {needle}"), proc.stderr[-3000:]
    assert not (tmp_path / "out.jsonl").exists()
