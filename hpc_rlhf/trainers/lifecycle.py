"""What every trainer does around its loop: join the world with the stop signals armed (``run_in_world`` for
the data-parallel trainers, ``run_in_roles`` for the RL run's role worlds), and start from the newest
committed checkpoint when asked to resume or when SLURM requeued the job (a restarted job must not begin
again from step 0)."""
from __future__ import annotations

import logging

from ..checkpoint.store import latest_checkpoint, load_checkpoint
from ..distributed.env import init_distributed, shutdown
from ..distributed.preemption import RunStopped, StopRequest
from ..distributed.rendezvous import restart_count
from ..distributed.watchdog import from_torch_distributed
from ..distributed.worlds import join, leave
from ..engines.deepspeed_strategy import configure_deepspeed_env

log = logging.getLogger("hpc_rlhf.lifecycle")


def run_in_world(cfg, body):
    """``body(cfg, dist_env, stop)`` on this rank, between joining and leaving the default group."""
    configure_deepspeed_env()
    de = init_distributed(cfg.launch.backend)
    stop = StopRequest.from_config(cfg.slurm)
    try:
        return body(cfg, de, stop)
    finally:
        stop.restore()
        shutdown()


def run_in_roles(cfg, plan, body):
    """``body(role_context, stop)`` on this rank, between joining the job's role worlds (``plan``) and leaving
    them.  An error out of a collective (or the store) first waits for the watchdog's verdict: a dead peer is
    the usual cause, and the watchdog then ends this process naming it, which beats gloo's message.  Any other
    error is this rank's own: it becomes the job's verdict (the peers stop, naming this rank) and is raised
    at once."""
    configure_deepspeed_env()
    stop = StopRequest.from_config(cfg.slurm)
    try:
        p = cfg.placement
        ctx = join(plan, cfg.launch.backend, p.collective_timeout_s, p.dead_rank_timeout_s,
                   urgent=lambda: stop.received is not None)
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


def resume(engines: dict, ckpt_cfg, is_main: bool, rank: int | None = None) -> dict | None:
    """The trainer state of the checkpoint loaded into ``engines`` (its "step" included), or None."""
    if not (ckpt_cfg.load_checkpoint or restart_count() > 0):
        return None
    path = latest_checkpoint(ckpt_cfg.ckpt_path)
    if path is None:
        if is_main:
            log.info("load_checkpoint: no committed checkpoint in %s; starting fresh", ckpt_cfg.ckpt_path)
        return None
    state = load_checkpoint(engines, path, rank=rank)
    if is_main:
        log.info("resumed from %s at step %d", path, state["step"])
    return state
