"""Config sections shared by the trainers.  Names follow OpenRLHF's flags where they fit."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .base import ConfigError, field


@dataclass
class VllmOptions:
    """The vLLM engine's settings (docs/vllm.md)."""
    max_model_len: int | None = field(None, ge=1, aliases=("vllm_max_model_len",),
                                      help="longest prompt + response (default: the model's)")
    cpu_kv_cache_gib: int = field(1, ge=1, aliases=("vllm_cpu_kv_cache_gib",),
                                  help="on CPU: KV cache size in whole GiB (VLLM_CPU_KVCACHE_SPACE)")
    gpu_memory_utilization: float = field(0.5, gt=0, le=1, aliases=("vllm_gpu_memory_utilization",),
                                          help="on GPU: fraction of GPU memory for weights and KV cache (lower it "
                                               "when the actor shares the GPU)")
    tensor_parallel_size: int = field(1, ge=1, aliases=("vllm_tensor_parallel_size",),
                                      help="shards of the model inside each rank's engine (worker processes; on GPU "
                                           "one device each)")


@dataclass
class LeanOptions:
    """The lean engine's settings (hpc_rlhf/generation/lean/)."""
    cuda_graphs: bool = field(True, help="on CUDA: replay each decode step as one CUDA graph, captured once per batch "
                                         "(finished rows then stay in the batch); false: launch its kernels one by "
                                         "one")
    shared_prefix: bool = field(True, help="on the CPU in fp32: a prompt's samples share its prefilled cache (its keys "
                                           "and values kept once, attended to once per prompt); false: each sample "
                                           "holds a copy (as on CUDA and in bf16)")
    few_row_kernel: bool = field(True, help="on an x86 CPU with AVX2 in fp32: kernels compiled on first use with the "
                                            "machine's C++ compiler and cached take every matrix product (the RMS "
                                            "norm, silu(gate) * up and the residual on the way), each decode step's "
                                            "rotary embedding, cache write and attention (hpc_rlhf/generation/lean/"
                                            "few_rows.py; a warning and PyTorch's operations where they cannot be "
                                            "built); false: PyTorch's operations (oneDNN's products)")


@dataclass(kw_only=True)
class EngineOptions:
    """The generation engine and its settings, one section per engine: shared by `train rl` and `hpc-rlhf eval`
    (rollout) and `hpc-rlhf generate` (model)."""
    engine: Literal["auto", "vllm", "lean", "hf"] = field(
        "auto", help="generation engine: auto (vllm on rollout ranks with CUDA where vLLM is installed, else lean "
                     "for a model it runs, else hf; `hpc-rlhf plan` and the run's first log line say which and why), "
                     "vllm (the vllm package on GPU, vllm-cpu on CPU; docs/vllm.md), lean (the lean decoder: "
                     "llama-family models (llama, qwen2, mistral) through a lean forward, the CPU / small-model path, "
                     "which keeps packed copies of the linear weights, one more copy of them; refuses other models), "
                     "hf (the plain transformers forward)")
    vllm: VllmOptions = field(default_factory=VllmOptions, help="engine vllm")
    lean: LeanOptions = field(default_factory=LeanOptions, help="engine lean (and auto where it picks lean)")


@dataclass
class ModelConfig:
    pretrain: str = field(path="tokenizer", help="HF model folder or hub name of the model to train (and of its "
                                                 "tokenizer)")
    param_dtype: Literal["bf16", "fp32"] = field("fp32", help="dtype of the trained parameters: bf16 on GPUs (on CPUs "
                                                              "without AMX its matmuls are many times slower)")
    gradient_checkpointing: bool = field(False, help="recompute activations in backward to save memory")
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = field(
        "sdpa", help="attention kernel passed to transformers")
    lora_rank: int = field(0, ge=0, help="LoRA rank; 0 trains all parameters")
    lora_alpha: int = field(16, ge=1, help="LoRA scaling numerator (scale = lora_alpha / lora_rank)")
    lora_dropout: float = field(0.0, ge=0, lt=1, help="dropout on the LoRA branch")
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"],
                                      help="module names LoRA wraps; 'all-linear' wraps every linear layer "
                                           "except the output head")
    load_in_4bit: bool = field(False, help="QLoRA: load the frozen base in 4-bit NF4 (bitsandbytes); "
                                            "needs lora_rank > 0")

    def validate(self) -> None:
        if self.load_in_4bit and self.lora_rank == 0:
            raise ConfigError("model.load_in_4bit=true trains a 4-bit base through LoRA only: set lora_rank > 0")


