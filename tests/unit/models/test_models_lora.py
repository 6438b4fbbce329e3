"""Model loading (dtype, checkpointing, LoRA, QLoRA), packing check, adapter save/merge, offline errors."""
import argparse
import json
import os

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from hpc_rlhf.config.sections import ModelConfig
from hpc_rlhf.entrypoints.tools import add_lora_merge_args, lora_merge
from hpc_rlhf.models.loading import check_packing, load_causal_lm, load_tokenizer
from hpc_rlhf.models.lora import merge_lora, save_lora_adapter
from hpc_rlhf.models.paths import HubOfflineError, resolve_pretrained
from hpc_rlhf.models.tiny import build_tiny_model

SMALL = dict(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_position_embeddings=64)
IDS = torch.tensor([[72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33]])


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("llama"), arch="llama", **SMALL))


def _cfg(path, **kw):
    kw.setdefault("param_dtype", "fp32")
    return ModelConfig(pretrain=path, **kw)


def _logits(model, ids=IDS):
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


# --- resolve_pretrained / load_tokenizer --------------------------------------------------------------

def test_resolve_pretrained(llama, tmp_path, monkeypatch):
    assert resolve_pretrained(llama) == llama
    missing = str(tmp_path / "no" / "such_model")
    with pytest.raises(FileNotFoundError, match="such_model"):
        resolve_pretrained(missing)
    with pytest.raises(FileNotFoundError, match=r"\./nothing_here"):
        resolve_pretrained("./nothing_here")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    assert resolve_pretrained("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubOfflineError) as err:
        resolve_pretrained("Qwen/Qwen2.5-0.5B")
    assert str(err.value) == ("Qwen/Qwen2.5-0.5B is not a local folder, and HF_HUB_OFFLINE is set, so the "
                              "Hub cannot be reached: copy the model to the cluster and pass its path")
    with pytest.raises(HubOfflineError):
        load_causal_lm(_cfg("gpt2"))


def test_load_tokenizer(llama, tmp_path):
    tok = load_tokenizer(llama, chat_template="{{ messages[0]['content'] }}")
    assert tok.padding_side == "right" and tok.pad_token == "<|pad|>"
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False) == "x"
    # A tokenizer without a pad token gets eos as pad.
    AutoTokenizer.from_pretrained(llama).save_pretrained(tmp_path)
    cfg_file = tmp_path / "tokenizer_config.json"
    data = json.loads(cfg_file.read_text())
    data.pop("pad_token")
    data["padding_side"] = "left"
    cfg_file.write_text(json.dumps(data))
    tok = load_tokenizer(str(tmp_path))
    assert tok.pad_token == "<|endoftext|>" and tok.padding_side == "right"


def test_a_model_folder_without_tokenizer_files_is_refused(llama, tmp_path):
    # from a gemma config.json alone transformers builds a 5-token tokenizer that reads every word as <unk>
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text(json.dumps({"model_type": "gemma3_text"}))
    with pytest.raises(FileNotFoundError) as err:
        load_tokenizer(str(bare))
    assert str(err.value) == (f"model folder {bare} has no tokenizer: it needs tokenizer.json, or the vocabulary of "
                              "a slow tokenizer (tokenizer.model, spiece.model, sentencepiece.bpe.model, spm.model, "
                              "vocab.json, vocab.txt, tekken.json); copy the tokenizer files of the model it was "
                              "trained from into it")
    # a slow tokenizer's vocabulary is enough: GPT-2's BPE files, converted by transformers
    bpe = json.loads(AutoTokenizer.from_pretrained(llama).backend_tokenizer.to_str())["model"]
    (bare / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    (bare / "vocab.json").write_text(json.dumps(bpe["vocab"]))
    (bare / "merges.txt").write_text("#version: 0.2\n")
    assert load_tokenizer(str(bare))("hello").input_ids == [104, 101, 108, 108, 111]


# --- load_causal_lm ----------------------------------------------------------------------------------

def test_load_dtype_attn_and_checkpointing(llama):
    model = load_causal_lm(_cfg(llama, param_dtype="bf16", attn_implementation="eager",
                                gradient_checkpointing=True))
    assert model.dtype == torch.bfloat16 and model.config._attn_implementation == "eager"
    assert model.config.use_cache is False and all(p.requires_grad for p in model.parameters())
    layers = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False)]
    assert layers and all(m._gradient_checkpointing_func.keywords["use_reentrant"] is False for m in layers)
    model.train()
    model(input_ids=IDS, labels=IDS).loss.backward()
    assert model.lm_head.weight.grad is not None

    plain = load_causal_lm(_cfg(llama))
    assert plain.dtype == torch.float32 and plain.config._attn_implementation == "sdpa"
    assert not any(getattr(m, "gradient_checkpointing", False) for m in plain.modules())

    frozen = load_causal_lm(_cfg(llama, lora_rank=4, gradient_checkpointing=True), trainable=False)
    assert not frozen.training and not any(p.requires_grad for p in frozen.parameters())
    assert not hasattr(frozen, "peft_config")


