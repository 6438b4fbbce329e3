"""`hpc-rlhf sweep`: a grid of config overrides (times seeds) as one SLURM job array, or one run after the other
with ``--local``.

Every run of the sweep (a grid point and a seed) is a normal hpc_rlhf job: its own full config
(``SWEEP_DIR/configs/NNN.yaml``), run folder (``SWEEP_DIR/runs/NNN``: its ckpt.save_path, the checkpoints in
``runs/NNN/checkpoints``), stop signals, checkpoints, requeue and exact resume.  Element NNN of the job array
(``SLURM_ARRAY_TASK_ID``) runs ``configs/NNN.yaml``; ``sweep.json`` (``reports/sweep.py``) lists the points,
their overrides and seeds, and `hpc-rlhf report SWEEP_DIR` compares them.

SLURM has no heterogeneous job arrays (sbatch refuses ``--array`` on a script with ``#SBATCH hetjob``
components: "Batch job submission failed: Invalid job array specification", Slurm 22.05 on the test
cluster, tests/e2e/slurm/test_slurm_sweep.py), so each array element is one homogeneous allocation of
all the plan's ranks, each task with the largest CPU and GPU count any role group asks for; the placement
plan still gives every rank its roles (rank r of the srun step is rank r of the plan), exactly as a
``slurm.hetjob=never`` job.  Role groups on different partitions or node features cannot share one
allocation: such a sweep is refused (submit its points one by one with `hpc-rlhf submit`).
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .. import commands
from ..config import ConfigError, dump_yaml
from ..config.base import resolve_key
from ..reports.sweep import MANIFEST
from .job import JobComponent, Resources, components
from .sbatch import Raw, python_command, render

SEED_KEY = "train.seed"


class SweepError(ValueError):
    """A bad --grid, --seeds or sweep folder: one line naming the flag (the command exits 2)."""


@dataclass(frozen=True)
class Axis:
    key: str  # the option's dotted path
    values: tuple[str, ...]  # as written (the config parses them like key=value overrides)
    flag: str  # the --grid argument it came from, for error messages


@dataclass(frozen=True)
class SweepRun:
    index: int  # the job array element (SLURM_ARRAY_TASK_ID)
    point: int  # the grid point
    grid: tuple[tuple[str, str], ...]  # (dotted key, value) of the point
    seed: int | None  # from --seeds; None: the config's own train.seed (or the grid's)

    @property
    def name(self) -> str:
        return f"{self.index:03d}"

    @property
    def overrides(self) -> tuple[tuple[str, str], ...]:
        return self.grid + (((SEED_KEY, str(self.seed)),) if self.seed is not None else ())

    @property
    def label(self) -> str:
        return point_label(self.grid)


# -- the grid (pure) ----------------------------------------------------------------------------------------

_CLOSE = {"[": "]", "{": "}", "(": ")"}


def split_values(text: str, flag: str) -> list[str]:
    """The comma-separated values of a --grid flag.  A comma inside quotes ('...' or "...") or brackets
    ([...], {...}, (...)) belongs to the value; quotes around a whole value are removed.  Empty values,
    unbalanced quotes or brackets are errors."""
    values, cur, stack, quote = [], [], [], None
    for ch in text:
        if quote:
            if ch == quote:
                quote = None
            cur.append(ch)
        elif ch in "'\"":
            quote = ch
            cur.append(ch)
        elif ch in _CLOSE:
            stack.append(_CLOSE[ch])
            cur.append(ch)
        elif stack and ch == stack[-1]:
            stack.pop()
            cur.append(ch)
        elif ch == "," and not stack:
            values.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if quote or stack:
        raise SweepError(f"--grid {flag!r}: unbalanced {quote or 'brackets'}")
    values.append("".join(cur))
    out = []
    for v in (v.strip() for v in values):
        if len(v) >= 2 and v[0] == v[-1] and v[0] in "'\"":
            v = v[1:-1]
        elif not v:
            raise SweepError(f"--grid {flag!r}: an empty value (write KEY=V1,V2,...)")
        out.append(v)
    return out


def parse_grid(flag: str) -> tuple[str, list[str]]:
    """``KEY=V1,V2,...`` -> (KEY as written, [V1, V2, ...]); a value given twice is an error."""
    key, sep, rest = flag.partition("=")
    key = key.strip()
    if not sep or not key or not rest.strip():
        raise SweepError(f"--grid {flag!r}: write KEY=V1,V2,... (e.g. algo.advantage_estimator=group_norm,rloo)")
    values = split_values(rest, flag)
    repeated = sorted({v for v in values if values.count(v) > 1})
    if repeated:
        raise SweepError(f"--grid {flag!r}: value {repeated[0]!r} is given twice")
    return key, values


def parse_seeds(text: str | None, base_seed: int) -> list[int] | None:
    """``--seeds N``: N seeds from the config's train.seed up (base, base + 1, ...); ``--seeds A,B,...``: those
    seeds.  None when not given (every run keeps the config's seed)."""
    if text is None:
        return None
    parts = [p.strip() for p in str(text).split(",")]
    try:
        numbers = [int(p) for p in parts]
    except ValueError:
        raise SweepError(f"--seeds {text!r}: write a count N or a list of seeds A,B,...") from None
    if len(parts) == 1:
        if numbers[0] < 1:
            raise SweepError(f"--seeds {text!r}: the count must be at least 1")
        return [base_seed + i for i in range(numbers[0])]
    if any(n < 0 for n in numbers):
        raise SweepError(f"--seeds {text!r}: seeds are >= 0")
    if len(set(numbers)) != len(numbers):
        raise SweepError(f"--seeds {text!r}: a seed is given twice")
    return numbers


def expand(axes: list[Axis], seeds: list[int] | None) -> list[SweepRun]:
    """Every run of the sweep: the grid points in order (the first --grid varies slowest, like nested loops in
    flag order), each point's seeds innermost.  No axis: one point (the base config)."""
    runs = []
    points = itertools.product(*[[(a.key, v) for v in a.values] for a in axes])
    for p, overrides in enumerate(points):
        for seed in seeds or [None]:
            runs.append(SweepRun(len(runs), p, tuple(overrides), seed))
    return runs


def point_label(overrides: tuple[tuple[str, str], ...]) -> str:
    """``name=value, ...`` of a point's grid overrides (each option by its last name)."""
    parts = [f"{k.rsplit('.', 1)[-1]}={v}" for k, v in overrides]
    return ", ".join(parts) or "base config"


# -- the job array ------------------------------------------------------------------------------------------

def array_components(comps: list[JobComponent]) -> list[JobComponent]:
    """The components with one set of resources (a job array element is one homogeneous allocation): each
    task gets the largest CPU and GPU count and memory per CPU of any group; no node counts (SLURM places
    the tasks).  Groups on different partitions or node features cannot share it: ValueError."""
    res = [c.resources for c in comps]
    for what in ("partition", "constraint"):
        if len({getattr(r, what) for r in res}) > 1:
            asked = ", ".join(getattr(r, what) or "(default)" for r in res)
            raise ValueError(f"the role groups ask for different {what}s ({asked}), "
                             "which one job array allocation cannot give: submit the points with `hpc-rlhf submit`")
    mems = {r.mem_per_cpu for r in res if r.mem_per_cpu}
    mem = max(mems, key=_mem_bytes) if mems else ""
    one = Resources(nodes=None, gpus_per_task=max(r.gpus_per_task for r in res),
                    cpus_per_task=max(r.cpus_per_task for r in res), mem_per_cpu=mem,
                    partition=res[0].partition, constraint=res[0].constraint)
    return [dataclasses.replace(c, resources=one) for c in comps]


def _mem_bytes(text: str) -> float:
    units = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}
    t = text.strip().upper()
    return float(t[:-1]) * units[t[-1]] if t and t[-1] in units else float(t or 0) * 2 ** 20


