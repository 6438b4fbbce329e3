"""models/shape.py: a model's shape from its config.json, counted without torch, equals transformers' own count."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hpc_rlhf.models.shape import ModelShape, built_shape, model_shape
from hpc_rlhf.models.tiny import build_tiny_model

CASES = [("llama", {}), ("llama", {"num_kv_heads": 2}), ("qwen2", {}), ("qwen2", {"num_kv_heads": 2}),
         ("mistral", {"num_kv_heads": 1}), ("gpt2", {}), ("mixtral", {"num_kv_heads": 2})]


@pytest.mark.parametrize("arch,kw", CASES, ids=[f"{a}-{len(k)}" for a, k in CASES])
def test_counted_shape_is_the_built_models(tmp_path, arch, kw):
    path = str(build_tiny_model(tmp_path / arch, arch=arch, hidden_size=32, num_layers=2, num_heads=4,
                                intermediate_size=48, max_position_embeddings=64, **kw))
    counted, built = model_shape(path), built_shape(path)
    assert counted.params == built.params  # every parameter transformers creates, biases and norms included
    # the dimensions, but `gated`: mixtral's experts are gated MLPs that transformers fuses (no w3 module to see)
    assert counted == ModelShape(**{**built.__dict__, "gated": counted.gated})
    assert counted.gated == (arch != "gpt2")


def test_counted_llama_by_hand(tmp_path):
    """A llama config written by hand: 2 layers, h 8, 2 of 4 heads for k and v (head_dim 2), MLP 16, vocab 10.
    Embedding 80, per layer q 64 + k 32 + v 32 + o 64 + MLP 3*128 + norms 16 = 592, final norm 8, head 80."""
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 16, "vocab_size": 10, "tie_word_embeddings": False}))
    assert model_shape(str(tmp_path)) == ModelShape(params=80 + 2 * 592 + 8 + 80, hidden=8, layers=2, kv_heads=2,
                                                    head_dim=2, vocab=10, intermediate=16, model_type="llama")


def test_counting_loads_no_torch(tmp_path):
    path = build_tiny_model(tmp_path / "m", hidden_size=32, num_layers=2, max_position_embeddings=64)
    code = (f"import sys; from hpc_rlhf.models.shape import model_shape; model_shape({str(path)!r}); "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "[]\n"
