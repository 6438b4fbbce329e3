"""What each generation engine declares without being loaded: the architectures it runs, the weight transports it
takes and its memory model.  The factory builds engines from these and `hpc-rlhf plan` counts
their memory; neither imports an engine's code (torch, vLLM, the lean kernels) to read them."""
from __future__ import annotations

from dataclasses import dataclass

from ..models.shape import ModelShape, dtype_bytes

# the weight transports of a CPU bridge (distributed/weight_sync/): an engine names those it takes, preferred first;
# the broadcast, which every engine takes, is the last resort and the only transport of a GPU bridge
SHARED, SLOTS, BROADCAST = "shared", "slots", "broadcast"


@dataclass(frozen=True)
class EngineSpec:
    name: str
    transports: tuple[str, ...]
    model_types: tuple[str, ...] | None = None  # the architectures it runs (None: whatever transformers builds)

    def runs(self, model_type: str) -> bool:
        return self.model_types is None or model_type in self.model_types

    def memory(self, shape: ModelShape, param_dtype: str, rows: int, seq: int, *, cpu_kv_cache_gib: int = 0,
               on_cpu: bool = True) -> dict[str, int]:
        """Bytes of one rollout rank's engine: the weights and the key/value cache of ``rows`` sequences of ``seq``
        tokens (the cache lives while it generates)."""
        b = dtype_bytes(param_dtype)
        kv = 2 * shape.layers * shape.kv_heads * shape.head_dim * b * rows * seq
        return {"weights": shape.params * b, "kv cache": kv}


@dataclass(frozen=True)
class LeanSpec(EngineSpec):
    def memory(self, shape: ModelShape, param_dtype: str, rows: int, seq: int, *, cpu_kv_cache_gib: int = 0,
               on_cpu: bool = True) -> dict[str, int]:
        """The transformers engine's, plus the packed copy of the linear weights the lean decoder keeps (all but the
        input embedding, whose transpose is the head when they are tied)."""
        parts = super().memory(shape, param_dtype, rows, seq)
        packed = (shape.params - (0 if shape.tied else shape.vocab * shape.hidden)) * dtype_bytes(param_dtype)
        return {"weights": parts["weights"], "packed weights": packed, "kv cache": parts["kv cache"]}


@dataclass(frozen=True)
class VllmSpec(EngineSpec):
    def memory(self, shape: ModelShape, param_dtype: str, rows: int, seq: int, *, cpu_kv_cache_gib: int = 0,
               on_cpu: bool = True) -> dict[str, int]:
        """On a CPU the cache vLLM reserves (``rollout.vllm.cpu_kv_cache_gib``), which lasts; on a GPU the cache of
        ``rows`` sequences of ``seq`` tokens, within the share of the GPU vLLM takes."""
        parts = super().memory(shape, param_dtype, rows, seq)
        if on_cpu:
            return {"weights": parts["weights"], "kv cache (preallocated)": cpu_kv_cache_gib * 2 ** 30}
        return parts


TRANSFORMERS = EngineSpec("hf", (SHARED, SLOTS, BROADCAST))
LEAN = LeanSpec("lean", (SHARED, SLOTS, BROADCAST), model_types=("llama", "qwen2", "mistral"))
VLLM = VllmSpec("vllm", (SLOTS, BROADCAST))
ENGINES = {spec.name: spec for spec in (VLLM, LEAN, TRANSFORMERS)}
