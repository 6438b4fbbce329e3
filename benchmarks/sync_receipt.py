"""The weight sync's receipt on one model: how far the rollout engines' log-probs of a probe lie from the actor's
(the rounding of two computations of the same weights, by dtype), how far one tensor negated or zeroed moves them,
and what one probe costs on each side.

For fp32 and bf16: the actor's side is the model's forward as `train rl`'s actor runs it (``logprobs_per_sample``,
what ``Actor.probe_logprobs`` calls), the engines' side the transformers and the lean engine of the same folder
(``probe_logprobs``: the prompt prefilled, the response teacher-forced one decode step at a time).  ``--probes``
probes of the receipt's shape (``roles/sync.py``: 12 prompt and 4 response token ids), drawn with seeds 0, 1, ...
(0 is the receipt's own); ``gap`` is the largest |engine - actor| over a probe's 4 log-probs, ``max_gap`` the
largest over the probes.  ``corrupted``: the lean engine's gap on probe 0 with one tensor changed in place (the
last and the first layer's down_proj negated, the middle layer's o_proj zeroed).  ``actor_probe_s`` and
``engine_probe_s``: the median of ``--reps`` probes after one warm-up; ``load_avg`` the machine's load averages
(1, 5, 15 min) at the end, as other work slows the timings.  Prints one JSON line.

    .venv/bin/python benchmarks/sync_receipt.py        # SmolLM2-135M (scripts/real_assets.sh): a few minutes
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

REAL = Path(os.environ.get("HPC_RLHF_ASSETS", "~/.cache/hpc_rlhf/real")).expanduser()  # scripts/real_assets.sh


def _median_s(fn, reps: int) -> float:
    fn()  # warm-up (the lean engine's kernel is built at its first decode)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(model: str, dtype: str, probes: int, reps: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from hpc_rlhf.generation.factory import transformers_engine
    from hpc_rlhf.roles.experience import Experience
    from hpc_rlhf.roles.shared_prompts import logprobs_per_sample
    from hpc_rlhf.roles.sync import PROBE_PROMPT, PROBE_RESPONSE, probe_gap
    actor = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32 if dtype == "fp32" else torch.bfloat16)
    engines = {"hf": transformers_engine(model, dtype=dtype, lean=False),
               "lean": transformers_engine(model, dtype=dtype)}
    vocab = actor.config.vocab_size

    def draw(seed: int) -> tuple[list[int], list[int]]:
        rng = random.Random(seed)
        ids = [rng.randrange(vocab) for _ in range(PROBE_PROMPT + PROBE_RESPONSE)]
        return ids[:PROBE_PROMPT], ids[PROBE_PROMPT:]

    def actor_logprobs(prompt, response) -> list[float]:
        probe = Experience(0, 0, prompt, response, [], "length", "", "", None)
        return logprobs_per_sample(actor, [probe], 1, 0, "cpu", 1.0, False)[0]
    gaps = {name: [] for name in engines}
    for seed in range(probes):
        prompt, response = draw(seed)
        want = actor_logprobs(prompt, response)
        for name, engine in engines.items():
            gaps[name].append(probe_gap(want, engine.probe_logprobs(prompt, response)))
    prompt, response = draw(0)
    want, lean = actor_logprobs(prompt, response), engines["lean"]
    layers = actor.config.num_hidden_layers
    params = dict(lean.model.named_parameters())
    corrupted = {}
    for name, change in ((f"model.layers.{layers - 1}.mlp.down_proj.weight", "neg_"),
                         ("model.layers.0.mlp.down_proj.weight", "neg_"),
                         (f"model.layers.{layers // 2}.self_attn.o_proj.weight", "zero_")):
        kept = params[name].detach().clone()
        with torch.no_grad():
            getattr(params[name], change)()
        corrupted[f"{name} {change.rstrip('_')}"] = probe_gap(want, lean.probe_logprobs(prompt, response))
        with torch.no_grad():
            params[name].copy_(kept)
    return {"gap": gaps, "max_gap": {name: max(g) for name, g in gaps.items()}, "corrupted": corrupted,
            "actor_probe_s": _median_s(lambda: actor_logprobs(prompt, response), reps),
            "engine_probe_s": {name: _median_s(lambda e=e: e.probe_logprobs(prompt, response), reps)
                               for name, e in engines.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(REAL / "smollm2-135m-instruct"))
    ap.add_argument("--probes", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    import torch
    torch.set_num_threads(args.threads)
    result = {"benchmark": "sync_receipt", "model": Path(args.model).name, "threads": args.threads,
              "torch": torch.__version__, "probes": args.probes, "reps": args.reps}
    for dtype in ("fp32", "bf16"):
        result[dtype] = measure(args.model, dtype, args.probes, args.reps)
    result["load_avg"] = os.getloadavg()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