def _lora_expected(base, r):
    """r * (in + out) for every nn.Linear of the base model except the output head."""
    names = {n for n, m in base.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"}
    count = sum(r * (m.in_features + m.out_features) for n, m in base.named_modules() if n in names)
    return names, count


def test_lora_only_adapters_trainable(llama):
    model = load_causal_lm(_cfg(llama, lora_rank=4, lora_alpha=8))
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_A" in n or "lora_B" in n for n in trainable)
    names, count = _lora_expected(AutoModelForCausalLM.from_pretrained(llama), 4)
    assert len(names) == 2 * 7  # q k v o gate up down per layer
    wrapped = {n.removeprefix("base_model.model.") for n, m in model.named_modules() if hasattr(m, "lora_A")}
    assert wrapped == names
    assert sum(p.numel() for p in trainable.values()) == count  # 2 layers: 2*4*(4*64 + 3*96) = 4352
    assert count == 4352

    some = load_causal_lm(_cfg(llama, lora_rank=2, target_modules=["q_proj", "v_proj"]))
    n_some = sum(p.numel() for p in some.parameters() if p.requires_grad)
    assert n_some == 2 * 2 * (2 * (32 + 32))
    with pytest.raises(ValueError, match="all-linear"):
        load_causal_lm(_cfg(llama, lora_rank=2, target_modules=["all-linear", "q_proj"]))


def test_sgd_step_changes_adapter_only(llama):
    torch.manual_seed(0)
    model = load_causal_lm(_cfg(llama, lora_rank=4))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    model.train()
    model(input_ids=IDS, labels=IDS).loss.backward()
    opt.step()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all("lora_" in n for n in changed)
    assert any("lora_B" in n for n in changed)  # B starts at zero and is the one that moves first


def test_merge_lora_matches_peft(llama, tmp_path, capsys):
    torch.manual_seed(0)
    model = load_causal_lm(_cfg(llama, lora_rank=4, lora_alpha=8))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2)
    model.eval()
    expected = _logits(model)
    assert not torch.allclose(expected, _logits(AutoModelForCausalLM.from_pretrained(llama)), atol=1e-3)
    adapter = save_lora_adapter(model, tmp_path / "adapter", tokenizer=load_tokenizer(llama))
    assert (adapter / "adapter_config.json").is_file() and (adapter / "adapter_model.safetensors").is_file()

    out = merge_lora(adapter, tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    assert not any("lora" in n for n, _ in merged.named_parameters())
    assert torch.allclose(_logits(merged), expected, atol=1e-5, rtol=0)
    assert merged.generation_config.eos_token_id == [256, 259]
    mask = os.umask(0o022)
    os.umask(mask)
    want = oct(0o666 & ~mask)  # what the umask gives a new file: 0644 under 022 (safetensors writes 0600)
    assert {oct(p.stat().st_mode & 0o777) for p in [*adapter.iterdir(), *out.iterdir()]} == {want}

    parser = argparse.ArgumentParser()
    add_lora_merge_args(parser)
    args = parser.parse_args([str(adapter), str(tmp_path / "m2"), "--base", llama, "--dtype", "bf16"])
    lora_merge(args)
    assert str(tmp_path / "m2") in capsys.readouterr().out
    m2 = AutoModelForCausalLM.from_pretrained(tmp_path / "m2")
    assert m2.dtype == torch.bfloat16
    # bf16 keeps 8 bits of mantissa: the merged weights in bf16 move these logits by about 5e-3, the adapter moves
    # them by about 0.6, so 2e-2 tells the merged model from the unmerged one (or from one merged at half scale)
    unmerged = AutoModelForCausalLM.from_pretrained(llama, dtype=torch.bfloat16)
    assert (_logits(unmerged) - expected).abs().max() > 25 * 2e-2
    assert (_logits(m2) - expected).abs().max() <= 2e-2


def test_merge_lora_errors(llama, tmp_path):
    with pytest.raises(FileNotFoundError, match="full model"):
        merge_lora(llama, tmp_path / "x")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        merge_lora(tmp_path / "missing", tmp_path / "x")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no adapter_config.json"):
        merge_lora(tmp_path / "empty", tmp_path / "x", base=llama)


def test_qlora_forward_backward(llama):
    model = load_causal_lm(_cfg(llama, lora_rank=4, load_in_4bit=True, gradient_checkpointing=True))
    kinds = {type(m).__name__ for m in model.modules()}
    assert "Linear4bit" in kinds
    model.train()
    loss = model(input_ids=IDS, labels=IDS).loss
    loss.backward()
    assert torch.isfinite(loss)
    with_grad = [n for n, p in model.named_parameters() if p.grad is not None]
    assert with_grad and all("lora_" in n for n in with_grad)
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    assert all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)


