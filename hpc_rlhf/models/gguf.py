"""Import a GGUF checkpoint (llama.cpp's single-file format) as a normal transformers folder.

transformers reads GGUF files through the ``gguf`` package, dequantizing every tensor to the dtype asked
for, but refuses to ``save_pretrained`` a model loaded that way.  So the model is loaded once from the GGUF
file, a fresh model is built from its config (without the GGUF quantization entry), the dequantized state
dict is copied in, and the result is saved as safetensors next to the tokenizer and its chat template.
The weights are whatever the file holds: a Q4 file gives dequantized 4-bit weights, not the original ones.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import struct
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

from .files import follow_umask, umask

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DTYPES = tuple(_DTYPES)
IMPORT_RECORD = "hpc_rlhf_import.json"  # in every imported folder: the source it was converted from


class GGUFImportError(RuntimeError):
    """The GGUF file cannot be read or converted (missing file, missing ``gguf`` package, bad output folder)."""


def _need_gguf() -> None:
    if importlib.util.find_spec("gguf") is None:  # transformers imports it when reading the file
        raise GGUFImportError("reading GGUF files needs the `gguf` package: pip install gguf "
                              "(with the project's constraints file)")


def file_sha256(path: str | os.PathLike) -> str:
    """The sha256 of a file, read in 1 MiB blocks (a GGUF file is the source a converted folder records)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def import_record(folder: str | os.PathLike) -> dict | None:
    """What ``import_gguf`` recorded in ``folder`` (source file, its sha256 and size, dtype), or None when the
    folder is no complete import."""
    folder = Path(folder)
    try:
        record = json.loads((folder / IMPORT_RECORD).read_text())
    except (OSError, ValueError):
        return None
    return record if (folder / "config.json").is_file() and isinstance(record, dict) else None


def load_gguf(file: str | os.PathLike, dtype: str = "fp32"):
    """(model, tokenizer) read from a GGUF file, weights dequantized to ``dtype``."""
    if dtype not in _DTYPES:
        raise GGUFImportError(f"dtype must be one of {', '.join(_DTYPES)}, not {dtype!r}")
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
    except (ValueError, OSError, KeyError, IndexError, EOFError, struct.error) as e:  # a bad or truncated file
        what = "truncated or corrupt file" if isinstance(e, (IndexError, EOFError, struct.error)) else type(e).__name__
        raise GGUFImportError(f"cannot read {path} as a GGUF model: {what}: {e}") from e
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
    if out.exists() and not out.is_dir():
        raise GGUFImportError(f"output {out} exists and is not a folder")
    model, tok = load_gguf(file, dtype)
    source = Path(os.path.expanduser(str(file))).resolve()
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
    max_len = getattr(config, "max_position_embeddings", None)
    if max_len and (tok.model_max_length or 0) > max_len:  # the GGUF tokenizer says "no limit" (~1e30)
        tok.model_max_length = max_len
    for key in ("is_local", "local_files_only"):  # how this load found its files (HF_HUB_OFFLINE), not the model's
        tok.init_kwargs.pop(key, None)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        plain.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        (tmp / IMPORT_RECORD).write_text(json.dumps(
            {"source": str(source), "source_sha256": file_sha256(source), "source_bytes": source.stat().st_size,
             "dtype": dtype, "format": "gguf"}, indent=1) + "\n")
        if out.exists():
            shutil.rmtree(out)
        follow_umask(tmp)
        tmp.chmod(0o777 & ~umask())  # mkdtemp makes it private
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
