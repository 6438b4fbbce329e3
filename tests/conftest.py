"""Shared fixtures: a tiny byte-level tokenizer with a ChatML template and a tiny model, built locally (no hub);
the helpers of tests/support/ on sys.path; the markers that the e2e folders imply.

The layout (docs/architecture.md#tests): unit/<subpackage>/ single-process tests, ranks/ tests that start ranks
over gloo, e2e/ the demo, SLURM, vLLM and real-model tests, support/ the helpers and fixtures they share."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
# the tests import the helpers by module name (`from rl_fixtures import ...`); slurm_cluster is a plugin
sys.path.insert(0, str(TESTS / "support"))

pytest_plugins = ["slurm_cluster"]

# every test under one of these folders gets its marker (so `-m` selects by folder); a file there declares none
FOLDER_MARKERS = {"e2e/slurm": "slurm", "e2e/vllm": "vllm", "e2e/real": "real"}


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items):
    for item in items:
        try:
            folder = item.path.resolve().parent.relative_to(TESTS).as_posix()
        except ValueError:  # not under tests/
            continue
        for top, marker in FOLDER_MARKERS.items():
            if folder == top or folder.startswith(top + "/"):
                item.add_marker(marker)

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


# a 2-layer Llama of the local tokenizer, built once per test module
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from hpc_rlhf.models.tiny import build_tiny_model
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", arch="llama", hidden_size=32, num_layers=2,
                            num_heads=4, intermediate_size=64, max_position_embeddings=64, seed=0)


@pytest.fixture(scope="session")
def chatml_tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="session")
def bos_tokenizer():
    return make_tokenizer(bos=True)


# ---- the real assets (scripts/real_assets.sh): tests marked `real` fail, never skip, without them ----------
REAL_MODEL = "smollm2-135m-instruct"


def assets_dir() -> Path:
    return Path(os.path.expanduser(os.environ.get("HPC_RLHF_ASSETS", "~/.cache/hpc_rlhf/real")))


def _need(path: Path) -> Path:
    if not path.exists():
        pytest.fail(f"real asset {path} is missing: run `bash scripts/real_assets.sh` (HPC_RLHF_ASSETS="
                    f"{assets_dir()})", pytrace=False)
    return path


@pytest.fixture(scope="session")
def real_model() -> str:
    """The SmolLM2-135M-Instruct transformers folder that scripts/real_assets.sh converted from GGUF."""
    return str(_need(assets_dir() / REAL_MODEL / "config.json").parent)


@pytest.fixture(scope="session")
def asdiv() -> Path:
    """The folder with ASDiv's train.jsonl and heldout.jsonl splits (scripts/real_assets.sh)."""
    _need(assets_dir() / "asdiv" / "heldout.jsonl")
    return _need(assets_dir() / "asdiv" / "train.jsonl").parent
