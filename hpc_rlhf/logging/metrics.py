"""Metrics sinks: ``metrics.jsonl`` (one JSON object per logged step), TensorBoard events and, optionally,
Weights & Biases (``wandb_sink.py``).

Only rank 0 writes; the other ranks get a logger that does nothing. A run that starts at step S
keeps the rows of an earlier ``metrics.jsonl`` up to step S (the steps a resumed run does not
repeat) and continues it. Rows past S (a fresh run in a used folder, or steps logged after the last
checkpoint of a killed run) would be logged again, so the old file is kept aside, not mixed in.
"""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path

from torch.utils.tensorboard import SummaryWriter

from .wandb_sink import WandbSink

log = logging.getLogger(__name__)


class MetricsLogger:
    def __init__(self, save_path: str | Path, enabled: bool, use_tensorboard: bool = True, start_step: int = 0,
                 wandb_options: dict | None = None, run_config: dict | None = None):
        """``wandb_options`` (project, org, group, run_name): also log to W&B; ``run_config``: its config."""
        self.enabled = enabled
        self._jsonl = None
        self._tb = None
        self._wandb = None
        if not enabled:
            return
        root = Path(save_path)
        root.mkdir(parents=True, exist_ok=True)
        path = root / "metrics.jsonl"
        set_aside_later_rows(path, start_step)
        self._jsonl = open(path, "a", buffering=1)
        if use_tensorboard:
            self._tb = SummaryWriter(log_dir=str(root / "tensorboard"))
        if wandb_options is not None:
            self._wandb = WandbSink(root, wandb_options, run_config, start_step)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        clean = {k: (float(v) if isinstance(v, (int, float)) else v) for k, v in metrics.items()}
        self._jsonl.write(json.dumps({"step": step, **clean}, allow_nan=True) + "\n")
        if self._tb is not None:
            for k, v in clean.items():
                if isinstance(v, float) and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(step, clean)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.close()
            self._wandb = None


def set_aside_later_rows(path: Path, start_step: int) -> None:
    """Keep only the rows up to ``start_step`` in ``path``; the whole old file moves to metrics.old-N.jsonl."""
    if not path.exists():
        return
    rows = path.read_text().splitlines(keepends=True)
    kept = [r for r in rows if r.strip() and json.loads(r)["step"] <= start_step]
    if len(kept) == len(rows):
        return
    n = 1
    while (old := path.with_name(f"metrics.old-{n}.jsonl")).exists():
        n += 1
    path.rename(old)
    path.write_text("".join(kept))
    log.info("%s had rows past step %d from an earlier run; moved it to %s and kept %d rows",
             path, start_step, old.name, len(kept))


def read_metrics(path: str | Path) -> list[dict]:
    """Rows of a metrics.jsonl file (for tests, plots and resume checks)."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
