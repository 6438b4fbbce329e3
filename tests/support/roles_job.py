"""One rank of a tiny role job for the launcher tests: `python tests/support/roles_job.py SCENARIO MARKER_DIR`.

The plan has one rank per role, actor, reward, rollout (as many as WORLD_SIZE; one rank without a launcher).
Scenario ``barriers``: every rank joins the worlds through ``run_in_roles`` (heartbeats every second, dead
after 2 s), writes its pid to MARKER_DIR/rank-N and loops on barriers over the control bridge; rank 0 keeps the
attempt record in MARKER_DIR/run/attempts.jsonl.  Scenario
``raise``: the same, but rank 1 (rank 0 when alone) raises a ValueError instead, after writing the time to
MARKER_DIR/raised.  Scenario ``idle``: the rank joins nothing and sleeps, so only the launcher can end it.
Scenario ``stuck``: peers are dead after 60 s; ranks 0 and 1 wait on a receive from each other over the
trainers' bridge, which the rollout rank is not in (a wait inside gloo that only its timeout ends, whoever else
dies), the rollout rank sleeps.
"""
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from hpc_rlhf.distributed.env import read_env
from hpc_rlhf.distributed.placement import make_plan
from hpc_rlhf.trainers.lifecycle import run_in_roles

scenario, markers = sys.argv[1], Path(sys.argv[2])
de = read_env()
if scenario == "idle":
    (markers / f"rank-{de.rank}").write_text(str(os.getpid()))
    time.sleep(600)
    sys.exit(0)

cfg = SimpleNamespace(launch=SimpleNamespace(backend="gloo"),
                      slurm=SimpleNamespace(stop_signals=["TERM"], requeue_signals=[], requeue=False,
                                            log_dir=str(markers / "logs")),
                      ckpt=SimpleNamespace(save_path=str(markers / "run"), ckpt_path=str(markers / "ckpt")),
                      placement=SimpleNamespace(collective_timeout_s=120.0,
                                                dead_rank_timeout_s=60.0 if scenario == "stuck" else 2.0))
plan = make_plan({role: 1 for role in ("actor", "reward", "rollout")[:de.world_size]})


def body(ctx, stop):
    (markers / f"rank-{ctx.global_rank}").write_text(str(os.getpid()))
    if scenario == "raise" and ctx.global_rank == min(1, de.world_size - 1):
        (markers / "raised").write_text(repr(time.time()))
        raise ValueError("bad row 7")
    if scenario == "stuck":
        if ctx.trainers is not None:  # ranks 0 and 1, as the trainers' exchanges of async training
            ctx.trainers.pg.recv([torch.zeros(1)], 1 - ctx.trainers.index, 0).wait()
        time.sleep(600)
    while True:
        ctx.control.barrier()
        time.sleep(0.05)


run_in_roles(cfg, plan, body)
