"""Joining and leaving the job's default process group, and this rank's device (where ``env.py`` says this process
sits)."""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from .collectives import barrier
from .env import DistEnv, read_env, rendezvous_env, store_host


def open_store(de: DistEnv, timeout: datetime.timedelta) -> dist.TCPStore:
    """The job's store on MASTER_ADDR:MASTER_PORT, started here on the rank that hosts it."""
    return dist.TCPStore(de.master_addr, de.master_port, de.world_size, de.rank == store_host(de),
                         timeout=timeout)


def pick_backend(choice: str = "auto") -> str:
    if choice != "auto":
        return choice
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(backend: str = "auto", timeout_s: int = 600) -> DistEnv:
    """Join the default process group (a group of one for a single process) and return where we are."""
    if dist.is_initialized():
        return read_env()
    de = rendezvous_env()
    backend = pick_backend(backend)
    if backend == "nccl":
        torch.cuda.set_device(device_for(de))
    # DeepSpeed reads these from the environment whatever launched us.
    for key, value in (("RANK", de.rank), ("WORLD_SIZE", de.world_size), ("LOCAL_RANK", de.local_rank),
                       ("MASTER_ADDR", de.master_addr), ("MASTER_PORT", de.master_port)):
        os.environ.setdefault(key, str(value))
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend=backend, store=open_store(de, timeout), rank=de.rank,
                            world_size=de.world_size, timeout=timeout)
    return de


def shutdown() -> None:
    """Barrier, then destroy: gloo aborts now and then if a rank leaves while peers still talk."""
    if dist.is_initialized():
        try:
            barrier()
        finally:
            dist.destroy_process_group()


def device_for(de: DistEnv) -> torch.device:
    """This rank's device.  The local rank indexes the GPUs this process sees, modulo their count: a
    task started with srun --gpus-per-task=1 sees only its own GPU (as device 0), whatever its rank."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", de.local_rank % torch.cuda.device_count())
