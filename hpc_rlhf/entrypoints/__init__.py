"""The command line, one module per group of subcommands; `hpc_rlhf/cli.py` assembles them.

Only argparse and the printing of results live here: each subcommand calls the command table
(`hpc_rlhf/commands.py`) or a plain function of the library.  Library code never imports this package.

A subcommand's arguments are added, and what it runs imported, only when it is the command given: `hpc-rlhf --help`,
`options`, `plan`, `status`, `report` and `sweep` load no torch, and a configured command (`train`, `generate`, ...)
reports a config error before it loads torch (``Subcommand.light``).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Subcommand:
    name: str
    help: str
    add_args: Callable[[argparse.ArgumentParser], None]
    run: Callable  # (args, rest) -> exit code
    takes_rest: bool = False  # key=value overrides after the named arguments
    light: bool = False  # runs without torch loaded first (a configured command loads it after its checks)
