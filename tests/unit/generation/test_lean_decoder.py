"""The lean decoder computes the transformers forward: same logits, prefill and decode, padded rows."""
import pytest
import torch

from hpc_rlhf.generation.engine import SamplingParams
from hpc_rlhf.generation.factory import transformers_engine
from hpc_rlhf.generation.hf import HFEngine
from hpc_rlhf.generation.lean import few_rows
from hpc_rlhf.generation.lean.decoder import LeanDecoder, Packed, _matmul, lean_supported, onednn_products


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_lean_logits_match_transformers(tmp_path, arch):
    from transformers import AutoModelForCausalLM

    from hpc_rlhf.models.tiny import build_tiny_model
    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(
        tmp_path / arch, arch=arch, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
        max_position_embeddings=64, seed=1)).eval()
    assert lean_supported(model)
    prompts = [[5, 6, 7, 8, 9], [11, 12], [13, 14, 15]]
    width = 5
    ids = torch.tensor([[257] * (width - len(p)) + p for p in prompts])
    valid = torch.tensor([[False] * (width - len(p)) + [True] * len(p) for p in prompts])
    pos = (valid.long().cumsum(-1) - 1).clamp(min=0)
    lean = LeanDecoder(model)
    lean.start(3, width + 3, torch.float32, torch.device("cpu"))
    seqs = [list(p) for p in prompts]
    with torch.no_grad():
        got = lean.forward(ids, pos, valid)
        for _ in range(3):
            for b, seq in enumerate(seqs):  # each row alone through transformers, no padding at all
                want = model(torch.tensor([seq])).logits[0, -1]
                torch.testing.assert_close(got[b], want, atol=1e-5, rtol=1e-5)
            nxt = got.argmax(-1)
            for b in range(3):
                seqs[b].append(int(nxt[b]))
            next_pos = torch.tensor([[len(s) - 1] for s in seqs])
            got = lean.forward(nxt[:, None], next_pos, torch.ones((3, 1), dtype=torch.bool))


