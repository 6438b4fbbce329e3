"""Run a function on N local gloo ranks (spawned processes) and collect what each returns."""
from __future__ import annotations

import os
import pickle
import socket
import tempfile
from pathlib import Path

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, out: str, fn, args) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from hpc_rlhf.distributed.process_group import init_distributed, shutdown
    init_distributed("gloo")
    try:
        result = fn(*args)
    finally:
        shutdown()
    Path(out, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))


def run_ranks(fn, world: int, *args) -> list:
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_entry, args=(world, _free_port(), out, fn, args), nprocs=world, join=True,
                           start_method="spawn")
        return [pickle.loads(Path(out, f"rank{r}.pkl").read_bytes()) for r in range(world)]


def grads_at_step(engine) -> dict:
    """The gradients ``engine``'s optimizer steps with, by parameter name: filled in just before each step (after
    the ranks' reduction)."""
    import torch

    opt = engine.optimizer
    while not isinstance(opt, torch.optim.Optimizer):
        opt = opt.optimizer
    grads = {}

    def capture(*_):
        for name, p in engine.module.named_parameters():
            grads[name] = p.grad.detach().clone()
    opt.register_step_pre_hook(capture)
    return grads
