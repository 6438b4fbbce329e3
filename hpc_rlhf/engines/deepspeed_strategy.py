"""DeepSpeed training engine: ZeRO 0-3, optimizer offload, bf16/fp32, clipping, lr schedule.

Gradient accumulation is owned by the caller (``managed_gradient_accumulation: false``): every
``backward`` accumulates, ``step`` is the boundary.  Micro-batch counts may then vary from step
to step (token-budget micro-batches), and losses are normalised by the caller
(see ``algorithms.sft_loss.step_token_mean``), so DeepSpeed's own 1/GAS scaling is switched off.
"""
from __future__ import annotations

import logging
import os

import torch

from ..config.sections import OptimizerConfig
from .schedule import make_scheduler

log = logging.getLogger(__name__)


def _common_config(param_dtype: str, world_size: int) -> dict:
    """What every engine's config holds: one sample per micro-batch and no accumulation of DeepSpeed's own (the
    callers batch), bf16 when the parameters are, DeepSpeed's periodic prints off."""
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": world_size,
        "bf16": {"enabled": param_dtype == "bf16"},
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
    }


def ds_config(train: OptimizerConfig, param_dtype: str, world_size: int) -> dict:
    zero: dict = {"stage": train.zero_stage}
    if train.adam_offload and train.zero_stage > 0:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if train.zero_stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    if train.zero_stage in (1, 2, 3):
        zero["overlap_comm"] = False
    return _common_config(param_dtype, world_size) | {
        "managed_gradient_accumulation": False,
        "gradient_clipping": train.max_norm,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
    }


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only; biases and norm weights (1-D) are not decayed."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def make_optimizer(model: torch.nn.Module, train: OptimizerConfig, learning_rate: float) -> torch.optim.Optimizer:
    groups = param_groups(model, train.weight_decay)
    betas = tuple(train.adam_betas)
    if train.adam_offload and train.zero_stage > 0 and torch.cuda.is_available():  # offload needs ZeRO 1-3
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        return DeepSpeedCPUAdam(groups, lr=learning_rate, betas=betas)
    # A torch optimizer avoids compiling DeepSpeed's fused Adam on machines without CUDA.
    return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=True)  # fused: ~2x faster on CPU too


def build_engine(model: torch.nn.Module, train: OptimizerConfig, learning_rate: float, param_dtype: str,
                 total_steps: int, world_size: int):
    """Wrap ``model`` in a DeepSpeed engine with its optimizer and lr schedule."""
    import deepspeed

    optimizer = make_optimizer(model, train, learning_rate)
    scheduler = make_scheduler(optimizer, total_steps, train.lr_warmup_ratio, train.lr_scheduler,
                               train.min_lr_ratio)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                           config=ds_config(train, param_dtype, world_size),
                                           dist_init_required=False)
    if engine.zero_optimization_stage() == 0:
        # DeepSpeed's bf16 wrapper for ZeRO-0 allocates Adam's states by stepping once on zero gradients;
        # Adam counts that step, and its bias correction would shrink the first real updates (by ~25%).
        optimizer.state.clear()
        if engine.seq_dp_world_size == 1:
            # Its gradient all-reduce (over the data- and sequence-parallel ranks) copies every gradient into one
            # flat buffer and back even when that is one rank, whose mean is the gradient itself.  ZeRO 1-3 keep
            # theirs: it fills their partitions.
            engine.enable_backward_allreduce = False
    return engine


def build_frozen_engine(model: torch.nn.Module, param_dtype: str, world_size: int, role: str):
    """Wrap the frozen ``model`` in a DeepSpeed ZeRO-3 engine without an optimizer, over the default process group
    (the rank's world): each rank keeps 1/``world_size`` of every parameter (those below DeepSpeed's persistence
    threshold, norms and biases, whole) and the ranks gather a module's parameters for its forward, so every rank
    of the world must run the same number of forwards.  The parameters are partitioned one by one as they move to
    the device, so the whole model is never on it; the buffers follow them there.  Logs the share of ``role``'s
    parameters this rank holds."""
    import deepspeed

    config = _common_config(param_dtype, world_size) | {"zero_optimization": {"stage": 3}}
    deepspeed.init_distributed(dist_init_required=False)  # zero.Init reads the world size before it joins
    deepspeed.zero.Init(module=model, config_dict_or_path=config)
    engine, _, _, _ = deepspeed.initialize(model=model, config=config, dist_init_required=False)
    for module in engine.module.modules():
        for name, buffer in module.named_buffers(recurse=False):
            setattr(module, name, buffer.to(engine.device))
    held = sum(p.ds_tensor.numel() for p in engine.module.parameters())
    log.info("%s: ZeRO-3 over %d ranks, %d of its %d parameter elements on this rank", role, world_size, held,
             sum(p.ds_numel for p in engine.module.parameters()))
    engine.eval()
    return engine


def optimizer_step(engine) -> float:
    """``engine.step()``; returns the gradient norm before clipping.  DeepSpeed reports it from its ZeRO and
    bf16 optimizers only: for ZeRO-0 in fp32 it is computed here, from the gradients the last backward left
    (already averaged over the ranks: every backward is an accumulation boundary, see ``ds_config``)."""
    own = None
    if engine.zero_optimization_stage() == 0 and not engine.bfloat16_enabled():
        norms = [p.grad.detach().float().norm() for p in engine.module.parameters() if p.grad is not None]
        own = float(torch.stack(norms).norm()) if norms else 0.0
    engine.step()
    reported = engine.get_global_grad_norm()
    if reported is not None:
        return float(reported)
    return own if own is not None else float("nan")


def configure_deepspeed_env() -> None:
    """Quiet DeepSpeed's INFO chatter and point its JIT cache at a persistent folder."""
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