def test_fixed_shape_step_is_the_decode_forward(tmp_path, monkeypatch):
    """``step_at`` (what a CUDA graph replays: one token per row at a cache slot given as a tensor, attending over
    the whole cache) gives the logits of ``forward`` step after step, after a prefill of padded rows expanded to
    their samples by ``select_rows``; run twice at one slot with the same inputs (the graph's warm-up, then its
    first replay) it leaves the cache as one run does."""
    from transformers import AutoModelForCausalLM

    from hpc_rlhf.models.tiny import build_tiny_model
    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(
        tmp_path / "m", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, max_position_embeddings=64,
        seed=4)).eval()
    prompts, width, steps = [[5, 6, 7, 8, 9], [11, 12]], 5, 4
    ids = torch.tensor([[257] * (width - len(p)) + p for p in prompts])
    valid = torch.tensor([[False] * (width - len(p)) + [True] * len(p) for p in prompts])
    pos = (valid.long().cumsum(-1) - 1).clamp(min=0)
    rows = torch.tensor([0, 0, 1, 1, 1])
    eager, fixed = LeanDecoder(model, shared_prefix_min_elements=0), LeanDecoder(model, shared_prefix_min_elements=0)
    monkeypatch.setattr(fixed, "graphed", lambda device: True)  # select_rows zeroes the slots not yet written
    with torch.no_grad():
        for dec in (eager, fixed):
            dec.start(2, width + steps + 1, torch.float32, torch.device("cpu"))
            dec.forward(ids, pos, valid)
            dec.select_rows(rows)
        for d in (fixed.keys, fixed.values):  # unwritten slots hold zeros, not whatever memory was there
            assert all(bool((t[:, :, width:] == 0).all()) for t in d)
        tokens, positions = torch.tensor([[3], [4], [5], [6], [7]]), pos[:, -1:].index_select(0, rows) + 1
        for step in range(steps):
            want = eager.forward(tokens, positions, torch.ones_like(tokens, dtype=torch.bool))
            slot = torch.tensor([fixed.length])
            got = fixed.step_at(tokens, positions, slot)
            if step == 0:
                keys = [t.clone() for t in fixed.keys]
                again = fixed.step_at(tokens, positions, slot)
                torch.testing.assert_close(again, got, atol=0, rtol=0)
                assert all(torch.equal(a, b) for a, b in zip(keys, fixed.keys))
            fixed.length += 1
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            tokens, positions = want.argmax(-1, keepdim=True), positions + 1
        # the eager decoder on the CPU shares the prompts' prefix: its own slots start after it
        assert fixed.prefix is None and eager.prefix is not None and eager.offset == width
        assert bool(fixed.key_valid[:, :width].equal(valid.index_select(0, rows)))
        assert bool(fixed.key_valid[:, width:width + steps].all()) and bool(eager.key_valid[:, :steps].all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_the_llama_norm(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from hpc_rlhf.generation.lean.decoder import _rms
    g = torch.Generator().manual_seed(0)
    norm = LlamaRMSNorm(64, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64, generator=g) * 0.5 + 1)
    norm = norm.to(dtype)
    x = (torch.randn(3, 5, 64, generator=g) * 3).to(dtype)
    got = _rms(x, norm)
    assert got.dtype == dtype
    tol = 0 if dtype == torch.bfloat16 else 1e-6  # bf16: the same single rounding, bit for bit
    torch.testing.assert_close(got, norm(x), rtol=tol, atol=tol)


@pytest.mark.parametrize("T", [1, 4])
def test_grouped_attention_is_gqa_attention(T):
    """Query heads folded into their key/value head's rows give what enable_gqa gives, with a padding mask
    (decode: one mask row, broadcast) and a causal one (prefill: T rows)."""
    import torch.nn.functional as F

    from hpc_rlhf.generation.lean.decoder import grouped_attention
    g = torch.Generator().manual_seed(T)
    B, nq, nkv, S, D = 3, 6, 2, 7, 8
    q, k, v = (torch.randn(B, h, n, D, generator=g) for h, n in ((nq, T), (nkv, S), (nkv, S)))
    valid = torch.rand(B, S, generator=g) > 0.3
    valid[:, -1] = True
    if T == 1:
        mask = valid[:, None, None, :]
    else:  # query t sits at key position S - T + t
        causal = torch.arange(S)[None, :] <= torch.arange(S - T, S)[:, None]
        mask = (causal[None] & valid[:, None, :])[:, None]
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(grouped_attention(q, k, v, mask, 0.3), want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("rows", [[0, 0, 0, 1, 1, 1], [0, 0, 2, 2, 2], [2, 0, 2, 0, 0]])
def test_split_attention_is_attention_over_prefix_and_row(T, rows):
    """Each row's queries over its prefix (padding masked) and then its own keys, computed in two parts merged
    by their log-sum-exps, equal attention over the two concatenated: rows in prefix order with as many per
    prefix (no slot map), uneven and unordered ones, and a prefix that no row reads (prefix 1, dropped)."""
    import torch.nn.functional as F

    from hpc_rlhf.generation.lean.decoder import SharedPrefix, split_attention
    g = torch.Generator().manual_seed(len(rows) + T)
    B, U, nq, nkv, P, S, D = len(rows), 3, 6, 2, 5, 4, 8
    pk, pv = (torch.randn(U, nkv, P, D, generator=g) for _ in range(2))
    pvalid = torch.ones(U, P, dtype=torch.bool)
    pvalid[0, :2] = pvalid[2, :1] = False  # left padding
    q = torch.randn(B, nq, T, D, generator=g)
    k, v = (torch.randn(B, nkv, S, D, generator=g) for _ in range(2))
    valid = torch.rand(B, S, generator=g) > 0.3
    valid[:, -T:] = True
    causal = torch.arange(S)[None, :] <= torch.arange(S - T, S)[:, None]  # query t sits at row slot S - T + t
    own = (causal[None] & valid[:, None, :])[:, None]  # [B, 1, T, S]
    prefix = SharedPrefix([pk], [pv], pvalid, rows)
    assert prefix.count == len(set(rows)) and (prefix.slot is None) == (rows == [0, 0, 0, 1, 1, 1])
    additive = torch.zeros(own.shape).masked_fill(~own, float("-inf"))
    got = split_attention(q, prefix, 0, k, v, additive, 0.3)
    idx = torch.tensor(rows)
    whole_k = torch.cat([pk.index_select(0, idx), k], dim=2)
    whole_v = torch.cat([pv.index_select(0, idx), v], dim=2)
    whole_mask = torch.cat([pvalid.index_select(0, idx)[:, None, None].expand(B, 1, T, P), own], dim=-1)
    want = F.scaled_dot_product_attention(q, whole_k, whole_v, attn_mask=whole_mask, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_shared_prefix_decode_matches_transformers(tmp_path):
    """Prompts prefilled once, their samples sharing the prefill (``select_rows`` with repeats), rows then
    leaving the batch unevenly, then all of one prompt's rows leaving and another row repeated: every step's
    logits are those of transformers run on each row's whole sequence alone."""
    from transformers import AutoModelForCausalLM

    from hpc_rlhf.models.tiny import build_tiny_model
    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(
        tmp_path / "m", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, max_position_embeddings=64,
        seed=5)).eval()
    prompts, width = [[5, 6, 7, 8, 9], [11, 12]], 5
    ids = torch.tensor([[257] * (width - len(p)) + p for p in prompts])
    valid = torch.tensor([[False] * (width - len(p)) + [True] * len(p) for p in prompts])
    pos = (valid.long().cumsum(-1) - 1).clamp(min=0)
    lean = LeanDecoder(model, shared_prefix_min_elements=0)  # shares any repeated prefix, however short
    lean.start(2, width + 8, torch.float32, torch.device("cpu"))
    with torch.no_grad():
        got = lean.forward(ids, pos, valid)
        seqs = [list(p) for p in prompts]
        for step, rows in enumerate([[0, 0, 0, 1, 1, 1], None, [0, 2, 3], None, [1, 1, 0], None]):
            if rows is not None:
                lean.select_rows(torch.tensor(rows))
                seqs = [list(seqs[r]) for r in rows]
                got = got.index_select(0, torch.tensor(rows))
                assert lean.prefix is not None and lean.offset == width
            nxt = torch.tensor([(3 * b + step) % 250 for b in range(len(seqs))])  # rows of a prompt part ways
            for b, seq in enumerate(seqs):
                seq.append(int(nxt[b]))
            got = lean.forward(nxt[:, None], torch.tensor([[len(s) - 1] for s in seqs]),
                               torch.ones((len(seqs), 1), dtype=torch.bool))
            for b, seq in enumerate(seqs):
                want = model(torch.tensor([seq])).logits[0, -1]
                torch.testing.assert_close(got[b], want, atol=1e-5, rtol=1e-5)
        assert lean.prefix.count == 1 and lean.prefix.rows == [0, 0, 0]  # no row reads prompt 1's prefix now
    cpu = torch.device("cpu")  # where the sharing was measured: not in bf16, not on CUDA
    assert lean.shares_prefix(torch.float32, cpu) and not lean.shares_prefix(torch.bfloat16, cpu)
    assert not lean.shares_prefix(torch.float32, torch.device("cuda"))


def test_engine_lean_and_transformers_paths_sample_the_same(tmp_path):
    from hpc_rlhf.models.tiny import build_tiny_model
    path = build_tiny_model(tmp_path / "m", hidden_size=32, num_layers=2, max_position_embeddings=64, seed=2)
    prompts = [[40, 41, 42], [50], [60, 61, 62, 63, 64]]
    params = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=8, stop_token_ids=[256])
    a = transformers_engine(path).generate(prompts, params, [1, 2, 3])
    b = HFEngine(path).generate(prompts, params, [1, 2, 3])
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    for x, y in zip(a, b):
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5)


