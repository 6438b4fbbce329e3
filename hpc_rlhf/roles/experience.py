"""What one generated sample carries through the phases of an RL step, and its model-ready batches."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..rewards.types import same_components


@dataclass
class Experience:
    prompt_index: int                 # index of the prompt in the step (its group)
    sample_index: int                 # index among the prompt's n samples
    prompt_ids: list[int]
    response_ids: list[int]           # everything after the prompt: the sampled tokens (stop token included) and,
                                      # multi-turn, the feedback between turns
    engine_logprobs: list[float]      # per response token (0.0 where action_mask is 0)
    finish_reason: str                # "stop" or "length" (a limit cut it)
    prompt_text: str
    response_text: str
    label: str | None
    policy_step: int = 0              # RL steps of training behind the weights that generated it
    reward: float = float("nan")
    reward_valid: bool = True
    prediction: str | None = None     # the answer the reward function extracted (maj@k), None if none
    reward_components: dict[str, float] | None = None  # the named parts of the reward (None: it has none)
    values: list[float] | None = None
    ref_logprobs: list[float] | None = None
    old_logprobs: list[float] | None = None
    advantages: list[float] | None = None
    returns: list[float] | None = None
    extra: dict = field(default_factory=dict)
    # multi-turn (agents/): 1 on sampled tokens, 0 on feedback and template tokens; None = all sampled
    action_mask: list[int] | None = None
    turn_ends: list[int] = field(default_factory=list)      # response index of each turn's last action token
    turn_rewards: list[float] = field(default_factory=list)  # the environment's reward of each turn
    env_reward: float | None = None   # the environment's total reward (None: no environment)
    env_error: str | None = None      # why the environment failed for this sample (it is then invalid)
    score: float | None = None        # what dynamic filtering compares (None: the reward)
    extra_logs: dict = field(default_factory=dict)          # the environment's last extra_logs

    @property
    def uid(self) -> tuple[int, int]:
        """The sample's id within its step: (group, index in the group)."""
        return self.prompt_index, self.sample_index

    @property
    def length(self) -> int:
        """Prompt and response tokens: the positions the sample takes in a batch."""
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def loss_mask(self) -> list[float]:
        """1.0 on the response tokens that carry loss (the sampled ones), 0.0 on the others."""
        if self.action_mask is None:
            return [1.0] * len(self.response_ids)
        return [float(m) for m in self.action_mask]

    @property
    def action_length(self) -> int:
        """Sampled tokens in the response (what response_length counts)."""
        return len(self.response_ids) if self.action_mask is None else sum(self.action_mask)

    def intermediate_rewards(self) -> list[float]:
        """Per response token: each turn's reward on its last action token, for every turn but the last (whose
        reward is in the sample's scalar reward with the rest of the total); zeros for single-turn samples."""
        out = [0.0] * len(self.response_ids)
        for end, r in zip(self.turn_ends[:-1], self.turn_rewards[:-1]):
            out[end] += r
        return out


def reward_component_table(samples: list[Experience]) -> tuple[tuple[str, ...], torch.Tensor] | None:
    """The names of the reward components of ``samples`` and their values [B, K] (0 on the invalid samples); None
    when no valid sample has components.  Valid samples with other names (or none) are a RewardError."""
    named = [s for s in samples if s.reward_valid]
    names = tuple(named[0].reward_components or ()) if named else ()
    for s in named:
        same_components(tuple(s.reward_components or ()), names, "the reward sources", s.uid, named[0].uid)
    if not names:
        return None
    return names, torch.tensor([[s.reward_components[n] for n in names] if s.reward_valid else [0.0] * len(names)
                                for s in samples], dtype=torch.float32).reshape(len(samples), len(names))


def shard_groups(samples: list[Experience], n_ranks: int, index: int) -> list[Experience]:
    """Whole prompt groups, dealt round robin to ``n_ranks`` ranks (group-wise statistics stay local)."""
    groups = sorted({s.prompt_index for s in samples})
    mine = set(groups[index::n_ranks])
    return [s for s in samples if s.prompt_index in mine]


