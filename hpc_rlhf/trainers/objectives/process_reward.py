"""Process reward model (PRM): a causal LM that answers a positive or a negative token at each step placeholder.

The loss is `process_reward_loss` over the logits of the two reward tokens at the placeholder positions (the
logits the model computes at the placeholder token, i.e. its prediction of the token after it), a mean over
every placeholder of the step.  A step's score is softmax([z_neg, z_pos])[1] there.
"""
from __future__ import annotations

import torch

from ...algorithms.reward_model_loss import process_reward_loss
from ...data.process import ProcessSample, load_process_data, single_token_id
from .common import OFFLINE_OBJECTIVES, LossOut, PolicyObjective, StepView
from .per_unit_mean import StepUnits, as_item_mean


def collate_steps(samples: list[ProcessSample], pad_id: int, soft: bool, device):
    """Right-padded ids, attention mask, position ids, the placeholder mask and the step targets [B, T]."""
    b, width = len(samples), max(len(s) for s in samples)
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    attn = torch.zeros((b, width), dtype=torch.long)
    mask = torch.zeros((b, width), dtype=torch.bool)
    targets = torch.zeros((b, width), dtype=torch.float32 if soft else torch.long)
    for i, s in enumerate(samples):
        ids[i, :len(s)] = torch.tensor(s.input_ids, dtype=torch.long)
        attn[i, :len(s)] = 1
        pos = torch.tensor(s.positions, dtype=torch.long)
        mask[i, pos] = True
        targets[i, pos] = torch.tensor(s.labels, dtype=targets.dtype)
    position_ids = torch.arange(width, dtype=torch.long).expand(b, width).clone()
    return tuple(t.to(device) for t in (ids, attn, position_ids, mask, targets))


@OFFLINE_OBJECTIVES.register("prm")
class ProcessRewardModel(PolicyObjective):
    def __init__(self, cfg, de, device, tokenizer):
        super().__init__(cfg, de, device, tokenizer)
        o = cfg.objective
        # (negative, positive): hard label 1 / soft probability s refer to the positive token
        self.reward_ids = (single_token_id(tokenizer, o.negative_token, "objective.negative_token"),
                           single_token_id(tokenizer, o.positive_token, "objective.positive_token"))

    def load_data(self):
        return load_process_data(self.cfg.data, self.tokenizer, self.cfg.train.seed)

    def step_context(self, engine, view: StepView) -> StepUnits:
        return StepUnits(sum(len(s.positions) for s in view.items), len(view.items))

    def loss(self, engine, rows: list, ctx: StepUnits) -> LossOut:
        ids, attn, pos, mask, targets = collate_steps(rows, self.pad_id, self.cfg.data.soft_labels, self.device)
        logits = engine(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=False).logits
        loss, m = process_reward_loss(logits, targets, mask, self.reward_ids)
        steps = float(m["steps"])
        stats = {"accuracy": (float(m["accuracy"]) * steps, steps), "steps_per_row": (steps, float(len(rows)))}
        return LossOut(as_item_mean(loss * steps, ctx, len(rows)), len(rows), stats)
