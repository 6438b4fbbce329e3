"""The checks: each takes the shared context and its time limit, returns its key figures, or raises
CheckFailed.  Every training run goes through `hpc-rlhf train` and is judged by its metrics.jsonl, its
checkpoints and its HF export, as the CPU tests judge theirs."""
from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from .runs import CheckFailed, cli, metrics, run_ranks, train

RESUME_TOL = 2e-3       # bf16 on CUDA: atomics in attention backward may flip a last bit; a lost optimizer state
                        # or a wrong data order moves the loss by 1e-1
RANKS_STEP1_RTOL = 1e-2  # step 1 (the same weights) on 2 ranks vs 1: only the reduction order differs
MISMATCH_TOL = 1e-2     # fp32 vLLM vs fp32 trainer log-probs (1e-3 on CPU; other kernels on GPU)


@dataclass
class Context:
    work: Path
    assets: dict[str, Path]
    gpus: int


class Clock:
    def __init__(self, timeout_s: float):
        self.end = time.time() + timeout_s

    def left(self) -> float:
        return max(1.0, self.end - time.time())


def expect(ok: bool, what: str, figures: dict) -> None:
    if not ok:
        raise CheckFailed(what, figures)


# ---- collectives ---------------------------------------------------------------------------------------------
def collectives(ctx: Context, timeout_s: float) -> dict:
    """Two ranks over NCCL with two GPUs; with one, a 1-rank NCCL group (the Bridge really calls NCCL, the
    default-group helpers take their single-process path) and two ranks over gloo with CUDA tensors."""
    clock, probe = Clock(timeout_s), [sys.executable, "-m", "gpu_check.collectives_probe"]
    runs = [("nccl", 2)] if ctx.gpus >= 2 else [("nccl", 1), ("gloo", 2)]
    figures = {}
    for backend, n in runs:
        lines = run_ranks([*probe, backend], n, ctx.work / "logs" / f"collectives_{backend}{n}", clock.left())
        figures[f"{backend}_{n}_ranks"] = [json.loads(x) for x in lines]
    return figures


# ---- SFT -----------------------------------------------------------------------------------------------------
def sft_config(ctx: Context, name: str, nproc: int = 1) -> dict:
    """ZeRO-3, bf16, 4 steps of 8 rows (every step the same size), a checkpoint after step 2."""
    return {"model": {"pretrain": str(ctx.assets["model"]), "param_dtype": "bf16"},
            "data": {"dataset": [str(ctx.assets["sft_data"])], "max_len": 32},
            "train": {"train_batch_size": 8, "micro_train_batch_size": 2, "max_epochs": 100, "max_steps": 4,
                      "learning_rate": 1e-2, "zero_stage": 3, "seed": 3},
            "ckpt": {"save_path": str(ctx.work / name), "ckpt_path": str(ctx.work / f"{name}_ckpt"), "save_steps": 2},
            "log": {"logging_steps": 1, "progress_bar": "off", "use_tensorboard": False},
            "launch": {"nproc": nproc}}


