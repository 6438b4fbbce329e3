"""The rollout role: turns the step's prompt shard into samples with the generation engine."""
from __future__ import annotations

from transformers import GenerationConfig

from ..config.rl import RLConfig
from ..data.prompts import Prompt
from ..engines.factory import make_engine as build
from ..engines.rollout import SamplingParams
from ..engines.seeds import sample_seed
from ..models.loading import resolve_pretrained
from .experience import Experience


def make_engine(cfg: RLConfig, device):
    r = cfg.rollout
    return build(r, cfg.model.pretrain, cfg.model.param_dtype, device, r.max_batch_size, seed=cfg.train.seed,
                 sleep=r.vllm_sleep, track_checksums=cfg.log.check_weight_sync)


def stop_token_ids(pretrain: str, tokenizer) -> list[int]:
    """The tokenizer's eos and every eos id of the model's generation config (e.g. an end-of-turn token)."""
    ids = {tokenizer.eos_token_id}
    try:
        eos = GenerationConfig.from_pretrained(resolve_pretrained(pretrain)).eos_token_id
        ids |= set(eos if isinstance(eos, list) else [eos])
    except OSError:
        pass  # no generation_config.json
    return sorted(i for i in ids if i is not None)


class Rollout:
    def __init__(self, cfg: RLConfig, tokenizer, device, engine=None):
        self.cfg, self.tokenizer = cfg, tokenizer
        self.engine = engine or make_engine(cfg, device)
        r = cfg.rollout
        self.params = SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                                     max_new_tokens=r.generate_max_len,
                                     stop_token_ids=stop_token_ids(cfg.model.pretrain, tokenizer))

    def generate(self, prompts: list[tuple[int, Prompt]], step: int, n: int, params: SamplingParams | None = None,
                 salt: int = 0) -> list[Experience]:
        """n samples for each (prompt_index, prompt); seeds from (seed, step, prompt, sample)."""
        params = params or self.params
        flat = [(i, p, k) for i, p in prompts for k in range(n)]
        seeds = [sample_seed(self.cfg.train.seed + salt, step, i, k) for i, _, k in flat]
        outs = self.engine.generate([p.prompt_ids for _, p, _ in flat], params, seeds) if flat else []
        return [Experience(prompt_index=i, sample_index=k, prompt_ids=list(p.prompt_ids), response_ids=o.token_ids,
                           engine_logprobs=o.logprobs, finish_reason=o.finish_reason, prompt_text=p.text,
                           response_text=self.tokenizer.decode(o.token_ids, skip_special_tokens=True),
                           label=p.label) for (i, p, k), o in zip(flat, outs)]
