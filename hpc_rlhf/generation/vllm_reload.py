"""vLLM's reload: the worker side of a weight update into vLLM, which ``VllmEngine`` runs in each of vLLM's workers
through ``collective_rpc`` (in its own process with one worker; pickled to each worker process, which keeps its
shard, under tensor parallelism).  The buckets reach the rollout rank by the transport of the weights bridge
(``distributed/weight_sync/``); these three steps put them into the model vLLM generates with: the layerwise reload
begins, each bucket's tensors are loaded by name, and the reload ends by redoing the backend's post-processing of
the loaded weights (on a CPU the linear layers are repacked).  Module-level functions: a worker process imports
them by name."""
from __future__ import annotations

import torch


def begin(worker) -> None:
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload
    initialize_layerwise_reload(worker.model_runner.model)


def load(worker, named: list[tuple[str, torch.Tensor]]) -> None:
    worker.model_runner.model.load_weights(named)


def finish(worker) -> None:
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload
    finalize_layerwise_reload(worker.model_runner.model, worker.model_runner.model_config)