def test_shared_and_copied_prefix_sample_the_same(tmp_path):
    """A prompt's samples sharing its prefilled cache (the default on the CPU in fp32) sample the tokens and
    log-probabilities of samples that copy it: repeated prompts, rows finishing early (a quarter of the vocabulary
    stops them) so the batch shrinks unevenly."""
    from hpc_rlhf.models.tiny import build_tiny_model
    path = build_tiny_model(tmp_path / "m", hidden_size=32, num_layers=2, max_position_embeddings=64, seed=3)
    prompts = [[40, 41, 42]] * 4 + [[50]] * 3 + [[60, 61, 62, 63, 64]] * 4
    params = SamplingParams(temperature=1.0, max_new_tokens=12, stop_token_ids=list(range(64)))
    seeds = list(range(len(prompts)))
    shared, copied = transformers_engine(path), transformers_engine(path, shared_prefix=False)
    shared._lean.shared_prefix_min_elements = 0  # shares these short prompts
    a, b = shared.generate(prompts, params, seeds), copied.generate(prompts, params, seeds)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    assert len({len(c.token_ids) for c in a}) > 2  # rows ended at different steps
    for x, y in zip(a, b):
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5)


def test_prefix_pays_counts_the_key_elements_sharing_saves():
    """Rows that repeat share their prefix once (repeats) × length × kv heads × head size reach the threshold:
    8 samples of one prompt are 7 repeats, 8 of each of 8 prompts 56."""
    from hpc_rlhf.generation.lean.decoder import SHARED_PREFIX_MIN_ELEMENTS, prefix_pays
    one = [0] * 8
    assert not prefix_pays(one, 96, 4, 64)  # 7 × 96 × 256 = 172,032 < 262,144
    assert prefix_pays(one, 147, 4, 64)  # 7 × 147 × 256 = 263,424
    assert not prefix_pays(one, 146, 4, 64)  # 261,632
    eight = [p for p in range(8) for _ in range(8)]
    assert not prefix_pays(eight, 16, 4, 64)  # 56 × 16 × 256 = 229,376
    assert prefix_pays(eight, 32, 4, 64)  # 458,752
    assert prefix_pays(eight, 100, 3, 64)  # SmolLM2's GRPO batch: 1,075,200
    assert prefix_pays([0, 0], 1, 1, 1, min_elements=1) and not prefix_pays([0, 0], 1, 1, 1, min_elements=2)
    # no repeated row, or nothing cached yet: nothing to share, whatever the threshold
    assert not prefix_pays([0, 1, 2], 100, 4, 64, min_elements=0)
    assert not prefix_pays([0, 0, 0], 0, 4, 64, min_elements=0)
    assert not prefix_pays([], 10, 4, 64, min_elements=0)
    assert SHARED_PREFIX_MIN_ELEMENTS == 2 ** 18


