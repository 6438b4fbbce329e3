"""Import a GGUF checkpoint (llama.cpp's single-file format) as a normal transformers folder.

transformers reads GGUF files through the ``gguf`` package, dequantizing every tensor to the dtype asked
for, but refuses to ``save_pretrained`` a model loaded that way.  So the model is loaded once from the GGUF
file, a fresh model is built from its config (without the GGUF quantization entry), the dequantized state
dict is copied in, and the result is saved as safetensors next to the tokenizer and its chat template.
The weights are whatever the file holds: a Q4 file gives dequantized 4-bit weights, not the original ones.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class GGUFImportError(RuntimeError):
    """The GGUF file cannot be read or converted (missing file, missing ``gguf`` package, bad output folder)."""


def _need_gguf() -> None:
    if importlib.util.find_spec("gguf") is None:  # transformers imports it when reading the file
        raise GGUFImportError("reading GGUF files needs the `gguf` package: pip install gguf "
                              "(with the project's constraints file)")


def load_gguf(file: str | os.PathLike, dtype: str = "fp32"):
    """(model, tokenizer) read from a GGUF file, weights dequantized to ``dtype``."""
    path = Path(os.path.expanduser(str(file)))
    if not path.is_file():
        raise GGUFImportError(f"GGUF file {path} does not exist" if not path.exists()
                              else f"GGUF path {path} is not a file")
    _need_gguf()
    folder, name = str(path.parent), path.name
    try:
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        # dequantize=True: without it an installed `kernels` package keeps packed, untrainable layers
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=_DTYPES[dtype],
                                                     quantization_config=GgufConfig(dequantize=True))
    except (ValueError, OSError, KeyError) as e:
        raise GGUFImportError(f"cannot read {path} as a GGUF model: {type(e).__name__}: {e}") from e
    return model, tok


def import_gguf(file: str | os.PathLike, out: str | os.PathLike, dtype: str = "fp32",
                overwrite: bool = False) -> Path:
    """Write the GGUF model at ``file`` as a transformers folder ``out`` (config, safetensors, tokenizer,
    chat template, generation config) and return it.  The folder is written under a temporary name and
    renamed at the end, so an interrupted import leaves no half folder behind.  An existing ``out`` is an
    error unless ``overwrite``."""
    out = Path(os.path.expanduser(str(out)))
    if out.exists() and not overwrite:
        raise GGUFImportError(f"output folder {out} already exists (pass --overwrite to replace it)")
    model, tok = load_gguf(file, dtype)
    config = model.config
    for key in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, key):
            delattr(config, key)
    plain = AutoModelForCausalLM.from_config(config, dtype=_DTYPES[dtype])
    missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if unexpected or set(missing) - tied:
        raise GGUFImportError(f"{file}: the GGUF weights do not fit the model built from its config "
                              f"(missing {sorted(set(missing) - tied)[:5]}, unexpected {sorted(unexpected)[:5]})")
    if tied:
        plain.tie_weights()
    plain.generation_config = model.generation_config
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        plain.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        (tmp / "hpc_rlhf_import.json").write_text(json.dumps(
            {"source": str(Path(file).resolve()), "dtype": dtype, "format": "gguf"}, indent=1) + "\n")
        if out.exists():
            shutil.rmtree(out)
        tmp.chmod(0o755)  # mkdtemp makes it private
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
