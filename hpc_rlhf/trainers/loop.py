"""The outer loop every trainer runs once its set-up is done: the steps, the eval cadence, metrics.jsonl and
the progress line, the step boundary (stop agreement, checkpoints), the export and the final close.

The same call runs on every rank; only the leader's sinks write (``is_main``).  A step's metrics must be the
same on every rank (they are reduced before they come back), since the row logged is the leader's.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Callable

from ..distributed.preemption import StepBoundary
from ..logging import attempts
from ..logging.metrics import MetricsLogger
from ..logging.progress import Progress

__all__ = ["StepBoundary", "run_steps"]

log = logging.getLogger("hpc_rlhf.loop")

Metrics = dict[str, float]


def _shown_as_is(metrics: Metrics) -> Metrics:
    return metrics


def run_steps(cfg, step: Callable[[int], Metrics], start: int, total: int, boundary: StepBoundary, *,
              is_main: bool, desc: str, evaluate: Callable[[int], Metrics] | None = None,
              export: Callable[[], Metrics] | None = None,
              shown: Callable[[Metrics], Metrics] = _shown_as_is, eval_at_start: bool = False,
              eval_only: bool = False, on_eval: Callable[[int, Metrics], bool] | None = None) -> Metrics:
    """Run ``step(i)`` for i = start .. total - 1 (0-based) and return the last step's metrics.

    ``cfg`` is the trainer's config: ``cfg.log`` (logging_steps, eval_steps, use_tensorboard, progress_bar)
    and ``cfg.ckpt.save_path`` (where metrics.jsonl and the TensorBoard events go) are read.  After step i,
    ``evaluate(i + 1)`` (its argument: the steps done) runs every ``eval_steps`` steps and after the last
    step, its metrics joining the step's row; a row is logged every ``logging_steps`` steps and after the
    last step; ``shown`` picks what the progress line shows; then ``boundary`` ends the step (it may raise
    RunStopped, having closed the sinks).  After the last step ``export()`` writes the result; what it
    returns is logged as a row of its own (when not empty) and joins the returned metrics.

    ``eval_at_start``: ``evaluate(start)`` first, logged as a row of step ``start``; ``eval_only``: that eval
    alone, returned (no step, no export).  ``on_eval(done, eval_metrics)`` sees every eval (keeping the best
    model, say); when it returns True the run ends there: a checkpoint of that step (``boundary.save``), then
    the export, as after the last step.  It must decide alike on every rank."""
    log_cfg = cfg.log
    if is_main:  # for `hpc-rlhf status`: where this attempt starts and how many steps the run has
        attempts.append(cfg.ckpt.save_path, "steps", start_step=start, total_steps=total, trainer=desc)
    wandb_options = ({"project": log_cfg.wandb_project, "org": log_cfg.wandb_org, "group": log_cfg.wandb_group,
                      "run_name": log_cfg.wandb_run_name} if log_cfg.use_wandb else None)
    metrics_log = MetricsLogger(cfg.ckpt.save_path, is_main, log_cfg.use_tensorboard, start, wandb_options,
                                dataclasses.asdict(cfg) if wandb_options is not None else None)
    progress = Progress(total, start, is_main, log_cfg.progress_bar, desc=desc)

    def close() -> None:
        progress.close()
        metrics_log.close()

    def evaluated(done: int, metrics: Metrics) -> bool:
        """The eval's metrics into ``metrics``; True: stop here."""
        got = evaluate(done)
        metrics.update(got)
        return on_eval is not None and on_eval(done, got)

    last: Metrics = {}
    end = total  # the steps done when the run ends
    if evaluate is not None and (eval_at_start or eval_only):
        stop_now = evaluated(start, last)
        metrics_log.log(start, last)
        if eval_only:
            close()
            return last
        if stop_now:
            log.info("early stop before the first step: the eval at step %d reached the threshold", start)
            end = start
    for i in range(start, end):
        last = step(i)
        done = i + 1
        stop_now = False
        if evaluate is not None and (done == total or (log_cfg.eval_steps > 0 and done % log_cfg.eval_steps == 0)):
            stop_now = evaluated(done, last)
        on_cadence = done % log_cfg.logging_steps == 0
        if on_cadence or done == total or stop_now:
            metrics_log.log(done, last)
        progress.update(done, shown(last), on_cadence)
        if stop_now and done < total:
            log.info("early stop after step %d of %d: the eval reached the threshold", done, total)
            boundary.save(done)
            end = done
            break
        boundary(done, total, close)
    progress.close()
    exported = export() if export is not None else {}
    if exported:
        metrics_log.log(end, exported)
        last.update(exported)
    metrics_log.close()
    return last
