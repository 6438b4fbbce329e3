"""Resumable checkpoints, written atomically.

Layout under ``ckpt_path``::

    global_step12/            one committed checkpoint
        <engine>/             DeepSpeed model + optimizer + scheduler shards per engine (actor, critic, ...)
        rng_rank{r}.pt        each rank's RNG states
        state_rank{r}.pt      what else a rank must keep (optional; e.g. samples generated ahead of the step)
        trainer.json          step, epoch and whatever the trainer needs to continue exactly
        config.yaml           the run's config (`checkpoint/existing.py` compares it with a new run's)
        manifest.json         every file above with its size (and sha256 of the small ones): `checkpoint/manifest.py`
        COMMITTED             written last: only folders with it count

Every rank writes into ``.tmp-global_step12``; after a barrier over all roles, global rank 0 writes ``trainer.json``,
``config.yaml``, the manifest (listing the files every rank wrote: all ranks share the file system) and
``COMMITTED``, renames the folder into place and removes the oldest checkpoints beyond the limit.
A crash at any point leaves either no new checkpoint or a complete one; a file damaged afterwards is found
by the manifest before the checkpoint is loaded (``newest_intact``).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from ..distributed.collectives import barrier, max_over_ranks
from .layout import COMMITTED, CONFIG, CheckpointError, committed_steps
from .manifest import write_manifest
from .rng import rng_state, set_rng_state


def _default_barrier() -> None:
    barrier()


def _default_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def save_checkpoint(engines: dict, ckpt_path: str | Path, step: int, trainer_state: dict, max_keep: int, *,
                    run_config: str, rank: int | None = None, barrier: Callable[[], None] = _default_barrier,
                    rank_state: dict | None = None) -> Path:
    """Collective over every rank of the job (``barrier`` spans them all; ``rank`` is the global rank).

    ``engines`` maps a name to each DeepSpeed engine this rank holds; an engine's ranks all hold it
    under the same name, and its shards go to ``<name>/``.  ``rank_state`` (any picklable dict) is
    this rank's own state; ``load_checkpoint`` hands it back as ``state["rank_state"]``.  ``run_config``
    (the run's config as YAML) is kept as ``config.yaml``.
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
        (tmp / CONFIG).write_text(run_config)
        write_manifest(tmp)
        (tmp / COMMITTED).write_text(f"{step}\n")
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        for old in committed_steps(root)[:-max_keep]:
            shutil.rmtree(root / f"global_step{old}", ignore_errors=True)
    barrier()
    return final


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def _read(file: Path, load: Callable = lambda f: torch.load(f, weights_only=False)):
    try:
        return load(file)
    except Exception as e:  # a damaged file of a checkpoint without manifest: name it
        raise CheckpointError(f"{file} cannot be loaded ({_first_line(e)})") from e


def _load_engine(engine, path: Path, name: str) -> None:
    try:
        load_path, _ = engine.load_checkpoint(str(path), tag=name, load_optimizer_states=True,
                                              load_lr_scheduler_states=True)
    except Exception as e:
        raise CheckpointError(f"{path / name}: DeepSpeed could not load it ({_first_line(e)})") from e
    if load_path is None:
        raise CheckpointError(f"DeepSpeed found no checkpoint in {path / name}")


def _on_every_rank(phase: Callable, agree: Callable[[int], int], path: Path):
    """``phase()`` on this rank; when it fails on any rank, every rank raises (before the next phase, whose
    collectives would wait for the failed rank forever): its own error, or one saying another rank failed."""
    try:
        result, error = phase(), None
    except CheckpointError as e:
        result, error = None, e
    if agree(int(error is not None)):
        raise error or CheckpointError(f"another rank could not load its part of {path} (its log names the file)")
    return result


def load_checkpoint(engines: dict, path: str | Path, rank: int | None = None,
                    agree: Callable[[int], int] = max_over_ranks) -> dict:
    """Restore this rank's engines and RNG states; return the trainer state (with this rank's
    ``rank_state`` under the key "rank_state" when it saved one).  Collective: ``agree`` is the maximum of
    an int over every rank of the job; a file that cannot be read stops every rank with a CheckpointError."""
    rank = _default_rank() if rank is None else rank
    path = Path(path)

    def own_files() -> tuple:
        rng_file = path / f"rng_rank{rank}.pt"
        if not rng_file.is_file():
            raise CheckpointError(f"{rng_file} is missing: was the checkpoint written with a different number of "
                                  f"ranks?")
        state = _read(path / "trainer.json", lambda f: json.loads(f.read_text()))
        own = path / f"state_rank{rank}.pt"
        if own.is_file():
            state["rank_state"] = _read(own)
        return _read(rng_file), state

    rng, state = _on_every_rank(own_files, agree, path)
    _on_every_rank(lambda: [_load_engine(engine, path, name) for name, engine in engines.items()], agree, path)
    set_rng_state(rng)
    return state
