"""Subcommands of the pipelines: generate, score, iterative-dpo (config files) and the data builders."""
from __future__ import annotations

import argparse
import json
import sys


def _launch_or_run(command: str, config_cls: str, run: str, args: argparse.Namespace, rest: list[str]) -> int:
    """N local ranks when launch.nproc > 1 and no launcher started us; otherwise this process is a rank."""
    from ..cli import _import
    from ..config import load_config
    from ..launch.local import already_launched, launch_local
    cfg = load_config(_import(config_cls), args.config, rest)
    if cfg.launch.nproc > 1 and not already_launched():
        return launch_local([command, *(["--config", args.config] if args.config else []), *rest], cfg.launch.nproc)
    stats = _import(run)(cfg)
    from ..distributed.env import read_env
    if read_env().is_main:
        print(json.dumps(stats))
    return 0


def cmd_generate(args, rest):
    return _launch_or_run("generate", "hpc_rlhf.config.pipelines:GenerateConfig",
                          "hpc_rlhf.pipelines.generate:run_generate", args, rest)


def cmd_score(args, rest):
    return _launch_or_run("score", "hpc_rlhf.config.pipelines:ScoreConfig", "hpc_rlhf.pipelines.score:run_score",
                          args, rest)


def cmd_iterative_dpo(args, rest):
    from ..config import load_config
    from ..config.pipelines import IterativeDPOConfig
    from ..distributed.env import read_env
    from .iterative_dpo import StageFailed, run_iterative_dpo
    cfg = load_config(IterativeDPOConfig, args.config, rest)
    if read_env().world_size > 1:
        print("hpc-rlhf iterative-dpo: run the driver as one process; its stages start "
              "iterative.stage_nproc ranks each", file=sys.stderr)
        return 2
    try:
        for row in run_iterative_dpo(cfg):
            print(json.dumps(row))
    except StageFailed as e:
        print(f"hpc-rlhf iterative-dpo: {e}", file=sys.stderr)
        return 1
    return 0


def cmd_build(args, rest):
    from . import builders
    from .common import read_jsonl, write_jsonl
    keys = dict(prompt_key=args.prompt_key, response_key=args.response_key, reward_key=args.reward_key)
    try:
        rows = read_jsonl(args.input)
        if args.command == "best-of-n":
            out = builders.best_of_n(rows, threshold=args.threshold, input_key=args.input_key,
                                     output_key=args.output_key, **keys)
        elif args.command == "make-pairs":
            out = builders.best_worst_pairs(rows, min_margin=args.min_margin, **keys)
        else:
            out = builders.conditional_sft(rows, template=args.template, input_key=args.input_key,
                                           output_key=args.output_key, **keys)
    except ValueError as e:
        print(f"hpc-rlhf {args.command}: {args.input}: {e}", file=sys.stderr)
        return 2
    write_jsonl(out, args.output)
    print(json.dumps({"input_rows": len(rows), "output_rows": len(out), "output": args.output}))
    return 0


def add_subcommands(sub) -> None:
    for name, func, what in (
            ("generate", cmd_generate, "sample responses for a prompt set into a jsonl file (sharded over ranks)"),
            ("score", cmd_score, "add reward-model scores to the rows of a jsonl file (sharded over ranks)"),
            ("iterative-dpo", cmd_iterative_dpo, "rounds of generate -> score -> best/worst pairs -> train dpo")):
        c = sub.add_parser(name, help=f"{what}: hpc-rlhf {name} --config FILE [key=value ...]")
        c.add_argument("--config", help="YAML config file; key=value or --key value arguments override it")
        c.set_defaults(func=func, takes_rest=True)

    from .builders import DEFAULT_SCORE_TEMPLATE
    for name, what in (("best-of-n", "rejection sampling: the best response per prompt as SFT rows"),
                       ("make-pairs", "best vs worst response per prompt as DPO pairs"),
                       ("csft-data", "conditional SFT rows: the score as a prefix of the prompt")):
        c = sub.add_parser(name, help=f"{what} (from a scored jsonl)")
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
            c.add_argument("--template", default=DEFAULT_SCORE_TEMPLATE,
                           help="prefix template with a {score} field (default %(default)r)")
        if name != "make-pairs":
            c.add_argument("--input-key", default="input", help="SFT prompt column written")
            c.add_argument("--output-key", default="output", help="SFT response column written")
        c.set_defaults(func=cmd_build)
