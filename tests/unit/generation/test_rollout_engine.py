"""In-process rollout engine: greedy == transformers generate, batch-invariant seeded sampling,
top-k / top-p, stop tokens, log-probabilities, weight loading, checksum, sampling distribution."""
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from hpc_rlhf.generation.engine import Completion, RolloutEngine, SamplingParams, sample_seed
from hpc_rlhf.generation.factory import transformers_engine
from hpc_rlhf.generation.hf import filter_logits, inverse_cdf_sample
from hpc_rlhf.models.tiny import build_tiny_model

EOS, PAD, IM_END = 256, 257, 259
TINY = dict(hidden_size=32, num_layers=2, num_heads=4, max_position_embeddings=128)
PROMPTS = [[72, 101, 108, 108, 111], [1, 2], [200, 13, 40, 41, 42, 43, 44, 45, 46], [99]]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("rollout")
    return {arch_seed: build_tiny_model(root / f"{arch_seed[0]}{arch_seed[1]}", arch=arch_seed[0],
                                        seed=arch_seed[1], **TINY)
            for arch_seed in [("llama", 0), ("llama", 1), ("gpt2", 0)]}


@pytest.fixture(scope="module")
def engine(model_dirs):
    return transformers_engine(model_dirs[("llama", 0)], max_batch_size=64)


def _hf_greedy(model, prompts, max_new, stop):
    """transformers generate on a left-padded batch; each row cut after its first stop token."""
    width = max(map(len, prompts))
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new,
                         min_new_tokens=max_new, eos_token_id=None, pad_token_id=PAD)
    rows = []
    for row in out[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in stop), len(row))
        rows.append(row[:cut])
    return rows


def test_seed_derivation():
    s = sample_seed(1234, 7, 3, 2)
    assert s == sample_seed(1234, 7, 3, 2) and 0 <= s < 2 ** 63
    others = {sample_seed(1234, 7, 3, 1), sample_seed(1234, 7, 2, 2), sample_seed(1234, 6, 3, 2),
              sample_seed(1235, 7, 3, 2), sample_seed(1234, 3, 7, 2)}
    assert s not in others and len(others) == 5


def test_params_validation():
    with pytest.raises(ValueError):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError):
        SamplingParams(max_new_tokens=0)
    assert SamplingParams(temperature=0).greedy


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_greedy_matches_transformers_generate(model_dirs, arch):
    path = model_dirs[(arch, 0)]
    eng = transformers_engine(path)
    assert isinstance(eng, RolloutEngine)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    params = SamplingParams(temperature=0, max_new_tokens=12)
    got = eng.generate(PROMPTS, params, seeds=[0] * len(PROMPTS))
    want = _hf_greedy(model, PROMPTS, 12, stop=[])
    assert [c.token_ids for c in got] == want
    assert all(isinstance(c, Completion) and c.finish_reason == "length" for c in got)
    assert [c.prompt_ids for c in got] == PROMPTS
    # The same with the tiny model's real stop tokens, whichever rows happen to hit them.
    stop = [EOS, IM_END]
    got = eng.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=12, stop_token_ids=stop),
                       seeds=[0] * len(PROMPTS))
    assert [c.token_ids for c in got] == _hf_greedy(model, PROMPTS, 12, stop=stop)


def test_sample_is_batch_invariant(engine):
    params = SamplingParams(temperature=1.0, top_p=0.95, top_k=50, max_new_tokens=16)
    seeds = [sample_seed(0, 0, i, 0) for i in range(len(PROMPTS))]
    batched = engine.generate(PROMPTS, params, seeds)
    perm = [2, 0, 3, 1]
    shuffled = engine.generate([PROMPTS[i] for i in perm] + [[5, 6, 7] * 10],
                               params, [seeds[i] for i in perm] + [99])
    for j, i in enumerate(perm):
        alone = engine.generate([PROMPTS[i]], params, [seeds[i]])[0]
        assert alone.token_ids == batched[i].token_ids == shuffled[j].token_ids
        assert alone.logprobs == pytest.approx(batched[i].logprobs, abs=1e-5)
    # Chunking (max_batch_size) does not change samples either.
    small = transformers_engine(engine.model, max_batch_size=2)
    assert [c.token_ids for c in small.generate(PROMPTS, params, seeds)] == [c.token_ids for c in batched]


