"""`hpc-rlhf import-gguf`: bad input ends with exit code 2 and one line on stderr (the round trip on the real
SmolLM2 file is in test_real_assets.py)."""
from __future__ import annotations

import sys

import pytest

from hpc_rlhf.cli import main


@pytest.fixture
def gguf_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF\x03\x00\x00\x00")  # the magic and version, then nothing: a truncated file
    return path


def _err_line(capsys) -> str:
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1, err
    return err[0]


def test_missing_file(tmp_path, capsys):
    assert main(["import-gguf", str(tmp_path / "nope.gguf"), str(tmp_path / "out")]) == 2
    assert _err_line(capsys) == f"hpc-rlhf: GGUF file {tmp_path / 'nope.gguf'} does not exist"
    assert not (tmp_path / "out").exists()


def test_a_folder_is_not_a_file(tmp_path, capsys):
    assert main(["import-gguf", str(tmp_path), str(tmp_path / "out")]) == 2
    assert _err_line(capsys) == f"hpc-rlhf: GGUF path {tmp_path} is not a file"


def test_existing_output_needs_overwrite(tmp_path, gguf_file, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["import-gguf", str(gguf_file), str(out)]) == 2
    assert _err_line(capsys) == f"hpc-rlhf: output folder {out} already exists (pass --overwrite to replace it)"
    assert (out / "keep.txt").read_text() == "mine"


def test_missing_gguf_package(tmp_path, gguf_file, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` raises ImportError, as when not installed
    assert main(["import-gguf", str(gguf_file), str(tmp_path / "out")]) == 2
    assert _err_line(capsys) == ("hpc-rlhf: reading GGUF files needs the `gguf` package: pip install gguf "
                                 "(with the project's constraints file)")


@pytest.mark.parametrize("content, needle", [
    (b"GGUF\x03\x00\x00\x00", "truncated or corrupt file"),
    (b"not a gguf file at all, just text\n" * 4, "ValueError"),
], ids=["truncated", "not-gguf"])
def test_unreadable_file(tmp_path, capsys, content, needle):
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    assert main(["import-gguf", str(path), str(tmp_path / "out"), "--overwrite"]) == 2
    line = _err_line(capsys)
    assert line.startswith(f"hpc-rlhf: cannot read {path} as a GGUF model: {needle}: "), line
    assert not (tmp_path / "out").exists() and [p.name for p in tmp_path.iterdir()] == ["bad.gguf"]


def test_dtype_is_checked_by_the_library(tmp_path, gguf_file):
    from hpc_rlhf.models.gguf import GGUFImportError, import_gguf
    with pytest.raises(GGUFImportError, match="dtype must be one of fp32, bf16, not 'fp16'"):
        import_gguf(gguf_file, tmp_path / "out", dtype="fp16")