def losses(rows: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def run_sft(ctx: Context, name: str, config: dict, steps: list[int], timeout_s: float) -> dict[int, float]:
    got = losses(train("sft", config, ctx.work / f"{name}.yaml", ctx.work / "logs" / f"{name}.log", timeout_s))
    expect(sorted(got) == steps and all(math.isfinite(v) for v in got.values()),
           f"{name}: logged losses {got}, wanted finite losses of steps {steps}", {"losses": got})
    return got


def exported_tensors(save_path: Path) -> int:
    from safetensors import safe_open
    n = 0
    for f in save_path.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as st:
            n += len(list(st.keys()))
    return n


def sft_zero3_bf16_resume(ctx: Context, timeout_s: float) -> dict:
    clock, config = Clock(timeout_s), sft_config(ctx, "sft_full")
    full = run_sft(ctx, "sft_full", config, [1, 2, 3, 4], clock.left())
    ckpts = sorted(p.name for p in (ctx.work / "sft_full_ckpt").iterdir() if (p / "COMMITTED").is_file())
    figures = {"losses": full, "committed_checkpoints": ckpts,
               "exported_tensors": exported_tensors(ctx.work / "sft_full")}
    expect("global_step2" in ckpts, "no committed checkpoint after step 2", figures)
    expect(figures["exported_tensors"] > 0 and (ctx.work / "sft_full" / "config.json").is_file(),
           "no HF export in save_path", figures)
    cut = ctx.work / "sft_resume_ckpt"
    shutil.rmtree(cut, ignore_errors=True)
    shutil.copytree(ctx.work / "sft_full_ckpt" / "global_step2", cut / "global_step2")  # as if stopped after 2
    config["ckpt"] = {"save_path": str(ctx.work / "sft_resumed"), "ckpt_path": str(cut), "load_checkpoint": True}
    resumed = run_sft(ctx, "sft_resumed", config, [3, 4], clock.left())
    figures["resumed_losses"] = resumed
    figures["resume_max_abs_diff"] = max(abs(resumed[s] - full[s]) for s in resumed)
    expect(figures["resume_max_abs_diff"] <= RESUME_TOL, f"the resumed run's losses differ by more than "
           f"{RESUME_TOL} from the uninterrupted run's", figures)
    return figures


def sft_two_ranks_nccl(ctx: Context, timeout_s: float) -> dict:
    """Two ranks, one GPU each, NCCL; step 1 (before any update) matches the 1-rank run of sft_zero3_bf16_resume."""
    two = run_sft(ctx, "sft_two_ranks", sft_config(ctx, "sft_two_ranks", nproc=2), [1, 2, 3, 4], timeout_s)
    figures = {"losses": two}
    one_rank = ctx.work / "sft_full" / "metrics.jsonl"
    if one_rank.exists():
        one = losses(metrics(one_rank.parent))
        figures["one_rank_losses"] = one
        figures["step1_rel_diff"] = abs(two[1] - one[1]) / abs(one[1])
        expect(figures["step1_rel_diff"] <= RANKS_STEP1_RTOL, "step 1 on 2 ranks differs from 1 rank", figures)
    return figures


# ---- GRPO ----------------------------------------------------------------------------------------------------
def grpo_config(ctx: Context, name: str, placement: dict, dtype: str = "bf16", **sections) -> dict:
    """GRPO on the tiny model: 4 prompts x 4 samples per step, 4 steps, checksums after every sync."""
    config = {"model": {"pretrain": str(ctx.assets["model"]), "param_dtype": dtype},
              "data": {"prompt_data": [str(ctx.assets["prompts"])], "input_key": "input", "label_key": "label"},
              "reward": {"reward_func": str(ctx.assets["reward"])},
              "rollout": {"n_samples_per_prompt": 4, "rollout_batch_size": 4, "generate_max_len": 8},
              "algo": {"advantage_estimator": "group_norm"},
              "train": {"train_batch_size": 16, "micro_train_batch_size": 8, "actor_learning_rate": 1e-3,
                        "max_steps": 4, "zero_stage": 2, "seed": 5},
              "placement": placement,
              "log": {"logging_steps": 1, "progress_bar": "off", "check_weight_sync": True, "use_tensorboard": False},
              "ckpt": {"save_path": str(ctx.work / name), "ckpt_path": str(ctx.work / f"{name}_ckpt")}}
    for section, values in sections.items():
        config.setdefault(section, {}).update(values)
    return config


def run_grpo(ctx: Context, name: str, config: dict, timeout_s: float) -> dict:
    """The run's figures, after checking that every sync delivered what the actor sent (each
    rollout rank's loaded checksum equals the sent one) and that the weights changed every step."""
    rows = [r for r in train("rl", config, ctx.work / f"{name}.yaml", ctx.work / "logs" / f"{name}.log", timeout_s)
            if "reward/mean" in r]
    sent = [r.get("sync/checksum_sent") for r in rows]
    loaded = [{k: v for k, v in r.items() if k.startswith("sync/checksum_loaded/")} for r in rows]
    worst = max((abs(v - s) / max(abs(s), 1e-30) for s, ld in zip(sent, loaded, strict=True) if s is not None
                 for v in ld.values()), default=None)
    figures = {"steps": [r["step"] for r in rows], "reward_mean": [round(r["reward/mean"], 4) for r in rows],
               "actor_loss": [r.get("actor/loss") for r in rows], "checksum_max_rel_diff": worst,
               "weight_sync_s": [round(r["time/weight_sync_s"], 3) for r in rows if "time/weight_sync_s" in r],
               "step_s": [round(r["time/step_s"], 2) for r in rows if "time/step_s" in r]}
    if any("actor/mismatch/max_abs_diff" in r for r in rows):
        figures["mismatch_max_abs_diff"] = [r.get("actor/mismatch/max_abs_diff") for r in rows]
    log = (ctx.work / "logs" / f"{name}.log").read_text(errors="replace")
    figures["rollout_engine"] = next((line.split("rollout engine: ", 1)[1] for line in log.splitlines()
                                      if "rollout engine: " in line), None)  # which engine the run chose, and why
    expect(figures["steps"] == [1, 2, 3, 4], f"{name}: logged steps {figures['steps']}", figures)
    expect(None not in figures["actor_loss"], f"{name}: a step without a finite actor/loss", figures)
    expect(None not in sent and all(ld for ld in loaded), f"{name}: a step without sync checksums", figures)
    expect(worst <= 1e-12, f"{name}: a rollout rank loaded other weights than the actor sent", figures)
    expect(len(set(sent)) == len(sent), f"{name}: the weights did not change every step", figures)
    return figures


def grpo_colocated_hf(ctx: Context, timeout_s: float) -> dict:
    """Actor, reference (KL in the reward), reward and rollout on one rank and one GPU, bf16, ZeRO-2."""
    config = grpo_config(ctx, "grpo_colocated_hf", {"colocate_all": True},
                         algo={"init_kl_coef": 0.01, "kl_estimator": "k3"})
    return run_grpo(ctx, "grpo_colocated_hf", config, timeout_s)


def grpo_colocated_vllm(ctx: Context, timeout_s: float) -> dict:
    """vLLM on the actor's GPU, asleep while the actor trains (woken by each sync), weights loaded in process,
    fp32 on both sides so that the engine's log-probs match the trainer's; then greedy parity of the export
    between vLLM and the transformers engine (`hpc-rlhf generate`, temperature 0)."""
    clock, name = Clock(timeout_s), "grpo_colocated_vllm"
    config = grpo_config(ctx, name, {"colocate_all": True}, dtype="fp32",
                         rollout={"engine": "vllm", "vllm": {"max_model_len": 64, "gpu_memory_utilization": 0.3,
                                                             "sleep": True}})
    figures = run_grpo(ctx, name, config, clock.left())
    log = (ctx.work / "logs" / f"{name}.log").read_text(errors="replace")
    figures["vllm_fell_asleep"], figures["vllm_woke_up"] = log.count("to fall asleep"), log.count("to wake up")
    expect(figures["vllm_fell_asleep"] > 0 and figures["vllm_woke_up"] > 0,
           "vLLM's log shows no sleep and wake (its lines 'It took N seconds to fall asleep / to wake up')", figures)
    worst = max(figures.get("mismatch_max_abs_diff") or [float("inf")])
    expect(worst < MISMATCH_TOL, f"vLLM's log-probs differ from the trainer's by {worst} (> {MISMATCH_TOL})",
           figures)
    figures.update(greedy_parity(ctx, ctx.work / name, clock))
    return figures


def generate(ctx: Context, model: Path, engine: str, clock: Clock) -> dict[int, str]:
    out = ctx.work / f"greedy_{engine}.jsonl"
    path = ctx.work / f"greedy_{engine}.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"pretrain": str(model), "param_dtype": "fp32", "engine": engine,
                  "vllm": {"max_model_len": 64, "gpu_memory_utilization": 0.3}},
        "data": {"prompt_data": [str(ctx.assets["prompts"])], "input_key": "input", "max_samples": 16},
        "sampling": {"temperature": 0.0, "max_new_tokens": 8},
        "output": {"output_path": str(out)}}))
    cli(["generate", "--config", str(path)], ctx.work / "logs" / f"greedy_{engine}.log", clock.left())
    return {r["prompt_index"]: r["response"] for r in map(json.loads, out.read_text().splitlines())}