def test_different_seeds_differ(engine):
    params = SamplingParams(temperature=1.0, max_new_tokens=8)
    outs = engine.generate([PROMPTS[0]] * 8, params, seeds=[sample_seed(0, 0, 0, j) for j in range(8)])
    assert len({tuple(c.token_ids) for c in outs}) == 8
    again = engine.generate([PROMPTS[0]] * 8, params, seeds=[sample_seed(0, 0, 0, j) for j in range(8)])
    assert [c.token_ids for c in again] == [c.token_ids for c in outs]


@pytest.mark.parametrize("kw", [dict(top_k=1), dict(top_p=1e-6), dict(top_k=1, temperature=5.0)])
def test_degenerate_filters_equal_greedy(engine, kw):
    greedy = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=10), [0] * 4)
    params = SamplingParams(**{"temperature": 1.0, "max_new_tokens": 10, **kw})
    got = engine.generate(PROMPTS, params, seeds=[11, 12, 13, 14])
    assert [c.token_ids for c in got] == [c.token_ids for c in greedy]


def test_stop_tokens_and_length(engine):
    params = SamplingParams(temperature=0, max_new_tokens=10)
    free = engine.generate(PROMPTS, params, [0] * 4)
    # Make row 0's third greedy token a stop token: row 0 stops there, the others run on unchanged.
    stop_tok = free[0].token_ids[2]
    assert all(stop_tok not in c.token_ids for c in free[1:]), "pick prompts whose outputs differ"
    got = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=10, stop_token_ids=[stop_tok]),
                          [0] * 4)
    first = free[0].token_ids.index(stop_tok)
    assert got[0].token_ids == free[0].token_ids[:first + 1] and got[0].token_ids[-1] == stop_tok
    assert got[0].finish_reason == "stop" and len(got[0].logprobs) == len(got[0].token_ids)
    for c, f in zip(got[1:], free[1:]):
        assert c.token_ids == f.token_ids and len(c.token_ids) == 10 and c.finish_reason == "length"


def test_logprobs_match_full_forward(engine):
    params = SamplingParams(temperature=0.8, top_k=20, max_new_tokens=10)
    outs = engine.generate(PROMPTS, params, seeds=[1, 2, 3, 4])
    with torch.no_grad():
        for c in outs:
            full = torch.tensor([c.prompt_ids + c.token_ids])
            logp = torch.log_softmax(engine.model(full).logits[0].float(), dim=-1)
            n = len(c.prompt_ids)
            want = [logp[n - 1 + t, tok].item() for t, tok in enumerate(c.token_ids)]
            assert c.logprobs == pytest.approx(want, abs=1e-4)


@pytest.mark.parametrize("arch,lean", [("llama", True), ("llama", False), ("gpt2", False)])
def test_probe_logprobs_match_full_forward(model_dirs, arch, lean):
    """The prompt prefilled, the response teacher-forced one decode step at a time: each token's log-prob is the
    full forward's; the lean engine takes weights loaded after its first pass (its packed copies follow)."""
    eng = transformers_engine(model_dirs[(arch, 0)], lean=lean)
    assert (type(eng).__name__ == "LeanEngine") == lean
    prompt, response = [72, 101, 108, 108, 111, 32, 9], [200, 13, 40, 7]

    def full_forward(model):
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([prompt + response])).logits[0].float(), dim=-1)
        return [logp[len(prompt) - 1 + t, tok].item() for t, tok in enumerate(response)]
    assert eng.probe_logprobs(prompt, response) == pytest.approx(full_forward(eng.model), abs=1e-4)
    if arch == "llama":
        other = AutoModelForCausalLM.from_pretrained(model_dirs[(arch, 1)])
        eng.update_weights(other.named_parameters())
        assert eng.probe_logprobs(prompt, response) == pytest.approx(full_forward(other), abs=1e-4)


