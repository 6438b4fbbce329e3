"""A sweep folder as the report reads it (`hpc-rlhf sweep` writes it, `launch/sweep.py`), and the table that
compares its points: final and best value of each metric per point, mean and spread over the point's seeds.

``SWEEP_DIR/sweep.json`` (the manifest)::

    {"version": 1, "trainer": "rl", "base_config": "/abs/base.yaml", "overrides": ["key=value", ...],
     "grid": [{"key": "algo.advantage_estimator", "values": ["group_norm", "rloo"]}, ...],
     "seeds": [42, 43] (null: the config's train.seed),
     "points": [{"label": "advantage_estimator=group_norm, actor_learning_rate=1e-6",
                 "overrides": {"algo.advantage_estimator": "group_norm", ...},
                 "runs": [{"index": 0, "seed": 42, "config": "configs/000.yaml", "run_dir": "runs/000"}, ...]}],
     "submissions": [{"time": ..., "array_job_id": "123", "array": "0-3%2"} or {"time": ..., "local": true}]}

``index`` is the run's element of the job array (SLURM_ARRAY_TASK_ID); paths are relative to SWEEP_DIR.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from .runs import METRICS, ReportError, Run, load_run
from .summary import fmt_value, summarize

MANIFEST = "sweep.json"


def is_sweep(path: str | Path) -> bool:
    return (Path(path).expanduser() / MANIFEST).is_file()


def read_manifest(sweep_dir: str | Path) -> dict:
    """The manifest of a sweep folder; ReportError naming the file when it is not one."""
    path = Path(sweep_dir).expanduser() / MANIFEST
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ReportError(f"{path}: cannot read the sweep manifest ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("points"), list) or not all(
            isinstance(p, dict) and isinstance(p.get("runs"), list) and isinstance(p.get("label"), str)
            for p in data["points"]):
        raise ReportError(f"{path}: not a sweep manifest (a \"points\" list, each with \"label\" and \"runs\")")
    return data


@dataclass
class SweepPoint:
    label: str
    overrides: dict
    runs: list[Run] = field(default_factory=list)  # the runs that have logged metrics
    waiting: list[str] = field(default_factory=list)  # run folders without metrics.jsonl yet


@dataclass
class Sweep:
    path: Path
    manifest: dict
    points: list[SweepPoint]

    @property
    def runs(self) -> list[Run]:
        return [r for p in self.points for r in p.runs]


def load_sweep(sweep_dir: str | Path) -> Sweep:
    """The sweep's points and the runs of each (labelled by point, and by seed when there are several);
    a run that has not logged yet is listed as waiting."""
    root = Path(sweep_dir).expanduser().resolve()
    manifest = read_manifest(root)
    points = []
    for p in manifest["points"]:
        point = SweepPoint(p["label"], dict(p.get("overrides") or {}))
        seeded = len(p["runs"]) > 1
        for r in p["runs"]:
            run_dir = root / r["run_dir"]
            if not (run_dir / METRICS).is_file():
                point.waiting.append(str(run_dir))
                continue
            run = load_run(run_dir, f"{p['label']}, seed {r.get('seed')}" if seeded else p["label"])
            run.group = p["label"]
            point.runs.append(run)
        points.append(point)
    return Sweep(root, manifest, points)


def spread(values: list[float]) -> dict:
    """n, mean, sample standard deviation (None for fewer than 2 values), min and max of ``values``."""
    n = len(values)
    if not n:
        return {"n": 0, "mean": None, "std": None, "min": None, "max": None}
    mean = sum(values) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else None
    return {"n": n, "mean": mean, "std": std, "min": min(values), "max": max(values)}


def point_metrics(summaries: list[dict]) -> dict[str, dict]:
    """Per metric (in the order the runs' summaries list them): the spread of the runs' final values and, for
    a metric with a better direction, of their best values."""
    keys: list[str] = []
    for s in summaries:
        keys += [k for k in s["metrics"] if k not in keys]
    out = {}
    for key in keys:
        got = [s["metrics"][key] for s in summaries if s["metrics"].get(key)]
        out[key] = {"final": spread([m["final"] for m in got]),
                    "best": spread([m["best"] for m in got if "best" in m])}
    return out


def _mean_std(s: dict) -> str:
    if not s["n"]:
        return "—"
    return fmt_value(s["mean"]) + (f" ± {fmt_value(s['std'])}" if s["std"] is not None else "")


def _range(s: dict) -> str:
    return "—" if s["n"] < 2 else f"{fmt_value(s['min'])} – {fmt_value(s['max'])}"


def sweep_table(points: list[tuple[str, list[dict]]]) -> list[list[str]]:
    """The comparison table of a sweep: one row per point and metric; ``points``: (label, the summaries of
    its runs).  ± is the sample standard deviation over the point's runs (seeds), then their min – max."""
    rows = [["point", "metric", "runs", "final (mean ± std)", "final min – max", "best (mean ± std)",
             "best min – max"]]
    for label, summaries in points:
        for key, m in point_metrics(summaries).items():
            rows.append([label, key, str(m["final"]["n"]), _mean_std(m["final"]), _range(m["final"]),
                         _mean_std(m["best"]), _range(m["best"])])
    return rows


def sweep_summaries(sweep: Sweep) -> list[tuple[str, list[dict]]]:
    return [(p.label, [summarize(r) for r in p.runs]) for p in sweep.points]


def sweep_notes(sweep: Sweep) -> list[str]:
    """What the table does not show: runs that have not logged yet, and the array jobs."""
    m = sweep.manifest
    notes = [f"trainer `{m.get('trainer')}`, {len(sweep.points)} points, "
             f"{sum(len(p.runs) + len(p.waiting) for p in sweep.points)} runs; seeds: "
             + (", ".join(map(str, m["seeds"])) if m.get("seeds") else "the config's train.seed")]
    for sub in m.get("submissions") or []:
        if sub.get("array_job_id"):
            notes.append(f"SLURM job array {sub['array_job_id']} (--array={sub.get('array')})")
    for p in sweep.points:
        for w in p.waiting:
            notes.append(f"{p.label}: {w} has no metrics yet (pending, or failed before its first step)")
    return notes