def array_spec(n_runs: int, max_parallel: int | None) -> str:
    """sbatch's --array value: ``0-N`` with a ``%K`` throttle (at most K elements run at once)."""
    spec = f"0-{n_runs - 1}"
    return spec + (f"%{max_parallel}" if max_parallel else "")


def array_script(cfg, plan, trainer: str, sweep_dir: Path, n_runs: int, max_parallel: int | None) -> str:
    """The sbatch script of the sweep's job array: element i runs `hpc-rlhf train TRAINER --config
    SWEEP_DIR/configs/<i, 3 digits>.yaml` on all the plan's ranks."""
    comps = array_components(components(cfg, plan))
    slurm = dataclasses.replace(cfg.slurm, hetjob="never")
    prelude = ['# this element\'s run: the config of array index SLURM_ARRAY_TASK_ID (sweep.json lists them)',
               f'POINT_CONFIG="{sweep_dir}/configs/$(printf %03d "$SLURM_ARRAY_TASK_ID").yaml"',
               'echo "hpc-rlhf sweep: array element $SLURM_ARRAY_TASK_ID runs $POINT_CONFIG"']
    command = [*python_command(cfg.slurm), "-m", "hpc_rlhf.cli", "train", trainer, "--config", Raw('"$POINT_CONFIG"')]
    return render(comps, slurm, command, str(sweep_dir / "logs"), array=array_spec(n_runs, max_parallel),
                  prelude=prelude, max_restarts=cfg.launch.max_restarts)


