"""`hpc-rlhf generate` with model.engine=vllm: greedy output equals the transformers engine's; n samples
per prompt.  Runs in .venv-vllm (`bash scripts/test_vllm.sh`)."""
import json
import subprocess
import sys

import yaml


def _generate(tmp_path, name, model, prompts, **sampling):
    cfg = {"model": {"pretrain": str(model), "param_dtype": "fp32", "max_batch_size": 8, "engine": name.split("_")[0],
                     "vllm": {"max_model_len": 32}},
           "data": {"prompt_data": [str(prompts)]},
           "sampling": {"n_samples_per_prompt": 1, "temperature": 0.0, "max_new_tokens": 8, "seed": 3, **sampling},
           "output": {"output_path": str(tmp_path / f"{name}.jsonl")}}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = subprocess.run([sys.executable, "-m", "hpc_rlhf.cli", "generate", "--config", str(path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(x) for x in (tmp_path / f"{name}.jsonl").read_text().splitlines()]


def test_generate_with_vllm(tmp_path):
    from hpc_rlhf.models.tiny import build_tiny_model
    model = build_tiny_model(tmp_path / "model", hidden_size=64, num_layers=2, num_heads=2,
                             max_position_embeddings=64, seed=0)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input": f"{i}+{i % 5}="}) + "\n" for i in range(6)))
    hf, vllm = _generate(tmp_path, "auto", model, prompts), _generate(tmp_path, "vllm", model, prompts)
    assert len(vllm) == 6
    assert [r["response"] for r in vllm] == [r["response"] for r in hf]
    sampled = _generate(tmp_path, "vllm_sampled", model, prompts, temperature=1.0, n_samples_per_prompt=3)
    assert len(sampled) == 18 and len({r["response"] for r in sampled}) > 6  # samples differ
