"""Build the configured generation engine (``EngineOptions``) for a model folder.  The one module that imports the
lean engine (``generation/lean/``)."""
from __future__ import annotations

import dataclasses

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


def packs_weights(engine: str, model_type: str) -> bool:
    """Whether ``engine`` (the config's engine option) keeps packed copies of the model's weights beside them (the
    lean decoder's CPU path), which the memory plan counts."""
    return engine in ("auto", "lean") and model_type in LEAN_MODEL_TYPES


def auto_engine(path: str, options: dict) -> HFEngine:
    """``engine: auto``: the lean engine for a model it runs, else the plain transformers engine.  ``options``: the
    keyword arguments of ``transformers_engine`` but ``lean``."""
    return transformers_engine(path, lean=True, **options)


def make_engine(opts, pretrain: str, dtype: str, device, max_batch_size: int, seed: int = 0,
                sleep: bool = False, track_checksums: bool = False) -> RolloutEngine:
    """The engine ``opts`` (``EngineOptions``) names, for the model ``pretrain``."""
    path = resolve_pretrained(pretrain)
    if opts.engine == "vllm":
        v = opts.vllm
        return VllmEngine(path, dtype=dtype, device=str(device), seed=seed, max_model_len=v.max_model_len,
                          max_num_seqs=max_batch_size, cpu_kv_cache_gib=v.cpu_kv_cache_gib,
                          gpu_memory_utilization=v.gpu_memory_utilization, enable_sleep_mode=sleep,
                          track_checksums=track_checksums, tensor_parallel_size=v.tensor_parallel_size)
    options = dict(dtype=dtype, device=str(device), max_batch_size=max_batch_size)
    if opts.engine == "hf":
        return HFEngine(path, **options)
    options |= dataclasses.asdict(opts.lean)
    if opts.engine == "lean":
        return LeanEngine(path, **options)  # a model it does not run: one line naming it
    return auto_engine(path, options)