@dataclass
class RLBatch:
    input_ids: torch.Tensor       # [B, T] prompt + response, right padded
    attention_mask: torch.Tensor  # [B, T]
    position_ids: torch.Tensor    # [B, T]
    logit_index: torch.Tensor     # [B, R] positions whose logits predict the response tokens
    tokens: torch.Tensor          # [B, R] response tokens
    mask: torch.Tensor            # [B, R] 1.0 on real response tokens

    @property
    def picked(self) -> torch.Tensor:
        """[B, R] bool: the response tokens that carry loss, whose logits ``response_logits`` returns."""
        return self.mask > 0

    def spread(self, flat: torch.Tensor) -> torch.Tensor:
        """Values [N] of the picked tokens (row-major) -> [B, R], zeros elsewhere; differentiable."""
        return flat.new_zeros(self.mask.shape).masked_scatter(self.picked, flat)


def collate(samples: list[Experience], pad_id: int, device: torch.device | str = "cpu") -> RLBatch:
    T, R = max(s.length for s in samples), max(len(s.response_ids) for s in samples)
    B = len(samples)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    att = torch.zeros((B, T), dtype=torch.long)
    index = torch.zeros((B, R), dtype=torch.long)
    tokens = torch.full((B, R), pad_id, dtype=torch.long)
    mask = torch.zeros((B, R))
    for b, s in enumerate(samples):
        seq = s.prompt_ids + s.response_ids
        ids[b, :len(seq)] = torch.tensor(seq)
        att[b, :len(seq)] = 1
        p, r = len(s.prompt_ids), len(s.response_ids)
        index[b, :r] = torch.arange(p - 1, p - 1 + r)
        tokens[b, :r] = torch.tensor(s.response_ids)
        mask[b, :r] = torch.tensor(s.loss_mask)
    pos = (att.cumsum(1) - 1).clamp(min=0)
    return RLBatch(ids.to(device), att.to(device), pos.to(device), index.to(device), tokens.to(device), mask.to(device))


def response_logits(model: torch.nn.Module, batch: RLBatch) -> torch.Tensor:
    """The logits that predict the picked response tokens, flat [N, V] (``batch.picked`` row-major; what
    ``response_logprobs`` and ``batch.spread`` take).

    The output head runs on those N positions only: a forward pre-hook hands it their hidden states, so no
    prompt, padding or masked position costs an [hidden, vocab] product or a [vocab] row of logits (in a GRPO
    step of SmolLM2-135M on ASDiv: 6547 response tokens in micro-batches of 12240 positions).  Whatever the
    model does to the head's output (a soft cap, a scale) still applies.  A model under a DeepSpeed engine
    (``.module``) or PEFT is reached through ``get_output_embeddings``; one without it gets its full logits,
    picked after."""
    kwargs = dict(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                  use_cache=False)
    picked = batch.picked
    rows, cols = picked.nonzero(as_tuple=True)
    cols = batch.logit_index[rows, cols]
    inner = getattr(model, "module", model)
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    if head is None:
        return model(**kwargs).logits[rows, cols]
    handle = head.register_forward_pre_hook(lambda _module, args: (args[0][rows, cols], *args[1:]))
    try:
        logits = model(**kwargs).logits
    finally:
        handle.remove()
    if logits.dim() != 2 or logits.size(0) != rows.numel():
        raise RuntimeError(f"{type(inner).__name__}'s output head gave logits of shape {tuple(logits.shape)} for "
                           f"{rows.numel()} picked positions: it reshapes the head's output, which "
                           f"response_logits cannot pick from")
    return logits


def response_logprobs(logits: torch.Tensor, batch: RLBatch, temperature: float = 1.0) -> torch.Tensor:
    """log p(response token) [B, R] from the picked tokens' logits [N, V] (``response_logits``); zeros at the
    tokens that are not picked (padding, masked feedback)."""
    z = logits.float()
    if temperature not in (0.0, 1.0):
        z = z / temperature
    logp = torch.log_softmax(z, dim=-1).gather(-1, batch.tokens[batch.picked].unsqueeze(-1)).squeeze(-1)
    return batch.spread(logp)


def padded(rows: list[list[float]], width: int) -> torch.Tensor:
    out = torch.zeros((len(rows), width))
    for b, r in enumerate(rows):
        out[b, :len(r)] = torch.tensor(r, dtype=torch.float32)
    return out


def unpadded(x: torch.Tensor, samples: list[Experience]) -> list[list[float]]:
    return [x[b, :len(s.response_ids)].tolist() for b, s in enumerate(samples)]
