"""What the check runs on a machine, and the one JSON summary it prints (no CUDA, no hpc_rlhf needed here)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

PASSED, FAILED, NOT_COVERED = "passed", "failed", "not covered"

# name -> what it shows, in the order the checks run
CHECKS = {
    "collectives": "hpc_rlhf.distributed.collectives on CUDA tensors in NCCL groups (default group and Bridge)",
    "sft_zero3_bf16_resume": "train sft, DeepSpeed ZeRO-3, bf16 on CUDA; a resume logs the uninterrupted losses",
    "grpo_colocated_hf": "train rl (GRPO), every role colocated on one GPU, transformers engine",
    "engine_cpu_cuda": "the transformers engine samples the same tokens on CUDA as on the CPU with the same seeds "
                       "(fp32, grouped-query attention)",
    "engine_cuda_graphs": "the engine's decode steps replayed as CUDA graphs sample the same tokens as its kernels "
                          "launched one by one, with the same seeds (fp32, 8 layers); the time of each",
    "shared_prompts_cuda": "train.share_prompts on CUDA: the prompt pass once and the responses attending to its "
                           "cache give the logits and gradient of padded batches (fp32)",
    "grpo_colocated_vllm": "train rl (GRPO), every role colocated, vLLM on CUDA: sleep/wake, in-process weight "
                           "load, checksums after every sync, log-prob and greedy parity with the trainer",
    "sft_two_ranks_nccl": "train sft on 2 ranks (2 GPUs) over NCCL",
    "grpo_bridge_nccl": "train rl (GRPO), actor and rollout on different GPUs: the NCCL weights bridge",
    "grpo_bridge_gloo": "train rl (GRPO), actor and rollout in 2 processes on one GPU: the weights bridge over "
                        "gloo with CUDA tensors",
    "deepspeed_no_jit": "DeepSpeed compiled no op on the fly (TORCH_EXTENSIONS_DIR stayed empty)",
}
NCCL_ACROSS_PROCESSES = "NCCL across processes"
ONE_GPU_WHY = ("one GPU: NCCL refuses two ranks on one GPU, so the collectives probe and the cross-process "
               "weights bridge ran over gloo with CUDA tensors (grpo_bridge_gloo)")


@dataclass
class Result:
    name: str
    status: str
    seconds: float = 0.0
    figures: dict = field(default_factory=dict)
    reason: str = ""  # why it failed or was not covered


def not_covered(name: str, why: str) -> Result:
    return Result(name, NOT_COVERED, reason=why)


def plan(gpus: int, vllm_installed: bool) -> tuple[list[str], list[Result]]:
    """The checks a machine with ``gpus`` CUDA devices runs, and what it cannot cover (with why)."""
    runs = ["collectives", "sft_zero3_bf16_resume", "grpo_colocated_hf", "engine_cpu_cuda", "engine_cuda_graphs",
            "shared_prompts_cuda"]
    left_out = []
    if vllm_installed:
        runs.append("grpo_colocated_vllm")
    else:
        left_out.append(not_covered("grpo_colocated_vllm", "vllm not installed (not importable)"))
    if gpus >= 2:
        runs += ["sft_two_ranks_nccl", "grpo_bridge_nccl"]
    else:
        runs.append("grpo_bridge_gloo")
        left_out += [not_covered(NCCL_ACROSS_PROCESSES, ONE_GPU_WHY),
                     not_covered("sft_two_ranks_nccl", "needs 2 GPUs"),
                     not_covered("grpo_bridge_nccl", "needs 2 GPUs")]
    return runs + ["deepspeed_no_jit"], left_out


def assemble(machine: dict, results: list[Result], seconds: float) -> dict:
    """The summary: the machine, the names that ran / passed / failed, what was not covered and why, and each
    result's figures.  ``ok`` is false as soon as one check failed."""
    failed = [r.name for r in results if r.status == FAILED]
    return {
        "gpu_check": "hpc_rlhf",
        **machine,
        "ok": not failed,
        "ran": [r.name for r in results if r.status != NOT_COVERED],
        "passed": [r.name for r in results if r.status == PASSED],
        "failed": failed,
        "not_covered": [{"what": r.name, "why": r.reason} for r in results if r.status == NOT_COVERED],
        "results": {r.name: {k: v for k, v in asdict(r).items() if k != "name" and v not in ("", {})}
                    for r in results if r.status != NOT_COVERED},
        "seconds": round(seconds, 1),
    }


def without_cuda(machine: dict, why: str) -> dict:
    """The summary of a machine where nothing can run: it says so, and is ok (the exit code is 0)."""
    return assemble(machine, [not_covered("everything", why)], 0.0)


def exit_code(summary: dict) -> int:
    return 0 if summary["ok"] else 1
