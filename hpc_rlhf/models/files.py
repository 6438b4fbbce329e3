"""The files of a model folder get the permissions the umask gives.  safetensors writes its files 0600 whatever the
umask (a temporary file renamed into place), so an exported model.safetensors was unreadable by the others of the
project group on a shared cluster while the folder's other files were not."""
from __future__ import annotations

import os
from pathlib import Path


def umask() -> int:
    """The process's umask, read from /proc where Linux shows it (setting it to read it would change it, for a
    moment, for the process's other threads)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def follow_umask(folder: str | os.PathLike) -> None:
    """Give every file under ``folder`` the read and write bits that a file created under the umask has (0644 under
    umask 022, 0600 under 077); execute bits are kept where the umask allows them."""
    mask = umask()
    for path in Path(folder).rglob("*"):
        if path.is_file() and not path.is_symlink():
            mode = path.stat().st_mode & 0o777
            want = ((mode & 0o111) | 0o666) & ~mask
            if mode != want:
                path.chmod(want)
