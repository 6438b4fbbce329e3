"""`hpc-rlhf generate|score|iterative-dpo` (the pipelines of the command table) and the data builders
`best-of-n`, `make-pairs`, `csft-data`."""
from __future__ import annotations

import argparse
import json
import sys

from .. import commands
from ..distributed.env import read_env
from ..pipelines import builders
from . import Subcommand
from .train import launch_or_run, load_runtime


def cmd_configured(args: argparse.Namespace, rest: list[str]) -> int:
    return launch_or_run(args.command_name, args.config, rest)


def cmd_driver(args: argparse.Namespace, rest: list[str]) -> int:
    """A driver is one process; it prints one JSON row per stage summary it yields."""
    cfg = commands.load_config(args.command_name, args.config, rest)
    commands.check_inputs(cfg)
    load_runtime()
    from ..pipelines.iterative_dpo import StageFailed
    if read_env().world_size > 1:
        print(f"hpc-rlhf {args.command_name}: run the driver as one process; its stages start "
              "iterative.stage_nproc ranks each", file=sys.stderr)
        return 2
    try:
        for row in commands.run(args.command_name, cfg):
            print(json.dumps(row))
    except StageFailed as e:
        print(f"hpc-rlhf {args.command_name}: {e}", file=sys.stderr)
        return 1
    return 0


def _build(command: str, rows: list[dict], args: argparse.Namespace) -> list[dict]:
    keys = dict(prompt_key=args.prompt_key, response_key=args.response_key, reward_key=args.reward_key)
    if command == "best-of-n":
        return builders.best_of_n(rows, threshold=args.threshold, input_key=args.input_key,
                                  output_key=args.output_key, **keys)
    if command == "make-pairs":
        return builders.best_worst_pairs(rows, min_margin=args.min_margin, **keys)
    return builders.conditional_sft(rows, template=args.template, input_key=args.input_key,
                                    output_key=args.output_key, **keys)


def cmd_build(args: argparse.Namespace, rest: list[str]) -> int:
    from ..pipelines.common import read_jsonl, write_jsonl
    try:
        rows = read_jsonl(args.input)
        out = _build(args.command, rows, args)
    except ValueError as e:
        print(f"hpc-rlhf {args.command}: {args.input}: {e}", file=sys.stderr)
        return 2
    write_jsonl(out, args.output)
    print(json.dumps({"input_rows": len(rows), "output_rows": len(out), "output": args.output}))
    return 0


def _builder_args(name: str):
    def add(c: argparse.ArgumentParser) -> None:
        c.add_argument("--input", required=True, help="scored jsonl (e.g. from hpc-rlhf score)")
        c.add_argument("--output", required=True, help="jsonl file to write")
        c.add_argument("--prompt-key", default="prompt")
        c.add_argument("--response-key", default="response")
        c.add_argument("--reward-key", default="reward")
        if name == "best-of-n":
            c.add_argument("--threshold", type=float, default=None,
                           help="keep a prompt only when its best reward is >= this")
        if name == "make-pairs":
            c.add_argument("--min-margin", type=float, default=0.0,
                           help="keep a pair only when best - worst reward > this")
        if name == "csft-data":
            c.add_argument("--template", default=builders.DEFAULT_SCORE_TEMPLATE,
                           help="prefix template with a {score} field (default %(default)r)")
        if name != "make-pairs":
            c.add_argument("--input-key", default="input", help="SFT prompt column written")
            c.add_argument("--output-key", default="output", help="SFT response column written")

    return add


def _configured_args(c: argparse.ArgumentParser) -> None:
    c.add_argument("--config", help="YAML config file; key=value or --key value arguments override it")


def _configured(name: str, command: commands.Command) -> Subcommand:
    def run(args: argparse.Namespace, rest: list[str]) -> int:
        args.command_name = name
        return (cmd_driver if command.driver else cmd_configured)(args, rest)
    return Subcommand(name, f"{command.help}: hpc-rlhf {name} --config FILE [key=value ...]", _configured_args, run,
                      takes_rest=True, light=True)


SUBCOMMANDS = [
    *(_configured(name, c) for name, c in commands.COMMANDS.items() if not name.startswith(commands.TRAIN)),
    *(Subcommand(name, f"{what} (from a scored jsonl)", _builder_args(name), cmd_build)
      for name, what in (("best-of-n", "rejection sampling: the best response per prompt as SFT rows"),
                         ("make-pairs", "best vs worst response per prompt as DPO pairs"),
                         ("csft-data", "conditional SFT rows: the score as a prefix of the prompt"))),
]
