"""What a run does with the committed checkpoints it finds in ``ckpt_path``: resume from the newest intact
one, start from step 0, or refuse (a run never overwrites the checkpoints of another one silently).

``choose`` reads only small files (manifests, ``config.yaml``), so the CLI calls it before anything is loaded
(a refusal then costs seconds), and every rank calls it again in ``trainers/lifecycle.py:resume``: the answer
depends only on the files, so every rank reading the same file system gets the same one.
"""
from __future__ import annotations

import logging
from pathlib import Path

import yaml

from ..config.base import flatten_keys
from .manifest import has_manifest
from .layout import CONFIG, CheckpointError, committed_steps, newest_intact

log = logging.getLogger("hpc_rlhf.checkpoint")

# Options that do not change what a run computes: a run differing from a checkpoint's only in these is the
# same run.  Whole sections end with a dot.
IGNORED = ("ckpt.", "log.", "slurm.", "launch.backend", "placement.collective_timeout_s",
           "placement.dead_rank_timeout_s")

HOW = ("pass load_checkpoint=true to resume from it anyway, or ckpt.start_over=true to move the checkpoints "
       "into a dated folder under ckpt_path and start from step 0")


def _ignored(key: str) -> bool:
    return any(key.startswith(k) if k.endswith(".") else key == k for k in IGNORED)


def config_differences(stored: str, current: str) -> dict[str, tuple]:
    """The options (dotted keys, IGNORED ones aside) whose values differ between two YAML dumps of a
    config: key -> (stored value, current value); a key missing on one side has the value None."""
    a, b = flatten_keys(yaml.safe_load(stored) or {}), flatten_keys(yaml.safe_load(current) or {})
    return {k: (a.get(k), b.get(k)) for k in sorted(a.keys() | b.keys())
            if not _ignored(k) and a.get(k) != b.get(k)}


def describe(diffs: dict[str, tuple], at_most: int = 6) -> str:
    def short(v) -> str:
        text = repr(v)
        return text if len(text) <= 40 else text[:37] + "..."
    parts = [f"{k} {short(old)} -> {short(new)}" for k, (old, new) in list(diffs.items())[:at_most]]
    more = len(diffs) - at_most
    return ", ".join(parts) + (f" and {more} more" if more > 0 else "")


def choose(ckpt, run_config: str, restarted: bool, report: bool) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The checkpoint this run starts from (None: step 0), and the newer committed ones found damaged
    (with what is wrong).  ``ckpt`` is the run's ckpt section, ``run_config`` its whole config as YAML,
    ``restarted`` whether SLURM requeued the job; ``report`` logs what was decided and why.

    - requeued, or ``load_checkpoint``: the newest intact checkpoint, whatever config wrote it (the options
      that differ are listed in a warning);
    - ``start_over``: none (``trainers/lifecycle.py:resume`` moves the old ones aside);
    - otherwise: the newest intact one if its run had the same config (IGNORED options aside); a different
      or unrecorded config raises CheckpointError saying how to resume or start over.
    Raises CheckpointError, naming the damaged files, when committed checkpoints exist but none is intact.
    """
    if ckpt.start_over and not restarted:
        return None, []
    root = Path(ckpt.ckpt_path)
    asked = ckpt.load_checkpoint or restarted
    if not asked and not committed_steps(root):
        return None, []
    path, damaged = newest_intact(root)
    if path is None:
        if report:
            log.info("no committed checkpoint in %s: starting from step 0", root)
        return None, []
    if report:
        for folder, why in damaged:
            log.warning("checkpoint %s is damaged (%s): resuming from %s instead", folder.name, why, path.name)
        if not has_manifest(path):
            log.warning("%s has no manifest (written by an older version): loading it unverified", path)
    stored = path / CONFIG
    diffs = config_differences(stored.read_text(), run_config) if stored.is_file() else None
    if asked:
        if report and diffs:
            log.warning("resuming from %s, written with another config: %s", path, describe(diffs))
        return path, damaged
    if diffs is None:
        raise CheckpointError(f"{root} holds committed checkpoints whose config was not recorded (newest intact: "
                              f"{path.name}): {HOW}")
    if diffs:
        raise CheckpointError(f"{root} holds checkpoints of another config ({path.name}: {describe(diffs)}): {HOW}")
    if report:
        log.info("%s holds checkpoints of this config: resuming from %s (ckpt.start_over=true starts from step 0 "
                 "instead)", root, path.name)
    return path, damaged
