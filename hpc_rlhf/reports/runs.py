"""A run folder as the report reads it: files only, no process attached, the run may still be going.

The folder is the run's ``ckpt.save_path``.  What a trainer leaves there:

- ``metrics.jsonl``: one JSON object per logged step (``logging/metrics.py``), with ``"step"`` (optimizer or RL
  steps done).  Rows of one step may come twice: the eval's and the export's rows share the last step's, and
  an eval at the start of a resumed attempt shares the step of the checkpoint it resumed from.  A resumed
  attempt keeps the rows up to its checkpoint and appends its own; rows logged after that checkpoint by the
  attempt that died were moved to ``metrics.old-N.jsonl`` (set aside, not part of the run any more).  The last
  line of a run still going may be half written.
- ``tensorboard/events.out.tfevents.*``: one file per attempt (the writer is opened when an attempt starts),
  each event with its wall-clock time: the attempts, their times and the steps each logged.
- ``hpc_rlhf_config.yaml`` and the model: written at the end (the export); ``best/best.json`` when the eval
  kept a best model.  While the run goes, its config is in each checkpoint of ``ckpt.ckpt_path``
  (``global_stepN/config.yaml``, committed when ``COMMITTED`` exists).
"""
from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ..checkpoint.layout import CONFIG, committed_steps

METRICS = "metrics.jsonl"
EXPORTED_CONFIG = "hpc_rlhf_config.yaml"


class ReportError(ValueError):
    """A run folder or metrics file the report cannot read; the message names the file (one line)."""


# -- metrics.jsonl ------------------------------------------------------------------------------------------

def read_rows(path: Path) -> tuple[list[dict], bool]:
    """The rows of a metrics.jsonl file in file order, and whether its last line was cut short (a run still
    writing it: that line is left out).  Any other line that is not a JSON object with an integer "step" is
    an error naming the file and line."""
    text = path.read_text(errors="replace")
    lines = text.split("\n")
    rows, partial = [], False
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        last = i == len(lines)  # no newline after it: the writer may be in the middle of it
        try:
            row = json.loads(line)
        except ValueError as e:
            if last:
                partial = True
                continue
            raise ReportError(f"{path}:{i}: not a JSON object ({e})") from None
        if not isinstance(row, dict) or isinstance(row.get("step"), bool) or not isinstance(row.get("step"), int):
            if last and not isinstance(row, dict):
                partial = True
                continue
            raise ReportError(f"{path}:{i}: a row needs an integer \"step\", got {line[:80]!r}")
        rows.append(row)
    return rows, partial


def join_attempts(rows: list[dict]) -> list[dict]:
    """The run's rows in step order, one per step, from rows in the order they were written.

    A row whose step is below the previous row's starts another attempt (one resumed from an earlier
    checkpoint): the earlier rows past its first step are dropped (that attempt's work after the checkpoint
    was lost), whether or not the new attempt logs those steps again.  Rows of one step are merged, the
    later one's values winning: a step's row and its eval or export row, or the row of the checkpoint's step
    and the eval a resumed attempt logs there first.  Values that are not finite numbers are dropped."""
    joined: dict[int, dict] = {}
    previous: int | None = None
    for row in rows:
        step = row["step"]
        if previous is not None and step < previous:  # another attempt: it went back to an earlier checkpoint
            joined = {s: r for s, r in joined.items() if s <= step}
        clean = {k: v for k, v in row.items() if not (isinstance(v, float) and not math.isfinite(v))}
        joined[step] = {**joined.get(step, {}), **clean}
        previous = step
    return [joined[s] for s in sorted(joined)]


# -- TensorBoard event files: the attempts ------------------------------------------------------------------

@dataclass(frozen=True)
class Attempt:
    """One attempt of the run: one TensorBoard event file."""
    file: str
    start: float  # wall-clock time (s since the epoch) the attempt opened its writer
    end: float  # that of its last event
    first_step: int | None  # the first and last steps it logged (None: none yet)
    last_step: int | None

    @property
    def seconds(self) -> float:
        return self.end - self.start


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if i >= len(buf):
            raise ValueError("varint runs past the end")
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, i
        shift += 7


