"""train.share_prompts: an optimizer step's distinct prompts run through the model once, and its micro-batches
run their responses only, attending to the prompt pass's keys and values.  The logits and the gradient must be
those of padded batches that run every sample's prompt."""
from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM, MistralConfig

from hpc_rlhf.models.tiny import build_tiny_model
from hpc_rlhf.roles.experience import Experience, collate, response_logits, response_logprobs
from hpc_rlhf.roles.shared_prompts import SharedPrompts, supports
from hpc_rlhf.roles.training import micro_batches, optimizer_steps


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # 4 query heads on 2 key/value heads: the gathered cache goes through grouped-query attention
    path = build_tiny_model(tmp_path_factory.mktemp("shared_prompts"), hidden_size=32, num_layers=2, num_heads=4,
                            num_kv_heads=2, max_position_embeddings=64)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def group_samples(responses=(3, 0, 9, 4, 1, 7, 0, 5, 2)) -> list[Experience]:
    """Sample i has prompt i % 3 (prompts of 5, 2 and 7 tokens) and a response of ``responses[i]`` tokens;
    sample 2 has two feedback tokens (action mask 0), which carry no loss."""
    g = random.Random(0)
    prompts = [[g.randrange(3, 250) for _ in range(n)] for n in (5, 2, 7)]
    out = []
    for i, r in enumerate(responses):
        out.append(Experience(i % 3, i // 3, list(prompts[i % 3]), [g.randrange(3, 250) for _ in range(r)],
                              [0.0] * r, "stop", "", "", None))
    out[2].action_mask = [1, 1, 0, 0, 1, 1, 1, 1, 1]
    return out


def test_each_distinct_prompt_runs_once_and_the_logits_are_the_padded_batches(tiny):
    """Nine samples of three prompts in micro-batches of 4, 3 and 2 rows: the embedding sees the 3 prompts once
    (3 x 7 positions) and then each micro-batch's responses only (B x its longest response); the logits equal
    ``response_logits`` of the padded batches, which run 9 prompts in 9 x (prompt + response) positions."""
    xs = group_samples()
    parts = [xs[:4], xs[4:7], xs[7:]]
    seen = []
    hook = tiny.model.embed_tokens.register_forward_hook(lambda m, args, out: seen.append(tuple(args[0].shape)))
    shared = SharedPrompts(tiny, xs, len(parts), 0, "cpu")
    got = [shared.logits(part, collate(part, 0)) for part in parts]
    assert seen == [(3, 7), (4, 9), (3, 7), (2, 5)] and shared.distinct == 3
    seen.clear()
    want = [response_logits(tiny, collate(part, 0)) for part in parts]
    assert seen == [(4, 16), (3, 14), (2, 9)]
    hook.remove()
    for a, b in zip(got, want):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    assert got[0].shape[0] == 3 + 0 + 7 + 4  # sample 2's two feedback tokens are not picked


def _grads(model, steps):
    model.zero_grad()
    loss = 0.0
    for _part, batch, logits, extra in steps():
        lp = response_logprobs(logits, batch)
        weights = torch.arange(1.0, lp.size(1) + 1) / 10  # a loss that weighs positions differently
        total = (lp * weights).sum()
        (total + extra()).backward()
        loss += float(total.detach())
    return loss, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("closing", [True, False])
def test_the_gradient_over_micro_batches_is_the_padded_batches(tiny, closing):
    """Micro-batches cut by response length (12 | 9, 7 | ... ; the last holds the two empty responses and
    nothing to pick): one backward per micro-batch, the last adding the closing term, gives the gradient of the
    padded batches.  Without the closing term the prompt pass gets only the last micro-batch's share of the
    gradient, and the gradient differs: the term is what carries the others through the prompt pass."""
    xs = group_samples()
    [step] = optimizer_steps(xs, 9, 3, 1, 0, 0, "cpu", 0, responses_only=True)
    assert [[len(s.response_ids) for s in part] for part, _ in step] == [[9, 7, 5], [4, 3, 2], [1, 0, 0]]

    def padded_steps():
        for part, batch in step:
            yield part, batch, response_logits(tiny, collate(part, 0)), lambda: 0.0

    def shared_steps():
        shared = SharedPrompts(tiny, xs, len(step), 0, "cpu")
        for part, batch in step:
            yield part, batch, shared.logits(part, batch), (shared.closing if closing else lambda: 0.0)
    want_loss, want = _grads(tiny, padded_steps)
    got_loss, got = _grads(tiny, shared_steps)
    assert got_loss == pytest.approx(want_loss, rel=1e-5)
    if closing:
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    else:
        assert max(float((a - b).abs().max()) for a, b in zip(got, want)) > 1e-3


