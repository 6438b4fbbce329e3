"""Weights & Biases: an optional metrics sink beside metrics.jsonl and TensorBoard (``log.use_wandb``).

- Only the main rank (global rank 0) logs, with the global step as W&B's step (``run.log(row, step=step)``).
- Offline by default: ``WANDB_MODE=offline`` unless the environment sets WANDB_MODE (compute nodes rarely
  reach the internet); the run is written under ``save_path/wandb/offline-run-DATE-ID/`` and uploaded later
  with ``wandb sync save_path/wandb/offline-run-*``.  ``WANDB_MODE=online`` logs live.
- The run id is kept in ``save_path/wandb_run_id``: an attempt that resumes from a checkpoint (start step > 0:
  a requeued job, a resumed run) reopens the same W&B run (``resume="allow"``); a run starting from step 0
  gets a new id.  W&B keeps a run's steps increasing: the steps a resumed attempt logs again (those after its
  checkpoint, logged by the attempt that died) are dropped by W&B and keep the first attempt's values, which
  exact resume makes the same.
- The API key is never an option (OpenRLHF's ``--use_wandb KEY`` passes it on the command line, which our
  configs would then store in every checkpoint): ``wandb login`` or WANDB_API_KEY, for online mode only.

``wandb`` is an optional extra (``pip install hpc_rlhf[wandb]``), imported only when a run uses it;
``check_installed`` is the preflight check.
"""
from __future__ import annotations

import logging
import math
import os
import secrets
import string
from pathlib import Path

log = logging.getLogger(__name__)

RUN_ID_FILE = "wandb_run_id"
MISSING = ("log.use_wandb needs the wandb package, which is not installed: pip install 'hpc_rlhf[wandb]' "
           "(or set log.use_wandb=false)")


def check_installed() -> str | None:
    """None when wandb can be imported, else the one-line message naming the option and the extra."""
    try:
        import wandb  # noqa: F401
    except ImportError:
        return MISSING
    return None


def new_run_id() -> str:
    """A fresh W&B run id: 8 lowercase letters and digits (the characters W&B accepts in ids)."""
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


def run_id_for(save_path: Path, start_step: int, new_id) -> str:
    """The W&B run id of this attempt: the stored one when it resumes (start_step > 0), else ``new_id()``,
    stored for the attempts after it."""
    path = Path(save_path) / RUN_ID_FILE
    if start_step > 0 and path.is_file() and path.read_text().strip():
        return path.read_text().strip()
    run_id = new_id()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(run_id + "\n")
    return run_id


class WandbSink:
    """One W&B run of the main rank; ``options``: project, org, group, run_name (log.wandb_*)."""

    def __init__(self, save_path: str | Path, options: dict, run_config: dict | None, start_step: int):
        import wandb
        mode = os.environ.setdefault("WANDB_MODE", "offline")  # explicit below too: wandb's settings outlive a run
        root = Path(save_path)
        self.run_id = run_id_for(root, start_step, new_run_id)
        self._run = wandb.init(project=options.get("project") or None, entity=options.get("org") or None,
                               group=options.get("group") or None, name=options.get("run_name") or root.name,
                               id=self.run_id, resume="allow", dir=str(root), config=run_config or {},
                               reinit="create_new", mode=mode,
                               settings=wandb.Settings(console="off", silent=True, x_disable_stats=True))
        log.info("W&B run %s (%s mode) in %s", self.run_id, mode, root / "wandb")

    def log(self, step: int, metrics: dict) -> None:
        row = {k: v for k, v in metrics.items() if isinstance(v, float) and math.isfinite(v)}
        if row:
            self._run.log(row, step=step)

    def close(self) -> None:
        """Finish the run, then ``wandb.teardown()``: it waits until W&B's service process has written
        everything and stops it, so the offline ``.wandb`` file is complete when close returns, even if the
        process then ends with ``os._exit`` (which skips W&B's exit hook).  Without it, a test reading the
        file right after ``finish()`` found a run without its run record once, on a loaded machine."""
        import wandb
        self._run.finish()
        wandb.teardown()