def test_load_weights_and_checksum(model_dirs):
    eng = transformers_engine(model_dirs[("llama", 0)])
    other = transformers_engine(model_dirs[("llama", 1)])
    params = SamplingParams(temperature=0, max_new_tokens=10)
    before, target = eng.generate(PROMPTS, params, [0] * 4), other.generate(PROMPTS, params, [0] * 4)
    assert [c.token_ids for c in before] != [c.token_ids for c in target]
    c0 = eng.state_checksum()
    assert c0 == eng.state_checksum() and c0 != other.state_checksum()
    eng.update_weights(other.model.named_parameters())
    assert eng.weight_version == 1
    assert [c.token_ids for c in eng.generate(PROMPTS, params, [0] * 4)] == [c.token_ids for c in target]
    assert eng.state_checksum() == pytest.approx(other.state_checksum(), rel=1e-12)
    # One changed weight changes the checksum.
    w = eng.model.model.layers[0].mlp.up_proj.weight
    c1 = eng.state_checksum()
    eng.update_weights([("model.layers.0.mlp.up_proj.weight", w.clone().index_put_((torch.tensor(3), torch.tensor(5)),
                                                                                 w[3, 5] + 1e-3))])
    assert eng.state_checksum() != c1 and eng.weight_version == 2
    with pytest.raises(KeyError):
        eng.update_weights([("model.not_a_layer.weight", torch.zeros(1))])
    with pytest.raises(ValueError):
        eng.update_weights([("model.norm.weight", torch.zeros(3))])
    assert eng.weight_version == 2


@pytest.mark.parametrize("lean", [True, False])
def test_shared_weights_written_by_another_mapping_are_what_it_generates_with(model_dirs, tmp_path, lean):
    """The engine takes views of a shared file as its parameters; a second mapping of the file (as the actor
    leader's, in another process) writes new weights, which no tensor version of the engine sees: after
    finish_weight_update it generates what an engine loaded with those weights does."""
    from hpc_rlhf.distributed.weight_sync.plan import ParamSpec
    from hpc_rlhf.distributed.weight_sync.shared import SharedWeights, shared_layout
    eng = transformers_engine(model_dirs[("llama", 0)], lean=lean)
    other = transformers_engine(model_dirs[("llama", 1)], lean=lean)
    params = SamplingParams(temperature=0, max_new_tokens=10)
    before, target = eng.generate(PROMPTS, params, [0] * 4), other.generate(PROMPTS, params, [0] * 4)
    assert [c.token_ids for c in before] != [c.token_ids for c in target]
    named = dict(eng.model.named_parameters())
    layout, nbytes = shared_layout([ParamSpec(n, tuple(t.shape)) for n, t in named.items()], torch.float32)
    assert all(offset % 64 == 0 for offset, _ in layout.values())
    mine = SharedWeights(tmp_path / "w", layout, nbytes, torch.float32, create=True)
    for name, view in mine.named():  # the engine's own weights first, as the first sync writes them
        view.copy_(named[name])
    assert eng.shareable(mine.named())
    assert not eng.shareable([(n, t.to(torch.bfloat16)) for n, t in mine.named()])  # another dtype: it loads
    assert not eng.shareable([("model.not_a_layer.weight", torch.zeros(1))])
    eng.share_weights(mine.named())
    assert [c.token_ids for c in eng.generate(PROMPTS, params, [0] * 4)] == [c.token_ids for c in before]
    leader = SharedWeights(tmp_path / "w", layout, nbytes, torch.float32, create=False)
    eng.begin_weight_update()
    for name, t in other.model.named_parameters():
        leader.view(name).copy_(t)
    eng.finish_weight_update()
    assert [c.token_ids for c in eng.generate(PROMPTS, params, [0] * 4)] == [c.token_ids for c in target]
    assert eng.state_checksum() == pytest.approx(other.state_checksum(), rel=1e-12)
    with pytest.raises(FileExistsError):  # the leader never takes over a file left behind
        SharedWeights(tmp_path / "w", layout, nbytes, torch.float32, create=True)


