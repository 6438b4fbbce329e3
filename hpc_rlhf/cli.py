"""`hpc-rlhf <command>`: one entry point for training, tools and the demo."""
from __future__ import annotations

import argparse
import sys

from .agents import AgentError
from .checkpoint.store import CheckpointError
from .commands import setup_logging
from .config import ConfigError
from .data.rows import DataError
from .distributed.rendezvous import adopt_slurm_rendezvous
from .engines.deepspeed_strategy import configure_deepspeed_env
from .entrypoints import demo, pipelines, tools, train
from .models.gguf import GGUFImportError
from .models.loading import HubOfflineError
from .rewards.types import RewardError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hpc-rlhf", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    train.add_parsers(sub)  # train, plan, submit, options
    tools.add_parsers(sub)  # tiny-model, import-gguf, lora-merge, serve-reward, status, report
    demo.add_parsers(sub)
    pipelines.add_parsers(sub)  # generate, score, iterative-dpo, best-of-n, make-pairs, csft-data
    return p


def main(argv: list[str] | None = None) -> int:
    adopt_slurm_rendezvous()  # inside an srun step: RANK, WORLD_SIZE, MASTER_ADDR/PORT from SLURM
    configure_deepspeed_env()  # before anything imports DeepSpeed (it prints to stdout when it guesses)
    setup_logging()
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest and not getattr(args, "takes_rest", False):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        return args.func(args, rest)
    except ConfigError as e:
        print(f"hpc-rlhf: config error: {e}", file=sys.stderr)
        return 2
    except (DataError, HubOfflineError, FileNotFoundError, RewardError, AgentError, CheckpointError,
            GGUFImportError) as e:
        print(f"hpc-rlhf: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
