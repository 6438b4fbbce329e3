"""`hpc-rlhf plan`: the placement, the memory per role and the sbatch script of a job; submits nothing."""
from __future__ import annotations

import sys
from pathlib import Path

from ..distributed.weight_sync import BUCKET_BYTES
from ..generation.factory import choose, vllm_installed
from ..generation.specs import SHARED
from ..models.shape import model_shape
from ..config import ConfigError
from . import estimate, memory
from .job import JobComponent, components, is_hetjob
from .sbatch import python_command, render


def train_command(cfg, trainer: str, config_path: str | None, overrides: list[str]) -> list[str]:
    cmd = [*python_command(cfg.slurm), "-m", "hpc_rlhf.cli", "train", trainer]
    if config_path:
        cmd += ["--config", str(Path(config_path).resolve())]
    return cmd + list(overrides)


def rollout_engine(cfg, plan):
    """The rollout ranks' engine (``EngineSpec``) and why: ``rollout.engine`` for the actor's architecture on the
    rollout component's devices, with vLLM as installed where the plan is made."""
    comps = components(cfg, plan)
    gpus = next(c for c in comps if "rollout" in c.placement.roles).resources.gpus_per_task
    return choose(cfg.rollout.engine, model_shape(cfg.model.pretrain).model_type, bool(gpus),
                  vllm_installed())


