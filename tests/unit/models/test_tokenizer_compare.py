"""models/paths.py:tokenizers_differ: two model folders' tokenizers compared from their files, no tokenizer built."""
from __future__ import annotations

import json
import shutil

from hpc_rlhf.models.paths import tokenizers_differ
from hpc_rlhf.models.tokenizer import build_tokenizer


def _saved(root, name, **kw):
    build_tokenizer(**kw).save_pretrained(root / name)
    return root / name


def _edited(src, dst, edit):
    shutil.copytree(src, dst)
    spec = json.loads((dst / "tokenizer.json").read_text())
    edit(spec)
    (dst / "tokenizer.json").write_text(json.dumps(spec))
    return dst


def test_the_same_vocabulary_is_the_same_tokenizer_whatever_else_differs(tmp_path):
    # another model_max_length (the tokenizer_config.json and the truncation settings) gives the same token ids
    a, b = _saved(tmp_path, "a"), _saved(tmp_path, "b", model_max_length=64)
    assert not tokenizers_differ(str(a), str(b))
    assert not tokenizers_differ(str(a), str(a))


def test_another_vocabulary_or_another_added_token_differs(tmp_path):
    a = _saved(tmp_path, "a")

    def swap_two_ids(spec):
        vocab = spec["model"]["vocab"]
        vocab["a"], vocab["b"] = vocab["b"], vocab["a"]

    def rename_added_token(spec):
        spec["added_tokens"][-1]["content"] = "<|other|>"
    assert tokenizers_differ(str(a), str(_edited(a, tmp_path / "swapped", swap_two_ids)))
    assert tokenizers_differ(str(a), str(_edited(a, tmp_path / "renamed", rename_added_token)))


def test_slow_tokenizer_files_are_compared_by_content_and_a_hub_name_not_at_all(tmp_path):
    for name, merges in (("x", "#version: 0.2\na b\n"), ("y", "#version: 0.2\na b\n"), ("z", "#version: 0.2\nb c\n")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "vocab.json").write_text('{"a": 0, "b": 1, "c": 2, "ab": 3}')
        (tmp_path / name / "merges.txt").write_text(merges)
    assert not tokenizers_differ(str(tmp_path / "x"), str(tmp_path / "y"))
    assert tokenizers_differ(str(tmp_path / "x"), str(tmp_path / "z"))
    assert not tokenizers_differ(str(tmp_path / "x"), "HuggingFaceTB/SmolLM2-135M-Instruct")
