"""`hpc-rlhf generate`: n sampled responses per prompt, sharded over ranks, merged in prompt order.

Sample ``j`` of prompt ``i`` is drawn with ``sample_seed(seed, 0, i, j)`` by an engine whose samples
depend only on their prompt, seed and the weights, so the file is the same on 1 or N ranks (on the
same kind of device).  Prompt ``i`` is the i-th usable prompt over all sources, in order.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from types import SimpleNamespace

from ..config.pipelines import GenDataConfig, GenerateConfig, GenSamplingConfig
from ..data.prompts import build_prompts
from ..data.rows import BadRows, DataError
from ..data.sources import load_source
from ..distributed.process_group import shutdown
from ..generation.factory import engine_choice, make_engine
from ..generation.engine import sample_seed, SamplingParams
from ..models.loading import load_tokenizer
from ..models.paths import resolve_pretrained
from ..roles.rollout import stop_token_ids
from .common import PartWriter, device, join, shard_bounds

log = logging.getLogger("hpc_rlhf.generate")


@dataclass
class GenPrompt:
    index: int
    ids: list[int]
    text: str
    label: str | None


def load_generation_prompts(cfg: GenDataConfig, tokenizer) -> list[GenPrompt]:
    """Every usable prompt of every source, numbered in order; ``prompt_prefix`` goes before the rendered text."""
    bad = BadRows(cfg.bad_rows)
    chat = cfg.apply_chat_template
    out: list[GenPrompt] = []
    for spec in cfg.prompt_data:
        rows, name = load_source(spec, cfg.prompt_split)
        columns = getattr(rows, "column_names", None) or []
        label_key = cfg.label_key if cfg.label_key in columns else None
        shim = SimpleNamespace(apply_chat_template=chat, input_key=cfg.input_key, input_template=cfg.input_template,
                               label_key=label_key, prompt_max_len=cfg.prompt_max_len)
        kept = 0
        for p in build_prompts(rows, name, tokenizer, shim, bad):
            text, ids = p.text, p.prompt_ids
            if cfg.prompt_prefix:
                text = cfg.prompt_prefix + text
                ids = tokenizer(text, add_special_tokens=not chat)["input_ids"]
                if len(ids) > cfg.prompt_max_len:
                    bad.add(name, int(p.source.rsplit(" ", 1)[-1]), "too_long",
                            f"{len(ids)} tokens with the prefix > prompt_max_len {cfg.prompt_max_len}")
                    continue
            out.append(GenPrompt(len(out), ids, text, p.label))
            kept += 1
        if not kept:
            raise DataError(f"{name}: none of its {len(rows)} rows is a usable prompt: {bad.summary(' | ')}")
    if bad.total:
        log.warning("%s", bad.summary())
    if cfg.max_samples is not None:
        out = out[:cfg.max_samples]
    return out


def sampling_params(s: GenSamplingConfig, stop_ids: list[int]) -> SamplingParams:
    return SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_new_tokens=s.max_new_tokens,
                          stop_token_ids=stop_ids)


def run_generate(cfg: GenerateConfig) -> dict:
    de = join(cfg.launch.backend)
    try:
        t0 = time.time()
        tokenizer = load_tokenizer(resolve_pretrained(cfg.model.pretrain), cfg.data.tokenizer_chat_template)
        prompts = load_generation_prompts(cfg.data, tokenizer)
        lo, hi = shard_bounds(len(prompts), de.rank, de.world_size)
        if de.is_main:
            spec, why = engine_choice(cfg.model, cfg.model.pretrain, device(de))
            log.info("engine: %s (%s)", spec.name, why)
        engine = make_engine(cfg.model, cfg.model.pretrain, cfg.model.param_dtype, device(de),
                             cfg.model.max_batch_size, seed=cfg.sampling.seed)
        params = sampling_params(cfg.sampling, stop_token_ids(cfg.model.pretrain, tokenizer))
        n, seed = cfg.sampling.n_samples_per_prompt, cfg.sampling.seed
        chunk = max(1, 4 * cfg.model.max_batch_size // n)  # prompts per engine call: bounded memory, steady output
        writer = PartWriter(cfg.output.output_path, de)
        for start in range(lo, hi, chunk):
            flat = [(p, k) for p in prompts[start:min(hi, start + chunk)] for k in range(n)]
            seeds = [sample_seed(seed, 0, p.index, k) for p, k in flat]
            outs = engine.generate([p.ids for p, _ in flat], params, seeds)
            for (p, k), o in zip(flat, outs):
                row = {"prompt": p.text, "response": tokenizer.decode(o.token_ids, skip_special_tokens=True),
                       "prompt_index": p.index, "sample_index": k, "finish_reason": o.finish_reason}
                if p.label is not None:
                    row["label"] = p.label
                writer.write(row)
            log.info("rank %d: %d/%d prompts generated", de.rank, min(hi, start + chunk) - lo, hi - lo)
        writer.finish()
        stats = {"prompts": len(prompts), "rows": len(prompts) * n, "seconds": round(time.time() - t0, 2)}
        if de.is_main:
            log.info("wrote %s: %s", cfg.output.output_path, stats)
        return stats
    finally:
        if de.world_size > 1:
            shutdown()
