"""`hpc-rlhf train|plan|submit|sweep TRAINER` and `hpc-rlhf options`: the trainers of the command table."""
from __future__ import annotations

import argparse
import json
import sys

from .. import commands
from ..checkpoint.layout import CheckpointError
from ..config import ConfigError, reference
from ..distributed.env import read_env
from . import Subcommand


def load_runtime(rank: bool = False) -> None:
    """torch, and DeepSpeed's environment set before anything imports it (it prints to stdout when it guesses the
    accelerator).  A training ``rank`` loads torch with the OpenMP wait policy chosen for it (distributed/openmp.py);
    other commands keep libgomp's default."""
    from ..distributed.openmp import load_torch
    if rank:
        load_torch()  # first: the module below imports torch
    from ..engines.deepspeed_strategy import configure_deepspeed_env
    configure_deepspeed_env()


def launch_or_run(name: str, config_path: str | None, rest: list[str]) -> int:
    """Command ``name`` on N local ranks when it needs several and no launcher started us; otherwise this
    process is one rank and runs it (the main rank prints the summary of a command that prints one).

    In a SLURM job the node's caches and the offline flags are set first (``commands.node_environment``: a folder
    that cannot be used stops every rank that finds it, with one line).  The config, the paths it names and the
    checkpoints in its ckpt_path are checked next, in the launching process before it starts any rank, and on every
    rank (under srun there is no launching process); only the main rank reports a problem.  A trainer whose
    ckpt_path holds checkpoints it must neither resume nor overwrite stops here (exit 2), before any model is
    loaded."""
    try:
        cfg = commands.load_config(name, config_path, rest)
        commands.node_environment(cfg)  # before torch and the libraries that read it, and before the checks
        commands.preflight(name, cfg)
        plan = commands.placement_plan(name, cfg)
    except (ConfigError, CheckpointError):
        if not read_env().is_main:
            raise SystemExit(2) from None  # the main rank prints the same message
        raise
    load_runtime(rank=name.startswith(commands.TRAIN))
    from ..launch.local import already_launched, launch_local
    nproc, describe = cfg.launch.nproc, None
    if plan is not None:
        nproc, describe = plan.world_size, lambda r: "roles " + "+".join(plan.roles_of(r))
    if nproc > 1 and not already_launched():
        return launch_local([*name.split(), *(["--config", config_path] if config_path else []), *rest],
                            nproc, describe=describe)
    summary = commands.run(name, cfg)
    if commands.COMMANDS[name].prints_summary and read_env().is_main:
        print(json.dumps(summary))
    return 0


def cmd_train(args: argparse.Namespace, rest: list[str]) -> int:
    return launch_or_run(commands.TRAIN + args.trainer, args.config, rest)


def cmd_plan(args: argparse.Namespace, rest: list[str]) -> int:
    from ..launch.plan import run_plan
    name = commands.TRAIN + args.trainer
    cfg = commands.load_config(name, args.config, rest)
    return run_plan(args.trainer, cfg, commands.placement_plan(name, cfg), args.config, rest, args.script_only,
                    args.estimate, args.auto, args.gpus)


def cmd_submit(args: argparse.Namespace, rest: list[str]) -> int:
    from ..launch.submit import submit
    job = submit(args.trainer, args.config, rest, folder=args.folder)
    print(f"submitted SLURM job {job.job_id} (submitit folder {job.paths.folder})")
    if args.wait:
        results = job.results()
        print(f"job {job.job_id} finished: {results[0]}")
    return 0


def cmd_sweep(args: argparse.Namespace, rest: list[str]) -> int:
    """Check the whole sweep, then write it and submit one job array (or run it here with --local)."""
    from ..launch.sweep import SweepError, describe, plan_sweep, run_local, submit_array, write_sweep
    if "=" in args.trainer or args.trainer.startswith("-"):  # no TRAINER given: an override took its place
        rest, args.trainer = [args.trainer, *rest], "rl"
    if args.trainer not in commands.trainers():
        print(f"hpc-rlhf sweep: TRAINER {args.trainer!r} is not one of {', '.join(commands.trainers())}",
              file=sys.stderr)
        return 2
    try:
        planned = plan_sweep(args.trainer, args.config, rest, args.grid or [], args.seeds, args.out,
                             args.max_parallel, args.local)
    except SweepError as e:
        print(f"hpc-rlhf sweep: {e}", file=sys.stderr)
        return 2
    print(describe(planned), flush=True)
    if args.dry_run:
        if planned.script is not None:
            print("\njob array script (written as SWEEP_DIR/sweep.sbatch without --dry-run):\n")
            print(planned.script, end="")
        return 0
    write_sweep(planned)
    if args.local:
        code = run_local(planned)
    else:
        try:
            job = submit_array(planned)
        except SweepError as e:
            print(f"hpc-rlhf sweep: {e}", file=sys.stderr)
            return 2
        print(f"submitted SLURM job array {job} ({len(planned.runs)} elements, script "
              f"{planned.sweep_dir / 'sweep.sbatch'})")
        code = 0
    print(f"compare the runs: hpc-rlhf report {planned.sweep_dir} --out {planned.sweep_dir / 'report'}")
    return code


