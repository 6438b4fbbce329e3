"""The command table: every config-driven command of `hpc-rlhf`, read by the CLI (its subcommands), the
option reference (docs/options.md) and the SLURM submission (`launch/submit.py`).

A command names its config class and its run function as "module:attribute" strings, imported when the
command runs: reading the table imports no trainer.  Adding a trainer or a pipeline is one row here.
"""
from __future__ import annotations

import importlib
import logging
import os
import sys
from dataclasses import dataclass

from pathlib import Path

from .checkpoint.existing import choose
from .config import ConfigError, dump_yaml, reference
from .config import load_config as parse_config
from .config.base import leaf_values
from .data.locate import check_source
from .distributed.preemption import EXIT_STOPPED, RunStopped
from .distributed import scratch
from .distributed.rendezvous import restarted
from .logging import wandb_sink
from .models.paths import resolve_pretrained, resolve_tokenizer, tokenizers_differ
from .rewards.builtins import check_reward_source

log = logging.getLogger(__name__)

TRAIN = "train "  # the trainers' commands: `hpc-rlhf train NAME`, also planned and submitted to SLURM


@dataclass(frozen=True)
class Command:
    config: str  # the config class, "module:Class"
    run: str  # the run function, "module:function": takes the config, returns the run's summary
    plan: str | None = None  # "module:function" of the placement plan: ranks come from it, not launch.nproc
    driver: bool = False  # one process that starts its stages itself; yields one summary row per stage
    prints_summary: bool = False  # the main rank prints the run's summary as one JSON line
    help: str = ""


_OFFLINE = "hpc_rlhf.trainers.offline:run_offline"
COMMANDS: dict[str, Command] = {
    "train sft": Command("hpc_rlhf.config.sft:SFTConfig", "hpc_rlhf.trainers.offline:run_sft"),
    "train rl": Command("hpc_rlhf.config.rl:RLConfig", "hpc_rlhf.trainers.rl:run_rl",
                        plan="hpc_rlhf.trainers.placement:plan_from_config"),
    "train rm": Command("hpc_rlhf.config.preference:RMConfig", _OFFLINE),
    "train dpo": Command("hpc_rlhf.config.preference:DPOConfig", _OFFLINE),
    "train kto": Command("hpc_rlhf.config.preference:KTOConfig", _OFFLINE),
    "train simpo": Command("hpc_rlhf.config.preference:SimPOConfig", _OFFLINE),
    "train orpo": Command("hpc_rlhf.config.preference:ORPOConfig", _OFFLINE),
    "train prm": Command("hpc_rlhf.config.preference:PRMConfig", _OFFLINE),
    "train kd": Command("hpc_rlhf.config.preference:KDConfig", _OFFLINE),
    # the pipelines (docs/pipelines.md)
    "generate": Command("hpc_rlhf.config.pipelines:GenerateConfig", "hpc_rlhf.pipelines.generate:run_generate",
                        prints_summary=True,
                        help="sample responses for a prompt set into a jsonl file (sharded over ranks)"),
    "score": Command("hpc_rlhf.config.pipelines:ScoreConfig", "hpc_rlhf.pipelines.score:run_score",
                     prints_summary=True,
                     help="add reward-model scores to the rows of a jsonl file (sharded over ranks)"),
    "eval": Command("hpc_rlhf.config.evaluation:EvalRunConfig", "hpc_rlhf.trainers.rl:run_eval",
                    plan="hpc_rlhf.trainers.placement:eval_plan", prints_summary=True,
                    help="n samples per prompt scored by a reward or verifier: pass@k, avg@n, maj@k "
                         "(docs/eval.md)"),
    "iterative-dpo": Command("hpc_rlhf.config.pipelines:IterativeDPOConfig",
                             "hpc_rlhf.pipelines.iterative_dpo:run_iterative_dpo", driver=True,
                             help="rounds of generate -> score -> best/worst pairs -> train dpo"),
}


def trainers() -> list[str]:
    """The NAMEs of `hpc-rlhf train NAME`, sorted."""
    return sorted(name[len(TRAIN):] for name in COMMANDS if name.startswith(TRAIN))


def resolve(spec: str):
    """The attribute a "module:attribute" string names, its module imported."""
    module, attr = spec.split(":")
    return getattr(importlib.import_module(module), attr)


def load_config(name: str, config_path: str | None, overrides: list[str]):
    """The config of command ``name`` from its YAML file and key=value overrides (ConfigError when invalid)."""
    return parse_config(resolve(COMMANDS[name].config), config_path, overrides)


def placement_plan(name: str, cfg):
    """The placement plan of a command whose ranks come from one (train rl), else None."""
    plan = COMMANDS[name].plan
    return resolve(plan)(cfg) if plan else None


def _check_file(path: str) -> None:
    if not Path(path).expanduser().is_file():
        raise FileNotFoundError(f"{path} is not a file" if Path(path).expanduser().exists()
                                else f"file {path} does not exist")


