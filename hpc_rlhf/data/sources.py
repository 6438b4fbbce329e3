"""Open one data source (local file, saved folder or hub name) as a `datasets.Dataset`."""
from __future__ import annotations

import contextlib
import csv
import json
import logging
import sys
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq

from .locate import check_source, split_spec
from .rows import DataError

# suffix -> datasets builder
BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}


def _one_line(text, limit: int = 80) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _reason(error: BaseException) -> str:
    """The innermost cause of ``error`` (datasets wraps the parser's error), as "Type: message" on one line."""
    while error.__cause__ is not None:
        error = error.__cause__
    return f"{type(error).__name__}: {_one_line(error, 300)}"


def _blank(path: Path) -> bool:
    """True when the file holds nothing but whitespace (read until the first other character)."""
    with open(path, "rb") as f:
        while chunk := f.read(1 << 16):
            if chunk.strip():
                return False
    return True


def _json_problem(path: Path) -> str | None:
    """Why a JSON or JSON-lines file gives no rows, to follow its name ("line N: what: excerpt", 1-based), or None."""
    with open(path, "rb") as f:
        start = f.read(1 << 12).lstrip()
    if start.startswith(b"["):  # one JSON document: a list of rows
        text = path.read_text(encoding="utf-8", errors="replace")
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            excerpt = text.splitlines()[e.lineno - 1] if text.splitlines() else ""
            return f"line {e.lineno}: invalid JSON ({e.msg} at column {e.colno}): {_one_line(excerpt)!r}"
        return "holds an empty JSON list, no rows" if rows == [] else None
    with open(path, "rb") as f:  # JSON lines: one row object per line
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                return f"line {n}: not UTF-8 text ({e.reason} at byte {e.start} of the line)"
            if not line.strip():
                continue
            line = line.rstrip("\r\n")
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                return f"line {n}: invalid JSON ({e.msg} at column {e.colno}): {_one_line(line)!r}"
            if not isinstance(row, dict):
                return f"line {n}: a JSON {type(row).__name__}, not a row object {{...}}: {_one_line(line)!r}"
    return None


def _csv_problem(path: Path, header: list[str]) -> str | None:
    """The first row (by its 1-based line) of a CSV file with more fields than its header or broken quoting, or
    None."""
    with open(path, newline="", encoding="utf-8", errors="replace") as f:
        reader = csv.reader(f, strict=True)
        while True:
            line = reader.line_num + 1  # where the next row starts (a quoted field may span lines)
            try:
                row = next(reader)
            except StopIteration:
                return None
            except csv.Error as e:
                return f"line {line}: {e}"
            if len(row) > len(header):
                return f"line {line}: {len(row)} fields, but the header has {len(header)}"


def _parquet_problem(path: Path) -> str | None:
    try:
        return "has no rows" if pq.read_metadata(path).num_rows == 0 else None
    except pa.ArrowException:  # not a parquet file: the loader's own message says so
        return None


@contextlib.contextmanager
def _quiet_datasets():
    """While a file loads, the `datasets` library's log is muted (it logs a parse error, with 0-based row numbers,
    before raising it, and the DataError raised here says it better) and its progress bar shows only on a
    terminal (as with log.progress_bar=auto)."""
    logger = logging.getLogger("datasets")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    hide_bar = (not sys.stderr.isatty() and not datasets.utils.are_progress_bars_disabled()
                and datasets.config.HF_DATASETS_DISABLE_PROGRESS_BARS is None)
    if hide_bar:
        datasets.utils.disable_progress_bars()
    try:
        yield
    finally:
        logger.setLevel(level)
        if hide_bar:
            datasets.utils.enable_progress_bars()


def _load_file(path: Path, spec: str) -> datasets.Dataset:
    builder = BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise DataError(f"{spec}: unsupported file type {path.suffix or '(no suffix)'!r}; supported are "
                        f"{', '.join(sorted(BUILDERS))} files, save_to_disk folders and hub names")
    if path.stat().st_size == 0:
        raise DataError(f"{spec}: the file is empty")
    if builder in ("json", "csv") and _blank(path):
        raise DataError(f"{spec}: the file has only blank lines, no rows")
    kwargs = {}
    if builder == "csv":
        with open(path, newline="", encoding="utf-8", errors="replace") as f:  # a decoding error: see below
            reader = csv.reader(f)
            header = next(reader, None)
            first = next((row for row in reader if row), None)
        if not header:
            raise DataError(f"{spec}: the CSV file has no header row")
        if first is None:
            raise DataError(f"{spec}: the CSV file has a header row but no rows")
        if len(first) > len(header):  # pandas would take the first column as the index and shift the rest
            raise DataError(f"{spec} line {reader.line_num}: {len(first)} fields, but the header has {len(header)}")
        # read every column as text: numbers in a CSV answer column are still answers
        kwargs["features"] = datasets.Features({c: datasets.Value("string") for c in header})
    try:
        with _quiet_datasets():
            rows = datasets.load_dataset(builder, data_files=str(path), split="train", **kwargs)
        if builder == "json":  # pyarrow's JSON reader keeps bytes that are not UTF-8 in its strings
            rows.data.table.validate(full=True)
    except Exception as e:  # noqa: BLE001 - parser errors of every builder
        problem = (_json_problem(path) if builder == "json" else
                   _csv_problem(path, header) if builder == "csv" else
                   _parquet_problem(path) if builder == "parquet" else None)
        if problem is not None:
            raise DataError(f"{spec} {problem}") from e
        raise DataError(f"{spec}: cannot read it as {builder}: {_reason(e)}") from e
    if len(rows) == 0:
        raise DataError(f"{spec}: the file has no rows")
    return rows


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
                        f"folder nor a folder of data files): {_reason(e)}") from e


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
    check_source(spec)
    try:
        rows = datasets.load_dataset(base, split=split)
    except Exception as e:  # noqa: BLE001 - network, missing split, missing dataset
        raise DataError(f"{spec}: not a local file or folder, and loading it from the Hub failed: "
                        f"{type(e).__name__}: {_one_line(e, 300)}") from e
    return rows, f"{base}@{split}"


def only_columns(rows: datasets.Dataset, keys: list[str]) -> datasets.Dataset:
    """``rows`` with just the columns ``keys`` when it has them all (the others are not converted to Python objects);
    else whole, so that a bad row missing a key lists the keys it has."""
    return rows.select_columns(keys) if keys and set(keys) <= set(rows.column_names) else rows
