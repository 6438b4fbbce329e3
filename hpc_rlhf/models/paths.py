"""Where a model the config names lives: a local folder, or a hub name when the hub can be reached; whether a folder
holds a tokenizer.  No torch: the config checks of a login node's commands use it."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path


class HubOfflineError(OSError):
    """A hub model name was given while HF_HUB_OFFLINE is set."""


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


def _looks_local(name: str) -> bool:
    # Hub ids are "name" or "org/name"; anything else with a path shape is meant as a local folder.
    return (name.startswith(("/", ".", "~")) or "\\" in name or name.count("/") > 1
            or name.endswith("/") or Path(name).exists())


def resolve_pretrained(name: str) -> str:
    """Return ``name`` when it is a local folder; fail clearly for a missing path or an offline hub name."""
    if os.path.isdir(os.path.expanduser(name)):
        return os.path.expanduser(name)  # transformers takes "~/..." for a hub id
    if _looks_local(name):
        raise FileNotFoundError(f"model folder {name} does not exist (or is not a folder)")
    if _env_true("HF_HUB_OFFLINE"):
        raise HubOfflineError(f"{name} is not a local folder, and HF_HUB_OFFLINE is set, so the Hub "
                              "cannot be reached: copy the model to the cluster and pass its path")
    return name


# What transformers builds a tokenizer from: the tokenizers library's file, or the vocabulary of a slow tokenizer
# (sentencepiece, BPE, WordPiece, Mistral's tekken), which it converts.  Without any of them it builds, from the
# model type alone, a tokenizer of a handful of special tokens that reads every word as <unk> (or as nothing).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "spm.model",
                   "vocab.json", "vocab.txt", "tekken.json")


def resolve_tokenizer(name: str) -> str:
    """``resolve_pretrained(name)`` for a model its tokenizer is read from too: a local folder must hold one of
    TOKENIZER_FILES (FileNotFoundError naming the folder and the files otherwise); a hub name is not checked."""
    path = resolve_pretrained(name)
    if os.path.isdir(path) and not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        raise FileNotFoundError(f"model folder {path} has no tokenizer: it needs tokenizer.json, or the vocabulary "
                                f"of a slow tokenizer ({', '.join(TOKENIZER_FILES[1:])}); copy the tokenizer files "
                                f"of the model it was trained from into it")
    return path


def _tokenizer_identity(path: str):
    """What decides the token ids of the tokenizer in the folder ``path``, read without building it: tokenizer.json's
    model (vocabulary, merges) and added tokens, else the hashes of the slow tokenizer's files."""
    fast = os.path.join(path, "tokenizer.json")
    if os.path.isfile(fast):
        with open(fast) as f:
            spec = json.load(f)
        return spec.get("model"), [(t.get("id"), t.get("content")) for t in spec.get("added_tokens", [])]
    files = [f for f in (*TOKENIZER_FILES[1:], "merges.txt", "added_tokens.json")
             if os.path.isfile(os.path.join(path, f))]
    return {f: hashlib.sha256(Path(path, f).read_bytes()).hexdigest() for f in files}


def tokenizers_differ(a: str, b: str) -> bool:
    """The model folders ``a`` and ``b`` hold tokenizers that give other token ids (another vocabulary, other
    merges or added tokens); a hub name is not a local folder and is not compared (False)."""
    a, b = os.path.expanduser(a), os.path.expanduser(b)
    return os.path.isdir(a) and os.path.isdir(b) and _tokenizer_identity(a) != _tokenizer_identity(b)
