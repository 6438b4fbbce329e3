"""The registry of generation engines (``specs.ENGINES``), the choice among them and their construction.  The one
module that builds the lean engine (``generation/lean/``); importing it loads no engine: an engine's code is imported
when one is built."""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import logging

from ..models.paths import resolve_pretrained
from ..models.shape import model_shape
from .specs import ENGINES, LEAN, TRANSFORMERS, VLLM, EngineSpec

log = logging.getLogger(__name__)
# each engine's class, imported when one is built (vLLM and the lean kernels load nothing before)
IMPLEMENTATIONS = {"hf": "hpc_rlhf.generation.hf:HFEngine", "lean": "hpc_rlhf.generation.lean.engine:LeanEngine",
                   "vllm": "hpc_rlhf.generation.vllm:VllmEngine"}
LEAN_CHECK = "hpc_rlhf.generation.lean.decoder:lean_supported"  # whether the lean engine runs a built model


def vllm_installed() -> bool:
    """Whether vLLM is installed where this process runs (found, not imported: vLLM takes seconds to import)."""
    return importlib.util.find_spec("vllm") is not None


def choose(requested: str, model_type: str, cuda: bool, vllm_found: bool) -> tuple[EngineSpec, str]:
    """The engine ``rollout.engine=requested`` means for a ``model_type`` model on rollout ranks with (``cuda``) or
    without CUDA, where vLLM is installed (``vllm_found``) or not, and why.  ``auto``: vLLM on CUDA when it is
    installed, else the lean engine for the architectures it runs, else the plain transformers engine."""
    if requested != "auto":
        return ENGINES[requested], f"rollout.engine={requested}"
    if cuda and vllm_found:
        return VLLM, "rollout.engine=auto: the rollout ranks have CUDA and vLLM is installed"
    why = "vLLM is not installed" if cuda else "the rollout ranks have no CUDA"
    if LEAN.runs(model_type):
        return LEAN, f"rollout.engine=auto: {why}, and the lean engine runs {model_type} models"
    return TRANSFORMERS, f"rollout.engine=auto: {why}, and the lean engine does not run {model_type} models"


def _resolve(reference: str):
    module, name = reference.split(":")
    return getattr(importlib.import_module(module), name)


def _implementation(spec: EngineSpec):
    return _resolve(IMPLEMENTATIONS[spec.name])


def transformers_engine(model_path_or_module, dtype="fp32", device="cpu", max_batch_size: int = 64, lean: bool = True,
                        cuda_graphs: bool = True, shared_prefix: bool = True, few_row_kernel: bool = True):
    """The in-process transformers engine for a model folder or a built model: the lean engine when ``lean`` and the
    model is one it runs, else the plain one."""
    engine = _implementation(TRANSFORMERS)(model_path_or_module, dtype=dtype, device=device,
                                           max_batch_size=max_batch_size)
    if lean and _resolve(LEAN_CHECK)(engine.model):
        return _implementation(LEAN)(engine.model, dtype=dtype, device=device, max_batch_size=max_batch_size,
                                     cuda_graphs=cuda_graphs, shared_prefix=shared_prefix,
                                     few_row_kernel=few_row_kernel)
    return engine


def engine_choice(opts, pretrain: str, device) -> tuple[EngineSpec, str]:
    """The engine ``opts`` (``EngineOptions``) means for the model ``pretrain`` on ``device``, and why (``choose``)."""
    return choose(opts.engine, model_shape(pretrain).model_type, str(device).startswith("cuda"),
                  vllm_installed())


def make_engine(opts, pretrain: str, dtype: str, device, max_batch_size: int, seed: int = 0,
                sleep: bool = False, track_checksums: bool = False):
    """The engine ``opts`` (``EngineOptions``) asks for on ``device``, as ``engine_choice`` picks it."""
    path = resolve_pretrained(pretrain)
    spec, _ = engine_choice(opts, path, device)
    if spec is VLLM:
        v = opts.vllm
        return _implementation(VLLM)(path, dtype=dtype, device=str(device), seed=seed, max_model_len=v.max_model_len,
                                     max_num_seqs=max_batch_size, cpu_kv_cache_gib=v.cpu_kv_cache_gib,
                                     gpu_memory_utilization=v.gpu_memory_utilization, enable_sleep_mode=sleep,
                                     track_checksums=track_checksums, tensor_parallel_size=v.tensor_parallel_size)
    options = dict(dtype=dtype, device=str(device), max_batch_size=max_batch_size)
    if spec is TRANSFORMERS:
        return _implementation(TRANSFORMERS)(path, **options)
    options |= dataclasses.asdict(opts.lean)
    if opts.engine == "lean":
        return _implementation(LEAN)(path, **options)  # a model it does not run: one line naming it
    engine = transformers_engine(path, lean=True, **options)
    if engine.spec is not LEAN:
        log.warning("the lean engine does not run this model's configuration (a sliding window, a rotary scaling or "
                    "an activation it lacks): the plain transformers engine generates")
    return engine
