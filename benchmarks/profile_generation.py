"""Where a generation's time goes: the transformers engine (its lean decoder) under ``torch.profiler``.

One batch of ``--prompts`` ASDiv prompts × ``--samples`` samples (the model's chat template), up to
``--max-new-tokens`` at temperature 1, timed once without the profiler and once with it.  The operators'
self time is grouped: matrix products, attention, sampling (the uniform draws, the Gumbel transform, argmax,
the log-softmax of the chosen tokens), everything else.  One JSON line last on stdout.

    .venv/bin/python benchmarks/profile_generation.py     # SmolLM2-135M, 8 x 8 x 256: about 1.5 minutes
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

REAL = Path(os.environ.get("HPC_RLHF_ASSETS", "~/.cache/hpc_rlhf/real")).expanduser()  # scripts/real_assets.sh
GROUPS = {"matmul": ("aten::mm", "aten::addmm", "aten::bmm"),
          "attention": ("aten::_scaled_dot_product", "aten::scaled_dot_product"),
          "sampling": ("aten::uniform_", "aten::exponential_", "aten::log_", "aten::neg_", "aten::argmax",
                       "aten::_log_softmax")}


def group_of(op: str, groups: dict[str, tuple[str, ...]] = GROUPS) -> str:
    """The group an operator's name falls in (pure)."""
    return next((name for name, prefixes in groups.items() if op.startswith(prefixes)), "other")


def add_batch_args(ap: argparse.ArgumentParser) -> None:
    """The flags of one generation batch (shared with profile_training.py)."""
    ap.add_argument("--model", default=str(REAL / "smollm2-135m-instruct"))
    ap.add_argument("--data", default=str(REAL / "asdiv" / "train.jsonl"))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)


def generation_batch(args):
    """(tokenizer, engine, prompts × samples, sampling params, seeds) of the batch ``args`` describe: the first
    ``--prompts`` ASDiv prompts in the model's chat template, temperature 1, up to ``--max-new-tokens``."""
    import torch
    from transformers import AutoTokenizer

    from hpc_rlhf.engines.hf_engine import HFEngine
    from hpc_rlhf.engines.rollout import SamplingParams
    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.model)
    rows = [json.loads(x) for x in Path(args.data).read_text().splitlines() if x.strip()][:args.prompts]
    texts = [tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True,
                                     tokenize=False) for r in rows]
    prompts = tok(texts, add_special_tokens=False)["input_ids"]
    engine = HFEngine(args.model, max_batch_size=args.prompts * args.samples)
    params = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens,
                            stop_token_ids=sorted({tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id}))
    flat = [p for p in prompts for _ in range(args.samples)]
    return tok, engine, flat, params, list(range(len(flat)))


def self_time(prof, groups: dict[str, tuple[str, ...]], top_n: int) -> dict:
    """A profile's operator self seconds summed by group, calls by group, and the ``top_n`` operators (the
    list also printed to stderr)."""
    seconds, calls, top = defaultdict(float), defaultdict(int), []
    for e in prof.key_averages():
        seconds[group_of(e.key, groups)] += e.self_cpu_time_total / 1e6
        calls[group_of(e.key, groups)] += e.count
        top.append((e.self_cpu_time_total / 1e6, e.key, e.count))
    top = sorted(top, reverse=True)[:top_n]
    for s, k, n in top:
        print(f"{k:50s} {s:7.2f} s {n:9d} calls", file=sys.stderr)
    return {"self_s": dict(seconds), "calls": dict(calls),
            "top": [{"op": k, "self_s": s, "calls": n} for s, k, n in top]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_batch_args(ap)
    args = ap.parse_args(argv)
    from torch.profiler import ProfilerActivity, profile
    tok, engine, flat, params, seeds = generation_batch(args)
    t0 = time.perf_counter()
    out = engine.generate(flat, params, seeds)
    plain_s = time.perf_counter() - t0
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        engine.generate(flat, params, seeds)
        profiled_s = time.perf_counter() - t0
    result = {"tokens": sum(len(c.token_ids) for c in out), "longest": max(len(c.token_ids) for c in out),
              "plain_s": plain_s, "profiled_s": profiled_s, **self_time(prof, GROUPS, 12)}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