def greedy_parity(ctx: Context, model: Path, clock: Clock) -> dict:
    hf, vllm = generate(ctx, model, "auto", clock), generate(ctx, model, "vllm", clock)
    equal = sum(hf[i] == vllm.get(i) for i in hf)
    figures = {"greedy_prompts": len(hf), "greedy_equal": equal}
    expect(len(hf) == 16 and equal == len(hf), "vLLM's greedy responses differ from the transformers engine's",
           figures)
    return figures


ENGINE_LOGPROB_TOL = 1e-3  # fp32: cuBLAS and MKL sum in other orders (the tokens themselves must agree)


def engine_cpu_cuda(ctx: Context, timeout_s: float, devices: tuple[str, str] = ("cpu", "cuda")) -> dict:
    """The transformers engine (its lean decoder, grouped-query attention folded, its decode steps replayed as CUDA
    graphs on the GPU) sampling 16 rows of 4 prompts at temperature 1 on the GPU and on the CPU with the same
    seeds, fp32: each row draws its uniforms on the host, so the tokens agree wherever the logits agree to float
    rounding.  (``devices``: the tests run it on the CPU twice.)"""
    from hpc_rlhf.models.tiny import build_tiny_model

    model = build_tiny_model(ctx.work / "gqa_model", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                             max_position_embeddings=128, seed=1)
    return same_samples([(device, dict(model_path_or_module=model, device=device)) for device in devices])