def _check_agent(path: str) -> None:
    """The environment file imports and defines an environment (the agents package loads torch: only a run that names
    an environment imports it here)."""
    resolve("hpc_rlhf.agents.contract:load_agent")(path)


_CHECKS = {"model": resolve_pretrained, "tokenizer": resolve_tokenizer, "file": _check_file, "data": check_source,
           "reward": check_reward_source, "agent": _check_agent}
# the errors that mean bad input: one line and exit 2, never a traceback (hpc_rlhf/cli.py)
USER_ERRORS = ("hpc_rlhf.config.base:ConfigError", "hpc_rlhf.data.rows:DataError",
               "hpc_rlhf.models.paths:HubOfflineError", "hpc_rlhf.rewards.errors:RewardError",
               "hpc_rlhf.agents.contract:AgentFileError", "hpc_rlhf.agents.executor:AgentError",
               "hpc_rlhf.checkpoint.layout:CheckpointError", "hpc_rlhf.models.gguf:GGUFImportError",
               "hpc_rlhf.distributed.scratch:ScratchError")


def user_errors() -> tuple[type[Exception], ...]:
    """FileNotFoundError and the classes of USER_ERRORS whose modules are loaded (a module not loaded raised none)."""
    loaded = [spec.split(":") for spec in USER_ERRORS]
    return (FileNotFoundError, *(getattr(sys.modules[m], name) for m, name in loaded if m in sys.modules))


def exit_code(error: BaseException) -> int:
    """The exit code of a rank ending on ``error``: SystemExit's own, 2 for a config or user error, else 1."""
    if isinstance(error, SystemExit):  # as Python exits: None is 0, a message 1
        return 0 if error.code is None else error.code if isinstance(error.code, int) else 1
    return 2 if isinstance(error, (ConfigError, *user_errors())) else 1


def check_inputs(cfg) -> None:
    """ConfigError naming the option when a model, file or data source the run reads cannot be found (a missing
    local path, or a hub name while offline), or when a model's tokenizer is not the one its option must share
    (``same_tokenizer_as``; two local folders compared): a few file-system lookups, before any rank loads anything."""
    leaves = leaf_values(cfg)
    for key, f, value in leaves:
        check = _CHECKS.get(f.metadata.get("path"))
        if check is None or value is None:
            continue
        for item in value if isinstance(value, list) else [value]:
            try:
                check(item)
            except user_errors() as e:
                raise ConfigError(f"{key}: {e}") from None
    values = {key: value for key, _, value in leaves}
    for key, f, value in leaves:
        other = f.metadata.get("same_tokenizer_as")
        if other and value is not None and tokenizers_differ(value, values[other]):
            raise ConfigError(f"{key}: the tokenizer of {value} is not the one of {other} {values[other]} (their "
                              f"vocabularies or token ids differ); the two models must score the same token ids")


def node_environment(cfg) -> None:
    """This process's caches and offline flags on a cluster node (``distributed/scratch.py``), set before it loads
    torch or a library that reads them: the caches with ``launch.node_local_caches``, the offline flags with
    ``slurm.hf_offline`` (on for commands without a ``slurm`` section).  ScratchError for a folder that cannot be
    used."""
    slurm = getattr(cfg, "slurm", None)
    added = scratch.prepare(cfg.launch.node_local_caches, slurm is None or slurm.hf_offline)
    if added:
        log.info("node environment: %s", " ".join(f"{k}={v}" for k, v in added.items()))


def preflight(name: str, cfg) -> None:
    """The checks of a run before any rank starts: the inputs its config names exist, and a trainer's ckpt_path
    holds no checkpoints it must neither resume nor overwrite (CheckpointError).  Seconds, no model loaded."""
    check_inputs(cfg)
    if getattr(getattr(cfg, "log", None), "use_wandb", False) and (missing := wandb_sink.check_installed()):
        raise ConfigError(missing)
    if name.startswith(TRAIN):
        choose(cfg.ckpt, dump_yaml(cfg), restarted(), report=False)


def run(name: str, cfg):
    """One rank's whole run of command ``name``; returns its summary.  A run stopped by a signal
    (preemption, time limit) has written its checkpoint (and its leader has requeued the SLURM job
    when asked to): every rank exits with code EXIT_STOPPED."""
    try:
        return resolve(COMMANDS[name].run)(cfg)
    except RunStopped:  # logged where the ranks agreed to stop
        raise SystemExit(EXIT_STOPPED) from None


def option_reference() -> str:
    """docs/options.md: the option table of every command's config class, in table order."""
    return reference.render({name: resolve(c.config) for name, c in COMMANDS.items()})


def setup_logging() -> None:
    rank = os.environ.get("RANK", "0")
    level = logging.INFO if rank == "0" else logging.WARNING
    logging.basicConfig(level=level, stream=sys.stderr,
                        format=f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    for noisy in ("DeepSpeed", "deepspeed", "torch.distributed", "datasets", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