def test_short_prefixes_are_copied_long_ones_shared(tmp_path):
    """With the default threshold a prompt too short to pay is copied to its samples, a long one shared; both
    sample what copies sample."""
    from hpc_rlhf.models.tiny import build_tiny_model
    path = build_tiny_model(tmp_path / "m", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=4,
                            max_position_embeddings=320, seed=4)
    params = SamplingParams(temperature=1.0, max_new_tokens=4, stop_token_ids=[256])
    engine, copied = transformers_engine(path), transformers_engine(path, shared_prefix=False)
    decisions = []
    select = engine._lean.select_rows

    def spy(index):
        select(index)
        decisions.append(engine._lean.prefix is not None)
    engine._lean.select_rows = spy
    # 7 repeats × 4 kv heads × head size 32 = 896 elements a position: 292 positions do not pay (261,632 < 2**18),
    # 293 do (262,528)
    for length, shared in ((40, False), (292, False), (293, True), (300, True)):
        prompts, seeds = [[40 + i % 50 for i in range(length)]] * 8, list(range(8))
        decisions.clear()
        a, b = engine.generate(prompts, params, seeds), copied.generate(prompts, params, seeds)
        assert decisions[0] is shared
        assert [c.token_ids for c in a] == [c.token_ids for c in b]


def test_the_cache_is_freed_when_a_generation_ends(tmp_path):
    """Between generations the lean decoder holds no cache (a colocated actor trains in that memory); the next
    generation, and every batch of one split by max_batch_size, allocates its own and samples the same."""
    from hpc_rlhf.models.tiny import build_tiny_model
    path = build_tiny_model(tmp_path / "m", hidden_size=32, num_layers=2, max_position_embeddings=64, seed=2)
    prompts = [[40, 41, 42], [50], [60, 61, 62, 63, 64]]
    params = SamplingParams(temperature=1.0, max_new_tokens=6, stop_token_ids=[256])
    engine = transformers_engine(path)
    first = engine.generate(prompts, params, [1, 2, 3])
    assert engine._lean.keys == [] and engine._lean.values == [] and engine._lean.key_valid is None
    assert [c.token_ids for c in engine.generate(prompts, params, [1, 2, 3])] == [c.token_ids for c in first]
    split = transformers_engine(engine.model, max_batch_size=2).generate(prompts, params, [1, 2, 3])
    assert [c.token_ids for c in split] == [c.token_ids for c in first]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_product_is_the_linear(dtype, bias):
    """A packed product (stacked weights, oneDNN's layout on the CPU in float32) is ``F.linear`` of the stacked
    weights and biases, for any leading shape of the input."""
    torch.manual_seed(0)
    linears = [torch.nn.Linear(24, n, bias=bias, dtype=dtype) for n in (8, 16)]
    if bias:
        linears.append(torch.nn.Linear(24, 4, bias=False, dtype=dtype))  # a layer without one gets zeros
    packed = Packed(linears)
    assert packed.weight.is_mkldnn == (dtype == torch.float32 and torch.backends.mkldnn.is_available())
    assert onednn_products(dtype, torch.device("cpu")) == packed.weight.is_mkldnn
    assert not onednn_products(torch.float32, torch.device("cuda"))
    weight = torch.cat([m.weight for m in linears]).detach()
    b = torch.cat([m.bias if m.bias is not None else torch.zeros(m.out_features, dtype=dtype) for m in linears])
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    # the few-row kernel takes products of at most 8 rows (in float32 only: the decoder passes it no other)
    kernels = [None] + ([few_rows.kernel()] if dtype == torch.float32 else [])
    for few in kernels:
        for shape in ((5, 24), (3, 7, 24), (1, 1, 24), (2, 4, 24)):
            x = torch.randn(shape, dtype=dtype)
            with torch.no_grad():
                got = _matmul(x, packed, few)
            assert got.shape == shape[:-1] + (weight.shape[0],)
            torch.testing.assert_close(got, torch.nn.functional.linear(x, weight, b if bias else None), **tol)