def engine_cuda_graphs(ctx: Context, timeout_s: float, device: str = "cuda") -> dict:
    """The lean decoder's decode steps replayed as CUDA graphs sample what its kernels launched one by one sample:
    16 rows of 4 prompts, 8 layers (GQA), fp32, the same seeds; and the time of each.  (``device``: the tests run
    it on the CPU, where no graph is captured.)"""
    from hpc_rlhf.models.tiny import build_tiny_model

    model = build_tiny_model(ctx.work / "gqa_model_8_layers", hidden_size=128, num_layers=8, num_heads=4,
                             num_kv_heads=2, max_position_embeddings=128, seed=3)
    return same_samples([("launched", dict(model_path_or_module=model, device=device, cuda_graphs=False)),
                         ("graphs", dict(model_path_or_module=model, device=device))])


def same_samples(engines: list[tuple[str, dict]]) -> dict:
    """Two ``HFEngine``s (name, its arguments) sample 16 rows of 4 prompts at temperature 1 with the same
    seeds, after a warm-up each: the same tokens in every row and log-probs within ``ENGINE_LOGPROB_TOL``."""
    import torch

    from hpc_rlhf.generation.factory import transformers_engine
    from hpc_rlhf.generation.engine import SamplingParams

    prompts = [[72, 101, 108, 108, 111], [1, 2], [200, 13, 40, 41, 42, 43, 44, 45, 46], [99]] * 4
    params = SamplingParams(temperature=1.0, max_new_tokens=24, stop_token_ids=[3, 7])
    seeds = list(range(100, 116))
    runs, seconds, graphed = [], [], []
    for _, kwargs in engines:
        engine = transformers_engine(**kwargs)
        expect(engine._lean is not None, "the lean decoder does not take the tiny llama", {})
        graphed.append(engine._lean.graphed(engine.device))
        engine.generate(prompts, params, seeds)  # warm-up
        t0 = time.time()
        runs.append(engine.generate(prompts, params, seeds))
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(round(time.time() - t0, 4))
    first, second = runs
    same = [a.token_ids == b.token_ids for a, b in zip(first, second)]
    diff = max(abs(x - y) for a, b in zip(first, second) for x, y in zip(a.logprobs, b.logprobs))
    names = [name for name, _ in engines]
    figures = {"engines": names, "cuda_graphs": graphed, "rows": len(same), "rows_equal": sum(same),
               "tokens": sum(len(c.token_ids) for c in second), "logprob_max_abs_diff": diff,
               "generate_s": seconds, "finish_reasons": sorted({c.finish_reason for c in second})}
    expect(all(same), f"{names[1]} sampled other tokens than {names[0]} with the same seeds", figures)
    expect(diff <= ENGINE_LOGPROB_TOL, f"the log-probs differ by {diff} (> {ENGINE_LOGPROB_TOL})", figures)
    return figures


SHARED_LOGIT_TOL, SHARED_GRAD_TOL = 1e-4, 1e-4  # fp32; the kernels sum in other orders for the two shapes


