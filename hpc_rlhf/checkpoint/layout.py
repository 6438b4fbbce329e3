"""The checkpoint folders under ``ckpt_path`` (store.py describes what one holds): which are committed, which is the
newest intact one, and setting folders aside.  File-system work only, no torch: `hpc-rlhf status`, `report` and the
checks before a run read checkpoints through it."""
from __future__ import annotations

import re
import time
from pathlib import Path

from .manifest import damage

COMMITTED = "COMMITTED"
CONFIG = "config.yaml"
_STEP_DIR = re.compile(r"^global_step(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used, or checkpoints a run must not overwrite; the message names the file."""


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


def step_of(folder: Path) -> int:
    return int(_STEP_DIR.match(folder.name).group(1))


def newest_intact(ckpt_path: str | Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest committed checkpoint whose files match its manifest (None when there is no committed one),
    and the newer committed ones found damaged, each with what is wrong.  Raises CheckpointError, naming
    every damaged file, when no committed checkpoint is intact.  Deterministic: every rank reading the same
    file system picks the same one."""
    root = Path(ckpt_path)
    damaged = []
    for step in reversed(committed_steps(root)):
        folder = root / f"global_step{step}"
        why = damage(folder)
        if why is None:
            return folder, damaged
        damaged.append((folder, why))
    if damaged:
        raise CheckpointError(f"no intact checkpoint in {root}: {'; '.join(why for _, why in damaged)} "
                              f"(ckpt.start_over=true moves them aside and starts from step 0)")
    return None, []


def _stamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S")


def set_aside_damaged(folder: Path) -> Path:
    """Rename a damaged checkpoint so that it is neither loaded nor counted (nor removed) by later saves."""
    target = folder.with_name(f"{folder.name}.damaged-{_stamp()}")
    folder.rename(target)
    return target


def move_aside(ckpt_path: str | Path) -> Path | None:
    """Move every checkpoint folder of ``ckpt_path`` (committed, unfinished or set aside as damaged) into a
    new dated folder ``ckpt_path/old-DATE`` and return it (None when there was nothing to move)."""
    root = Path(ckpt_path)
    found = [p for p in root.glob("*") if p.name.startswith(("global_step", ".tmp-global_step"))]
    if not found:
        return None
    target, n = root / f"old-{_stamp()}", 1
    while target.exists():
        n += 1
        target = root / f"old-{_stamp()}-{n}"
    target.mkdir()
    for p in found:
        p.rename(target / p.name)
    return target
