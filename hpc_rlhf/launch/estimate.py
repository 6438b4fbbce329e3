"""`hpc-rlhf plan` on a GPU model (`plan.gpu`): whether each role fits its GPUs, the seconds of each phase of one
step from a roofline of the GPU (`--estimate`), and the placement with the least estimated step time
(`--auto --gpus N`).  Arithmetic on the model configs and the data sheet: no torch, no weights.

One step: ``prompts`` x ``samples`` sequences of ``prompt_len`` + ``response_len`` tokens (the workload's means).
- generation: each vLLM engine (``tp`` GPUs) holds the weights / tp and, in the rest of ``gpu_util`` of each GPU,
  the key/value cache; it runs as many of its sequences at once as the cache holds at full length, in waves.  A
  prefill is compute-bound (2 N tokens FLOPs at the training efficiency); a decode step reads the weights and the
  cache of the running sequences (at the mean context, prompt + half the response) at the HBM bandwidth, or does
  2 N FLOPs per sequence at the matmul peak, whichever is slower, plus a fixed time per layer and, with tensor
  parallelism, two all-reduces of the hidden states per layer over NVLink.
- weight sync: the actor's weights over the link between the actor's first GPU and the engines (NVLink when the
  whole job fits one node, else the network), after the ZeRO-3 gather on the actor's GPUs.
- logits and reward: a forward pass (2 N FLOPs per token) of every sequence by the actor (old log-probs), the
  critic (values), the reference and the reward model, each on its GPUs; roles on the same GPUs add up, the
  others overlap.  Under ZeRO-3 every micro-batch gathers the weights over the role's link.
- training: 6 N FLOPs per token (8 N with gradient checkpointing: the forward again), ZeRO-3 gathers (forward and
  backward, and the recomputation), and per optimizer step the gradients' reduce-scatter and, with Adam offloaded,
  the gradients to the CPU and the weights back over PCIe; actor and critic overlap.  The CPU Adam step itself is
  not counted.
Efficiency factors (``CALIBRATION``) come from this project's own measurements (benchmarks/plan_calibration.py,
docs/runs/plan/calibration.json), not from any published step time.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from ..config.gpus import GPUS, GpuSpec
from ..models.shape import ModelShape, dtype_bytes, model_shape
from . import memory


@dataclass(frozen=True)
class Calibration:
    matmul: float        # measured matmul FLOP/s over the data sheet's peak
    hbm: float           # measured read bandwidth over the data sheet's
    train: float         # training FLOP/s over the measured matmul peak
    link: float          # weight-sync bytes/s over the copy bandwidth
    layer_step_s: float  # seconds per layer of a decode step beyond the roofline


CALIBRATION = Calibration(matmul=0.768, hbm=0.87, train=0.688, link=0.312, layer_step_s=0.000124)
PHASES = ("generation", "weight sync", "logits and reward", "training")


@dataclass(frozen=True)
class Layout:
    """GPUs per role (one rank per GPU; 0: the role does not run or shares its host's GPUs) and the engines."""
    actor: int
    critic: int
    reference: int
    reward: int
    engines: int
    tp: int
    colocate_actor_ref: bool = False
    colocate_critic_reward: bool = False
    zero_stage: int = 2
    offload: bool = True

    @property
    def gpus(self) -> int:
        return self.actor + self.critic + self.reference + self.reward + self.engines * self.tp

    def groups(self) -> list[tuple[str, tuple[str, ...], int]]:
        """(name, roles, GPUs) of each group of GPUs, in the order the plan lays ranks out."""
        out = [("actor", ("actor", "reference") if self.colocate_actor_ref else ("actor",), self.actor)]
        if self.reference and not self.colocate_actor_ref:
            out.append(("reference", ("reference",), self.reference))
        if self.critic:
            out.append(("critic", ("critic", "reward") if self.colocate_critic_reward else ("critic",), self.critic))
        if self.reward and not self.colocate_critic_reward:
            out.append(("reward", ("reward",), self.reward))
        out.append(("rollout", ("rollout",), self.engines * self.tp))
        return out

    def overrides(self) -> list[str]:
        return [f"placement.actor_num_ranks={self.actor}", f"placement.critic_num_ranks={self.critic or 1}",
                f"placement.ref_num_ranks={self.reference or 1}", f"placement.reward_num_ranks={self.reward or 1}",
                f"placement.rollout_num_ranks={self.engines}", f"rollout.vllm.tensor_parallel_size={self.tp}",
                f"slurm.roles.rollout.gpus_per_task={self.tp}",
                f"placement.colocate_actor_ref={str(self.colocate_actor_ref).lower()}",
                f"placement.colocate_critic_reward={str(self.colocate_critic_reward).lower()}",
                f"train.zero_stage={self.zero_stage}", f"train.adam_offload={str(self.offload).lower()}"]


@dataclass(frozen=True)
class Workload:
    prompts: int
    samples: int
    prompt_len: int      # mean tokens
    response_len: int    # mean tokens
    max_len: int         # prompt_max_len + generate_max_len: the length memory is counted at
    max_response: int    # generate_max_len: the logits of a trained policy
    micro_batch: int
    train_batch: int
    epochs: int
    checkpointing: bool
    dtype: str
    gpu_util: float      # rollout.vllm.gpu_memory_utilization
    engine_batch: int    # rollout.max_batch_size: sequences an engine runs at once at most

    @property
    def sequences(self) -> int:
        return self.prompts * self.samples

    @property
    def tokens(self) -> int:
        return self.sequences * (self.prompt_len + self.response_len)


@dataclass(frozen=True)
class Models:
    actor: ModelShape
    critic: ModelShape | None
    reference: ModelShape | None
    reward: ModelShape | None

    def of(self, role: str) -> ModelShape | None:
        return getattr(self, role)


@dataclass(frozen=True)
class Machine:
    gpu: GpuSpec
    gpus_per_node: int
    network_bytes_per_s: float | None = None

    def link(self, across_nodes: bool) -> float:
        return self.gpu.link_bytes_per_s(across_nodes, self.network_bytes_per_s)


# ----------------------------------------------------------------------------------------------------------- memory

@dataclass(frozen=True)
class Fit:
    group: str
    gpus: int
    per_gpu: int          # bytes at the peak on one GPU
    parts: dict[str, int]
    fits: bool
    note: str = ""


def kv_bytes_per_token(shape: ModelShape, dtype: str) -> int:
    return 2 * shape.layers * shape.kv_heads * shape.head_dim * dtype_bytes(dtype)


def engine_capacity(models: Models, layout: Layout, work: Workload, gpu: GpuSpec) -> int:
    """Tokens of key/value cache one engine holds: its share of ``gpu_util`` of each GPU less the weights and the
    runtime (may be negative: the weights do not fit)."""
    b = dtype_bytes(work.dtype)
    per_gpu = work.gpu_util * gpu.memory_bytes - models.actor.params * b / layout.tp - memory.RUNTIME_BYTES
    return int(layout.tp * per_gpu // kv_bytes_per_token(models.actor, work.dtype))


def _role_parts(role: str, models: Models, layout: Layout, work: Workload, gpus: int) -> dict[str, int]:
    shape = models.of(role)
    if role in ("actor", "critic"):
        return memory.trained(shape, work.dtype, layout.zero_stage, gpus, False, layout.offload, work.micro_batch,
                              work.max_len, work.checkpointing, work.max_response if role == "actor" else 0)
    return memory.frozen(shape, work.dtype, gpus, layout.zero_stage)


def fits(models: Models, layout: Layout, work: Workload, gpu: GpuSpec) -> list[Fit]:
    """Each group of GPUs: its peak bytes on one GPU and whether it fits the GPU's memory."""
    out = []
    for name, roles, gpus in layout.groups():
        if name == "rollout":
            b = dtype_bytes(work.dtype)
            capacity = engine_capacity(models, layout, work, gpu)
            weights = models.actor.params * b // layout.tp
            kv = max(capacity, 0) * kv_bytes_per_token(models.actor, work.dtype) // layout.tp
            ok = capacity >= work.max_len
            note = (f"kv cache {capacity} tokens per engine: {capacity // work.max_len} sequences of "
                    f"{work.max_len} at once" if ok else
                    f"the weights / tp and one sequence of {work.max_len} tokens do not fit in "
                    f"gpu_memory_utilization {work.gpu_util} of the GPU")
            out.append(Fit(name, gpus, int(work.gpu_util * gpu.memory_bytes),
                           {"weights": weights, "kv cache": kv}, ok, note))
            continue
        present = [r for r in roles if models.of(r) is not None]
        parts = [_role_parts(r, models, layout, work, gpus) for r in present]
        per_gpu = memory.rank_total(parts)
        merged = {f"{r} {k}" if len(present) > 1 else k: v for r, p in zip(present, parts) for k, v in p.items()}
        out.append(Fit(name, gpus, per_gpu, merged, per_gpu <= gpu.memory_bytes))
    return out


# ------------------------------------------------------------------------------------------------------------- time

def _link(gpus: int, machine: Machine) -> float:
    """The link among ``gpus`` GPUs: NVLink when they fit one node (a group of a node or less is assumed to get
    one: `slurm.roles.<role>.nodes`), else the network."""
    return machine.link(gpus > machine.gpus_per_node)


def _flops_s(flops: float, gpus: int, machine: Machine, cal: Calibration) -> float:
    return flops / (gpus * machine.gpu.bf16_flops * cal.matmul * cal.train)


def generation_s(models: Models, layout: Layout, work: Workload, machine: Machine, cal: Calibration) -> float:
    gpu, shape, b = machine.gpu, models.actor, dtype_bytes(work.dtype)
    capacity = engine_capacity(models, layout, work, gpu)
    per_engine = -(-work.sequences // layout.engines)
    at_once = min(per_engine, work.engine_batch, capacity // (work.prompt_len + work.response_len))
    if at_once < 1:
        return math.inf
    kv = kv_bytes_per_token(shape, work.dtype)
    prefill = _flops_s(2 * shape.params * per_engine * work.prompt_len, layout.tp, machine, cal)
    decode, left = 0.0, per_engine
    while left > 0:
        rows = min(at_once, left)
        read = (shape.params * b + rows * (work.prompt_len + work.response_len / 2) * kv) / layout.tp
        step = max(read / (gpu.hbm_bytes_per_s * cal.hbm),
                   2 * shape.params * rows / layout.tp / (gpu.bf16_flops * cal.matmul))
        # tensor parallel: two all-reduces of the rows' hidden states a layer (a ring moves 2 (tp - 1) / tp of them)
        reduce = 2 * shape.layers * 2 * (layout.tp - 1) / layout.tp * rows * shape.hidden * b \
            / (machine.link(False) * cal.link)
        decode += work.response_len * (step + reduce + shape.layers * cal.layer_step_s)
        left -= rows
    return prefill + decode


def _gather_s(shape: ModelShape, dtype: str, gpus: int, link: float, cal: Calibration) -> float:
    """One ZeRO-3 all-gather of the weights on ``gpus`` GPUs: each receives the (gpus - 1) / gpus it lacks."""
    return shape.params * dtype_bytes(dtype) * (gpus - 1) / gpus / (link * cal.link) if gpus > 1 else 0.0


def weight_sync_s(models: Models, layout: Layout, work: Workload, machine: Machine, cal: Calibration) -> float:
    gather = _gather_s(models.actor, work.dtype, layout.actor, _link(layout.actor, machine), cal) \
        if layout.zero_stage == 3 else 0.0
    # the actor's first GPU and the engines share a node only when the whole job fits one
    return gather + models.actor.params * dtype_bytes(work.dtype) / (_link(layout.gpus, machine) * cal.link)


def _micro_batches(work: Workload, gpus: int) -> int:
    return -(-work.sequences // (gpus * work.micro_batch))


def logits_s(models: Models, layout: Layout, work: Workload, machine: Machine, cal: Calibration) -> float:
    slowest = 0.0
    for name, roles, gpus in layout.groups():
        if name == "rollout":
            continue
        link, total = _link(gpus, machine), 0.0
        for role in roles:
            shape = models.of(role)
            if shape is None:
                continue
            total += _flops_s(2 * shape.params * work.tokens, gpus, machine, cal)
            if layout.zero_stage == 3:
                total += _micro_batches(work, gpus) * _gather_s(shape, work.dtype, gpus, link, cal)
        slowest = max(slowest, total)
    return slowest


def training_s(models: Models, layout: Layout, work: Workload, machine: Machine, cal: Calibration) -> float:
    slowest = 0.0
    steps = work.epochs * -(-work.sequences // work.train_batch)
    for role, gpus in (("actor", layout.actor), ("critic", layout.critic)):
        shape = models.of(role)
        if shape is None or not gpus:
            continue
        link, b = _link(gpus, machine), dtype_bytes(work.dtype)
        passes = 3 if work.checkpointing else 2  # forward, backward (and the recomputing forward)
        t = _flops_s((passes + 1) * 2 * shape.params * work.tokens * work.epochs, gpus, machine, cal)
        if layout.zero_stage == 3:
            t += passes * work.epochs * _micro_batches(work, gpus) * _gather_s(shape, work.dtype, gpus, link, cal)
        if layout.zero_stage >= 2:
            t += steps * _gather_s(shape, work.dtype, gpus, link, cal)  # the reduce-scatter moves as much
        if layout.offload:
            t += steps * 2 * shape.params * b / gpus / (machine.gpu.pcie_bytes_per_s * cal.link)
        slowest = max(slowest, t)
    return slowest


def estimate(models: Models, layout: Layout, work: Workload, machine: Machine,
             cal: Calibration = CALIBRATION) -> dict[str, float]:
    """Seconds per phase of one step, and their sum (``total``)."""
    out = {"generation": generation_s(models, layout, work, machine, cal),
           "weight sync": weight_sync_s(models, layout, work, machine, cal),
           "logits and reward": logits_s(models, layout, work, machine, cal),
           "training": training_s(models, layout, work, machine, cal)}
    out["total"] = sum(out.values())
    return out


# ------------------------------------------------------------------------------------------------------- the search

def _sizes(n: int) -> list[int]:
    return [k for k in (1, 2, 4, 8, 16, 32, 64) if k <= n]


def candidates(n: int, models: Models, work: Workload, gpus_per_node: int):
    """Every layout of exactly ``n`` GPUs whose role sizes divide the step's prompts (powers of two per role, tensor
    parallel within a node, the reference on the actor's GPUs or its own, the reward model on the critic's or its
    own, ZeRO-2 or 3, Adam offloaded or not)."""
    has = {r: models.of(r) is not None for r in ("critic", "reference", "reward")}
    for actor, critic, ref, reward, tp in itertools.product(
            _sizes(n), _sizes(n) if has["critic"] else [0], [0, *_sizes(n)] if has["reference"] else [0],
            [0, *_sizes(n)] if has["reward"] else [0], [t for t in _sizes(gpus_per_node) if t <= 8]):
        rest = n - actor - critic - ref - reward
        if rest < tp or rest % tp:
            continue
        engines = rest // tp
        if any(work.prompts % k for k in (actor, critic or 1, ref or 1, reward or 1, engines)):
            continue
        if has["reward"] and not reward and not critic:
            continue
        for zero, offload in itertools.product((2, 3), (True, False)):
            yield Layout(actor, critic, ref, reward, engines, tp, colocate_actor_ref=has["reference"] and not ref,
                         colocate_critic_reward=has["reward"] and not reward, zero_stage=zero, offload=offload)


def search(n: int, models: Models, work: Workload, machine: Machine,
           cal: Calibration = CALIBRATION) -> tuple[Layout, dict[str, float]] | None:
    """The layout of ``n`` GPUs that fits with the least estimated step time (None: none fits)."""
    best = None
    for layout in candidates(n, models, work, machine.gpus_per_node):
        if not all(f.fits for f in fits(models, layout, work, machine.gpu)):
            continue
        est = estimate(models, layout, work, machine, cal)
        if best is None or est["total"] < best[1]["total"]:
            best = (layout, est)
    return best


# ------------------------------------------------------------------------------------------------- from the config

def from_config(cfg, plan) -> tuple[Models, Layout, Workload, Machine]:
    """The models, placement, workload and machine of a `train rl` config whose plan.gpu is set."""
    p, r, t, m = cfg.placement, cfg.rollout, cfg.train, cfg.model
    if p.colocate_all:
        raise ValueError("plan.gpu: the estimate covers roles on GPUs of their own or colocate_actor_ref / "
                         "colocate_critic_reward, not placement.colocate_all")
    actor = model_shape(m.pretrain)

    def shape(path):
        return actor if path == m.pretrain else model_shape(path)
    models = Models(actor=actor,
                    critic=shape(cfg.critic_pretrain or cfg.reward.reward_pretrain or m.pretrain)
                    if plan.has("critic") else None,
                    reference=shape(cfg.reference_pretrain()) if plan.has("reference") else None,
                    reward=shape(cfg.reward.reward_pretrain) if plan.has("reward") and cfg.reward.reward_pretrain
                    else None)
    tp = r.vllm.tensor_parallel_size
    layout = Layout(actor=p.actor_num_ranks, critic=p.critic_num_ranks if plan.has("critic") else 0,
                    reference=p.ref_num_ranks if plan.has("reference") and not p.colocate_actor_ref else 0,
                    reward=p.reward_num_ranks if models.reward and not p.colocate_critic_reward else 0,
                    engines=p.rollout_num_ranks, tp=tp, colocate_actor_ref=p.colocate_actor_ref,
                    colocate_critic_reward=p.colocate_critic_reward, zero_stage=t.zero_stage,
                    offload=t.adam_offload)
    work = Workload(prompts=r.rollout_batch_size, samples=r.n_samples_per_prompt,
                    prompt_len=cfg.plan.prompt_len or cfg.data.prompt_max_len,
                    response_len=cfg.plan.response_len or r.generate_max_len, max_len=cfg.sequence_len(),
                    max_response=r.generate_max_len, micro_batch=t.micro_train_batch_size,
                    train_batch=t.train_batch_size, epochs=t.max_epochs, checkpointing=m.gradient_checkpointing,
                    dtype=m.param_dtype, gpu_util=r.vllm.gpu_memory_utilization, engine_batch=r.max_batch_size)
    net = cfg.plan.network_gb_per_s
    machine = Machine(GPUS[cfg.plan.gpu], cfg.plan.gpus_per_node, net * 1e9 if net else None)
    return models, layout, work, machine


def describe_fits(fit: list[Fit], gpu: GpuSpec) -> list[str]:
    lines = [f"memory per GPU on {gpu.name} ({memory.gib(gpu.memory_bytes)}):"]
    for f in fit:
        verdict = "fits" if f.fits else "DOES NOT FIT"
        detail = ", ".join(f"{k} {memory.gib(v)}" for k, v in f.parts.items())
        lines.append(f"  {f.group:<10} {f.gpus:>3} GPUs  {memory.gib(f.per_gpu):>10}  {verdict}  ({detail})"
                     + (f"; {f.note}" if f.note else ""))
    return lines


def describe_estimate(est: dict[str, float], work: Workload) -> list[str]:
    lines = [f"step time estimate ({work.prompts} prompts x {work.samples} samples per prompt, {work.prompt_len} "
             f"prompt and {work.response_len} response tokens on average; docs/hpc.md#planning-a-large-run):"]
    lines += [f"  {k:<18} {v:9.1f} s" for k, v in est.items()]
    return lines


def describe_auto(n: int, models: Models, seed: Layout, work: Workload, machine: Machine) -> list[str]:
    """The config's placement next to the one ``search`` chooses on ``n`` GPUs, with their estimates."""
    chosen = search(n, models, work, machine)
    seed_est = estimate(models, seed, work, machine) if seed.gpus == n else None
    lines = [f"placement from throughput on {n} x {machine.gpu.name} (config's placement | chosen):"]
    if chosen is None:
        return lines + [f"  no placement of {n} GPUs fits"]
    layout, est = chosen
    rows = [("GPUs", seed.gpus, layout.gpus), ("actor", seed.actor, layout.actor),
            ("critic", seed.critic, layout.critic),
            ("reference", "on actor" if seed.colocate_actor_ref else seed.reference,
             "on actor" if layout.colocate_actor_ref else layout.reference),
            ("reward", "on critic" if seed.colocate_critic_reward else seed.reward,
             "on critic" if layout.colocate_critic_reward else layout.reward),
            ("vLLM engines x TP", f"{seed.engines} x {seed.tp}", f"{layout.engines} x {layout.tp}"),
            ("ZeRO stage", seed.zero_stage, layout.zero_stage), ("Adam offload", seed.offload, layout.offload)]
    rows += [(f"{k} s", f"{seed_est[k]:.1f}" if seed_est else "-", f"{v:.1f}") for k, v in est.items()]
    if not all(f.fits for f in fits(models, seed, work, machine.gpu)):
        rows.append(("config's fits", "no", "yes"))
    lines += [f"  {name:<22} {str(a):>12} | {b}" for name, a, b in rows]
    lines.append("  overrides for the chosen one: " + " ".join(layout.overrides()))
    return lines
