"""Where this process sits: rank, world size and rendezvous, read from the launcher's environment.

The local launcher and torchrun set RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT.
Under srun the command line entry point first derives the same variables from the SLURM environment
(``distributed.rendezvous.adopt_slurm_rendezvous``).  A plain `python` run is rank 0 of 1.

The job's TCPStore listens on MASTER_ADDR:MASTER_PORT.  Global rank 0 hosts it, unless the local launcher
does (it then sets LAUNCHER_STORE to that address): a store in the launcher outlives every rank, so the
launcher and the ranks can read there which rank brought the job down.
"""
from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .collectives import barrier

LAUNCHER_STORE = "HPC_RLHF_LAUNCHER_STORE"  # "host:port" of a store the local launcher hosts for its ranks


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def read_env(environ: dict | None = None) -> DistEnv:
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world, local = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0))
    else:
        rank, world, local = 0, 1, 0
    return DistEnv(rank, world, local, env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", 29500)))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rendezvous_env() -> DistEnv:
    """``read_env()``, except that a lone process started without a launcher (no MASTER_PORT) takes a free
    port: two such runs on one machine would both build their store on the default port 29500."""
    de = read_env()
    if de.world_size == 1 and "MASTER_PORT" not in os.environ:
        return DistEnv(0, 1, 0, "127.0.0.1", free_port())
    return de


def store_host(de: DistEnv) -> int | None:
    """The global rank hosting the job's store: 0, or None when the local launcher hosts it."""
    return None if os.environ.get(LAUNCHER_STORE) == f"{de.master_addr}:{de.master_port}" else 0


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
