"""What every trainer does around its loop: join the world with the stop signals armed (``run_in_world`` for
the data-parallel trainers, ``run_in_roles`` for the RL run's role worlds), and start from the newest intact
committed checkpoint when asked to resume, when SLURM requeued the job (a restarted job must not begin again
from step 0) or when ckpt_path holds checkpoints of the same config (`checkpoint/existing.py`).  The main rank
notes each start and how it ended in the attempt record (`logging/attempts.py`, read by `hpc-rlhf status`)."""
from __future__ import annotations

import logging
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from ..checkpoint.existing import choose
from ..checkpoint.layout import CheckpointError, move_aside, set_aside_damaged, step_of
from ..checkpoint.store import load_checkpoint
from ..config import dump_yaml
from ..distributed.collectives import max_over_ranks
from ..distributed.env import read_env
from ..distributed.process_group import init_distributed, shutdown
from ..distributed.preemption import RunStopped, StopRequest
from ..distributed.rendezvous import restarted
from ..distributed.watchdog import from_torch_distributed
from ..distributed.worlds import join, leave
from ..engines.deepspeed_strategy import configure_deepspeed_env
from ..logging import attempts

log = logging.getLogger("hpc_rlhf.lifecycle")


@contextmanager
def recorded(cfg, stop: StopRequest, main: bool):
    """The attempt record of this run (``main``: this rank writes it): a start row now, an end row saying how
    the block ended (finished, stopped by a signal at a step boundary, or the error raised)."""
    if not main:
        yield None
        return
    run_dir = cfg.ckpt.save_path
    where = attempts.identity()
    if where["job_id"]:
        where["log_dir"] = str(Path(cfg.slurm.log_dir).resolve())
    attempts.append(run_dir, "start", **where, ckpt_path=str(Path(cfg.ckpt.ckpt_path).resolve()))
    try:
        yield run_dir
    except RunStopped as e:
        attempts.append(run_dir, "end", reason="stopped", step=e.step, signal=stop.received, requeue=e.requeue)
        raise
    except BaseException as e:
        attempts.append(run_dir, "end", reason="error", error=attempts.error_text(e))
        raise
    attempts.append(run_dir, "end", reason="finished")


def run_in_world(cfg, body):
    """``body(cfg, dist_env, stop)`` on this rank, between joining and leaving the default group."""
    configure_deepspeed_env()
    stop = StopRequest.from_config(cfg.slurm)
    try:
        with recorded(cfg, stop, read_env().is_main):
            de = init_distributed(cfg.launch.backend)
            try:
                return body(cfg, de, stop)
            finally:
                shutdown()
    finally:
        stop.restore()


def run_in_roles(cfg, plan, body):
    """``body(role_context, stop)`` on this rank, between joining the job's role worlds (``plan``) and leaving
    them.  An error out of a collective (or the store) first waits for the watchdog's verdict: a dead peer is
    the usual cause, and the watchdog then ends this process naming it, which beats gloo's message.  Any other
    error is this rank's own: it becomes the job's verdict (the peers stop, naming this rank) and is raised
    at once."""
    configure_deepspeed_env()
    stop = StopRequest.from_config(cfg.slurm)
    try:
        with recorded(cfg, stop, read_env().is_main) as run_dir:
            p = cfg.placement
            ctx = join(plan, cfg.launch.backend, p.collective_timeout_s, p.dead_rank_timeout_s,
                       urgent=stop.arrived)
            if run_dir is not None:  # the watchdog ends the process at once: the verdict goes into the record first
                ctx.watchdog.on_die = lambda why: attempts.append(run_dir, "end", reason="error", error=why)
            try:
                result = body(ctx, stop)
            except RunStopped:
                leave(ctx)
                raise
            except Exception as e:
                if from_torch_distributed(e):
                    ctx.watchdog.explain_failure()
                ctx.watchdog.fail(e)
                raise
            leave(ctx)
            return result
    finally:
        stop.restore()


def resume(engines: dict, cfg, is_main: bool, rank: int | None = None,
           agree: Callable[[int], int] = max_over_ranks) -> dict | None:
    """The trainer state of the checkpoint loaded into ``engines`` (its "step" included), or None: step 0.

    `checkpoint/existing.py:choose` decides from the files (and raises when the run must neither resume nor
    start over); ``agree`` (the maximum of an int over every rank of the job) makes sure that every rank chose
    the same checkpoint before any loads it.  The main rank moves the old checkpoints aside for
    ``ckpt.start_over`` and renames the damaged ones newer than the checkpoint loaded, so that no later save
    counts them among the ``max_ckpt_num`` it keeps (which could remove the intact one)."""
    ckpt, again = cfg.ckpt, restarted()
    if ckpt.start_over and not again:
        moved = move_aside(ckpt.ckpt_path) if is_main else None
        if moved is not None:
            log.warning("ckpt.start_over: moved the checkpoints of %s into %s; starting from step 0",
                        ckpt.ckpt_path, moved)
        return None
    path, damaged = choose(ckpt, dump_yaml(cfg), again, report=is_main)
    step = step_of(path) if path is not None else 0
    low, high = -agree(-step), agree(step)
    if low != high:
        raise CheckpointError(f"the ranks chose different checkpoints in {ckpt.ckpt_path} (steps {low} to {high}; "
                              f"0: none): does every node see the same files there?")
    if path is None:
        return None
    if is_main:
        for folder, _ in damaged:
            log.warning("renamed the damaged checkpoint %s to %s", folder, set_aside_damaged(folder))
    state = load_checkpoint(engines, path, rank=rank, agree=agree)
    if is_main:
        log.info("resumed from %s at step %d", path, state["step"])
    return state
