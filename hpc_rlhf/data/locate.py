"""Where a data source is: a local file or folder, or a hub name (with an optional '@split'), and whether it can be
read here.  No datasets, no torch: the checks before a run use it."""
from __future__ import annotations

import os
from pathlib import Path

from .rows import DataError

# suffixes that mark a spec as a file path even when the file is missing (hub names have none of these)
_FILE_SUFFIXES = {".json", ".jsonl", ".parquet", ".csv", ".arrow", ".txt", ".tsv", ".gz", ".bz2", ".xz", ".zst", ".zip",
                  ".tar", ".pq", ".feather", ".ndjson", ".yaml", ".yml", ".pkl", ".pt"}
_TRUE = ("1", "true", "yes", "on")


def hub_offline() -> bool:
    """True when HF_HUB_OFFLINE or HF_DATASETS_OFFLINE is set to a true value."""
    return any(os.environ.get(v, "").strip().lower() in _TRUE for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def split_spec(spec: str, default_split: str) -> tuple[str, str, bool]:
    """'name@split' -> (name, split, True); a spec without '@split' -> (spec, default_split, False)."""
    if "@" in spec and not os.path.exists(os.path.expanduser(spec)):
        base, _, split = spec.rpartition("@")
        if base and split and "/" not in split:
            return base, split, True
    return spec, default_split, False


def _looks_like_path(spec: str) -> bool:
    if spec.startswith(("/", "./", "../", "~", ".\\")) or spec.count("/") >= 2:
        return True
    return Path(spec).suffix.lower() in _FILE_SUFFIXES


def check_source(spec: str) -> None:
    """DataError when ``spec`` can be neither read here nor fetched: a missing local path, or a hub name while
    offline (a few file-system lookups: the launcher runs it before any rank starts)."""
    base = split_spec(spec.strip(), "")[0]
    path = Path(base).expanduser()
    if path.exists():
        return
    if _looks_like_path(base):
        raise DataError(f"{spec}: file not found (looked for {path.absolute()})")
    if hub_offline():
        raise DataError(f"{base} is not a local file or folder, and HF_HUB_OFFLINE is set, so the Hub cannot "
                        f"be reached: copy the dataset to the cluster and pass its path")