def role_memory(cfg, plan) -> dict[str, dict[str, int]]:
    """Bytes per rank of each role (see launch.memory for what is counted)."""
    m, t = cfg.model, cfg.train
    actor = model_shape(m.pretrain)
    lora = m.lora_rank > 0
    if plan is None:  # one role group: the trained model, and a frozen reference or teacher on its ranks
        objective = getattr(cfg, "objective", None)
        logits = 0 if getattr(objective, "score_head", False) else cfg.data.max_len  # a score head has no logits
        out = {"actor": memory.trained(actor, m.param_dtype, t.zero_stage, cfg.launch.nproc, lora, t.adam_offload,
                                       t.micro_train_batch_size, cfg.data.max_len, m.gradient_checkpointing, logits)}
        for attr, role in (("ref_pretrain", "reference"), ("teacher_pretrain", "teacher")):
            if hasattr(objective, attr) and not (role == "reference" and getattr(objective, "ref_precompute", False)):
                path = getattr(objective, attr) or m.pretrain
                out[role] = memory.frozen(actor if path == m.pretrain else model_shape(path), m.param_dtype)
        if getattr(objective, "lmbda", 0) > 0:  # kd's on-policy steps: the student's own engine, with its weights
            r, gpus = cfg.rollout, cfg.slurm.resources.gpus_per_task
            spec = choose(r.engine, actor.model_type, bool(gpus), vllm_installed())[0]
            rows = min(r.max_batch_size, -(-t.train_batch_size // cfg.launch.nproc))
            out["student engine"] = spec.memory(actor, m.param_dtype, rows, cfg.data.max_len,
                                                cpu_kv_cache_gib=r.vllm.cpu_kv_cache_gib, on_cpu=not gpus)
        return out
    seq = cfg.sequence_len()
    out = {}
    for role in ("actor", "critic"):
        if plan.has(role):
            path = m.pretrain if role == "actor" else (cfg.critic_pretrain or cfg.reward.reward_pretrain or m.pretrain)
            shape = actor if path == m.pretrain else model_shape(path)
            # the actor's logits: the response positions (the whole context budget of a multi-turn sample)
            logits = (seq - (0 if cfg.agent.agent_func_path else cfg.data.prompt_max_len)) if role == "actor" else 0
            out[role] = memory.trained(shape, m.param_dtype, t.zero_stage, len(plan.ranks_of(role)),
                                       lora and role == "actor", t.adam_offload, t.micro_train_batch_size, seq,
                                       m.gradient_checkpointing, logits)
    if plan.has("reference"):
        out["reference"] = memory.frozen(model_shape(cfg.reference_pretrain()), m.param_dtype,
                                         len(plan.ranks_of("reference")), t.zero_stage)
    if plan.has("reward"):
        out["reward"] = (memory.frozen(model_shape(cfg.reward.reward_pretrain), m.param_dtype,
                                       len(plan.ranks_of("reward")), t.zero_stage)
                         if cfg.reward.reward_pretrain else {})
    if plan.has("rollout"):
        r = cfg.rollout
        per_rank = -(-r.rollout_batch_size * r.n_samples_per_prompt // len(plan.ranks_of("rollout")))
        comps = components(cfg, plan)
        on_cpu = not next(c for c in comps if "rollout" in c.placement.roles).resources.gpus_per_task
        spec = rollout_engine(cfg, plan)[0]
        out["rollout"] = spec.memory(actor, m.param_dtype, min(per_rank, r.max_batch_size), seq,
                                     cpu_kv_cache_gib=r.vllm.cpu_kv_cache_gib, on_cpu=on_cpu)
        # a weights bridge between CPU components: engines that take shared weights have them in shared memory that
        # the actor leader maps and writes; the others load from two shared-memory slots that both sides map
        actor_comp = next((c for c in comps if "actor" in c.placement.roles), None)
        if actor_comp is not None and "rollout" not in actor_comp.placement.roles \
                and not any(c.resources.gpus_per_task for c in comps):
            if spec.transports[0] == SHARED:
                out["actor"]["weight-sync shared weights"] = memory.shared_weights(actor, m.param_dtype)
            else:
                out["rollout"]["weight-sync slots"] = out["actor"]["weight-sync slots"] = \
                    memory.weight_slots(actor, m.param_dtype, BUCKET_BYTES)
    return out


def rank_memory(cfg, plan, per_role: dict[str, dict[str, int]]) -> list[tuple[JobComponent, int]]:
    """Each component's peak bytes per rank (``memory.rank_total`` of the roles it runs; without a placement plan,
    the one group runs every model the trainer loads)."""
    return [(c, memory.rank_total([per_role.get(role, {}) for role in (c.placement.roles if plan else per_role)]))
            for c in components(cfg, plan)]


def _component_line(c: JobComponent, width: int) -> str:
    r = c.resources
    device = f"{r.gpus_per_task} GPU + {r.cpus_per_task} CPU per task" if r.gpus_per_task else \
        f"{r.cpus_per_task} CPU per task"
    last = c.first_rank + c.ntasks - 1
    where = f"{r.nodes} node(s)" if r.nodes else "nodes chosen by SLURM"
    part = f", partition {r.partition}" if r.partition else ""
    return f"  {c.name:<{width}}  ranks {c.first_rank}-{last} ({c.ntasks} tasks)  {device}, {where}{part}"


def on_gpu(cfg, plan):
    """(models, layout, workload, machine) of a `train rl` config with `plan.gpu` set (launch/estimate.py), None
    without one; OSError or ValueError when its models cannot be read or its placement is not one it covers."""
    if plan is None or getattr(getattr(cfg, "plan", None), "gpu", "none") == "none":
        return None
    return estimate.from_config(cfg, plan)


def gpu_lines(cfg, plan, with_estimate: bool, auto: bool, gpus: int | None) -> list[str]:
    """On `plan.gpu`: whether each role fits, and with ``with_estimate`` the seconds per phase, and with ``auto`` the
    placement of ``gpus`` GPUs (default: the config's) chosen from the estimate (launch/estimate.py)."""
    if gpus is not None and (gpus < 1 or not auto):
        raise ConfigError(f"--gpus {gpus}: give a positive count, with --auto")
    try:
        setup = on_gpu(cfg, plan)
    except (OSError, ValueError) as exc:
        return ["", f"memory per GPU: unknown: {exc}"]
    if setup is None:
        if with_estimate or auto:
            raise ConfigError("--estimate and --auto need a `train rl` config with plan.gpu set (e.g. "
                              "plan.gpu=a800-80g)")
        return []
    models, layout, work, machine = setup
    lines = ["", *estimate.describe_fits(estimate.fits(models, layout, work, machine.gpu), machine.gpu)]
    if with_estimate:
        lines += ["", *estimate.describe_estimate(estimate.estimate(models, layout, work, machine), work)]
    if auto:
        lines += ["", *estimate.describe_auto(gpus or layout.gpus, models, layout, work, machine)]
    return lines


def describe(cfg, trainer: str, plan, config_path: str | None, overrides: list[str], with_estimate: bool = False,
             auto: bool = False, gpus: int | None = None) -> str:
    comps = components(cfg, plan)
    het = is_hetjob(comps, cfg.slurm.hetjob)
    lines = [f"hpc-rlhf plan: train {trainer}, {sum(c.ntasks for c in comps)} ranks, "
             f"{'heterogeneous' if het else 'homogeneous'} job", "", "placement (role group -> ranks, devices):"]
    if not het and len({c.resources for c in comps}) > 1:
        lines.append("  note: slurm.hetjob=never, so every task gets the first group's resources below")
    width = max(len(c.name) for c in comps)
    lines += [_component_line(c, width) for c in comps]
    if plan is not None and plan.has("rollout"):
        try:
            spec, why = rollout_engine(cfg, plan)
            lines += ["", f"rollout engine: {spec.name} ({why})"]
        except (OSError, ValueError) as exc:
            lines += ["", f"rollout engine: unknown: {exc}"]
    lines += ["", "memory per rank (estimate; see hpc_rlhf/launch/memory.py for what is counted):"]
    try:
        per_role = role_memory(cfg, plan)
    except (OSError, ValueError) as exc:  # the model folder may not exist yet (e.g. an SFT still to run)
        per_role = {}
        lines.append(f"  unknown: {exc}")
    for role, parts in per_role.items():
        if not parts:
            lines.append(f"  {role:<10} no model (reward functions / remote reward only)")
            continue
        detail = ", ".join(f"{k} {memory.gib(v)}" for k, v in parts.items())
        lines.append(f"  {role:<10} {memory.gib(sum(v for k, v in parts.items() if 'CPU' not in k)):>10}  ({detail})")
    if per_role:
        lines += ["per rank (its roles' lasting parts, the largest phase of one role: activations, logits or kv "
                  f"cache, and {memory.gib(memory.RUNTIME_BYTES)} runtime):"]
        lines += [f"  {c.name:<{width}}  {memory.gib(total):>10}" for c, total in rank_memory(cfg, plan, per_role)]
    lines += gpu_lines(cfg, plan, with_estimate, auto, gpus)
    lines += ["", "sbatch script (`hpc-rlhf submit` submits this; `hpc-rlhf plan ... --script-only > job.sbatch` "
              "saves it for `sbatch job.sbatch`):", "", job_script(cfg, trainer, plan, config_path, overrides)]
    return "\n".join(lines)


def job_script(cfg, trainer: str, plan, config_path: str | None, overrides: list[str]) -> str:
    log_dir = str(Path(cfg.slurm.log_dir).resolve())
    return render(components(cfg, plan), cfg.slurm, train_command(cfg, trainer, config_path, overrides), log_dir,
                  max_restarts=cfg.launch.max_restarts)


def run_plan(trainer: str, cfg, plan, config_path: str | None, overrides: list[str], script_only: bool,
             with_estimate: bool = False, auto: bool = False, gpus: int | None = None) -> int:
    text = job_script(cfg, trainer, plan, config_path, overrides) if script_only else \
        describe(cfg, trainer, plan, config_path, overrides, with_estimate, auto, gpus)
    sys.stdout.write(text)
    if misfit := too_large(cfg, plan):
        print(f"error: {misfit}", file=sys.stderr)
        return 2
    return 0


def too_large(cfg, plan) -> str | None:
    """One line naming the first group of GPUs the run does not fit on `plan.gpu`, else None."""
    try:
        setup = on_gpu(cfg, plan)
    except (OSError, ValueError):  # said in the plan's memory lines
        return None
    if setup is None:
        return None
    models, layout, work, machine = setup
    for f in estimate.fits(models, layout, work, machine.gpu):
        if not f.fits:
            need = f"needs {memory.gib(f.per_gpu)} per GPU" if f.group != "rollout" else f.note
            return (f"{f.group} on {f.gpus} x {machine.gpu.name} ({memory.gib(machine.gpu.memory_bytes)}): {need}; "
                    f"more GPUs for it, train.adam_offload, train.zero_stage=3 or a smaller "
                    f"train.micro_train_batch_size (memory per GPU above)")
    return None