def test_the_gradient_is_the_same_bits_run_after_run(tmp_path):
    """128 samples of 16 prompts on 2 threads: the prompt pass's gradient adds each prompt's 8 rows in one order,
    so repeating the step gives the same bits (with ``cache[u]`` the rows were added in a thread-dependent order,
    and an RL run's metrics drifted apart from the first step on).  A layer's gathered keys are 128 x 2 heads x 8
    positions x 32: past torch's 32768-element grain, so 2 threads share the adding."""
    tiny = AutoModelForCausalLM.from_pretrained(
        build_tiny_model(tmp_path, hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=2,
                         max_position_embeddings=64), dtype=torch.float32)
    g = random.Random(1)
    prompts = [[g.randrange(3, 250) for _ in range(8)] for _ in range(16)]
    xs = [Experience(i % 16, i // 16, list(prompts[i % 16]), [g.randrange(3, 250) for _ in range(12)], [0.0] * 12,
                     "stop", "", "", None) for i in range(128)]
    [step] = optimizer_steps(xs, 128, 128, 1, 0, 0, "cpu", 0, responses_only=True)

    def shared_steps():
        shared = SharedPrompts(tiny, xs, len(step), 0, "cpu")
        for part, batch in step:
            yield part, batch, shared.logits(part, batch), shared.closing
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _, first = _grads(tiny, shared_steps)
        repeats = [_grads(tiny, shared_steps)[1] for _ in range(5)]
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for grads in repeats for a, b in zip(first, grads))


def test_micro_batches_cut_by_response_length_where_prompts_run_apart():
    """Responses 12, 9, 7, 4, 3, 2, 1, 0 (prompts of 2-6 tokens, which no longer pad anything), at most 4 rows
    and 4 positions' overhead a micro-batch: (12 | 9, 7 | 4, 3 | 2, 1, 0) costs 12 + 18 + 8 + 6 + 4 x 4 = 60,
    tied with (12 | 9, 7 | 4, 3, 2 | 1, 0) (the longer last run wins); two runs of four cost 48 + 12 + 8 = 68."""
    shapes = [(5, 1), (2, 9), (4, 4), (3, 12), (6, 2), (2, 3), (5, 7), (3, 0)]
    xs = [Experience(i, 0, [7] * p, [9] * r, [0.0] * r, "stop", "", "", None) for i, (p, r) in enumerate(shapes)]
    assert [[len(s.response_ids) for s in m] for m in micro_batches(xs, 4, 0, responses_only=True)] == \
        [[12, 9, 7, 4], [3, 2, 1, 0]]
    assert [[len(s.response_ids) for s in m] for m in micro_batches(xs, 4, 4, responses_only=True)] == \
        [[12], [9, 7], [4, 3], [2, 1, 0]]


def test_which_models_share_their_prompts(tiny):
    assert supports(tiny) is None
    sliding = AutoModelForCausalLM.from_config(MistralConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, sliding_window=4))
    assert "other than full attention" in supports(sliding)
    tiny.activation_checkpointing_enable()
    try:
        assert "gradient checkpointing" in supports(tiny)
    finally:
        tiny.activation_checkpointing_disable()
    assert "no output head" in supports(torch.nn.Linear(2, 2))


def test_an_empty_prompt_is_named():
    xs = group_samples()
    xs[4].prompt_ids = []
    with pytest.raises(ValueError, match=r"sample \(prompt 1, sample 1\) has an empty prompt"):
        SharedPrompts(torch.nn.Linear(2, 2), xs, 1, 0, "cpu")


def test_per_sample_log_probs_share_one_prompt_pass(tiny):
    """The reference's and the actor's old log-probs (no gradient): one prompt pass for the call, then
    micro-batches of 4 responses cut longest first (9, 7, 5, 4 | 3, 2, 1, 0 | 0), the same log-probs per sample
    as without sharing; samples whose prompts all differ run as before."""
    from hpc_rlhf.roles.shared_prompts import logprobs_per_sample
    xs = group_samples()
    seen = []
    hook = tiny.model.embed_tokens.register_forward_hook(lambda m, args, out: seen.append(tuple(args[0].shape)))
    got = logprobs_per_sample(tiny, xs, 4, 0, "cpu", 1.0, share=True)
    assert seen == [(3, 7), (4, 9), (4, 3), (1, 1)]
    seen.clear()
    want = logprobs_per_sample(tiny, xs, 4, 0, "cpu", 1.0, share=False)
    assert seen == [(4, 16), (4, 8), (1, 2)]  # prompt + response: 16, 14, 9, 9 | 8, 7, 5, 3 | 2
    hook.remove()
    assert [len(r) for r in got] == [len(s.response_ids) for s in xs]
    for a, b in zip(got, want):
        assert a == pytest.approx(b, abs=1e-5)
    assert got[2][2:4] == [0.0, 0.0]  # feedback tokens
    seen.clear()
    hook = tiny.model.embed_tokens.register_forward_hook(lambda m, args, out: seen.append(tuple(args[0].shape)))
    logprobs_per_sample(tiny, xs[:3], 4, 0, "cpu", 1.0, share=True)
    hook.remove()
    assert seen == [(3, 16)]


