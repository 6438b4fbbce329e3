"""Where a model the config names lives: a local folder, or a hub name when the hub can be reached.  No torch: the
config checks of a login node's commands use it."""
from __future__ import annotations

import os
from pathlib import Path


class HubOfflineError(OSError):
    """A hub model name was given while HF_HUB_OFFLINE is set."""


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


def _looks_local(name: str) -> bool:
    # Hub ids are "name" or "org/name"; anything else with a path shape is meant as a local folder.
    return (name.startswith(("/", ".", "~")) or "\\" in name or name.count("/") > 1
            or name.endswith("/") or Path(name).exists())


def resolve_pretrained(name: str) -> str:
    """Return ``name`` when it is a local folder; fail clearly for a missing path or an offline hub name."""
    if os.path.isdir(os.path.expanduser(name)):
        return os.path.expanduser(name)  # transformers takes "~/..." for a hub id
    if _looks_local(name):
        raise FileNotFoundError(f"model folder {name} does not exist (or is not a folder)")
    if _env_true("HF_HUB_OFFLINE"):
        raise HubOfflineError(f"{name} is not a local folder, and HF_HUB_OFFLINE is set, so the Hub "
                              "cannot be reached: copy the model to the cluster and pass its path")
    return name