def test_packed_weights_follow_in_place_changes(tmp_path):
    """The packed copies are rebuilt when a module weight changes in place (as an optimizer step does it)
    or is replaced, and kept as they are while nothing changed."""
    from transformers import AutoModelForCausalLM

    from hpc_rlhf.models.tiny import build_tiny_model
    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(
        tmp_path / "m", hidden_size=32, num_layers=2, max_position_embeddings=64, seed=3)).eval()
    lean = LeanDecoder(model)
    ids = torch.tensor([[5, 6, 7]])
    pos = torch.arange(3)[None]
    valid = torch.ones((1, 3), dtype=torch.bool)

    def logits():
        lean.start(1, 4, torch.float32, torch.device("cpu"))
        with torch.no_grad():
            return lean.forward(ids, pos, valid)

    first = logits()
    packed = lean.layers
    logits()
    assert lean.layers is packed  # unchanged weights: no rebuild
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight.mul_(1.5)  # in place: the version counter moves
        want = model(ids).logits[0, -1]
    got = logits()
    assert lean.layers is not packed and not torch.allclose(got[0], first[0])
    torch.testing.assert_close(got[0], want, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        model.model.layers[0].self_attn.v_proj.weight = torch.nn.Parameter(torch.zeros(32, 32))  # replaced
        want = model(ids).logits[0, -1]
    torch.testing.assert_close(logits()[0], want, atol=1e-5, rtol=1e-5)


def test_rollout_engine_switch(tmp_path):
    """rollout.engine reaches the factory: auto (the default) and lean give the lean engine for a llama model, hf
    the transformers forward.  So do rollout.lean's options (default on)."""
    from hpc_rlhf.config import load_config
    from hpc_rlhf.config.pipelines import GenerateConfig
    from hpc_rlhf.config.rl import RLConfig
    from hpc_rlhf.generation.factory import make_engine as factory_engine
    from hpc_rlhf.models.tiny import build_tiny_model
    from hpc_rlhf.roles.rollout import make_engine

    def rollout_engine(cfg, device):
        return make_engine(cfg.rollout, cfg.model, cfg.train.seed, False, device)
    path = build_tiny_model(tmp_path / "m", hidden_size=32, num_layers=2, max_position_embeddings=64, seed=2)
    rl = [f"pretrain={path}", "prompt_data=p.jsonl", "reward_func=r.py", "param_dtype=fp32"]
    assert isinstance(rollout_engine(load_config(RLConfig, None, rl), "cpu")._lean, LeanDecoder)
    assert isinstance(rollout_engine(load_config(RLConfig, None, rl + ["rollout.engine=lean"]), "cpu")._lean,
                      LeanDecoder)
    assert type(rollout_engine(load_config(RLConfig, None, rl + ["rollout.engine=hf"]), "cpu")) is HFEngine
    assert rollout_engine(load_config(RLConfig, None, rl), "cpu")._lean.cuda_graphs
    assert not rollout_engine(load_config(RLConfig, None, rl + ["rollout.lean.cuda_graphs=false"]),
                              "cpu")._lean.cuda_graphs
    assert rollout_engine(load_config(RLConfig, None, rl), "cpu")._lean.shared_prefix
    lean = rollout_engine(load_config(RLConfig, None, rl + ["rollout.lean.shared_prefix=false"]), "cpu")._lean
    assert not lean.shared_prefix and not lean.shares_prefix(torch.float32, torch.device("cpu"))
    gen = load_config(GenerateConfig, None, [f"pretrain={path}", "prompt_data=p.jsonl", "output_path=o.jsonl",
                                             "engine=hf"]).model
    assert type(factory_engine(gen, gen.pretrain, "fp32", "cpu", 4)) is HFEngine
