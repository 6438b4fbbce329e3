"""How the actor, critic and reference cut an RL step's samples into model batches: micro-batches of similar
lengths (the optimizer step's samples unchanged, its gradient the same), results back in the samples' order,
and logits computed only from the first position that predicts a response token."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from hpc_rlhf.data.batching import chunks
from hpc_rlhf.models.tiny import build_tiny_model
from hpc_rlhf.roles.experience import (Experience, collate, gather_positions, response_logits, response_logprobs,
                                       takes_logits_to_keep)
from hpc_rlhf.roles.training import combine, optimizer_steps, per_sample

# (prompt length, response length) of eight samples: the shortest prompt has 2 tokens
SHAPES = [(5, 1), (2, 9), (4, 4), (3, 12), (6, 2), (2, 3), (5, 7), (3, 0)]


def samples(shapes=SHAPES) -> list[Experience]:
    out = []
    for i, (p, r) in enumerate(shapes):
        g = random.Random(i)
        out.append(Experience(i // 2, i % 2, [g.randrange(3, 250) for _ in range(p)],
                              [g.randrange(3, 250) for _ in range(r)], [0.0] * r, "stop", "", "", None))
    return out


def total(s: Experience) -> int:
    return len(s.prompt_ids) + len(s.response_ids)


def test_each_optimizer_step_keeps_its_shuffled_samples_cut_longest_first():
    xs = samples()
    steps = optimizer_steps(xs, per_rank_batch=4, micro=2, epochs=2, seed=3, pad_id=0, device="cpu")
    assert len(steps) == 4  # 2 epochs x 8 samples / 4 per optimizer step
    for k, step in enumerate(steps):
        epoch, j = divmod(k, 2)
        order = list(xs)
        random.Random(3 * 1000 + epoch).shuffle(order)
        expected = order[4 * j:4 * j + 4]  # the shuffle decides which samples share an optimizer step
        got = [s for micro, _ in step for s in micro]
        assert sorted(map(id, got)) == sorted(map(id, expected))
        lengths = [total(s) for s in got]
        assert lengths == sorted(lengths, reverse=True)
        for micro, batch in step:
            assert batch.input_ids.shape == (len(micro), max(map(total, micro)))
    # epoch 0 shuffles the totals to (15, 11, 5, 8 | 12, 6, 3, 8): cut as they come, the micro-batches are
    # 2 x 15 + 2 x 8 + 2 x 12 + 2 x 8 = 86 positions; longest first (15, 11 | 8, 5 | 12, 8 | 6, 3),
    # 2 x 15 + 2 x 8 + 2 x 12 + 2 x 6 = 82 (the real tokens: 68)
    assert [[total(s) for m, _ in step for s in m] for step in steps[:2]] == [[15, 11, 8, 5], [12, 8, 6, 3]]
    assert sum(b.input_ids.numel() for step in steps[:2] for _, b in step) == 82


def test_per_sample_returns_each_samples_row_in_the_order_given():
    xs = samples()
    seen = []

    def fn(batch):  # a [B, R] result that names each sample: its response tokens
        seen.append(batch.input_ids.shape[1])
        return batch.tokens.float()
    out = per_sample(torch.nn.Linear(1, 1), xs, 3, 0, "cpu", fn)
    assert out == [[float(t) for t in s.response_ids] for s in xs]
    assert seen == [max(map(total, part)) for part in chunks(sorted(xs, key=lambda s: -total(s)), 3)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("rl_batches"), hidden_size=32, num_layers=2, num_heads=4,
                            max_position_embeddings=64)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def test_response_logits_start_at_the_shortest_prompts_last_position(tiny):
    xs = samples()
    batch = collate(xs, 0)
    assert batch.logit_start == 1  # the shortest prompt has 2 tokens: position 1 predicts its first response token
    assert takes_logits_to_keep(tiny) and takes_logits_to_keep(SimpleNamespace(module=tiny))
    kept = []
    hook = tiny.register_forward_pre_hook(lambda m, a, kw: kept.append(kw.get("logits_to_keep")), with_kwargs=True)
    with torch.no_grad():
        got = response_logits(tiny, batch)
        full = gather_positions(tiny(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                                     position_ids=batch.position_ids, use_cache=False).logits, batch)
    hook.remove()
    assert kept == [batch.input_ids.shape[1] - 1, None] and got.shape == full.shape
    m = batch.mask.bool()
    torch.testing.assert_close(got[m], full[m], rtol=0, atol=1e-5)
    torch.testing.assert_close(response_logprobs(got, batch), response_logprobs(full, batch), rtol=0, atol=1e-5)


def test_a_model_without_logits_to_keep_gets_every_position():
    class Plain(torch.nn.Module):
        def forward(self, input_ids, attention_mask, position_ids, use_cache):
            return SimpleNamespace(logits=torch.arange(input_ids.numel() * 3.0).view(*input_ids.shape, 3))
    xs = samples()
    batch = collate(xs, 0)
    assert not takes_logits_to_keep(Plain())
    got = response_logits(Plain(), batch)
    for b, s in enumerate(xs):
        p = len(s.prompt_ids)
        for t in range(len(s.response_ids)):  # position p - 1 + t predicts response token t
            assert got[b, t].tolist() == [3.0 * (b * batch.input_ids.shape[1] + p - 1 + t) + k for k in range(3)]


def test_sorted_micro_batches_give_the_gradient_of_one_batch(tiny):
    """The summed token log-probs of the step's samples: one padded batch of all eight against the optimizer
    step's micro-batches (longest first, logits from the shortest prompt on): the same loss and gradient."""
    xs = samples()

    def grads(parts):
        tiny.zero_grad()
        loss = 0.0
        for part in parts:
            batch = collate(part, 0)
            lp = response_logprobs(response_logits(tiny, batch), batch).sum()
            lp.backward()
            loss += float(lp.detach())
        return loss, [p.grad.clone() for p in tiny.parameters()]
    [step] = optimizer_steps(xs, 8, 3, 1, 0, 0, "cpu")
    one_loss, one = grads([xs])
    cut_loss, cut = grads([micro for micro, _ in step])
    assert cut_loss == pytest.approx(one_loss, rel=1e-6)
    for a, b in zip(one, cut):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_combine_sums_seconds_and_averages_the_rest():
    # two optimizer steps of one call: the loss is a mean (0.5 + 1.5) / 2; the seconds add (0.25 + 0.5)
    history = [{"loss": 0.5, "grad_norm": 2.0, "forward_s": 0.25}, {"loss": 1.5, "grad_norm": 4.0, "forward_s": 0.5}]
    assert combine(history) == {"loss": 1.0, "grad_norm": 3.0, "forward_s": 0.75}
    assert combine(history[:1]) == history[0]
