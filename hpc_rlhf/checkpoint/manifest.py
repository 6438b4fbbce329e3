"""What a committed checkpoint holds, recorded when it is committed and checked before it is loaded.

``manifest.json`` lists every file of the checkpoint folder with its size; files of at most
``HASHED_UP_TO`` bytes (trainer.json, config.yaml, the RNG files, small DeepSpeed files) also carry their
sha256.  Checking costs one ``stat`` per file plus reading those small files: cheap however big the model
and optimizer shards are, and it finds a truncated, missing or emptied file, and any change to a small one.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

MANIFEST = "manifest.json"
HASHED_UP_TO = 64 * 1024  # bytes


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_manifest(folder: Path) -> None:
    """List every file under ``folder`` in ``folder/manifest.json``."""
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder).as_posix()
        if rel == MANIFEST:
            continue
        size = path.stat().st_size
        files[rel] = {"size": size, **({"sha256": _sha256(path)} if size <= HASHED_UP_TO else {})}
    (folder / MANIFEST).write_text(json.dumps({"files": files}, indent=1))


def has_manifest(folder: Path) -> bool:
    return (folder / MANIFEST).is_file()


def damage(folder: Path) -> str | None:
    """What is wrong with ``folder`` (naming the file), or None when every file of its manifest is as
    recorded.  A folder without a manifest cannot be checked: None (see ``has_manifest``)."""
    if not has_manifest(folder):
        return None
    try:
        files = json.loads((folder / MANIFEST).read_text())["files"]
    except (ValueError, KeyError, TypeError) as e:
        return f"{folder / MANIFEST}: cannot be read ({e})"
    for rel, want in files.items():
        path = folder / rel
        if not path.is_file():
            return f"{path}: missing"
        size = path.stat().st_size
        if size != want["size"]:
            return f"{path}: {want['size']} bytes expected, {size} found"
        if "sha256" in want and _sha256(path) != want["sha256"]:
            return f"{path}: sha256 differs from the one recorded at commit (same size, other content)"
    return None
