"""`hpc-rlhf <command>`: one entry point for training, tools and the demo."""
from __future__ import annotations

import argparse
import logging
import os
import sys

from .config import ConfigError, load_config
from .data.rows import DataError
from .models.loading import HubOfflineError

TRAINERS = {"sft": ("hpc_rlhf.config.sft:SFTConfig", "hpc_rlhf.trainers.sft:run_sft"),
            "rl": ("hpc_rlhf.config.rl:RLConfig", "hpc_rlhf.trainers.rl:run_rl")}
# Trainers whose rank count follows from their placement plan rather than launch.nproc.
PLANNED = {"rl": "hpc_rlhf.trainers.rl:plan_from_config"}


def _import(spec: str):
    import importlib
    module, name = spec.split(":")
    return getattr(importlib.import_module(module), name)


def setup_logging() -> None:
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))
    level = logging.INFO if rank == "0" else logging.WARNING
    logging.basicConfig(level=level, stream=sys.stderr,
                        format=f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    for noisy in ("DeepSpeed", "deepspeed", "torch.distributed", "datasets", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def cmd_train(args: argparse.Namespace, rest: list[str]) -> int:
    from .launch.local import already_launched, launch_local
    config_cls, runner = TRAINERS[args.trainer]
    cfg = load_config(_import(config_cls), args.config, rest)
    nproc, describe = cfg.launch.nproc, None
    if args.trainer in PLANNED:
        plan = _import(PLANNED[args.trainer])(cfg)
        nproc, describe = plan.world_size, lambda r: "roles " + "+".join(plan.roles_of(r))
    if nproc > 1 and not already_launched():
        return launch_local(["train", args.trainer, *(["--config", args.config] if args.config else []), *rest],
                            nproc, describe=describe)
    _import(runner)(cfg)
    return 0


def cmd_options(args: argparse.Namespace, rest: list[str]) -> int:
    from .config import reference
    if args.write:
        print(reference.write())
    else:
        print(reference.render())
    return 0


def cmd_tiny_model(args: argparse.Namespace, rest: list[str]) -> int:
    from .models import tiny
    tiny.run_cli(args)
    return 0


def cmd_lora_merge(args: argparse.Namespace, rest: list[str]) -> int:
    from .models import lora
    lora.run_cli(args)
    return 0


def cmd_demo(args: argparse.Namespace, rest: list[str]) -> int:
    from .demo.run import run_cli
    return run_cli(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hpc-rlhf", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train a model: hpc-rlhf train sft --config FILE [key=value ...]")
    t.add_argument("trainer", choices=sorted(TRAINERS))
    t.add_argument("--config", help="YAML config file; key=value or --key value arguments override it")
    t.set_defaults(func=cmd_train, takes_rest=True)

    o = sub.add_parser("options", help="print the option reference (docs/options.md)")
    o.add_argument("--write", action="store_true", help="rewrite docs/options.md")
    o.set_defaults(func=cmd_options)

    from .models import lora, tiny
    m = sub.add_parser("tiny-model", help="build a random-weight tiny model and a local tokenizer")
    tiny.add_cli_args(m)
    m.set_defaults(func=cmd_tiny_model)
    lm = sub.add_parser("lora-merge", help="merge a LoRA adapter into its base model")
    lora.add_cli_args(lm)
    lm.set_defaults(func=cmd_lora_merge)

    from .rewards import server as reward_server
    sr = sub.add_parser("serve-reward", help="serve a reward-function file over HTTP (127.0.0.1 by default)")
    reward_server.add_cli_args(sr)
    sr.set_defaults(func=lambda a, r: reward_server.run_cli(a))

    from .demo.run import add_cli_args as demo_args
    d = sub.add_parser("demo", help="the tiny end-to-end job: synthetic addition task, training, held-out accuracy")
    demo_args(d)
    d.set_defaults(func=cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
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
    except (DataError, HubOfflineError, FileNotFoundError) as e:
        print(f"hpc-rlhf: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
