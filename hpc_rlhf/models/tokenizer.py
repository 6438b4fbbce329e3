"""A byte-level tokenizer built locally (no Hub): every byte is one token, so any text round-trips."""
from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [EOS_TOKEN, PAD_TOKEN, IM_START, IM_END]

# ChatML.  The {% generation %} block marks the trained part of assistant turns (content + <|im_end|>)
# for apply_chat_template(..., return_assistant_tokens_mask=True); it does not change the rendered text.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}"
    "{{ '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tokenizer(model_max_length: int = 2048) -> PreTrainedTokenizerFast:
    """Byte-level BPE with no merges (256 byte tokens) plus the four special tokens; ChatML template."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet, key=lambda c: _byte_of(c)))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=model_max_length,
        padding_side="right",
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
    )


def _byte_of(ch: str) -> int:
    """The byte value a ByteLevel alphabet character stands for (so token id == byte value)."""
    return _BYTE_OF[ch]


def _byte_table() -> dict[str, int]:
    # GPT-2's mapping: printable latin-1 bytes map to themselves, the rest to 256 + n in order.
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    table, n = {}, 0
    for b in range(256):
        if b in keep:
            table[chr(b)] = b
        else:
            table[chr(256 + n)] = b
            n += 1
    return table


_BYTE_OF = _byte_table()
