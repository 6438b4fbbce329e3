"""How the actor, critic and reference cut an RL step's samples into model batches: micro-batches of similar
lengths (the optimizer step's samples unchanged, its gradient the same), results back in the samples' order,
and the output head run only on the positions that predict a picked response token."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from hpc_rlhf.data.batching import chunks
from hpc_rlhf.models.tiny import build_tiny_model
from hpc_rlhf.roles.experience import Experience, collate, response_logits, response_logprobs
from hpc_rlhf.roles.training import combine, micro_batches, optimizer_steps, per_sample

from _dist import run_ranks

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

    def fn(part, batch):  # a [B, R] result that names each sample: its response tokens
        for b, s in enumerate(part):  # the samples given are the batch's rows
            assert batch.tokens[b, :len(s.response_ids)].tolist() == s.response_ids
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


def test_the_output_head_runs_on_the_picked_positions_only(tiny):
    """The head sees one hidden state per picked response token (sample 1's tokens 2-4 masked like feedback):
    41 of the 8 x 17 positions; its logits, log-probs and their gradient equal the full model's, picked."""
    xs = samples()
    xs[1].action_mask = [1, 1, 0, 0, 0, 1, 1, 1, 1]
    batch = collate(xs, 0)
    assert int(batch.picked.sum()) == 38 - 3 and batch.input_ids.shape == (8, 15)
    seen = []
    hook = tiny.lm_head.register_forward_hook(lambda m, args, out: seen.append((args[0].shape, out.shape)))
    got = response_logits(tiny, batch)
    logits = tiny(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                  use_cache=False).logits  # the positions that predict the response tokens, picked by hand:
    full = torch.gather(logits, 1, batch.logit_index.unsqueeze(-1).expand(-1, -1, logits.size(-1)))
    hook.remove()
    V = tiny.config.vocab_size
    assert seen == [(torch.Size([35, 32]), torch.Size([35, V])), (torch.Size([8, 15, 32]), torch.Size([8, 15, V]))]
    torch.testing.assert_close(got, full[batch.picked], rtol=0, atol=1e-5)
    lp = response_logprobs(got, batch)
    expected = torch.log_softmax(full, -1).gather(-1, batch.tokens.unsqueeze(-1)).squeeze(-1) * batch.mask
    torch.testing.assert_close(lp, expected, rtol=0, atol=1e-5)
    assert lp[1].tolist()[2:5] == [0.0, 0.0, 0.0] and lp[7].abs().sum() == 0  # masked; an empty response

    class Engine(torch.nn.Module):  # as a DeepSpeed engine wraps the model: ``.module``
        def __init__(self, module):
            super().__init__()
            self.module = module

        def forward(self, **kwargs):
            return self.module(**kwargs)
    seen.clear()
    hook = tiny.lm_head.register_forward_hook(lambda m, args, out: seen.append(args[0].shape))
    torch.testing.assert_close(response_logits(Engine(tiny), batch), got, rtol=0, atol=0)
    hook.remove()
    assert seen == [torch.Size([35, 32])]
    ga = torch.autograd.grad(lp.sum(), tiny.lm_head.weight, retain_graph=True)[0]
    gb = torch.autograd.grad(expected.sum(), tiny.lm_head.weight)[0]
    torch.testing.assert_close(ga, gb, rtol=1e-4, atol=1e-6)


def test_a_model_without_output_embeddings_gets_its_full_logits_picked():
    class Plain(torch.nn.Module):
        def forward(self, input_ids, attention_mask, position_ids, use_cache):
            return SimpleNamespace(logits=torch.arange(input_ids.numel() * 3.0).view(*input_ids.shape, 3))
    xs = samples()
    batch = collate(xs, 0)
    got = response_logits(Plain(), batch)
    want = []
    for b, s in enumerate(xs):
        p = len(s.prompt_ids)
        for t in range(len(s.response_ids)):  # position p - 1 + t predicts response token t
            want.append([3.0 * (b * batch.input_ids.shape[1] + p - 1 + t) + k for k in range(3)])
    assert got.tolist() == want


def test_spread_puts_the_picked_values_back_in_place():
    xs = samples([(2, 3), (1, 1), (1, 0)])
    xs[0].action_mask = [1, 0, 1]
    batch = collate(xs, 0)
    x = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    out = batch.spread(x)
    assert out.tolist() == [[1.0, 0.0, 2.0], [3.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    (out * torch.tensor([[1.0, 5.0, 2.0], [4.0, 5.0, 5.0], [5.0, 5.0, 5.0]])).sum().backward()
    assert x.grad.tolist() == [1.0, 2.0, 4.0]


def test_an_overhead_cuts_micro_batches_where_padding_costs_more():
    """Totals 15, 12, 11, 8, 8, 6, 5, 3 (68 tokens), at most 4 rows a micro-batch.  Four rows each: 60 + 32 = 92
    positions.  With 4 positions' overhead a micro-batch, (15 | 12, 11 | 8, 8 | 6, 5, 3) costs
    15 + 24 + 16 + 18 + 4 x 4 = 89, tied with (15 | 12, 11 | 8, 8, 6 | 5, 3) (the longer last run wins);
    (15, 12 | 11 | 8, 8, 6 | 5, 3) costs 91, two runs of four 100."""
    xs = samples()
    assert [len(m) for m in micro_batches(xs, 4, 0)] == [4, 4]
    [step] = optimizer_steps(xs, 8, 4, 1, 0, 0, "cpu", overhead=4)
    assert [[total(s) for s in m] for m, _ in step] == [[15], [12, 11], [8, 8], [6, 5, 3]]
    assert sum(b.input_ids.numel() for _, b in step) == 73


def _agreed_cut(rank_shapes):
    from hpc_rlhf.distributed.collectives import world_size
    import torch.distributed as dist
    mine = rank_shapes[dist.get_rank() if world_size() > 1 else 0]
    return [len(m) for m in micro_batches(samples(mine), 4, 4)]


def test_every_rank_makes_as_many_backward_passes_as_the_one_that_needs_most():
    """Rank 0's samples want 4 micro-batches (above); rank 1's eight equal rows want 2 of 4 rows and get 4
    (each backward reduces the gradient over the ranks, so the counts must match): every cut of equal rows
    has 40 positions, and ties go to the longer last run, so 1, 1, 2, 4."""
    equal = [(2, 3)] * 8
    assert _agreed_cut([equal]) == [4, 4]
    assert run_ranks(_agreed_cut, 2, [SHAPES, equal]) == [[1, 2, 2, 3], [1, 1, 2, 4]]


@pytest.mark.parametrize("overhead", [0, 4])
def test_sorted_micro_batches_give_the_gradient_of_one_batch(tiny, overhead):
    """The summed token log-probs of the step's samples: one padded batch of all eight against the optimizer
    step's micro-batches (longest first; of 3 rows, or cut where padding costs more than 4 positions): the same
    loss and gradient."""
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
    [step] = optimizer_steps(xs, 8, 3, 1, 0, 0, "cpu", overhead)
    assert len(step) == (3 if overhead == 0 else 4)
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


def test_positions_trained_counts_each_distinct_prompt_once_where_prompts_are_shared():
    from hpc_rlhf.roles.training import positions_trained
    two = samples([(5, 1), (2, 9)])
    # each sample runs its prompt and response: (5 + 1) + (2 + 9) = 17
    assert positions_trained(two) == 17
    # shared: the two prompts differ, so both run once: 5 + 2 prompt positions and 1 + 9 response positions
    assert positions_trained(two, shared_prompts=True) == 17
    # two samples of one 5-token prompt (responses of 1 and 3 tokens): 5 + 1 + 3 = 9 shared, 6 + 8 = 14 apart
    twins = samples([(5, 1), (5, 3)])
    twins[1].prompt_ids = list(twins[0].prompt_ids)
    assert positions_trained(twins, shared_prompts=True) == 9 and positions_trained(twins) == 14
    assert positions_trained([]) == 0 and positions_trained([], shared_prompts=True) == 0
