"""Epoch sampling, micro-batch splitting, padded and packed collation."""
from __future__ import annotations

import pytest
import torch

from hpc_rlhf.data.batching import EpochSampler, cut_longest_first, split_micro_batches
from hpc_rlhf.data.packing import collate_packed, collate_padded, packed_attention_mask
from hpc_rlhf.data.sft import Sample


def sample(n: int, start: int = 1, prompt: int = 2, tag: str = "") -> Sample:
    ids = [(start + i) % 60 + 1 for i in range(n)]
    return Sample(ids, [0] * prompt + [1] * (n - prompt), tag or f"s{n}")


# ---- EpochSampler -------------------------------------------------------------------------------

@pytest.mark.parametrize("n,batch,world", [(10, 4, 2), (8, 4, 4), (3, 8, 2), (7, 7, 1)])
def test_sampler_covers_every_index_each_epoch(n, batch, world):
    samplers = [EpochSampler(n, batch, world, rank, seed=5) for rank in range(world)]
    steps = samplers[0].steps_per_epoch
    assert steps == -(-n // batch)
    assert samplers[0].padded_in_last_step == steps * batch - n
    orders = []
    for epoch in range(2):
        seen = []
        for step in range(steps):
            per_rank = [s.step_indices(epoch, step) for s in samplers]
            assert all(len(p) == batch // world for p in per_rank)
            # rank r holds items r, r+W, ... of the step's global batch
            merged = [per_rank[i % world][i // world] for i in range(batch)]
            seen += merged
        assert len(seen) == steps * batch
        assert set(seen) == set(range(n))
        assert sorted(seen[:n]) == list(range(n))                # the first n positions: a permutation
        assert seen[n:] == (seen[:n] * batch)[:len(seen) - n]   # the wrap repeats the epoch's start
        orders.append(seen[:n])
    if n > 3:
        assert orders[0] != orders[1]                            # a new order every epoch
    again = EpochSampler(n, batch, world, 0, seed=5)
    assert again.step_indices(1, 0) == samplers[0].step_indices(1, 0)


def test_padded_steps_counts_the_epoch_ends_a_run_reaches():
    sampler = EpochSampler(30, 8, 1, 0, seed=0)  # 4 steps per epoch, the 4th repeats 2 samples
    assert sampler.padded_in_last_step == 2
    # steps are 0-based: 3, 7, 11, ... end an epoch
    assert [sampler.padded_steps(0, end) for end in (1, 3, 4, 7, 8, 9)] == [0, 0, 1, 1, 2, 2]
    assert [sampler.padded_steps(start, 8) for start in (3, 4, 7)] == [2, 1, 1]
    assert sampler.padded_steps(4, 7) == 0  # resumed after step 4, stopped by max_steps before step 8
    assert EpochSampler(32, 8, 1, 0, seed=0).padded_steps(0, 8) == 0  # nothing to repeat


def test_sampler_without_shuffle_keeps_the_given_order_every_epoch():
    # 5 items, batches of 2 over 2 ranks: steps take 0 1 | 2 3 | 4 and the wrap's 0; rank 1 the odd places
    s0, s1 = (EpochSampler(5, 2, 2, rank, seed=5, shuffle=False) for rank in (0, 1))
    for epoch in (0, 3):
        assert [s0.step_indices(epoch, k) for k in range(3)] == [[0], [2], [4]]
        assert [s1.step_indices(epoch, k) for k in range(3)] == [[1], [3], [0]]


def test_sampler_rejects_indivisible_batch():
    with pytest.raises(ValueError, match="train_batch_size 10 is not divisible by the number of ranks 4"):
        EpochSampler(100, 10, 4, 0, seed=0)
    with pytest.raises(IndexError):
        EpochSampler(10, 4, 1, 0, seed=0).step_indices(0, 3)


# ---- micro-batches ------------------------------------------------------------------------------

def test_fixed_size_micro_batches():
    samples = [sample(n, tag=str(i)) for i, n in enumerate([5, 6, 7, 8, 9])]
    groups = split_micro_batches(samples, micro_batch_size=2)
    assert [[s.source for s in g] for g in groups] == [["0", "1"], ["2", "3"], ["4"]]
    groups = split_micro_batches(samples, micro_batch_size=4, min_count=3)
    assert [[s.source for s in g] for g in groups] == [["0", "1"], ["2", "3"], ["4"]]


def test_token_budget_micro_batches_and_min_count():
    samples = [sample(n, tag=str(i)) for i, n in enumerate([10, 10, 5, 20, 3, 3])]
    groups = split_micro_batches(samples, token_budget=25)
    assert [[s.source for s in g] for g in groups] == [["0", "1", "2"], ["3", "4"], ["5"]]
    assert all(sum(len(s) for s in g) <= 25 for g in groups)
    for want in (4, 5, 6):
        groups = split_micro_batches(samples, token_budget=25, min_count=want)
        assert len(groups) == want
        assert [s.source for g in groups for s in g] == [str(i) for i in range(6)]   # order kept
        assert all(g for g in groups)
    with pytest.raises(ValueError, match="cannot make 7 micro-batches out of 6 samples"):
        split_micro_batches(samples, token_budget=25, min_count=7)
    with pytest.raises(ValueError, match="exactly one"):
        split_micro_batches(samples)


def test_ranks_get_equal_micro_batch_counts():
    rank0 = [sample(n) for n in [30, 30, 30, 30]]       # 4 groups under a 40-token budget
    rank1 = [sample(n) for n in [5, 5, 5, 5]]           # 1 group
    counts = [len(split_micro_batches(r, token_budget=40)) for r in (rank0, rank1)]
    need = max(counts)                                  # what the trainer's all-reduce(max) gives
    assert [len(split_micro_batches(r, token_budget=40, min_count=need)) for r in (rank0, rank1)] == [4, 4]


# ---- collation ----------------------------------------------------------------------------------

def test_collate_padded_and_packed_layout():
    a = Sample([11, 12, 13], [0, 1, 1], "a")
    b = Sample([21, 22], [0, 1], "b")
    pad = collate_padded([a, b], pad_id=0)
    assert pad.input_ids.tolist() == [[11, 12, 13], [21, 22, 0]]
    assert pad.labels.tolist() == [[-100, 12, 13], [-100, 22, -100]]
    assert pad.attention_mask.tolist() == [[1, 1, 1], [1, 1, 0]]
    assert pad.position_ids.tolist() == [[0, 1, 2], [0, 1, 2]]
    assert pad.seq_lens is None and pad.num_loss_tokens == 3

    packed = collate_packed([a, b])
    assert packed.input_ids.tolist() == [[11, 12, 13, 21, 22]]
    assert packed.labels.tolist() == [[-100, 12, 13, -100, 22]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 1]]
    assert packed.attention_mask is None and packed.seq_lens == [3, 2] and packed.num_loss_tokens == 3
    assert packed.to("cpu").input_ids.tolist() == packed.input_ids.tolist()

    m = packed_attention_mask([3, 2], torch.float32)[0, 0]
    allowed = (m == 0).int().tolist()
    assert allowed == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 1, 1]]
    assert m.min().item() == torch.finfo(torch.float32).min

    with pytest.raises(ValueError, match="loss_mask\\[0\\] is 1"):
        collate_packed([a, Sample([1, 2], [1, 1], "bad")])


def test_packed_equals_padded_on_tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         attn_implementation="sdpa")
    model = LlamaForCausalLM(config).eval()
    samples = [sample(7, start=3, prompt=3), sample(4, start=20, prompt=1), sample(11, start=40, prompt=5)]

    padded = collate_padded(samples, pad_id=0)
    packed = collate_packed(samples)
    # no target crosses a sample boundary: each sample's first token is never a target
    starts = [0, 7, 11]
    assert all(packed.labels[0, t].item() == -100 for t in starts)

    with torch.no_grad():
        out_pad = model(input_ids=padded.input_ids, attention_mask=padded.attention_mask,
                        position_ids=padded.position_ids).logits
        mask4d = packed_attention_mask(packed.seq_lens, out_pad.dtype)
        out_pack = model(input_ids=packed.input_ids, attention_mask=mask4d, position_ids=packed.position_ids).logits

    for b, (s, start) in enumerate(zip(samples, starts)):
        torch.testing.assert_close(out_pack[0, start:start + len(s)], out_pad[b, :len(s)], atol=1e-5, rtol=0)

    def nll(logits, labels):
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(),
                                                 ignore_index=-100, reduction="sum")

    assert packed.num_loss_tokens == padded.num_loss_tokens == sum(s.num_loss_tokens for s in samples)
    torch.testing.assert_close(nll(out_pack, packed.labels), nll(out_pad, padded.labels), atol=1e-5, rtol=0)


