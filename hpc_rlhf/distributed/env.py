"""Where this process sits: rank, world size and rendezvous, read from the launcher's environment.

The local launcher and torchrun set RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT.
Under srun the command line entry point first derives the same variables from the SLURM environment
(``distributed.rendezvous.adopt_slurm_rendezvous``).  A plain `python` run is rank 0 of 1.

The job's TCPStore listens on MASTER_ADDR:MASTER_PORT.  Global rank 0 hosts it, unless the local launcher
does (it then sets LAUNCHER_STORE to that address): a store in the launcher outlives every rank, so the
launcher and the ranks can read there which rank brought the job down.

No torch here (the launcher's checks read it); joining the process group is ``distributed/process_group.py``.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass

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
