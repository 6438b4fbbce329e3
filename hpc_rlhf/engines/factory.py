"""Build the configured generation engine (``EngineOptions``) for a model folder."""
from __future__ import annotations

from .rollout import RolloutEngine


def make_engine(opts, pretrain: str, dtype: str, device, max_batch_size: int, seed: int = 0,
                sleep: bool = False, track_checksums: bool = False) -> RolloutEngine:
    from ..models.loading import resolve_pretrained
    path = resolve_pretrained(pretrain)
    if opts.engine == "vllm":
        from .vllm_engine import VllmEngine
        return VllmEngine(path, dtype=dtype, device=str(device), seed=seed, max_model_len=opts.vllm_max_model_len,
                          max_num_seqs=max_batch_size, cpu_kv_cache_gib=opts.vllm_cpu_kv_cache_gib,
                          gpu_memory_utilization=opts.vllm_gpu_memory_utilization, enable_sleep_mode=sleep,
                          track_checksums=track_checksums, tensor_parallel_size=opts.vllm_tensor_parallel_size)
    from .hf_engine import HFEngine
    return HFEngine(path, dtype=dtype, device=str(device), max_batch_size=max_batch_size, lean=opts.lean_decoder)