def test_cut_longest_first_weighs_padding_against_the_cost_of_a_micro_batch():
    # lengths 10, 9, 3, 2 (longest first), at most 4 rows a run; a run costs rows x its first length + overhead
    # overhead 0: every row alone, 10 + 9 + 3 + 2 = 24 positions (no padding) beats (10, 9 | 3, 2) = 26
    assert cut_longest_first([10, 9, 3, 2], 4, 0) == [1, 1, 1, 1]
    # overhead 2: (10, 9 | 3, 2) = 20 + 6 + 2 x 2 = 30 beats alone 24 + 8 = 32, (10 | 9 | 3, 2) = 25 + 6 = 31
    assert cut_longest_first([10, 9, 3, 2], 4, 2) == [2, 2]
    # overhead 20: one run 40 + 20 = 60 beats (10, 9 | 3, 2) = 26 + 40 = 66
    assert cut_longest_first([10, 9, 3, 2], 4, 20) == [4]
    assert cut_longest_first([10, 9, 3, 2], 1, 20) == [1, 1, 1, 1]  # at most one row a run
    # at most 3 rows: (10, 9 | 3, 2) = 66 beats (10, 9, 3 | 2) = 30 + 2 + 40 = 72 and (10 | 9, 3, 2) = 77
    assert cut_longest_first([10, 9, 3, 2], 3, 20) == [2, 2]
    assert cut_longest_first([2, 2], 2, 0) == [2]  # a tie (4 positions either way): the fewer runs
    assert cut_longest_first([], 4, 1) == []
    # exactly 2 runs (what another rank needs): (10, 9 | 3, 2) = 26 against (10 | 9, 3, 2) 37, (10, 9, 3 | 2) 32
    assert cut_longest_first([10, 9, 3, 2], 4, 0, runs=2) == [2, 2]
    # exactly 3: (10 | 9 | 3, 2) = 25 ties (10, 9 | 3 | 2) = 25: the longer last run
    assert cut_longest_first([10, 9, 3, 2], 4, 0, runs=3) == [1, 1, 2]
    assert cut_longest_first([10, 9, 3, 2], 2, 50, runs=4) == [1, 1, 1, 1]


def test_cut_longest_first_refuses_unsorted_lengths_and_no_rows():
    with pytest.raises(ValueError, match="sorted longest first"):
        cut_longest_first([3, 5], 2, 0)
    with pytest.raises(ValueError, match="max_rows"):
        cut_longest_first([3], 0, 0)
    with pytest.raises(ValueError, match="cannot be cut into 1 runs of at most 2"):
        cut_longest_first([5, 4, 3], 2, 0, runs=1)
    with pytest.raises(ValueError, match="cannot be cut into 4 runs"):
        cut_longest_first([5, 4, 3], 2, 0, runs=4)