def test_an_engine_keeps_its_own_weights_unless_it_says_so():
    class Plain(RolloutEngine):
        def generate(self, prompts, params, seeds):
            return []

        def load_weights(self, named_tensors):
            pass

        def probe_logprobs(self, prompt_ids, response_ids):
            return []

        def part_checksums(self):
            return {}
    assert not Plain().shareable([("w", torch.zeros(2))])
    with pytest.raises(NotImplementedError, match="Plain keeps its own weights"):
        Plain().share_weights([("w", torch.zeros(2))])


def test_top_k_distribution(engine):
    """One step, top_k=2, temperature 1, 2000 seeds: frequencies match the renormalised probabilities."""
    prompt = PROMPTS[0]
    with torch.no_grad():
        logits = engine.model(torch.tensor([prompt])).logits[0, -1].float()
    p = torch.softmax(logits, -1)
    top = torch.topk(p, 2)
    p0 = (top.values[0] / top.values.sum()).item()
    n = 2000
    eng = transformers_engine(engine.model, max_batch_size=n)
    outs = eng.generate([prompt] * n, SamplingParams(temperature=1.0, top_k=2, max_new_tokens=1),
                        seeds=[sample_seed(7, 0, 0, j) for j in range(n)])
    toks = [c.token_ids[0] for c in outs]
    assert set(toks) <= set(top.indices.tolist())
    k0 = toks.count(top.indices[0].item())
    sigma = math.sqrt(n * p0 * (1 - p0))
    assert abs(k0 - n * p0) <= 3 * sigma, (k0, n * p0, sigma)


def test_top_p_keeps_smallest_set():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))

    def kept(top_p):
        return torch.isfinite(filter_logits(logits, SamplingParams(top_p=top_p)))[0].tolist()
    assert kept(0.49) == [True, False, False, False]
    assert kept(0.51) == [True, True, False, False]
    assert kept(0.79) == [True, True, False, False]
    assert kept(0.81) == [True, True, True, False]
    assert kept(1.0) == [True] * 4


def test_inverse_cdf_sample_by_hand():
    """p = (1, 2, 1) / 4: the running sums are (0.25, 0.75, 1), and the token is the first whose sum reaches
    (1 - u) * 1.  u = 0 -> target 1 -> token 2; u = 0.5 -> 0.5 -> token 1; u = 0.74 -> 0.26 -> token 1;
    u = 0.8 -> 0.2 -> token 0.  A constant added to a row changes nothing."""
    x = torch.log(torch.tensor([[1.0, 2.0, 1.0]] * 4))
    u = torch.tensor([0.0, 0.5, 0.74, 0.8], dtype=torch.float64)
    assert inverse_cdf_sample(x, u).tolist() == [2, 1, 1, 0]
    assert inverse_cdf_sample(x + 7.5, u).tolist() == [2, 1, 1, 0]


def test_inverse_cdf_sample_never_picks_a_filtered_token():
    """p = (0.5, 0, 0.5): sums (0.5, 0.5, 1).  Target 0.5 (u = 0.5) is first reached by token 0, not the banned
    token 1 beside it; 0.51 (u = 0.49) by token 2.  A banned last token is not reached by the largest target (u = 0,
    target = the total), nor a banned first token by the smallest (u just below 1)."""
    inf = float("-inf")
    middle = torch.tensor([[0.0, inf, 0.0]] * 2)
    assert inverse_cdf_sample(middle, torch.tensor([0.5, 0.49], dtype=torch.float64)).tolist() == [0, 2]
    assert inverse_cdf_sample(torch.tensor([[0.0, 0.0, inf]]), torch.zeros(1, dtype=torch.float64)).tolist() == [1]
    largest_u = torch.tensor([1.0 - 2.0 ** -53], dtype=torch.float64)
    assert inverse_cdf_sample(torch.tensor([[inf, 0.0, 0.0]]), largest_u).tolist() == [1]


