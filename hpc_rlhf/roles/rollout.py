"""The rollout role: turns the step's prompt shard into samples with the generation engine."""
from __future__ import annotations

from transformers import GenerationConfig

from ..agents import Request, make_executor
from ..config.rl import AgentConfig, RolloutConfig
from ..config.sections import ModelConfig
from ..data.prompts import Prompt
from ..generation.factory import make_engine as build
from ..generation.engine import sample_seed, SamplingParams
from ..models.paths import resolve_pretrained
from .experience import Experience


def make_engine(rollout: RolloutConfig, model: ModelConfig, seed: int, track_checksums: bool, device):
    """The rollout's engine for the actor ``model`` (``rollout.engine``; ``track_checksums``: log.check_weight_sync)."""
    return build(rollout, model.pretrain, model.param_dtype, device, rollout.max_batch_size, seed=seed,
                 sleep=rollout.vllm.sleep, track_checksums=track_checksums)


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
    def __init__(self, rollout: RolloutConfig, model: ModelConfig, agent: AgentConfig, seed: int,
                 track_checksums: bool, tokenizer, device, engine=None):
        """``model``: the actor's (the weights it starts from); ``seed``: the run's (train.seed); ``agent``: the
        multi-turn environment, if any."""
        self.seed, self.tokenizer = seed, tokenizer
        self.engine = engine or make_engine(rollout, model, seed, track_checksums, device)
        r = rollout
        self.params = SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                                     max_new_tokens=r.generate_max_len, min_new_tokens=r.min_new_tokens,
                                     stop_token_ids=stop_token_ids(model.pretrain, tokenizer))
        self.executor = make_executor(agent, tokenizer, self.params.stop_token_ids)

    def generate(self, prompts: list[tuple[int, Prompt]], step: int, n: int, params: SamplingParams | None = None,
                 salt: int = 0) -> list[Experience]:
        """n samples for each (prompt_index, prompt) by the executor (single- or multi-turn); seeds from (seed,
        step, prompt, sample)."""
        flat = [(i, p, k) for i, p in prompts for k in range(n)]
        requests = [Request(p.prompt_ids, p.text, p.label, sample_seed(self.seed + salt, step, i, k))
                    for i, p, k in flat]
        outs = self.executor.run(self.engine, requests, params or self.params)
        return [Experience(prompt_index=i, sample_index=k, prompt_ids=t.prompt_ids, response_ids=t.response_ids,
                           engine_logprobs=t.logprobs, finish_reason=t.finish_reason, prompt_text=p.text,
                           response_text=self.tokenizer.decode(t.response_ids, skip_special_tokens=True),
                           label=p.label, action_mask=t.action_mask, turn_ends=t.turn_ends,
                           turn_rewards=t.turn_rewards, env_reward=t.reward, env_error=t.error, score=t.score,
                           extra_logs=t.extra_logs) for (i, p, k), t in zip(flat, outs)]
