"""Byte-level tokenizer and tiny random models: build, save, reload."""
import argparse
import os

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from hpc_rlhf.entrypoints.tools import add_tiny_model_args, tiny_model
from hpc_rlhf.models.tiny import ARCHS, build_tiny_model, count_parameters
from hpc_rlhf.models.tokenizer import build_tokenizer

SMALL = dict(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, max_position_embeddings=64)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.mark.parametrize("text", ["Hello, world! 0123456789 \t\n  x  ", "~`!@#$%^&*()_+-=[]{}|;:'\",.<>/?",
                                  "héllo wörld 日本語 🙂 ß∑", ""])
def test_tokenizer_round_trip(tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert len(ids) == len(text.encode("utf-8"))  # one token per byte, no BOS


def test_tokenizer_ids_and_specials(tok):
    assert len(tok) == 260
    assert [tok.encode(c) for c in "09A "] == [[48], [57], [65], [32]]  # token id == byte value
    assert tok.eos_token == "<|endoftext|>" and tok.pad_token == "<|pad|>" and tok.bos_token is None
    specials = ["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]
    assert tok.convert_tokens_to_ids(specials) == [256, 257, 258, 259]
    assert tok.encode("a<|im_end|>") == [97, 259]
    assert tok.model_max_length == 2048 and build_tokenizer(128).model_max_length == 128


def test_chat_template_exact(tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"}]
    assert tok.apply_chat_template(msgs, tokenize=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\nhello<|im_end|>\n")
    assert tok.apply_chat_template(msgs[1:2], tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    out = tok.apply_chat_template(msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    kept = [i for i, m in zip(out["input_ids"], out["assistant_masks"]) if m]
    assert tok.decode(kept) == "hello<|im_end|>"


@pytest.mark.parametrize("arch", ARCHS)
def test_every_arch_builds_and_reloads(tmp_path, tok, arch):
    out = build_tiny_model(tmp_path / arch, arch=arch, seed=3, **SMALL)
    assert (out / "model.safetensors").is_file()
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    rtok = AutoTokenizer.from_pretrained(out)
    text = "héllo <|im_start|>user\n42<|im_end|>"
    assert rtok.encode(text) == tok.encode(text) and rtok.decode(rtok.encode(text)) == text
    assert rtok.chat_template == tok.chat_template and rtok.model_max_length == 64
    cfg = model.config
    assert cfg.model_type == arch
    assert cfg.vocab_size == len(tok) == model.get_input_embeddings().num_embeddings
    assert (cfg.eos_token_id, cfg.pad_token_id, cfg.bos_token_id) == (256, 257, None)
    assert model.generation_config.eos_token_id == [256, 259] and model.generation_config.pad_token_id == 257
    # Same config + same seed gives the weights that were saved: logits identical after the reload.
    torch.manual_seed(3)
    fresh = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out)).eval()
    ids = torch.tensor([tok.encode("The cat sat.")])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, fresh(ids).logits)
    if arch == "mixtral":
        assert (cfg.num_local_experts, cfg.num_experts_per_tok) == (4, 2)


def test_seed_changes_weights(tmp_path):
    a = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "a", seed=0, **SMALL))
    b = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "b", seed=1, **SMALL))
    assert not torch.equal(a.lm_head.weight, b.lm_head.weight)


def test_bf16_and_gqa(tmp_path):
    out = build_tiny_model(tmp_path / "m", arch="qwen2", num_kv_heads=1, dtype="bf16", **SMALL)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16 and model.config.num_key_value_heads == 1


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="unknown arch"):
        build_tiny_model(tmp_path, arch="bert")
    with pytest.raises(ValueError, match="gpt2 has no grouped-query"):
        build_tiny_model(tmp_path, arch="gpt2", num_kv_heads=1, **SMALL)


def test_cli(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    add_tiny_model_args(parser)
    args = parser.parse_args([str(tmp_path / "m"), "--arch", "mistral", "--hidden-size", "32",
                              "--layers", "1", "--heads", "2", "--intermediate-size", "48",
                              "--max-position", "32", "--seed", "5"])
    tiny_model(args)
    out = capsys.readouterr().out
    # embed 260*32 + head 260*32 + attn 4*32*32 + mlp 3*32*48 + 3 norms of 32
    expected = 2 * 260 * 32 + 4 * 32 * 32 + 3 * 32 * 48 + 3 * 32
    assert str(tmp_path / "m") in out and f"{expected:,} parameters" in out
    assert count_parameters(tmp_path / "m") == expected


@pytest.mark.parametrize("mask, mode", [(0o022, 0o644), (0o077, 0o600)], ids=["umask022", "umask077"])
def test_the_files_written_have_the_permissions_of_the_umask(tmp_path, mask, mode):
    # safetensors writes model.safetensors 0600 whatever the umask: the project group could not read the model
    old = os.umask(mask)
    try:
        out = build_tiny_model(tmp_path / "m", **SMALL)
    finally:
        os.umask(old)
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in out.iterdir()}
    assert "model.safetensors" in modes and modes == dict.fromkeys(modes, oct(mode))