# -- the sweep ----------------------------------------------------------------------------------------------

@dataclass
class Planned:
    """A validated sweep, nothing written yet."""
    trainer: str
    sweep_dir: Path
    axes: list[Axis]
    seeds: list[int] | None
    runs: list[SweepRun]
    configs: list  # the config of each run (paths, seed and grid values set)
    manifest: dict
    script: str | None  # the array script (None with --local)
    array: str  # its --array value (``0-N%K``)


def plan_sweep(trainer: str, config_path: str | None, overrides: list[str], grid: list[str], seeds: str | None,
               out: str | None, max_parallel: int | None, local: bool) -> Planned:
    """Parse and check everything: the grid flags, the seeds, every run's config and its inputs.  SweepError or
    ConfigError (one line naming the flag) before anything is written or submitted."""
    name = commands.TRAIN + trainer
    cls = commands.resolve(commands.COMMANDS[name].config)
    base = commands.load_config(name, config_path, overrides)
    if max_parallel is not None and max_parallel < 1:
        raise SweepError(f"--max-parallel {max_parallel}: at least 1")
    axes: list[Axis] = []
    for flag in grid:
        key, values = parse_grid(flag)
        try:
            path = resolve_key(cls, key)
        except ConfigError as e:
            raise SweepError(f"--grid {flag!r}: {e}") from None
        if any(a.key == path for a in axes):
            raise SweepError(f"--grid {flag!r}: {path} is already swept by --grid "
                             f"{next(a.flag for a in axes if a.key == path)!r}")
        if path.startswith(("ckpt.save_path", "ckpt.ckpt_path")) or (path.startswith("slurm.") and not local):
            raise SweepError(f"--grid {flag!r}: {path} is set by the sweep itself"
                             if path.startswith("ckpt.") else
                             f"--grid {flag!r}: the runs of one job array share its sbatch options; "
                             "set slurm.* in the config")
        if path == SEED_KEY and seeds is not None:
            raise SweepError(f"--grid {flag!r}: train.seed is swept by --seeds already: give one of them")
        for v in values:  # each value on its own: the error names the flag
            try:
                commands.load_config(name, config_path, [*overrides, f"{path}={v}"])
            except ConfigError as e:
                raise SweepError(f"--grid {flag!r}: {e}") from None
        axes.append(Axis(path, tuple(values), flag))
    seed_list = parse_seeds(seeds, getattr(getattr(base, "train", None), "seed", 0))
    if seed_list is not None and not hasattr(getattr(base, "train", None), "seed"):
        raise SweepError(f"--seeds: train {trainer} has no train.seed")
    runs = expand(axes, seed_list)
    root = Path(out or f"sweeps/{Path(config_path).stem if config_path else trainer}-"
                       f"{time.strftime('%Y%m%d-%H%M%S')}").expanduser().resolve()
    if root.exists() and not root.is_dir():
        raise SweepError(f"--out {root} is a file, not a folder")
    configs = []
    for r in runs:
        run_dir = root / "runs" / r.name
        extra = [f"{k}={v}" for k, v in r.overrides] + [f"ckpt.save_path={run_dir}",
                                                          f"ckpt.ckpt_path={run_dir / 'checkpoints'}"]
        if not local and hasattr(base, "slurm"):
            extra.append(f"slurm.log_dir={root / 'logs'}")
        log_cfg = getattr(base, "log", None)
        if getattr(log_cfg, "use_wandb", False):  # W&B: the sweep is a group, each run named by its point
            if not log_cfg.wandb_group:
                extra.append(f"log.wandb_group={root.name}")
            if not log_cfg.wandb_run_name:
                extra.append(f"log.wandb_run_name={r.label}" + ("" if r.seed is None else f", seed {r.seed}"))
        try:
            cfg = commands.load_config(name, config_path, [*overrides, *extra])
            commands.preflight(name, cfg)
        except ConfigError as e:
            raise SweepError(f"--grid run {r.name} ({r.label}): {e}") from None
        configs.append(cfg)
    script = None
    if not local:
        plan = commands.placement_plan(name, configs[0])
        try:
            script = array_script(configs[0], plan, trainer, root, len(runs), max_parallel)
        except ValueError as e:
            raise SweepError(f"--grid: {e}") from None
        first = array_components(components(configs[0], plan))
        for r, cfg in zip(runs, configs):
            if array_components(components(cfg, commands.placement_plan(name, cfg))) != first:
                raise SweepError(f"--grid run {r.name} ({r.label}): it needs other ranks or "
                                 "resources than run 000, and one job array has one allocation size")
    manifest = _manifest(trainer, config_path, overrides, axes, seed_list, runs)
    old = root / MANIFEST
    if old.is_file():
        prior = json.loads(old.read_text())
        if {k: prior.get(k) for k in ("trainer", "grid", "seeds", "points", "overrides")} != \
                {k: manifest[k] for k in ("trainer", "grid", "seeds", "points", "overrides")}:
            raise SweepError(f"--out {root} holds another sweep ({old} differs): choose another folder")
        manifest["submissions"] = prior.get("submissions") or []
    return Planned(trainer, root, axes, seed_list, runs, configs, manifest, script,
                   array_spec(len(runs), max_parallel))