def test_the_actor_shares_only_where_the_prompt_pass_fits_a_micro_batch():
    """Nine samples of three prompts: repeated; with micro-batches of 2 rows the three prompts' pass, which lives
    until the optimizer step's last backward, would outweigh a micro-batch of whole samples; all distinct: no
    repeat to share."""
    from hpc_rlhf.roles.shared_prompts import worth_sharing
    xs = group_samples()
    assert worth_sharing(xs, 0) and worth_sharing(xs, 0, 3) and not worth_sharing(xs, 0, 2)
    assert not worth_sharing(xs[:3], 0) and not worth_sharing(xs[:3], 0, 16)


def test_sharing_pays_from_the_positions_it_saves():
    """Prompts of 5, 2 and 7 tokens, three samples each: 42 prompt positions, 14 of them distinct, so one pass per
    prompt saves 28; sharing pays from min_positions 28 down, not at 29.  Samples whose prompts all differ save
    nothing, and an empty list saves nothing."""
    from hpc_rlhf.roles.shared_prompts import saved_positions, worth_sharing
    xs = group_samples()
    assert saved_positions(xs) == 3 * (5 + 2 + 7) - (5 + 2 + 7) == 28
    assert worth_sharing(xs, 28) and not worth_sharing(xs, 29)
    assert saved_positions(xs[:3]) == 0 and saved_positions([]) == 0
    assert saved_positions(xs[:4]) == 5  # prompt 0 twice: its 5 positions once more
    assert worth_sharing(xs[:4], 5) and not worth_sharing(xs[:4], 6)
    eight = [Experience(0, i, [7] * 7, [9], [0.0], "stop", "", "", None) for i in range(8)]
    assert saved_positions(eight) == 49  # the toy benchmark's step: 8 samples of a 7-token prompt
    from hpc_rlhf.config.rl import RLTrainConfig
    assert RLTrainConfig().share_prompts_min_positions == 128 and not worth_sharing(eight, 128)


@pytest.fixture(scope="module")
def critic_model(tmp_path_factory):
    from hpc_rlhf.roles.critic import load_value_model
    path = build_tiny_model(tmp_path_factory.mktemp("shared_values"), hidden_size=32, num_layers=2, num_heads=4,
                            num_kv_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = load_value_model(str(path), "fp32")
    torch.nn.init.normal_(model.score.weight, std=0.5)  # a score head that tells positions apart
    return model


def test_token_values_are_the_score_head_at_the_positions_that_predict_the_response(critic_model):
    """V at response position j is the score head on the hidden state of the position before response token j
    (the prompt's last position for j = 0): computed here from the base model's hidden states by hand, zero at
    feedback tokens and padding."""
    from hpc_rlhf.roles.critic import ValueHeadModel, token_values
    xs = group_samples()
    batch = collate(xs, 0)
    got = token_values(ValueHeadModel(critic_model), batch)
    for b, s in enumerate(xs):
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        with torch.no_grad():
            hidden = critic_model.base_model(input_ids=ids).last_hidden_state[0]
            v = critic_model.score(hidden).squeeze(-1)
        P, R = len(s.prompt_ids), len(s.response_ids)
        want = torch.zeros(got.size(1))
        want[:R] = v[P - 1:P - 1 + R] * torch.tensor(s.action_mask or [1] * R, dtype=torch.float32)
        torch.testing.assert_close(got[b].detach(), want, rtol=0, atol=1e-5)


def test_the_critic_shares_its_prompt_pass_with_the_same_values_and_gradient(critic_model):
    """The critic's value model through SharedPrompts (``ValueHeadModel``: the score head as the output head):
    each micro-batch's values equal the padded batches', and the gradient of a value loss over the micro-batches,
    the last adding the closing term, equals the padded batches' (without the term it differs)."""
    from hpc_rlhf.roles.critic import ValueHeadModel, spread_values, token_values
    model = ValueHeadModel(critic_model)
    assert supports(model) is None
    xs = group_samples()
    [step] = optimizer_steps(xs, 9, 3, 1, 0, 0, "cpu", 0, responses_only=True)

    def grads(shared: bool, closing: bool = True):
        critic_model.zero_grad()
        values, sp = [], SharedPrompts(model, xs, len(step), 0, "cpu") if shared else None
        for part, batch in step:
            v = spread_values(sp.logits(part, batch), batch) if shared else token_values(model, batch)
            target = torch.arange(1.0, v.size(1) + 1) / 10
            loss = ((v - target) ** 2 * batch.mask).sum()
            (loss + (sp.closing() if shared and closing else 0.0)).backward()
            values.append(v.detach())
        return values, [p.grad.clone() for p in critic_model.parameters()]
    want_v, want_g = grads(False)
    got_v, got_g = grads(True)
    for a, b in zip(got_v, want_v):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)

    def off(gs):  # the largest difference from the padded gradient, relative to that tensor's largest entry
        return max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(gs, want_g))
    assert off(got_g) < 1e-4
    assert off(grads(True, closing=False)[1]) > 1e-2
    critic_model.activation_checkpointing_enable()
    try:
        assert "gradient checkpointing" in supports(model)
    finally:
        critic_model.activation_checkpointing_disable()
