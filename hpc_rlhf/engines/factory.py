"""Build the configured generation engine (``EngineOptions``) for a model folder."""
from __future__ import annotations

from ..models.loading import resolve_pretrained
from .hf_engine import HFEngine
from .rollout import RolloutEngine
from .vllm_engine import VllmEngine


def make_engine(opts, pretrain: str, dtype: str, device, max_batch_size: int, seed: int = 0,
                sleep: bool = False, track_checksums: bool = False) -> RolloutEngine:
    path = resolve_pretrained(pretrain)
    if opts.engine == "vllm":
        return VllmEngine(path, dtype=dtype, device=str(device), seed=seed, max_model_len=opts.vllm_max_model_len,
                          max_num_seqs=max_batch_size, cpu_kv_cache_gib=opts.vllm_cpu_kv_cache_gib,
                          gpu_memory_utilization=opts.vllm_gpu_memory_utilization, enable_sleep_mode=sleep,
                          track_checksums=track_checksums, tensor_parallel_size=opts.vllm_tensor_parallel_size)
    return HFEngine(path, dtype=dtype, device=str(device), max_batch_size=max_batch_size, lean=opts.lean_decoder,
                    cuda_graphs=opts.cuda_graphs, shared_prefix=opts.shared_prefix,
                    few_row_kernel=opts.few_row_kernel)
