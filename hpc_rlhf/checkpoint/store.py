"""Resumable checkpoints, written atomically.

Layout under ``ckpt_path``::

    global_step12/            one committed checkpoint
        <engine>/             DeepSpeed model + optimizer + scheduler shards per engine (actor, critic, ...)
        rng_rank{r}.pt        each rank's RNG states
        state_rank{r}.pt      what else a rank must keep (optional; e.g. samples generated ahead of the step)
        trainer.json          step, epoch and whatever the trainer needs to continue exactly
        COMMITTED             written last: only folders with it count

Every rank writes into ``.tmp-global_step12``; after a barrier over all roles, global rank 0 writes ``trainer.json`` and
``COMMITTED``, renames the folder into place and removes the oldest checkpoints beyond the limit.
A crash at any point leaves either no new checkpoint or a complete one.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from ..distributed.collectives import barrier
from .rng import rng_state, set_rng_state

COMMITTED = "COMMITTED"
_STEP_DIR = re.compile(r"^global_step(\d+)$")


def committed_steps(ckpt_path: str | Path) -> list[int]:
    root = Path(ckpt_path)
    if not root.is_dir():
        return []
    steps = []
    for d in root.iterdir():
        m = _STEP_DIR.match(d.name)
        if m and (d / COMMITTED).is_file():
            steps.append(int(m.group(1)))
    return sorted(steps)


def latest_checkpoint(ckpt_path: str | Path) -> Path | None:
    steps = committed_steps(ckpt_path)
    return Path(ckpt_path) / f"global_step{steps[-1]}" if steps else None


def _default_barrier() -> None:
    barrier()


def _default_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def save_checkpoint(engines: dict, ckpt_path: str | Path, step: int, trainer_state: dict, max_keep: int,
                    rank: int | None = None, barrier: Callable[[], None] = _default_barrier,
                    rank_state: dict | None = None) -> Path:
    """Collective over every rank of the job (``barrier`` spans them all; ``rank`` is the global rank).

    ``engines`` maps a name to each DeepSpeed engine this rank holds; an engine's ranks all hold it
    under the same name, and its shards go to ``<name>/``.  ``rank_state`` (any picklable dict) is
    this rank's own state; ``load_checkpoint`` hands it back as ``state["rank_state"]``.
    """
    rank = _default_rank() if rank is None else rank
    root = Path(ckpt_path)
    final = root / f"global_step{step}"
    tmp = root / f".tmp-global_step{step}"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    for name, engine in engines.items():
        engine.save_checkpoint(str(tmp), tag=name, save_latest=False)
    torch.save(rng_state(), tmp / f"rng_rank{rank}.pt")
    if rank_state is not None:
        torch.save(rank_state, tmp / f"state_rank{rank}.pt")
    barrier()
    if rank == 0:
        (tmp / "trainer.json").write_text(json.dumps(trainer_state, indent=1))
        (tmp / COMMITTED).write_text(f"{step}\n")
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        for old in committed_steps(root)[:-max_keep]:
            shutil.rmtree(root / f"global_step{old}", ignore_errors=True)
    barrier()
    return final


def load_checkpoint(engines: dict, path: str | Path, rank: int | None = None) -> dict:
    """Restore this rank's engines and RNG states; return the trainer state (with this rank's
    ``rank_state`` under the key "rank_state" when it saved one)."""
    rank = _default_rank() if rank is None else rank
    path = Path(path)
    for name, engine in engines.items():
        load_path, _ = engine.load_checkpoint(str(path), tag=name, load_optimizer_states=True,
                                              load_lr_scheduler_states=True)
        if load_path is None:
            raise RuntimeError(f"DeepSpeed found no checkpoint in {path}/{name}")
    rng_file = path / f"rng_rank{rank}.pt"
    if not rng_file.is_file():
        raise RuntimeError(f"{rng_file} is missing: was the checkpoint written with a different number of ranks?")
    set_rng_state(torch.load(rng_file, weights_only=False))
    state = json.loads((path / "trainer.json").read_text())
    own = path / f"state_rank{rank}.pt"
    if own.is_file():
        state["rank_state"] = torch.load(own, weights_only=False)
    return state
