"""Progress with an ETA: a tqdm bar on a terminal, plain lines when the output is a file (SLURM logs)."""
from __future__ import annotations

import sys
import time

from tqdm import tqdm


class Progress:
    def __init__(self, total: int, start: int, enabled: bool, mode: str = "auto", desc: str = "train"):
        self.total, self.start, self.enabled, self.desc = total, start, enabled, desc
        self._t0 = time.time()
        self._bar = None
        use_bar = mode == "on" or (mode == "auto" and sys.stderr.isatty())
        if enabled and use_bar:
            self._bar = tqdm(total=total, initial=start, desc=desc, dynamic_ncols=True)

    def eta_s(self, step: int) -> float:
        done = step - self.start
        return (time.time() - self._t0) / done * (self.total - step) if done > 0 else float("nan")

    def update(self, step: int, metrics: dict[str, float], print_line: bool) -> None:
        if not self.enabled:
            return
        short = {k: v for k, v in metrics.items() if k in ("loss", "eval_loss", "lr", "grad_norm")}
        if self._bar is not None:
            self._bar.set_postfix({k: f"{v:.4g}" for k, v in short.items()}, refresh=False)
            self._bar.update(step - self._bar.n)
        elif print_line:
            parts = " ".join(f"{k}={v:.4g}" for k, v in short.items())
            print(f"[{self.desc}] step {step}/{self.total} {parts} eta={self.eta_s(step):.0f}s",
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
