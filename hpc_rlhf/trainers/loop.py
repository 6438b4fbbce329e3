"""The one outer loop (TEMPORARY version in main until the loop branch lands)."""
from __future__ import annotations

from typing import Callable

from ..distributed.preemption import step_boundary
from ..logging.metrics import MetricsLogger
from ..logging.progress import Progress


class StepBoundary:
    def __init__(self, stop, save_steps: int, save, agree, barrier, leader: bool):
        self.stop, self.save_steps, self.save, self.agree, self.leader, self.barrier = (
            stop, save_steps, save, agree, leader, barrier)

    def __call__(self, done: int, total: int, before_stop=lambda: None) -> None:
        step_boundary(self.stop, done, total, self.save_steps, self.save, self.agree, self.leader, self.barrier,
                      before_stop)


def run_steps(cfg, step: Callable[[int], dict], start: int, total: int, boundary: StepBoundary, *,
              is_main: bool, desc: str, evaluate=None, export=None, shown=lambda m: m) -> dict[str, float]:
    log_cfg = cfg.log
    metrics_log = MetricsLogger(cfg.ckpt.save_path, is_main, log_cfg.use_tensorboard, start)
    progress = Progress(total, start, is_main, log_cfg.progress_bar, desc=desc)
    last: dict[str, float] = {}
    for i in range(start, total):
        last = step(i)
        done = i + 1
        if evaluate is not None and (done == total or (log_cfg.eval_steps > 0 and done % log_cfg.eval_steps == 0)):
            last.update(evaluate(i))
        if done % log_cfg.logging_steps == 0 or done == total:
            metrics_log.log(done, last)
        progress.update(done, shown(last), done % log_cfg.logging_steps == 0)
        boundary(done, total, lambda: (progress.close(), metrics_log.close()))
    progress.close()
    exported = export() if export is not None else {}
    if exported:
        metrics_log.log(total, exported)
        last.update(exported)
    metrics_log.close()
    return last
