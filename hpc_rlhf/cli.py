"""`hpc-rlhf <command>`: one entry point for training, tools and the demo."""
from __future__ import annotations

import argparse
import logging
import os
import sys

from .config import ConfigError, load_config
from .data.rows import DataError
from .models.loading import HubOfflineError

TRAINERS = {"sft": ("hpc_rlhf.config.sft:SFTConfig", "hpc_rlhf.trainers.offline:run_sft"),
            "rl": ("hpc_rlhf.config.rl:RLConfig", "hpc_rlhf.trainers.rl:run_rl"),
            "rm": ("hpc_rlhf.config.preference:RMConfig", "hpc_rlhf.trainers.offline:run_offline"),
            "dpo": ("hpc_rlhf.config.preference:DPOConfig", "hpc_rlhf.trainers.offline:run_offline"),
            "kto": ("hpc_rlhf.config.preference:KTOConfig", "hpc_rlhf.trainers.offline:run_offline"),
            "simpo": ("hpc_rlhf.config.preference:SimPOConfig", "hpc_rlhf.trainers.offline:run_offline"),
            "orpo": ("hpc_rlhf.config.preference:ORPOConfig", "hpc_rlhf.trainers.offline:run_offline"),
            "prm": ("hpc_rlhf.config.preference:PRMConfig", "hpc_rlhf.trainers.offline:run_offline"),
            "kd": ("hpc_rlhf.config.preference:KDConfig", "hpc_rlhf.trainers.offline:run_offline")}
# Trainers whose rank count follows from their placement plan rather than launch.nproc.
PLANNED = {"rl": "hpc_rlhf.trainers.rl:plan_from_config"}


def _import(spec: str):
    import importlib
    module, name = spec.split(":")
    return getattr(importlib.import_module(module), name)


def setup_logging() -> None:
    rank = os.environ.get("RANK", "0")
    level = logging.INFO if rank == "0" else logging.WARNING
    logging.basicConfig(level=level, stream=sys.stderr,
                        format=f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    for noisy in ("DeepSpeed", "deepspeed", "torch.distributed", "datasets", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def load_trainer_config(trainer: str, config_path: str | None, overrides: list[str]):
    """The trainer's config and, for trainers that have one, its placement plan (else None)."""
    config_cls, _ = TRAINERS[trainer]
    cfg = load_config(_import(config_cls), config_path, overrides)
    plan = _import(PLANNED[trainer])(cfg) if trainer in PLANNED else None
    return cfg, plan


def run_trainer(trainer: str, config_path: str | None, overrides: list[str]) -> dict:
    """One rank's whole run.  A run stopped by a signal (preemption, time limit) has written its
    checkpoint (and its leader has requeued the SLURM job when asked to): every rank exits with code 3."""
    from .launch.preemption import EXIT_STOPPED, RunStopped
    cfg, _ = load_trainer_config(trainer, config_path, overrides)
    try:
        return _import(TRAINERS[trainer][1])(cfg)
    except RunStopped:  # logged where the ranks agreed to stop
        raise SystemExit(EXIT_STOPPED) from None


def cmd_train(args: argparse.Namespace, rest: list[str]) -> int:
    from .launch.local import already_launched, launch_local
    cfg, plan = load_trainer_config(args.trainer, args.config, rest)
    nproc, describe = cfg.launch.nproc, None
    if plan is not None:
        nproc, describe = plan.world_size, lambda r: "roles " + "+".join(plan.roles_of(r))
    if nproc > 1 and not already_launched():
        return launch_local(["train", args.trainer, *(["--config", args.config] if args.config else []), *rest],
                            nproc, describe=describe)
    run_trainer(args.trainer, args.config, rest)
    return 0


def cmd_plan(args: argparse.Namespace, rest: list[str]) -> int:
    from .launch.plan import run_plan
    cfg, plan = load_trainer_config(args.trainer, args.config, rest)
    return run_plan(args.trainer, cfg, plan, args.config, rest, args.script_only)


def cmd_submit(args: argparse.Namespace, rest: list[str]) -> int:
    from .launch.submit import submit
    job = submit(args.trainer, args.config, rest, folder=args.folder)
    print(f"submitted SLURM job {job.job_id} (submitit folder {job.paths.folder})")
    if args.wait:
        results = job.results()
        print(f"job {job.job_id} finished: {results[0]}")
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

    for name, func, what in (("plan", cmd_plan, "print the placement, memory per role and sbatch script; "
                                                 "submits nothing"),
                             ("submit", cmd_submit, "submit the job to SLURM through submitit")):
        c = sub.add_parser(name, help=f"{what}: hpc-rlhf {name} rl --config FILE [key=value ...]")
        c.add_argument("trainer", choices=sorted(TRAINERS))
        c.add_argument("--config", help="YAML config file (its `slurm` section sets resources); key=value overrides")
        if name == "plan":
            c.add_argument("--script-only", action="store_true", help="print only the sbatch script")
        if name == "submit":
            c.add_argument("--folder", help="submitit folder (default: slurm.log_dir/submitit)")
            c.add_argument("--wait", action="store_true", help="wait for the job and print rank 0's final metrics")
        c.set_defaults(func=func, takes_rest=True)

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

    from .pipelines.cli import add_subcommands as pipeline_commands
    pipeline_commands(sub)  # generate, score, iterative-dpo, best-of-n, make-pairs, csft-data
    return p


def main(argv: list[str] | None = None) -> int:
    from .launch.slurm_env import adopt_slurm_rendezvous
    adopt_slurm_rendezvous()  # inside an srun step: RANK, WORLD_SIZE, MASTER_ADDR/PORT from SLURM
    from .engines.deepspeed_strategy import configure_deepspeed_env
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
    except (DataError, HubOfflineError, FileNotFoundError) as e:
        print(f"hpc-rlhf: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
