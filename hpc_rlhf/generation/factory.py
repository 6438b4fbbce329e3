"""Build the configured generation engine (``EngineOptions``) for a model folder.  The one module that imports the
lean engine (``generation/lean/``)."""
from __future__ import annotations

from ..models.loading import resolve_pretrained
from .engine import RolloutEngine
from .hf import HFEngine
from .lean.decoder import SUPPORTED as LEAN_MODEL_TYPES
from .lean.decoder import lean_supported
from .lean.engine import LeanEngine
from .vllm import VllmEngine


def transformers_engine(model_path_or_module, dtype="fp32", device="cpu", max_batch_size: int = 64, lean: bool = True,
                        cuda_graphs: bool = True, shared_prefix: bool = True, few_row_kernel: bool = True) -> HFEngine:
    """The in-process transformers engine for a model folder or a built model: the lean engine when ``lean`` and the
    model is one it runs, else the plain one."""
    engine = HFEngine(model_path_or_module, dtype=dtype, device=device, max_batch_size=max_batch_size)
    if lean and lean_supported(engine.model):
        return LeanEngine(engine.model, dtype=dtype, device=device, max_batch_size=max_batch_size,
                          cuda_graphs=cuda_graphs, shared_prefix=shared_prefix, few_row_kernel=few_row_kernel)
    return engine


def packs_weights(engine: str, lean: bool, model_type: str) -> bool:
    """Whether the engine keeps packed copies of the model's weights beside them (the lean decoder's CPU path),
    which the memory plan counts."""
    return engine == "hf" and lean and model_type in LEAN_MODEL_TYPES


def make_engine(opts, pretrain: str, dtype: str, device, max_batch_size: int, seed: int = 0,
                sleep: bool = False, track_checksums: bool = False) -> RolloutEngine:
    path = resolve_pretrained(pretrain)
    if opts.engine == "vllm":
        return VllmEngine(path, dtype=dtype, device=str(device), seed=seed, max_model_len=opts.vllm_max_model_len,
                          max_num_seqs=max_batch_size, cpu_kv_cache_gib=opts.vllm_cpu_kv_cache_gib,
                          gpu_memory_utilization=opts.vllm_gpu_memory_utilization, enable_sleep_mode=sleep,
                          track_checksums=track_checksums, tensor_parallel_size=opts.vllm_tensor_parallel_size)
    return transformers_engine(path, dtype=dtype, device=str(device), max_batch_size=max_batch_size,
                               lean=opts.lean_decoder, cuda_graphs=opts.cuda_graphs, shared_prefix=opts.shared_prefix,
                               few_row_kernel=opts.few_row_kernel)