def parse_event(buf: bytes) -> tuple[float, int, bool]:
    """(wall_time, step, has a summary) of one serialized ``tensorboard Event`` message: fields 1 (double
    wall_time), 2 (int64 step) and 5 (summary); the other fields are skipped."""
    wall, step, summary, i = 0.0, 0, False, 0
    while i < len(buf):
        key, i = _varint(buf, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(buf, i)
            if number == 2:
                step = value - (1 << 64) if value >= 1 << 63 else value
        elif wire == 1:
            if i + 8 > len(buf):
                raise ValueError("fixed64 runs past the end")
            if number == 1:
                (wall,) = struct.unpack_from("<d", buf, i)
            i += 8
        elif wire == 2:
            length, i = _varint(buf, i)
            if i + length > len(buf):
                raise ValueError("field runs past the end")
            summary = summary or number == 5
            i += length
        elif wire == 5:
            i += 4
        else:
            raise ValueError(f"wire type {wire}")
    return wall, step, summary


def read_events(path: Path) -> list[tuple[float, int, bool]]:
    """The events of a TensorBoard event file (TFRecord framing: 8-byte length, 4-byte CRC, data, 4-byte CRC),
    up to the first record cut short or unreadable (a writer still going)."""
    data = path.read_bytes()
    out, pos = [], 0
    while pos + 12 <= len(data):
        (length,) = struct.unpack_from("<Q", data, pos)
        end = pos + 12 + length + 4
        if end > len(data):
            break
        try:
            out.append(parse_event(data[pos + 12:pos + 12 + length]))
        except ValueError:
            break
        pos = end
    return out


def read_attempts(run_dir: Path) -> list[Attempt]:
    """The attempts of a run from its TensorBoard event files, in the order they started."""
    found = []
    for path in sorted((run_dir / "tensorboard").glob("events.out.tfevents.*")):
        events = read_events(path)
        if not events:
            continue
        steps = [s for _, s, summary in events if summary]
        found.append(Attempt(path.name, min(t for t, _, _ in events), max(t for t, _, _ in events),
                             min(steps) if steps else None, max(steps) if steps else None))
    return sorted(found, key=lambda a: a.start)


# -- the config and the checkpoints -------------------------------------------------------------------------

def _load_yaml(path: Path) -> dict | None:
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return None
    return data if isinstance(data, dict) else None


def checkpoint_folder(run_dir: Path, config: dict | None) -> Path | None:
    """The run's ckpt.ckpt_path when it holds committed checkpoints: the one its config names (a relative one
    resolved where the run started, found from its relative save_path, else here), else the usual places
    beside the run folder (``NAME_checkpoints``, ``NAME_ckpt``, ``../checkpoints``) when the config of their
    newest checkpoint names this run's folder as its save_path."""
    named_candidates = []
    ckpt = (config or {}).get("ckpt") or {}
    named, save = ckpt.get("ckpt_path"), ckpt.get("save_path")
    if isinstance(named, str):
        p = Path(named).expanduser()
        if p.is_absolute():
            named_candidates.append(p)
        else:
            parts = Path(save).parts if isinstance(save, str) and not Path(save).is_absolute() else ()
            parts = tuple(x for x in parts if x != ".")
            if parts and run_dir.parts[-len(parts):] == parts:  # the folder the run started in
                named_candidates.append(Path(*run_dir.parts[:-len(parts)]) / p)
            named_candidates.append(Path.cwd() / p)
    for c in named_candidates:
        if committed_steps(c):
            return c
    for c in (run_dir.with_name(run_dir.name + "_checkpoints"), run_dir.with_name(run_dir.name + "_ckpt"),
              run_dir.parent / "checkpoints"):
        steps = committed_steps(c)
        if steps and _same_run(_load_yaml(c / f"global_step{steps[-1]}" / CONFIG), run_dir):
            return c
    return None


def _same_run(config: dict | None, run_dir: Path) -> bool:
    save = ((config or {}).get("ckpt") or {}).get("save_path")
    return isinstance(save, str) and (Path(save).expanduser().resolve() == run_dir
                                      or Path(save).name == run_dir.name)


# -- the run ------------------------------------------------------------------------------------------------

@dataclass
class Run:
    path: Path
    label: str
    rows: list[dict]  # joined: one per step, in step order
    partial_line: bool = False  # metrics.jsonl ended in half a line (the run is writing it)
    attempts: list[Attempt] = field(default_factory=list)
    set_aside: list[str] = field(default_factory=list)  # metrics.old-N.jsonl: rows of attempts that died
    config: dict | None = None
    config_file: Path | None = None
    ckpt_path: Path | None = None
    checkpoints: list[int] = field(default_factory=list)  # committed checkpoint steps
    exported: bool = False  # hpc_rlhf_config.yaml in the folder: the run finished and wrote its model
    best: dict | None = None  # best/best.json: metric, value, mode, step
    group: str = ""  # runs of one group (a sweep point's seeds) share a colour and one legend entry

    @property
    def kind(self) -> str:
        """"rl" (`train rl`), "offline" (sft and the preference trainers) or "unknown" (no rows yet)."""
        if (self.config or {}).get("rollout") is not None or any("time/step_s" in r for r in self.rows):
            return "rl"
        if self.config is not None or any("step_time_s" in r or "loss" in r for r in self.rows):
            return "offline"
        return "unknown"

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """Steps and values of one metric, over the rows that hold it as a number."""
        pairs = [(r["step"], float(r[key])) for r in self.rows
                 if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]
        return [s for s, _ in pairs], [v for _, v in pairs]

    def keys(self) -> set[str]:
        return {k for r in self.rows for k, v in r.items() if k != "step" and isinstance(v, (int, float))}

    def option(self, section: str, name: str):
        """An option of the run's config (None when the config or the option is unknown)."""
        return ((self.config or {}).get(section) or {}).get(name)


def load_run(path: str | Path, label: str | None = None) -> Run:
    """Everything the report reads from the run folder ``path``."""
    run_dir = Path(path).expanduser().resolve()
    if not run_dir.is_dir():
        raise ReportError(f"{path}: no such folder" if not run_dir.exists() else f"{path} is not a folder")
    metrics = run_dir / METRICS
    if not metrics.is_file():
        raise ReportError(f"{path} has no {METRICS}: give the run's ckpt.save_path (where its metrics go)")
    rows, partial = read_rows(metrics)
    run = Run(run_dir, label or run_dir.name, join_attempts(rows), partial)
    run.attempts = read_attempts(run_dir)
    run.set_aside = sorted(p.name for p in run_dir.glob("metrics.old-*.jsonl"))
    exported = run_dir / EXPORTED_CONFIG
    run.exported = exported.is_file()
    run.config, run.config_file = (_load_yaml(exported), exported) if run.exported else (None, None)
    run.ckpt_path = checkpoint_folder(run_dir, run.config)
    if run.ckpt_path is not None:
        run.checkpoints = committed_steps(run.ckpt_path)
        if run.config is None:  # the run has not exported yet: the config of its newest checkpoint
            newest = run.ckpt_path / f"global_step{run.checkpoints[-1]}" / CONFIG
            run.config, run.config_file = _load_yaml(newest), newest
    best = run_dir / "best" / "best.json"
    if best.is_file():
        try:
            run.best = json.loads(best.read_text())
        except ValueError:
            run.best = None
    return run


def run_labels(paths: list[Path]) -> list[str]:
    """A short name per run for legends: the folder name, or as many trailing path parts as it takes to tell
    the runs apart.  The same folder twice is an error."""
    resolved = [Path(p).expanduser().resolve() for p in paths]
    seen: dict[Path, int] = {}
    for i, p in enumerate(resolved):
        if p in seen:
            raise ReportError(f"{paths[i]}: the same run folder is given twice")
        seen[p] = i
    depth = 1
    while True:
        labels = ["/".join(p.parts[-depth:]) for p in resolved]
        if len(set(labels)) == len(labels) or depth >= max(len(p.parts) for p in resolved):
            return labels
        depth += 1