def cmd_options(args: argparse.Namespace, rest: list[str]) -> int:
    text = commands.option_reference()
    print(reference.write(text) if args.write else text)
    return 0


def add_train_args(t: argparse.ArgumentParser) -> None:
    t.add_argument("trainer", choices=commands.trainers())
    t.add_argument("--config", help="YAML config file; key=value or --key value arguments override it")


def _add_job_args(c: argparse.ArgumentParser) -> None:
    c.add_argument("trainer", choices=commands.trainers())
    c.add_argument("--config", help="YAML config file (its `slurm` section sets resources); key=value overrides")


def add_plan_args(c: argparse.ArgumentParser) -> None:
    _add_job_args(c)
    c.add_argument("--script-only", action="store_true", help="print only the sbatch script")
    c.add_argument("--estimate", action="store_true", help="on plan.gpu: also print the seconds of each phase of "
                                                           "one step (docs/hpc.md#planning-a-large-run)")
    c.add_argument("--auto", action="store_true", help="on plan.gpu: also print the placement of --gpus GPUs with "
                                                       "the least estimated step time next to the config's")
    c.add_argument("--gpus", type=int, metavar="N", help="GPUs --auto places (default: the config's placement's)")


def add_submit_args(c: argparse.ArgumentParser) -> None:
    _add_job_args(c)
    c.add_argument("--folder", help="submitit folder (default: slurm.log_dir/submitit)")
    c.add_argument("--wait", action="store_true", help="wait for the job and print rank 0's final metrics")


def add_sweep_args(w: argparse.ArgumentParser) -> None:
    w.add_argument("trainer", nargs="?", default="rl", metavar="TRAINER",
                   help=f"the trainer, one of {', '.join(commands.trainers())} (default rl)")
    w.add_argument("--config", help="the base YAML config; key=value arguments override it for every run")
    w.add_argument("--grid", action="append", metavar="KEY=V1,V2,...",
                   help="an option and its values (repeatable: the runs are every combination)")
    w.add_argument("--seeds", metavar="N|A,B,...",
                   help="N seeds from the config's train.seed up, or a list; every point runs with each")
    w.add_argument("--out", metavar="SWEEP_DIR", help="the sweep folder (default sweeps/CONFIG-DATE-TIME)")
    w.add_argument("--max-parallel", type=int, metavar="K", help="at most K runs at once (sbatch --array=...%%K)")
    w.add_argument("--local", action="store_true", help="no SLURM: run the runs here, one after the other")
    w.add_argument("--dry-run", action="store_true", help="check and print the runs and the script; write nothing")


def cmd_steps(args: argparse.Namespace, rest: list[str]) -> int:
    from ..launch.steps import main
    return main(args, rest)


def add_steps_args(s: argparse.ArgumentParser) -> None:
    from ..launch.steps import add_args
    add_args(s)


def add_options_args(o: argparse.ArgumentParser) -> None:
    o.add_argument("--write", action="store_true", help="rewrite docs/options.md")


SUBCOMMANDS = [
    Subcommand("train", "train a model: hpc-rlhf train sft --config FILE [key=value ...]", add_train_args, cmd_train,
               takes_rest=True, light=True),
    Subcommand("plan", "print the placement, memory per role and sbatch script; submits nothing: hpc-rlhf plan rl "
                       "--config FILE [key=value ...]", add_plan_args, cmd_plan, takes_rest=True, light=True),
    Subcommand("submit", "submit the job to SLURM through submitit: hpc-rlhf submit rl --config FILE [key=value ...]",
               add_submit_args, cmd_submit, takes_rest=True),
    Subcommand("sweep", "a grid of overrides x seeds as one SLURM job array (or --local, one run after the other): "
                        "hpc-rlhf sweep rl --config FILE --grid KEY=V1,V2 ...", add_sweep_args, cmd_sweep,
               takes_rest=True, light=True),
    Subcommand("options", "print the option reference (docs/options.md)", add_options_args, cmd_options, light=True),
    Subcommand("steps", "in a SLURM job's script: run its srun step, and again inside the allocation from the last "
                        "checkpoint when it fails: hpc-rlhf steps --log-dir DIR -- srun ...", add_steps_args,
               cmd_steps, takes_rest=True, light=True),
]