@dataclass
class SourcesConfig:
    """Where training and evaluation rows come from: what every data section shares."""
    dataset: list[str] = field(path="data", help="comma-separated data sources: json/jsonl/parquet/csv/arrow files, "
                                                 "datasets save_to_disk folders, or hub names (online only); "
                                                 "'name@split' picks a split")
    dataset_probs: list[float] | None = field(None, ge=0, help="mixing probabilities, one per dataset (default: "
                                                               "all rows of every dataset, in order)")
    dataset_split: str = field("train", help="split read from sources that have several")
    eval_dataset: list[str] | None = field(None, path="data", help="held-out data sources (same formats as dataset)")
    eval_split_ratio: float = field(0.0, ge=0, lt=1, help="when no eval_dataset is given, hold out this fraction of "
                                                          "the training rows for evaluation")
    max_eval_samples: int | None = field(None, ge=1, help="cap on eval rows")

    def validate(self) -> None:
        if not self.dataset:
            raise ConfigError("data.dataset is empty: name at least one data source")
        if self.dataset_probs is not None:
            if len(self.dataset_probs) != len(self.dataset):
                raise ConfigError(f"data.dataset_probs has {len(self.dataset_probs)} values for "
                                  f"{len(self.dataset)} datasets: give one probability per dataset")
            if sum(self.dataset_probs) <= 0:
                raise ConfigError("data.dataset_probs are all zero: give at least one dataset a probability")
        if self.eval_dataset and self.eval_split_ratio > 0:
            raise ConfigError("data.eval_dataset and data.eval_split_ratio exclude each other: evaluate on the "
                              "given eval_dataset or hold out a fraction of the training rows, not both")


def check_template(data) -> None:
    """A data section's ``input_template`` holds one {} and excludes ``apply_chat_template``."""
    if data.input_template is not None and data.input_template.count("{}") != 1:
        raise ConfigError("data.input_template must contain exactly one {} where the prompt goes")
    if data.apply_chat_template and data.input_template is not None:
        raise ConfigError("data.input_template and data.apply_chat_template exclude each other")


@dataclass
class RenderedSources(SourcesConfig):
    """Sources whose rows are rendered into text (SFT and preference data): by a template or the tokenizer's chat
    template, with a policy for bad rows."""
    input_template: str | None = field(None, help="format string with one {} for the prompt, e.g. "
                                                  "'User: {}\\nAssistant: '")
    apply_chat_template: bool = field(False, help="render rows with the tokenizer's chat template")
    tokenizer_chat_template: str | None = field(None, help="override the tokenizer's chat template "
                                                           "(a Jinja string)")
    bad_rows: Literal["skip", "error"] = field("skip", help="what to do with a bad row (missing key, empty, "
                                                            "wrong type, longer than max_len): skip it and "
                                                            "report the counts, or stop with an error")

    def validate(self) -> None:
        super().validate()
        check_template(self)


@dataclass
class DataConfig(RenderedSources):
    input_key: str = field("input", help="column holding the prompt (or the messages list with "
                                         "apply_chat_template)")
    output_key: str | None = field("output", help="column holding the response; null with a messages "
                                                  "list in input_key")
    apply_chat_template: bool = field(False, help="render rows with the tokenizer's chat template; loss "
                                                  "on every assistant turn")
    pretrain_mode: bool = field(False, help="loss on every token (continued pre-training)")
    max_len: int = field(2048, ge=2, help="maximum tokens per sample (prompt + response)")
    max_samples: int | None = field(None, ge=1, help="cap on training rows after mixing")
    packing_samples: bool = field(False, help="pack several samples into one row; attention stays inside "
                                              "each sample; no padding")
    micro_batch_tokens: int | None = field(None, ge=1, help="token budget per micro-batch (an alternative to "
                                                            "micro_train_batch_size)")

    def validate(self) -> None:
        super().validate()
        if self.pretrain_mode and (self.input_template is not None or self.apply_chat_template):
            raise ConfigError("data.pretrain_mode trains on the raw text of input_key: it excludes "
                              "data.input_template and data.apply_chat_template")
        if self.micro_batch_tokens is not None and self.micro_batch_tokens < self.max_len:
            raise ConfigError(f"data.micro_batch_tokens ({self.micro_batch_tokens}) must be >= data.max_len "
                              f"({self.max_len}) so every sample fits in a micro-batch")


@dataclass
class OptimizerConfig:
    """What every DeepSpeed-trained model shares: schedule shape, AdamW, clipping, ZeRO, seed."""
    lr_warmup_ratio: float = field(0.03, ge=0, le=1, help="fraction of the steps spent in linear warm-up")
    lr_scheduler: Literal["cosine_with_min_lr", "constant_with_warmup"] = field(
        "cosine_with_min_lr", help="schedule after warm-up")
    min_lr_ratio: float = field(0.1, ge=0, le=1, help="cosine floor as a fraction of the peak learning rate")
    weight_decay: float = field(0.0, ge=0, help="AdamW weight decay (matrices only)")
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.95], ge=0, lt=1, help="AdamW betas")
    max_norm: float = field(1.0, ge=0, help="gradient clipping norm (0 disables)")
    zero_stage: Literal[0, 1, 2, 3] = field(2, help="DeepSpeed ZeRO stage")
    adam_offload: bool = field(False, help="keep optimizer states in CPU memory (ZeRO offload)")
    seed: int = field(42, ge=0, le=2**32 - 1, help="seed for data order, initialisation and sampling")

    def validate(self) -> None:
        if len(self.adam_betas) != 2:
            raise ConfigError(f"train.adam_betas needs two values, got {self.adam_betas}")
        if self.adam_offload and self.zero_stage == 0:
            raise ConfigError("train.adam_offload needs train.zero_stage 1, 2 or 3 (ZeRO offloads the partitioned "
                              "optimizer states)")


