"""Memory per rank of each role, estimated from the model config and the run's settings.

Counts (bytes per parameter; N parameters, D data-parallel ranks of the role; h hidden, kv the key/value
width, i the MLP width, V the vocabulary; b = 2 for bf16 values, 4 for fp32):
- weights: b; ZeRO-3 divides them by D (a frozen reference or reward model of `train rl` too).
- gradients of a trained model: b; ZeRO-2/3 divide them by D.
- AdamW: two fp32 moments (8) plus an fp32 master copy (4) when the weights are bf16; ZeRO-1/2/3
  divide them by D; with `adam_offload` they sit in CPU memory instead.
- LoRA: gradients and optimizer states of the adapters only (counted as zero here).
- activations of one micro-batch at full length, without recomputation: per token and layer, the tensors
  autograd keeps for the backward pass of a Llama-style layer with a fused attention kernel: b x (11 h + 3 kv
  + 4 i) (the two RMS norms' inputs, squares and outputs; queries, keys and values before and after the
  rotation; the attention output; the gated MLP's four i-wide tensors; 2 i for an ungated MLP).  Measured on
  SmolLM2-135M in fp32 (16 rows, backward of the token log-probs): 1.43-1.53 MiB per token against 1.49
  counted.  With gradient checkpointing: each layer's input (b h per token and layer) plus one full layer.
- logits of a trained policy: 3 float32 [tokens, V] tensors per response token (the output head runs on the
  response tokens only: its output and the log-softmax of it in the forward pass; in the backward pass the
  saved log-softmax, the gradient of its output and of its input); measured 3.1 on SmolLM2-135M in fp32
  (16 rows of 136 prompt and 256 response tokens: 11.5 GiB over the model and its gradients, of which 9.15
  are the activations above).
- rollout: the engine's own memory model (``EngineSpec.memory``, hpc_rlhf/generation/specs.py): weights, the
  key/value cache of the rank's sequences at full length (vLLM on a CPU: the cache it preallocates,
  `rollout.vllm.cpu_kv_cache_gib`), and the lean engine's packed copy of the linear weights.
- weight-sync shared weights: on a CPU weights bridge (the actor's and the rollout ranks' components differ)
  to engines whose first transport is shared weights (the transformers engines), the engines' weights live in
  shared memory that the actor leader maps and writes at each sync: N b on the actor's ranks (the leader's; the
  other actor ranks do not map it), nothing more on the rollout's, whose weights they are.  Shared pages, counted
  in the RSS of each rank that touches them.
- weight-sync slots: to the other engines (vLLM), the two shared-memory slots the bridge keeps between syncs
  (both components), each the largest bucket: the bucket size, or the largest parameter (the embedding,
  V h b) when that is larger.
- runtime: 0.5 GiB per rank: the process with Python, torch and the libraries on a CPU rank (0.36-0.45 GiB
  measured here), about the CUDA context on a GPU.
The parts in TRANSIENT live only during one phase (a colocated rank generates, then trains), so a rank's
peak is its lasting parts plus the largest phase.  An estimate for planning: allocator fragmentation and
framework buffers are not in it.
"""
from __future__ import annotations

from ..models.shape import ModelShape, dtype_bytes

RUNTIME_BYTES = 2 ** 29
TRANSIENT = ("activations", "logits", "kv cache")  # the parts that live during one phase only
LOGIT_COPIES = 3


def activation_bytes(shape: ModelShape, b: int) -> int:
    """Bytes autograd keeps per token and layer (see the module docstring)."""
    i = shape.intermediate or 4 * shape.hidden
    return b * (11 * shape.hidden + 3 * shape.kv_heads * shape.head_dim + (4 if shape.gated else 2) * i)


def trained(shape: ModelShape, param_dtype: str, zero_stage: int, ranks: int, lora: bool, offload: bool,
            micro_batch: int, seq_len: int, checkpointing: bool, logit_positions: int = 0) -> dict[str, int]:
    """A trained model's parts; ``logit_positions`` > 0 adds the logits of that many positions per sequence."""
    b = dtype_bytes(param_dtype)
    n = shape.params
    out = {"weights": n * b // (ranks if zero_stage == 3 else 1)}
    if not lora:
        out["gradients"] = n * b // (ranks if zero_stage >= 2 else 1)
        optim = n * (8 + (4 if b == 2 else 0)) // (ranks if zero_stage >= 1 else 1)
        out["optimizer (CPU)" if offload else "optimizer"] = optim
    tokens = micro_batch * seq_len
    if checkpointing:
        out["activations"] = b * tokens * shape.hidden * shape.layers + activation_bytes(shape, b) * tokens
    else:
        out["activations"] = activation_bytes(shape, b) * tokens * shape.layers
    if logit_positions > 0 and shape.vocab:
        out["logits"] = LOGIT_COPIES * 4 * micro_batch * logit_positions * shape.vocab
    return out


def frozen(shape: ModelShape, param_dtype: str, ranks: int = 1, zero_stage: int = 0) -> dict[str, int]:
    """A frozen model's weights; ZeRO-3 shards them over the ``ranks`` of its role (roles/reference.py)."""
    return {"weights": shape.params * dtype_bytes(param_dtype) // (ranks if zero_stage == 3 else 1)}


def shared_weights(shape: ModelShape, param_dtype: str) -> int:
    """The shared weights of a CPU weight sync to transformers engines: the model
    (distributed/weight_sync/shared.py)."""
    return shape.params * dtype_bytes(param_dtype)


def weight_slots(shape: ModelShape, param_dtype: str, bucket_bytes: int) -> int:
    """The two shared-memory slots of a CPU weight sync: each the largest bucket (distributed/weight_sync/slots.py)."""
    b = dtype_bytes(param_dtype)
    return 2 * max(min(bucket_bytes, shape.params * b), shape.vocab * shape.hidden * b)


def rank_total(role_parts: list[dict[str, int]]) -> int:
    """One rank's peak from the parts of its roles: the lasting parts (not CPU-side ones) of all, plus the
    largest phase (the transient parts of one role), plus the runtime."""
    lasting = sum(v for parts in role_parts for k, v in parts.items() if k not in TRANSIENT and "CPU" not in k)
    phase = max((sum(v for k, v in parts.items() if k in TRANSIENT) for parts in role_parts), default=0)
    return lasting + phase + RUNTIME_BYTES


def gib(n: int) -> str:
    return f"{n / 2 ** 30:.2f} GiB" if n >= 2 ** 24 else f"{n / 2 ** 20:.1f} MiB"
