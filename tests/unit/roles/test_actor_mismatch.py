"""The actor's loss with an IS correction and the mismatch metrics, on a fake engine whose logits are a leaf
tensor (no model, no DeepSpeed): the gradient of the loss w.r.t. the logits shows which tokens contribute."""
import math
from types import SimpleNamespace

import pytest
import torch

from hpc_rlhf.algorithms.aggregation import StepNorm
from hpc_rlhf.algorithms.rl_algorithm import RLAlgorithm
from hpc_rlhf.config import load_config
from hpc_rlhf.config.base import ConfigError
from hpc_rlhf.config.rl import RLConfig
from hpc_rlhf.roles.actor import Actor
from hpc_rlhf.roles.experience import Experience, collate

BASE = ["pretrain=m", "prompt_data=p.jsonl", "reward_func=r.py"]
V = 5


class FakeEngine(torch.nn.Module):
    def __init__(self, logits: torch.Tensor):
        super().__init__()
        self.logits = torch.nn.Parameter(logits)

    def forward(self, input_ids, attention_mask, position_ids, use_cache):
        return SimpleNamespace(logits=self.logits)


def actor(*overrides: str, logits: torch.Tensor) -> Actor:
    a = Actor.__new__(Actor)  # the loss only needs the config, the engine's forward and the temperature
    a.cfg = load_config(RLConfig, None, BASE + ["loss_agg_mode=token_mean"] + list(overrides))
    a.algo = RLAlgorithm(a.cfg.algo, single_update=True)  # init_kl_coef 0: no KL term
    a.pad_id, a.device, a.world_size, a.temperature = 0, "cpu", 1, 1.0
    a.engine = FakeEngine(logits)
    return a


def samples_and_batch(logits: torch.Tensor, far: tuple[int, int], shift: float):
    """Two samples (responses of 3 and 2 tokens) whose engine log-probs equal the trainer's, except the token
    ``far`` (sample, position), which the engine put ``shift`` nats lower."""
    s = [Experience(0, 0, [1, 2], [3, 4, 1], [], "stop", "", "", None),
         Experience(0, 1, [1, 2], [2, 4], [], "length", "", "", None)]
    batch = collate(s, 0)
    lp = torch.log_softmax(logits.detach(), -1)
    for b, x in enumerate(s):
        pos = batch.logit_index[b, :len(x.response_ids)]
        x.engine_logprobs = lp[b, pos, torch.tensor(x.response_ids)].tolist()
        x.advantages = [1.0 if b == 0 else -0.5] * len(x.response_ids)
    s[far[0]].engine_logprobs[far[1]] -= shift
    return s, batch


def loss_grad(a: Actor, s, batch):
    loss, metrics = a._micro_loss(s, batch, StepNorm.from_masks([batch.mask]))
    loss.backward()
    return a.engine.logits.grad, metrics


@pytest.mark.parametrize("policy_loss", ["ppo", "cispo"])
def test_icepop_drops_the_token_the_engine_disagrees_on(policy_loss):
    torch.manual_seed(0)
    logits = torch.randn(2, 5, V)
    far = (0, 1)  # sample 0, second response token: engine log-prob 3 nats lower, ratio e^3 ≈ 20 > is_high = 2
    s, batch = samples_and_batch(logits, far, 3.0)
    pos = int(batch.logit_index[far])  # the logit position predicting that token
    grads = {}
    for corr in ("none", "icepop"):
        a = actor(f"is_correction={corr}", f"policy_loss={policy_loss}", "eps_clip=1.0", logits=logits.clone())
        grads[corr], metrics = loss_grad(a, s, batch)
        assert metrics["mismatch/max_abs_diff"].item() == pytest.approx(3.0, abs=1e-5)
        # one token of 5 where log π_engine − log π_trainer = −3: k1 = −3/5, k3 = (e^3 − 1 − 3)/5
        assert metrics["mismatch/k1"].item() == pytest.approx(-3.0 / 5, abs=1e-5)
        assert metrics["mismatch/k3"].item() == pytest.approx((math.exp(3.0) - 4.0) / 5, abs=1e-4)
        assert a._mismatch_max == pytest.approx(3.0, abs=1e-5)
    assert metrics["is/masked_frac"].item() == pytest.approx(1 / 5)
    assert grads["none"][0, pos].abs().sum() > 1e-4                 # without the correction it contributes
    assert torch.all(grads["icepop"][0, pos] == 0)                  # with icepop it does not
    other = [(b, int(batch.logit_index[b, t])) for b in range(2) for t in range(int(batch.mask[b].sum()))
             if (b, t) != far]
    for b, p in other:  # every other token keeps exactly its gradient (weight 1: the engine agreed)
        torch.testing.assert_close(grads["icepop"][b, p], grads["none"][b, p])


def test_tis_scales_the_token_and_seq_mask_tis_drops_the_sequence():
    torch.manual_seed(1)
    logits = torch.randn(2, 5, V)
    s, batch = samples_and_batch(logits, (1, 0), 1.5)  # sample 1: ratios e^1.5 ≈ 4.48, 1 → geometric mean 2.1
    grads = {}
    for corr in ("none", "tis", "seq_mask_tis"):
        a = actor(f"is_correction={corr}", "policy_loss=cispo", "eps_clip=1.0", "eps_clip_high=10",
                  logits=logits.clone())
        grads[corr], metrics = loss_grad(a, s, batch)
    p0, p1 = int(batch.logit_index[1, 0]), int(batch.logit_index[1, 1])
    # cispo with an unclipped ratio 1: the token's gradient is linear in its weight: min(4.48, 2) = 2 under tis
    torch.testing.assert_close(grads["tis"][1, p0], 2.0 * grads["none"][1, p0])
    torch.testing.assert_close(grads["tis"][1, p1], grads["none"][1, p1])
    assert torch.all(grads["seq_mask_tis"][1] == 0)               # the whole of sample 1 is dropped
    torch.testing.assert_close(grads["seq_mask_tis"][0], grads["none"][0])
    assert metrics["is/seq_masked_frac"].item() == pytest.approx(0.5)


def test_engine_logprobs_must_match_the_response():
    logits = torch.randn(2, 5, V)
    s, batch = samples_and_batch(logits, (0, 0), 0.0)
    s[1].engine_logprobs = s[1].engine_logprobs[:1]
    a = actor(logits=logits)  # is_correction=none: the metrics alone need them
    with pytest.raises(ValueError, match=r"sample \(prompt 0, sample 1\) has 1 engine_logprobs for 2 response"):
        loss_grad(a, s, batch)


def test_is_correction_refuses_a_sampling_temperature():
    with pytest.raises(ConfigError, match="needs rollout.temperature 1"):
        load_config(RLConfig, None, BASE + ["is_correction=tis", "temperature=0.7"])
