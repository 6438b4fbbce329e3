"""What the sharded pipeline commands share: joining the ranks, contiguous shards, part files, jsonl."""
from __future__ import annotations

import json
import os
from pathlib import Path


from ..distributed.collectives import barrier
from ..distributed.env import DistEnv, read_env
from ..distributed.process_group import device_for, init_distributed

# A rank that finishes its shard early waits for the others at the merge barrier: generous on purpose.
BARRIER_TIMEOUT_S = 24 * 3600


def join(backend: str = "auto") -> DistEnv:
    """Where this process sits; a process group only when there are several ranks."""
    de = read_env()
    if de.world_size > 1:
        de = init_distributed(backend, timeout_s=BARRIER_TIMEOUT_S)
    return de


def device(de: DistEnv):
    return device_for(de)


def shard_bounds(n: int, rank: int, world: int) -> tuple[int, int]:
    """Contiguous block [lo, hi) of ``n`` items for ``rank``: blocks in rank order cover 0..n-1 in order."""
    base, extra = divmod(n, world)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (1 if rank < extra else 0)


def read_jsonl(path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist")
    rows = []
    with path.open() as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path} line {n} is not JSON: {e}") from None
    return rows


def write_jsonl(rows, path) -> Path:
    """Write atomically (temporary file, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    return path


def part_path(output, rank: int, world: int) -> Path:
    output = Path(output)
    return output.with_name(f"{output.name}.part-{rank:05d}-of-{world:05d}")


class PartWriter:
    """This rank's rows go to a part file; :meth:`finish` has rank 0 concatenate the parts in rank order."""

    def __init__(self, output, de: DistEnv):
        self.output, self.de = Path(output), de
        self.output.parent.mkdir(parents=True, exist_ok=True)
        self.path = part_path(self.output, de.rank, de.world_size)
        self._f = self.path.open("w")
        self.count = 0

    def write(self, row: dict) -> None:
        self._f.write(json.dumps(row, ensure_ascii=False) + "\n")
        self.count += 1

    def finish(self) -> None:
        self._f.close()
        if self.de.world_size > 1:
            barrier()  # every part is complete (on a filesystem all ranks share)
        if self.de.rank == 0:
            tmp = self.output.with_name(self.output.name + ".tmp")
            with tmp.open("w") as out:
                for r in range(self.de.world_size):
                    p = part_path(self.output, r, self.de.world_size)
                    with p.open() as f:
                        for line in f:
                            out.write(line)
            os.replace(tmp, self.output)
            for r in range(self.de.world_size):
                part_path(self.output, r, self.de.world_size).unlink()
        barrier()