def _manifest(trainer, config_path, overrides, axes, seeds, runs) -> dict:
    points: dict[int, dict] = {}
    for r in runs:
        p = points.setdefault(r.point, {"label": r.label, "overrides": dict(r.grid), "runs": []})
        p["runs"].append({"index": r.index, "seed": r.seed, "config": f"configs/{r.name}.yaml",
                          "run_dir": f"runs/{r.name}"})
    return {"version": 1, "trainer": trainer,
            "base_config": str(Path(config_path).resolve()) if config_path else None,
            "overrides": list(overrides), "cwd": os.getcwd(),
            "grid": [{"key": a.key, "values": list(a.values)} for a in axes], "seeds": seeds,
            "points": [points[i] for i in sorted(points)], "submissions": []}


def write_sweep(p: Planned) -> None:
    """The configs, run folders, manifest and (for SLURM) the array script and log folder."""
    (p.sweep_dir / "configs").mkdir(parents=True, exist_ok=True)
    for r, cfg in zip(p.runs, p.configs):
        (p.sweep_dir / "configs" / f"{r.name}.yaml").write_text(dump_yaml(cfg))
        (p.sweep_dir / "runs" / r.name).mkdir(parents=True, exist_ok=True)
    if p.script is not None:
        (p.sweep_dir / "logs").mkdir(exist_ok=True)  # sbatch opens LOG_DIR/JOBID.out before the script runs
        (p.sweep_dir / "sweep.sbatch").write_text(p.script)
    save_manifest(p)


def save_manifest(p: Planned) -> None:
    tmp = p.sweep_dir / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(p.manifest, indent=1) + "\n")
    tmp.replace(p.sweep_dir / MANIFEST)


def submit_array(p: Planned) -> str:
    """sbatch the array script; returns the array job id (recorded in the manifest)."""
    try:
        proc = subprocess.run(["sbatch", "--parsable", str(p.sweep_dir / "sweep.sbatch")], capture_output=True,
                              text=True, timeout=120)
    except FileNotFoundError:
        raise SweepError("sbatch not found: no SLURM here (the sweep is written; --local runs it on this "
                         "machine)") from None
    if proc.returncode != 0:
        said = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
        raise SweepError(f"sbatch refused the job array (the sweep is written; sbatch {p.sweep_dir / 'sweep.sbatch'} "
                         f"submits it): {said}")
    job = proc.stdout.strip().split(";")[0]
    p.manifest["submissions"].append({"time": round(time.time(), 3), "array_job_id": job, "array": p.array})
    save_manifest(p)
    return job


def run_local(p: Planned, out=sys.stdout) -> int:
    """The runs one after another, each `python -m hpc_rlhf.cli train TRAINER --config configs/NNN.yaml` in a
    process of its own (output in SWEEP_DIR/logs/NNN.log); 0 when all finished, else 1."""
    p.manifest["submissions"].append({"time": round(time.time(), 3), "local": True})
    save_manifest(p)
    logs = p.sweep_dir / "logs"
    logs.mkdir(exist_ok=True)
    failed = []
    for r in p.runs:
        t0 = time.time()
        cmd = [sys.executable, "-m", "hpc_rlhf.cli", "train", p.trainer, "--config",
               str(p.sweep_dir / "configs" / f"{r.name}.yaml")]
        with open(logs / f"{r.name}.log", "a") as log:
            code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
        what = "finished" if code == 0 else f"failed (exit {code}; log {logs / f'{r.name}.log'})"
        print(f"hpc-rlhf sweep: run {r.name} ({r.label}"
              f"{'' if r.seed is None else f', seed {r.seed}'}) {what} in {time.time() - t0:.1f} s",
              file=out, flush=True)
        if code != 0:
            failed.append(r.name)
    if failed:
        print(f"hpc-rlhf sweep: {len(failed)} of {len(p.runs)} runs failed: {', '.join(failed)}", file=out)
        return 1
    return 0


def describe(p: Planned) -> str:
    lines = [f"hpc-rlhf sweep: train {p.trainer}, {len(p.runs)} runs into {p.sweep_dir}"]
    for r in p.runs:
        lines.append(f"  {r.name}  {r.label}" + ("" if r.seed is None else f"  seed {r.seed}"))
    return "\n".join(lines)