def shared_prompts_cuda(ctx: Context, timeout_s: float, device: str = "cuda") -> dict:
    """``train.share_prompts`` on the GPU: 16 samples of 4 prompts (GQA tiny llama, fp32), micro-batches of 4
    rows cut by response length; the prompt pass once and the responses attending to its cache give the logits
    and the gradient of padded batches.  (``device``: the tests run it on the CPU.)"""
    import random

    import torch
    from transformers import AutoModelForCausalLM

    from hpc_rlhf.models.tiny import build_tiny_model
    from hpc_rlhf.roles.experience import Experience, response_logits, response_logprobs
    from hpc_rlhf.roles.shared_prompts import SharedPrompts
    from hpc_rlhf.roles.training import optimizer_steps

    path = build_tiny_model(ctx.work / "shared_prompts_model", hidden_size=128, num_layers=2, num_heads=4,
                            num_kv_heads=2, max_position_embeddings=128, seed=2)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    g = random.Random(0)
    prompts = [[g.randrange(3, 250) for _ in range(n)] for n in (9, 3, 14, 6)]
    samples = []
    for i in range(16):
        response = [g.randrange(3, 250) for _ in range(g.randrange(0, 20))]
        samples.append(Experience(i % 4, i // 4, list(prompts[i % 4]), response, [0.0] * len(response), "stop",
                                  "", "", None))
    [step] = optimizer_steps(samples, 16, 4, 1, 0, 0, device, 0, responses_only=True)

    def run(share: bool):
        model.zero_grad(set_to_none=True)
        shared = SharedPrompts(model, samples, len(step), 0, device) if share else None
        logits = []
        t0 = time.time()
        for part, batch in step:
            out = shared.logits(part, batch) if shared else response_logits(model, batch)
            (response_logprobs(out, batch).sum() + (shared.closing() if shared else 0.0)).backward()
            logits.append(out.detach())
        if device == "cuda":
            torch.cuda.synchronize()
        return logits, [p.grad.detach().clone() for p in model.parameters()], round(time.time() - t0, 4)
    padded, shared = run(False), run(True)
    logit_diff = max(float((a - b).abs().max()) for a, b in zip(padded[0], shared[0]) if a.numel())
    grad_diff = max(float((a - b).abs().max() / b.abs().max().clamp(min=1e-30)) for a, b in zip(padded[1], shared[1]))
    figures = {"device": device, "samples": len(samples), "micro_batches": len(step),
               "logit_max_abs_diff": logit_diff, "grad_max_rel_diff": grad_diff, "seconds": [padded[2], shared[2]]}
    expect(logit_diff <= SHARED_LOGIT_TOL, f"shared prompts' logits differ by {logit_diff} (> {SHARED_LOGIT_TOL})",
           figures)
    expect(grad_diff <= SHARED_GRAD_TOL, f"shared prompts' gradient differs by {grad_diff} relative "
                                         f"(> {SHARED_GRAD_TOL})", figures)
    return figures


BRIDGE_PLACEMENT = {"actor_num_ranks": 1, "rollout_num_ranks": 1, "colocate_actor_reward": True}


def grpo_bridge_nccl(ctx: Context, timeout_s: float) -> dict:
    """Rank 0 (actor + reward) on GPU 0, rank 1 (rollout) on GPU 1: the weights go over NCCL."""
    config = grpo_config(ctx, "grpo_bridge_nccl", BRIDGE_PLACEMENT, launch={"backend": "nccl"})
    return run_grpo(ctx, "grpo_bridge_nccl", config, timeout_s)


def grpo_bridge_gloo(ctx: Context, timeout_s: float) -> dict:
    """Both ranks on the one GPU, every group over gloo: the bridge moves the actor's CUDA tensors through the
    CPU to the rollout rank's CUDA model.  fp32 and ZeRO-0, whose DeepSpeed engine needs only the collectives
    gloo has for CUDA tensors (broadcast, all-reduce)."""
    config = grpo_config(ctx, "grpo_bridge_gloo", BRIDGE_PLACEMENT, dtype="fp32", launch={"backend": "gloo"},
                         train={"zero_stage": 0})
    return run_grpo(ctx, "grpo_bridge_gloo", config, timeout_s)


def deepspeed_no_jit(ctx: Context, timeout_s: float) -> dict:
    """TORCH_EXTENSIONS_DIR (a fresh folder for this check) holds whatever DeepSpeed compiled on the fly."""
    folder = Path(os.environ["TORCH_EXTENSIONS_DIR"])
    built = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_dir()) if folder.exists() else []
    figures = {"torch_extensions_dir": str(folder), "built": built}
    expect(not built, "DeepSpeed compiled ops on the fly (DS_BUILD_OPS=0 and a torch optimizer should need none)",
           figures)
    return figures
