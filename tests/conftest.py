"""Shared fixtures: a tiny byte-level tokenizer with a ChatML template, built locally (no hub)."""
from __future__ import annotations

import pytest

pytest_plugins = ["slurm_cluster"]

CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tokenizer(bos: bool = False):
    """Byte-level BPE without merges (one token per byte) wrapped as a fast HF tokenizer.

    With bos=True the tokenizer puts "<|bos|>" in front of every encoded text.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>", "<|bos|>"])
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<|bos|> $A", special_tokens=[("<|bos|>", tok.token_to_id("<|bos|>"))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>",
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"],
                                   chat_template=CHATML_TEMPLATE)


@pytest.fixture(scope="session")
def chatml_tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="session")
def bos_tokenizer():
    return make_tokenizer(bos=True)
