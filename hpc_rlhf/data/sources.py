"""Open one data source (local file, saved folder or hub name) as a `datasets.Dataset`."""
from __future__ import annotations

import csv
import os
from pathlib import Path

import datasets

from .rows import DataError

# suffix -> datasets builder
BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
# suffixes that mark a spec as a file path even when the file is missing (hub names have none of these)
_FILE_SUFFIXES = set(BUILDERS) | {".txt", ".tsv", ".gz", ".bz2", ".xz", ".zst", ".zip", ".tar", ".pq",
                                  ".feather", ".ndjson", ".yaml", ".yml", ".pkl", ".pt"}
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


def _load_file(path: Path, spec: str) -> datasets.Dataset:
    builder = BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise DataError(f"{spec}: unsupported file type {path.suffix or '(no suffix)'!r}; supported are "
                        f"{', '.join(sorted(BUILDERS))} files, save_to_disk folders and hub names")
    kwargs = {}
    if builder == "csv":
        # read every column as text: numbers in a CSV answer column are still answers
        with open(path, newline="", encoding="utf-8") as f:
            header = next(csv.reader(f), None)
        if not header:
            raise DataError(f"{spec}: the CSV file is empty (no header row)")
        kwargs["features"] = datasets.Features({c: datasets.Value("string") for c in header})
    try:
        return datasets.load_dataset(builder, data_files=str(path), split="train", **kwargs)
    except Exception as e:  # noqa: BLE001 - parser errors of every builder
        raise DataError(f"{spec}: cannot read it as {builder}: {type(e).__name__}: {e}") from e


def _load_folder(path: Path, spec: str, split: str) -> tuple[datasets.Dataset, bool]:
    """Returns the rows and whether a split was picked among several."""
    if (path / "dataset_dict.json").is_file():
        dd = datasets.load_from_disk(str(path))
        if split not in dd:
            raise DataError(f"{spec} has no split {split!r}; its splits are {', '.join(dd.keys())}: "
                            f"write {spec}@SPLIT")
        return dd[split], True
    if (path / "state.json").is_file():
        return datasets.load_from_disk(str(path)), False
    try:  # a folder of data files, e.g. a hub snapshot copied to the cluster
        return datasets.load_dataset(str(path), split=split), True
    except Exception as e:  # noqa: BLE001
        raise DataError(f"{spec}: cannot read split {split!r} from this folder (neither a save_to_disk "
                        f"folder nor a folder of data files): {type(e).__name__}: {e}") from e


def load_source(spec: str, split: str = "train") -> tuple[datasets.Dataset, str]:
    """Rows of one data source and its display name (used in messages as '<name> row N')."""
    base, split, explicit = split_spec(spec.strip(), split)
    path = Path(base).expanduser()
    if path.is_file():
        if explicit and split != "train":
            raise DataError(f"{spec}: a single file has no splits; drop '@{split}' or name the file that "
                            f"holds those rows")
        return _load_file(path, spec), base
    if path.is_dir():
        rows, picked = _load_folder(path, spec, split)
        return rows, (f"{base}@{split}" if picked else base)
    if _looks_like_path(base):
        raise DataError(f"{spec}: file not found (looked for {path.absolute()})")
    if hub_offline():
        raise DataError(f"{base} is not a local file or folder, and HF_HUB_OFFLINE is set, so the Hub cannot "
                        f"be reached: copy the dataset to the cluster and pass its path")
    try:
        rows = datasets.load_dataset(base, split=split)
    except Exception as e:  # noqa: BLE001 - network, missing split, missing dataset
        raise DataError(f"{spec}: not a local file or folder, and loading it from the Hub failed: "
                        f"{type(e).__name__}: {e}") from e
    return rows, f"{base}@{split}"
