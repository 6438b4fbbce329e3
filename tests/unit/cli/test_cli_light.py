"""A login node's commands stay light: `hpc-rlhf --help`, `options`, `plan`, `status`, `report` and `sweep` load no
torch, and a configured command reports a config error (unknown key, value out of range, missing file) before it
loads torch (a model folder without a tokenizer included)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
HEAVY = ("torch", "transformers", "datasets", "deepspeed", "vllm")
# runs hpc_rlhf.cli.main(argv) and prints the exit code and the heavy packages it loaded, as JSON on the last line
PROBE = """
import json, sys
from hpc_rlhf import cli
try:
    rc = cli.main(sys.argv[1:])
except SystemExit as e:
    rc = e.code
print(json.dumps({"rc": rc, "loaded": [m for m in %r if m in sys.modules]}))
""" % (HEAVY,)


def probe(*argv: str, cwd=None) -> dict:
    proc = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=120, cwd=cwd)
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "stderr": proc.stderr}


def test_importing_the_cli_loads_no_torch():
    code = f"import sys; import hpc_rlhf.cli; print([m for m in {HEAVY!r} if m in sys.modules])"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "[]\n"


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("light")
    (root / "m").mkdir()
    (root / "m" / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 4,
        "intermediate_size": 16, "vocab_size": 10}))
    (root / "m" / "tokenizer.json").write_text("{}")  # only its presence is checked before torch loads
    (root / "bare").mkdir()  # a model folder without tokenizer files
    (root / "bare" / "config.json").write_text((root / "m" / "config.json").read_text())
    (root / "d.jsonl").write_text('{"input": "1+1=", "output": "2"}\n')
    (root / "config.yaml").write_text(f"model: {{pretrain: {root / 'm'}}}\ndata: {{dataset: [{root / 'd.jsonl'}]}}\n")
    return root


def light_commands(root):
    m, d = f"pretrain={root / 'm'}", root / "d.jsonl"
    return {
        "help": ["--help"],
        "options": ["options"],
        "plan sft": ["plan", "sft", m, f"dataset={d}"],
        "plan rl": ["plan", "rl", m, f"prompt_data={d}", "reward_func=builtin:math", "rollout_num_ranks=2"],
        "plan rl --auto": ["plan", "rl", "--config", str(ROOT / "examples" / "scale" / "llama2-70b-ppo.yaml"),
                           "--estimate", "--auto", "--gpus", "32"],
        "status": ["status", str(root)],
        "report": ["report", str(root), "--out", str(root / "report")],
        "sweep": ["sweep", "sft", "--config", str(root / "config.yaml"), "--grid", "learning_rate=1e-5,2e-5",
                  "--out", str(root / "sweep"), "--dry-run"],
    }


@pytest.mark.parametrize("name", ["help", "options", "plan sft", "plan rl", "plan rl --auto", "status", "report",
                                  "sweep"])
def test_login_node_commands_load_no_torch(inputs, name):
    out = probe(*light_commands(inputs)[name], cwd=ROOT)
    assert out["loaded"] == [], out["stderr"][-2000:]
    assert out["rc"] in (0, 2), out["stderr"][-2000:]  # status and report of a folder that is no run: exit 2


@pytest.mark.parametrize("override,message", [
    ("bogus_key=1", "unknown option 'bogus_key'"),
    ("train.learning_rate=-1", "learning_rate"),
    ("dataset=/nowhere/d.jsonl", "/nowhere/d.jsonl"),
])
def test_config_errors_come_before_torch(inputs, override, message):
    out = probe("train", "sft", f"pretrain={inputs / 'm'}", f"dataset={inputs / 'd.jsonl'}", override)
    assert out["rc"] == 2 and message in out["stderr"], out["stderr"][-2000:]
    assert out["loaded"] == []


@pytest.mark.parametrize("command", [
    ["train", "sft", "pretrain={bare}", "dataset={d}"],
    ["train", "dpo", "pretrain={bare}", "dataset={d}"],
    ["generate", "pretrain={bare}", "prompt_data={d}", "output_path={root}/out.jsonl"],
    ["score", "reward_pretrain={bare}", "input_path={d}", "output_path={root}/out.jsonl"],
])
def test_a_model_folder_without_a_tokenizer_is_refused_before_torch(inputs, command):
    """transformers would build a tokenizer of a few special tokens from config.json alone: every word <unk>."""
    out = probe(*(a.format(bare=inputs / "bare", d=inputs / "d.jsonl", root=inputs) for a in command))
    assert out["rc"] == 2 and out["loaded"] == [], out["stderr"][-2000:]
    line = [x for x in out["stderr"].splitlines() if "has no tokenizer" in x]
    assert len(line) == 1 and f"model folder {inputs / 'bare'} has no tokenizer: it needs tokenizer.json, or " \
        "the vocabulary of a slow tokenizer (tokenizer.model, " in line[0], out["stderr"][-2000:]


def test_a_teacher_with_another_tokenizer_is_refused_before_torch(inputs):
    """On-policy distillation compares the student's and the teacher's log-probs of the same token ids: a teacher
    folder whose tokenizer gives other ids stops `train rl` with one line naming both folders, exit 2."""
    m, teacher = inputs / "m", inputs / "other_vocab"
    teacher.mkdir()
    (teacher / "config.json").write_text((m / "config.json").read_text())
    (teacher / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1}}}))
    out = probe("train", "rl", f"pretrain={m}", f"prompt_data={inputs / 'd.jsonl'}", "reward_func=builtin:math",
                "advantage_estimator=opd", f"teacher_pretrain={teacher}")
    assert out["rc"] == 2 and out["loaded"] == [], out["stderr"][-2000:]
    assert out["stderr"].splitlines() == [
        f"hpc-rlhf: config error: model.teacher_pretrain: the tokenizer of {teacher} is not the one of model.pretrain "
        f"{m} (their vocabularies or token ids differ); the two models must score the same token ids"]