# --- check_packing -----------------------------------------------------------------------------------

@pytest.mark.parametrize("arch,attn,dtype", [("llama", "sdpa", "fp32"), ("llama", "eager", "fp32"),
                                             ("qwen2", "sdpa", "bf16"), ("gpt2", "sdpa", "fp32")])
def test_check_packing_passes(tmp_path, arch, attn, dtype):
    path = build_tiny_model(tmp_path, arch=arch, **SMALL)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn,
                                                 dtype=torch.float32 if dtype == "fp32" else torch.bfloat16)
    model.train()
    check_packing(model)
    assert model.training  # mode restored


class _IgnoresMask(nn.Module):
    """A model whose kernel drops the 4D mask (as a kernel without custom-mask support would)."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.config = inner, inner.config

    def forward(self, input_ids, position_ids=None, attention_mask=None):
        return self.inner(input_ids=input_ids, position_ids=position_ids)


def test_check_packing_rejects_mask_ignoring_model(llama):
    model = _IgnoresMask(AutoModelForCausalLM.from_pretrained(llama))
    with pytest.raises(ValueError, match=r"packing_samples is not supported by llama with "
                                         r"attn_implementation=sdpa: packed logits differ from unpacked by"):
        check_packing(model)


def test_check_packing_on_peft_model(llama):
    """check_packing runs through the LoRA wrapper: with non-zero adapters (B starts at zero) the packed logits
    equal the unpacked ones; with the decoder under the wrapper ignoring the packing (its block mask and restarted
    positions dropped, as a kernel without packing support would), they differ."""
    torch.manual_seed(0)
    model = load_causal_lm(_cfg(llama, lora_rank=2))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2)
    check_packing(model)
    inner = model.get_base_model().model  # the decoder under the adapter and the output head
    forward = inner.forward
    inner.forward = lambda *args, attention_mask=None, position_ids=None, **kw: forward(*args, **kw)
    with pytest.raises(ValueError, match="packed logits differ from unpacked"):
        check_packing(model)
