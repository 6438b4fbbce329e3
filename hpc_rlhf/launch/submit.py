"""`hpc-rlhf submit` and the Python API behind `launchers/*.py`: submission through submitit.

submitit writes its own single-component sbatch script and has no heterogeneous jobs (its issue
1741).  We keep submitit for what it is good at (pickling the call, sbatch, tracking the job with
sacct, collecting each task's result) and replace only the script: `HpcRlhfExecutor` renders the
same script as `hpc-rlhf plan` (hetjob blocks, per-role resources, set-up lines, requeue and signal
options), with submitit's task command in place of `hpc-rlhf train`.  Two more adjustments make
submitit follow a heterogeneous job:
- sacct reports the components as JOBID+0, JOBID+1, ...: component 0 is read as the job itself.
- the task count is the sum over the components (SLURM_PROCID counts across them in the step).
A run stopped by a signal exits with code 3 after its checkpoint without writing a result, so the
submitit job stays pending while SLURM requeues it, and `job.results()` returns the final metrics
of every rank once the requeued job finishes.
"""
from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from ..distributed.openmp import load_torch

if "SLURM_STEP_ID" in os.environ:  # a task of the job unpickling TrainTask, not the process that submits it
    load_torch()  # before anything loads torch (distributed/openmp.py)

import submitit  # noqa: E402
from submitit.slurm import slurm as submitit_slurm  # noqa: E402

from .. import commands  # noqa: E402
from ..distributed.rendezvous import adopt_slurm_rendezvous  # noqa: E402
from ..distributed.steprecord import note_exit  # noqa: E402
from .job import JobComponent, components  # noqa: E402
from .sbatch import python_command, render  # noqa: E402


class HetAwareWatcher(submitit_slurm.SlurmInfoWatcher):
    def read_info(self, string):
        if not isinstance(string, str):
            string = string.decode()
        lines = [re.sub(r"^(\d+)\+0(?=[.|])", r"\1", line) for line in string.splitlines()]
        return super().read_info("\n".join(line for line in lines if not re.match(r"^\d+\+\d+", line)))


class HpcRlhfJob(submitit_slurm.SlurmJob):
    watcher = HetAwareWatcher(delay_s=600)


class HpcRlhfExecutor(submitit.SlurmExecutor):
    job_class = HpcRlhfJob

    def __init__(self, folder: str | Path, comps: list[JobComponent], slurm_cfg, log_dir: str, max_restarts: int):
        # requeues are ours to decide, not submitit's; the tasks run slurm.python (or this interpreter)
        super().__init__(folder=folder, max_num_timeout=10 ** 6, python=shlex.join(python_command(slurm_cfg)))
        self.comps, self.slurm_cfg, self.log_dir, self.max_restarts = comps, slurm_cfg, log_dir, max_restarts

    def _num_tasks(self) -> int:
        return sum(c.ntasks for c in self.comps)

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        script = render(self.comps, self.slurm_cfg, shlex.split(command), self.log_dir, max_restarts=self.max_restarts)
        return script.replace("set -euo pipefail\n", "set -euo pipefail\nexport SUBMITIT_EXECUTOR=slurm\n", 1)


@dataclass
class TrainTask:
    """What every task of the job runs: one rank of `hpc-rlhf train TRAINER`."""
    trainer: str
    config_path: str | None
    overrides: list[str] = field(default_factory=list)

    def __call__(self) -> dict:
        """The rank's final metrics; its exit code noted for the job's step runner (distributed/steprecord.py) as
        `hpc-rlhf train` would exit: 2 for a user error, 3 stopped by a signal, else 1."""
        adopt_slurm_rendezvous()
        commands.setup_logging()
        name = commands.TRAIN + self.trainer
        try:
            cfg = commands.load_config(name, self.config_path, self.overrides)
            commands.node_environment(cfg)  # torch is loaded, but nothing yet that reads these variables
            result = commands.run(name, cfg)
        except BaseException as e:
            note_exit(commands.exit_code(e))
            raise
        note_exit(0)
        return result


def submit(trainer: str, config_path: str | None, overrides: list[str] | None = None,
           folder: str | Path | None = None) -> HpcRlhfJob:
    """Submit `hpc-rlhf train TRAINER` with the config's `slurm` section; returns the submitit job."""
    overrides = list(overrides or [])
    name = commands.TRAIN + trainer
    cfg = commands.load_config(name, config_path, overrides)
    commands.preflight(name, cfg)  # missing inputs, checkpoints to neither resume nor overwrite: before queueing
    log_dir = str(Path(cfg.slurm.log_dir).resolve())
    Path(log_dir).mkdir(parents=True, exist_ok=True)  # sbatch opens LOG_DIR/JOBID.out before the script runs
    folder = Path(folder or Path(log_dir) / "submitit")
    config_path = str(Path(config_path).resolve()) if config_path else None
    executor = HpcRlhfExecutor(folder, components(cfg, commands.placement_plan(name, cfg)), cfg.slurm, log_dir,
                               cfg.launch.max_restarts)
    return executor.submit(TrainTask(trainer, config_path, overrides))