def test_inverse_cdf_sample_frequencies():
    """Over 20,000 rows of seeded uniforms, p = (0.5, 0.25, 0.25) and a row with one token at 1e-3 of the
    rest: the frequencies match within 4 standard deviations, and rows are independent of each other."""
    n = 20_000
    u = torch.rand(n, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    for probs in ((0.5, 0.25, 0.25), (0.999 / 2, 0.001, 0.999 / 2)):
        draws = inverse_cdf_sample(torch.log(torch.tensor([probs])).expand(n, 3), u)
        for token, p in enumerate(probs):
            k = int((draws == token).sum())
            assert abs(k - n * p) <= 4 * math.sqrt(n * p * (1 - p)), (probs, token, k)
    x = torch.randn(5, 1000, generator=torch.Generator().manual_seed(1))
    u5 = torch.rand(5, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    assert inverse_cdf_sample(x, u5)[2:4].tolist() == inverse_cdf_sample(x[2:4], u5[2:4]).tolist()


@pytest.mark.parametrize("lean", [True, False])
def test_finished_rows_leave_the_batch_and_the_samples_stay_the_same(model_dirs, lean, monkeypatch):
    """Rows that hit a stop token leave the decode batch once they are a quarter of it: later forwards get
    fewer rows, and every sample is what it is alone (ids exactly, log-probs to float rounding)."""
    engine = transformers_engine(model_dirs[("llama", 0)], max_batch_size=64, lean=lean)
    prompts = [PROMPTS[i % 4] for i in range(12)]
    seeds = [sample_seed(5, 0, i, 0) for i in range(12)]
    with torch.no_grad():  # the most likely first tokens of the prompts: stopping on them ends rows early
        firsts = {int(engine.model(torch.tensor([p])).logits[0, -1].argmax()) for p in PROMPTS}
    params = SamplingParams(temperature=1.5, max_new_tokens=24, stop_token_ids=sorted(firsts | {3, 7, 11}))
    rows = []
    if lean:
        forward = engine._lean.forward
        monkeypatch.setattr(engine._lean, "forward", lambda ids, *a: (rows.append(len(ids)), forward(ids, *a))[1])
    else:
        forward = engine._forward
        monkeypatch.setattr(engine, "_forward", lambda ids, *a: (rows.append(len(ids)), forward(ids, *a))[1])
    out = engine.generate(prompts, params, seeds)
    lengths = sorted(len(c.token_ids) for c in out)
    assert any(c.finish_reason == "stop" for c in out) and lengths[-1] > lengths[0]
    assert rows[1] == 12 and min(rows[1:]) < 12, rows  # decode steps after the first finishes had fewer rows
    assert rows[1:] == sorted(rows[1:], reverse=True)
    for p, s, c in zip(prompts, seeds, out):
        alone = transformers_engine(engine.model, lean=lean).generate([p], params, [s])[0]
        assert (c.token_ids, c.finish_reason) == (alone.token_ids, alone.finish_reason)
        assert c.logprobs == pytest.approx(alone.logprobs, abs=1e-5)


@pytest.mark.parametrize("lean", [True, False])
def test_repeated_prompts_share_their_prefill(model_dirs, lean, monkeypatch):
    """n samples of one prompt: the prompt is prefilled once (one row per distinct prompt), and every sample
    is what that prompt gives alone with the sample's seed."""
    engine = transformers_engine(model_dirs[("llama", 0)], max_batch_size=64, lean=lean)
    params = SamplingParams(temperature=1.0, max_new_tokens=8)
    prompts = [PROMPTS[0]] * 3 + [PROMPTS[2]] * 2 + [PROMPTS[0]]
    seeds = [11, 12, 13, 21, 22, 14]
    rows_prefilled = []
    if lean:
        start = engine._lean.start
        monkeypatch.setattr(engine._lean, "start", lambda batch, *a: (rows_prefilled.append(batch), start(batch, *a)))
    else:
        forward = engine._forward
        monkeypatch.setattr(engine, "_forward", lambda ids, *a: (rows_prefilled.append(len(ids)), forward(ids, *a))[1])
    shared = engine.generate(prompts, params, seeds)
    assert rows_prefilled[0] == 2
    for p, s, c in zip(prompts, seeds, shared):
        alone = transformers_engine(engine.model, lean=lean).generate([p], params, [s])[0]
        assert c.token_ids == alone.token_ids
        assert c.logprobs == pytest.approx(alone.logprobs, abs=1e-5)
    assert len({tuple(c.token_ids) for c in shared[:3]}) > 1  # the copies sample on their own


def test_work_counters_by_hand(model_dirs):
    """Two distinct prompts (3 and 5 tokens), three samples each, greedy, 4 new tokens, no stop token: 24 tokens
    generated.  In one batch each distinct prompt is prefilled once (3 + 5 = 8); in batches of 4 rows (longest
    first: the 5-token prompt's three samples and one of the 3-token prompt's, then the other two) the 3-token
    prompt is prefilled in each batch: 5 + 3 + 3 = 11.  The counters add up over calls."""
    a, b = [10, 11, 12], [20, 21, 22, 23, 24]
    prompts = [a, b, a, b, a, b]
    params = SamplingParams(temperature=0, max_new_tokens=4)
    one = transformers_engine(model_dirs[("llama", 0)], max_batch_size=64)
    assert one.work_done() == {"prompt_tokens_prefilled": 0, "tokens_generated": 0}
    one.generate(prompts, params, [0] * 6)
    assert one.work_done() == {"prompt_tokens_prefilled": 8, "tokens_generated": 24}
    one.generate([a], params, [0])
    assert one.work_done() == {"prompt_tokens_prefilled": 11, "tokens_generated": 28}
    four = transformers_engine(model_dirs[("llama", 0)], max_batch_size=4)
    four.generate(prompts, params, [0] * 6)
    assert four.work_done() == {"prompt_tokens_prefilled": 11, "tokens_generated": 24}
    # a row that stops counts the tokens it generated, its stop token included
    first = one.generate([a], params, [0])[0].token_ids
    before = one.work_done()["tokens_generated"]
    got = one.generate([a], SamplingParams(temperature=0, max_new_tokens=4, stop_token_ids=[first[1]]), [0])
    assert len(got[0].token_ids) == first.index(first[1]) + 1
    assert one.work_done()["tokens_generated"] - before == len(got[0].token_ids)


def test_no_stop_token_before_min_new_tokens(engine):
    """The greedy row's second token made a stop token: with min_new_tokens 0 the row ends there (2 tokens); with
    min_new_tokens 4 the stop token cannot be picked before the 4th token, so the row runs on with the next best
    tokens, and its log-probs are still those of the unmodified model."""
    free = engine.generate(PROMPTS[:1], SamplingParams(temperature=0, max_new_tokens=8), [0])[0]
    stop = free.token_ids[1]
    assert free.token_ids[0] != stop, "pick a prompt whose first two greedy tokens differ"
    short = engine.generate(PROMPTS[:1], SamplingParams(temperature=0, max_new_tokens=8, stop_token_ids=[stop]),
                            [0])[0]
    assert short.token_ids == free.token_ids[:2] and short.finish_reason == "stop"
    held = engine.generate(PROMPTS[:1], SamplingParams(temperature=0, max_new_tokens=8, stop_token_ids=[stop],
                                                       min_new_tokens=4), [0])[0]
    assert held.token_ids[0] == free.token_ids[0] and stop not in held.token_ids[:4]
    assert held.finish_reason == "stop" or len(held.token_ids) == 8
    with torch.no_grad():
        full = torch.tensor([held.prompt_ids + held.token_ids])
        logp = torch.log_softmax(engine.model(full).logits[0].float(), dim=-1)
    n = len(held.prompt_ids)
    assert held.logprobs == pytest.approx([logp[n - 1 + t, tok].item() for t, tok in enumerate(held.token_ids)],
                                          abs=1e-4)
    # sampled at temperature 1, 16 rows: no stop token among any row's first 4 tokens
    rows = engine.generate(PROMPTS[:1] * 16, SamplingParams(temperature=1.0, max_new_tokens=6, min_new_tokens=4,
                                                            stop_token_ids=[stop, EOS]), list(range(16)))
    assert all(not {stop, EOS} & set(r.token_ids[:4]) and len(r.token_ids) >= 4 for r in rows)
    with pytest.raises(ValueError, match="min_new_tokens must be in"):
        SamplingParams(max_new_tokens=4, min_new_tokens=5)


def test_factory_picks_the_lean_engine_where_it_runs(model_dirs):
    """transformers_engine: the lean engine for a llama model (unless lean=False), the plain one for gpt2, which the
    lean engine refuses with one line."""
    from hpc_rlhf.generation.hf import HFEngine
    from hpc_rlhf.generation.lean.engine import LeanEngine
    assert isinstance(transformers_engine(model_dirs[("llama", 0)]), LeanEngine)
    assert type(transformers_engine(model_dirs[("llama", 0)], lean=False)) is HFEngine
    assert type(transformers_engine(model_dirs[("gpt2", 0)])) is HFEngine
    with pytest.raises(ValueError, match=r"^the lean engine does not run GPT2LMHeadModel \(gpt2\): use the "
                                         r"transformers engine$"):
        LeanEngine(model_dirs[("gpt2", 0)])


@pytest.mark.parametrize("requested,model_type,cuda,vllm_found,want,why", [
    ("auto", "llama", True, True, "vllm", "the rollout ranks have CUDA and vLLM is installed"),
    ("auto", "gpt2", True, True, "vllm", "the rollout ranks have CUDA and vLLM is installed"),
    ("auto", "llama", True, False, "lean", "vLLM is not installed, and the lean engine runs llama models"),
    ("auto", "llama", False, True, "lean", "the rollout ranks have no CUDA, and the lean engine runs llama models"),
    ("auto", "qwen2", False, False, "lean", "the rollout ranks have no CUDA, and the lean engine runs qwen2 models"),
    ("auto", "gpt2", False, True, "hf", "the rollout ranks have no CUDA, and the lean engine does not run gpt2 models"),
    ("hf", "llama", True, True, "hf", None), ("vllm", "gpt2", False, False, "vllm", None),
    ("lean", "llama", True, True, "lean", None)])
def test_engine_choice(requested, model_type, cuda, vllm_found, want, why):
    """rollout.engine=auto: vLLM where the rollout ranks have CUDA and vLLM is installed, else the lean engine for the
    architectures it runs, else plain transformers; a named engine is that engine.  The reason names what decided."""
    from hpc_rlhf.generation.factory import choose
    spec, reason = choose(requested, model_type, cuda, vllm_found)
    assert spec.name == want
    assert reason == (f"rollout.engine=auto: {why}" if why else f"rollout.engine={requested}")


@pytest.mark.parametrize("arch,engine,made", [
    ("llama", "auto", "LeanEngine"), ("llama", "lean", "LeanEngine"), ("llama", "hf", "HFEngine"),
    ("gpt2", "auto", "HFEngine"), ("gpt2", "hf", "HFEngine"), ("gpt2", "lean", None)])
def test_make_engine_builds_the_engine_the_config_names(model_dirs, arch, engine, made):
    """`engine` of a config (here `hpc-rlhf generate`'s model section): auto is the lean engine for a model it runs,
    else the plain one; lean refuses a model it does not run with one line."""
    from hpc_rlhf.config import load_config
    from hpc_rlhf.config.pipelines import GenerateConfig
    from hpc_rlhf.generation.factory import make_engine
    opts = load_config(GenerateConfig, None, [f"pretrain={model_dirs[(arch, 0)]}", "prompt_data=p.jsonl",
                                              "output_path=o.jsonl", f"engine={engine}"]).model
    if made is None:
        with pytest.raises(ValueError, match=r"^the lean engine does not run GPT2LMHeadModel \(gpt2\)"):
            make_engine(opts, opts.pretrain, "fp32", "cpu", 4)
    else:
        assert type(make_engine(opts, opts.pretrain, "fp32", "cpu", 4)).__name__ == made
