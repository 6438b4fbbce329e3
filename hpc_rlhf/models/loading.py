"""Load tokenizers and causal LMs from a ModelConfig: dtype, attention kernel, checkpointing, LoRA, QLoRA."""
from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

from ..config.sections import ModelConfig
from .paths import resolve_pretrained, resolve_tokenizer

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def load_tokenizer(path: str, chat_template: str | None = None):
    """AutoTokenizer with a pad token (eos when missing), right padding and an optional chat template."""
    tok = AutoTokenizer.from_pretrained(resolve_tokenizer(path))
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise ValueError(f"tokenizer of {path} has neither a pad nor an eos token")
        tok.pad_token = tok.eos_token
    tok.padding_side = "right"
    if chat_template is not None:
        tok.chat_template = chat_template
    return tok


def load_causal_lm(cfg: ModelConfig, *, trainable: bool = True):
    """AutoModelForCausalLM as ``cfg`` asks; a peft model when ``cfg.lora_rank > 0`` and trainable.

    ``trainable=False`` (reference / reward-frozen copies) skips LoRA and checkpointing and returns a
    frozen model in eval mode (still 4-bit when ``load_in_4bit``).
    """
    path = resolve_pretrained(cfg.pretrain)
    dtype = _DTYPES[cfg.param_dtype]
    kwargs = {"dtype": dtype, "attn_implementation": cfg.attn_implementation}
    if cfg.load_in_4bit:
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    if not trainable:
        model.requires_grad_(False)
        return model.eval()
    model.config.use_cache = False
    if cfg.load_in_4bit:
        from peft import prepare_model_for_kbit_training
        # Freezes the base and upcasts its non-quantized weights (norms, embeddings, head) to fp32.
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        _keep_4bit_training_layout(model)
    if cfg.gradient_checkpointing:
        _enable_checkpointing(model)
    if cfg.lora_rank > 0:
        model = _wrap_lora(model, cfg)
    # from_pretrained returns eval mode: dropout off and, in transformers, checkpointing skipped
    return model.train()


def _keep_4bit_training_layout(model) -> None:
    """Stop bitsandbytes from repacking 4-bit weights for its CPU inference kernel.

    On CPUs with AVX512-BF16 a Linear4bit run in eval mode on an input without grad (evaluation)
    rewrites its weight, for good, into a layout whose kernel has no autograd: later training steps
    then silently lose the gradient through the frozen base layers (and layers narrower than the
    quantization block size crash).
    """
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


def _enable_checkpointing(model) -> None:
    """Non-reentrant activation checkpointing of every decoder layer."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # newer name; older 5.x only has the other
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _wrap_lora(model, cfg: ModelConfig):
    from peft import LoraConfig, TaskType, get_peft_model
    targets = list(cfg.target_modules)
    if "all-linear" in targets:
        if len(targets) > 1:
            raise ValueError(f"model.target_modules {targets}: 'all-linear' cannot be combined with names")
        targets = "all-linear"  # peft: every linear layer (Linear, Conv1D, 4-bit Linear) but the output head
    lora = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=targets, task_type=TaskType.CAUSAL_LM)
    return get_peft_model(model, lora)


def _packed_mask(lengths: list[int], dtype: torch.dtype, device=None) -> torch.Tensor:
    """Additive [1, 1, T, T] mask: 0 where key and query are in the same sequence and key <= query."""
    seq = torch.cat([torch.full((n,), i, device=device) for i, n in enumerate(lengths)])
    pos = torch.arange(len(seq), device=device)
    allowed = (seq[:, None] == seq[None, :]) & (pos[None, :] <= pos[:, None])
    mask = torch.full(allowed.shape, torch.finfo(dtype).min, dtype=dtype, device=device)
    return mask.masked_fill(allowed, 0.0)[None, None]


@torch.no_grad()
def check_packing(model, lengths: tuple[int, ...] = (5, 7), seed: int = 0) -> None:
    """Raise ValueError unless packed rows (restarted position_ids + block mask) give the unpacked logits."""
    config = model.config
    param = next(model.parameters())
    device = param.device
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, config.vocab_size, (n,), generator=gen).to(device) for n in lengths]
    was_training = model.training
    model.eval()
    try:
        single = [model(input_ids=s[None], position_ids=torch.arange(len(s), device=device)[None]).logits[0]
                  for s in seqs]
        packed = model(input_ids=torch.cat(seqs)[None],
                       position_ids=torch.cat([torch.arange(n, device=device) for n in lengths])[None],
                       attention_mask=_packed_mask(list(lengths), dtype, device)).logits[0]
    finally:
        model.train(was_training)
    diff = (packed.float() - torch.cat(single).float()).abs().max().item()
    bound = 1e-3 if dtype == torch.float32 else 5e-2
    if not diff <= bound:
        impl = getattr(config, "_attn_implementation", None)
        raise ValueError(f"packing_samples is not supported by {config.model_type} with "
                         f"attn_implementation={impl}: packed logits differ from unpacked by {diff:.3g}")
