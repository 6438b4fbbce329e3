"""`hpc-rlhf <command>`: one entry point for training, tools and the demo."""
from __future__ import annotations

import argparse
import atexit
import gc
import sys

from .commands import exit_code, setup_logging, user_errors
from .config import ConfigError
from .distributed.rendezvous import adopt_slurm_rendezvous
from .distributed.steprecord import note_exit
from .entrypoints import demo, pipelines, tools, train


def _collect_once_at_exit() -> None:
    """One garbage collection, then none while the interpreter shuts down.

    A process that has imported torch, transformers, datasets and DeepSpeed holds about 500,000 objects the
    garbage collector tracks, and Python's shutdown traverses them all several times over as it empties the
    modules: 1.9-2.0 s of a training rank's exit on 2 CPU cores (0.25 s a traversal), every rank of every run,
    and the launcher waits for its ranks to end.  This collects once, as the program ends (every cycle that is
    garbage now, open files among them, is finalized as before), then freezes the survivors (``gc.freeze``):
    the shutdown's own collections skip them, 0.2 s instead of 2.0 s.  Registered when the CLI is imported;
    atexit runs it after the handlers registered later (those of the libraries the command loaded) and before
    the earlier ones (``logging.shutdown``), which run as they did."""
    gc.collect()
    gc.freeze()


atexit.register(_collect_once_at_exit)

# train, plan, submit, sweep, options; tiny-model, import-gguf, lora-merge, serve-reward, status, report; demo;
# generate, score, eval, iterative-dpo, best-of-n, make-pairs, csft-data
SUBCOMMANDS = [*train.SUBCOMMANDS, *tools.SUBCOMMANDS, *demo.SUBCOMMANDS, *pipelines.SUBCOMMANDS]


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every subcommand; the arguments of ``command`` only (of all when None): adding a subcommand's
    arguments may import what it runs."""
    p = argparse.ArgumentParser(prog="hpc-rlhf", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    for c in SUBCOMMANDS:
        parser = sub.add_parser(c.name, help=c.help)
        if command is None or c.name == command:
            c.add_args(parser)
        parser.set_defaults(func=c.run, takes_rest=c.takes_rest, light=c.light)
    return p


def main(argv: list[str] | None = None) -> int:
    """The command's exit code; inside a step of `hpc-rlhf steps` also noted for it (distributed/steprecord.py)."""
    try:
        code = _main(argv)
    except BaseException as e:  # argparse's usage errors (SystemExit) among them
        note_exit(exit_code(e))
        raise
    note_exit(code)
    return code


def _main(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    adopt_slurm_rendezvous()  # inside an srun step: RANK, WORLD_SIZE, MASTER_ADDR/PORT from SLURM
    setup_logging()
    parser = build_parser(next((a for a in argv if not a.startswith("-")), ""))
    args, rest = parser.parse_known_args(argv)
    if rest and not args.takes_rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        if not args.light:
            train.load_runtime()
        return args.func(args, rest)
    except ConfigError as e:
        print(f"hpc-rlhf: config error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        if not isinstance(e, user_errors()):
            raise
        print(f"hpc-rlhf: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
