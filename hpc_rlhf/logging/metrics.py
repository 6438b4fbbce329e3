"""Metrics sinks: ``metrics.jsonl`` (one JSON object per logged step) and TensorBoard events.

Only rank 0 writes; the other ranks get a logger that does nothing.
"""
from __future__ import annotations

import json
import math
from pathlib import Path


class MetricsLogger:
    def __init__(self, save_path: str | Path, enabled: bool, use_tensorboard: bool = True):
        self.enabled = enabled
        self._jsonl = None
        self._tb = None
        if not enabled:
            return
        root = Path(save_path)
        root.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(root / "metrics.jsonl", "a", buffering=1)
        if use_tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self._tb = SummaryWriter(log_dir=str(root / "tensorboard"))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        clean = {k: (float(v) if isinstance(v, (int, float)) else v) for k, v in metrics.items()}
        self._jsonl.write(json.dumps({"step": step, **clean}, allow_nan=True) + "\n")
        if self._tb is not None:
            for k, v in clean.items():
                if isinstance(v, float) and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(path: str | Path) -> list[dict]:
    """Rows of a metrics.jsonl file (for tests, plots and resume checks)."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