@dataclass
class TrainConfig(OptimizerConfig):
    train_batch_size: int = field(128, ge=1, help="samples per optimizer step, over all ranks")
    micro_train_batch_size: int = field(8, ge=1, help="samples per forward/backward on one rank")
    max_epochs: int = field(1, ge=1, help="passes over the training data")
    max_steps: int | None = field(None, ge=1, help="stop after this many optimizer steps")
    learning_rate: float = field(5e-6, gt=0, help="peak learning rate")


@dataclass
class CheckpointConfig:
    save_path: str = field("./ckpt/model", help="where the final HF model (safetensors + tokenizer) goes; "
                                                "metrics.jsonl and TensorBoard events go here too")
    save_steps: int = field(-1, choices=(-1,), ge=1, help="write a resumable checkpoint every N steps (-1: none; the "
                                                          "final model is exported to save_path in any case)")
    ckpt_path: str = field("./ckpt/checkpoints", help="folder of resumable checkpoints")
    max_ckpt_num: int = field(3, ge=1, help="resumable checkpoints kept (oldest removed first)")
    load_checkpoint: bool = field(False, help="resume from the newest intact committed checkpoint in ckpt_path, "
                                              "even one written with another config (a warning lists the "
                                              "differences); checkpoints of the same config resume without it")
    start_over: bool = field(False, help="start from step 0 although ckpt_path holds checkpoints: they are moved "
                                         "into ckpt_path/old-DATE (never deleted); a SLURM requeue still resumes")

    def validate(self) -> None:
        if self.load_checkpoint and self.start_over:
            raise ConfigError("ckpt.load_checkpoint and ckpt.start_over contradict each other: set one")


@dataclass
class LogConfig:
    logging_steps: int = field(1, ge=1, help="log metrics every N steps")
    eval_steps: int = field(-1, choices=(-1,), ge=1, help="evaluate every N steps (-1: only at the end)")
    use_tensorboard: bool = field(True, help="write TensorBoard events into save_path/tensorboard")
    use_wandb: bool = field(False, help="also log to Weights & Biases from rank 0 (pip install 'hpc_rlhf[wandb]'); "
                                        "offline unless WANDB_MODE is set: save_path/wandb, then `wandb sync` "
                                        "(docs/logging.md). The API key comes from `wandb login` or WANDB_API_KEY")
    wandb_org: str = field("", help="W&B entity (team or user; empty: your default)")
    wandb_project: str = field("hpc_rlhf", help="W&B project")
    wandb_group: str = field("", help="W&B group of the run (empty: none; `hpc-rlhf sweep` sets the sweep's name)")
    wandb_run_name: str = field("", help="W&B run name (empty: the save_path folder's name)")
    check_weight_sync: bool = field(False, help="RL: after every weight sync, log checksums of the weights the "
                                                "actor sent and each rollout rank loaded (costs a pass over them)")
    sync_receipt: bool = field(True, help="RL: after every weight sync, compare each rollout engine's log-probs of a "
                                          "fixed 16-token probe with the actor's; past sync_receipt_tolerance the run "
                                          "stops naming the engine's first tensor that differs from the one sent "
                                          "(docs/rl.md)")
    sync_receipt_tolerance: float | None = field(None, gt=0, help="RL: the largest |engine - actor| log-prob of the "
                                                                  "probe that passes (null: 0.01 with "
                                                                  "model.param_dtype fp32, 1.0 with bf16)")
    progress_bar: Literal["auto", "on", "off"] = field("auto", help="progress bar with ETA (auto: only on "
                                                                    "a terminal; plain lines otherwise)")


@dataclass
class LaunchConfig:
    nproc: int = field(1, ge=1, help="local launcher: processes to start on this machine (ignored when the "
                                     "process already runs under torchrun or SLURM)")
    backend: Literal["auto", "gloo", "nccl"] = field("auto", help="torch.distributed backend (auto: nccl "
                                                                  "with CUDA, else gloo)")
    node_local_caches: bool = field(True, help="in a SLURM job: the compile and datasets caches the environment does "
                                               "not place (TRITON_CACHE_DIR, TORCHINDUCTOR_CACHE_DIR, "
                                               "TORCH_EXTENSIONS_DIR, VLLM_CACHE_ROOT, HF_DATASETS_CACHE) go to the "
                                               "job's scratch folder on each node (docs/hpc.md)")
    max_restarts: int = field(2, ge=0, help="SLURM: new steps the job's script starts inside its allocation, "
                                         "from the last checkpoint, after a step failed (a rank killed, hung or "
                                         "lost with its node); never after a user error (exit 2)")
