"""Where an optimizer step's training passes go: the actor's forward and backward under ``torch.profiler``.

The transformers engine generates one batch of ``--prompts`` ASDiv prompts × ``--samples`` samples (the
model's chat template, up to ``--max-new-tokens`` at temperature 1), then the actor's code path trains on
them once: ``optimizer_steps`` cuts the batch into micro-batches of ``--micro`` rows longest first (or, with
``--overhead``, where padding costs more than that many positions),
``response_logits`` and ``response_logprobs`` give each token's log-prob, and a policy-gradient loss over the
tokens goes backward (no optimizer step: it changes nothing in the passes' cost).  The passes are timed once
without the profiler and once with it.  The operators' self time is grouped: matrix products, attention,
the output head's log-softmax and gathers over the vocabulary, everything else.  One JSON line last.

``--alternate K`` compares instead, without the profiler: K rounds of the passes as padded batches (each sample
runs its prompt) and with ``train.share_prompts`` (``SharedPrompts``: each distinct prompt once), one after
the other on the same samples and model, with the largest difference of their gradients.

    .venv/bin/python benchmarks/profile_training.py     # SmolLM2-135M, 8 x 8 x 256: about 4 minutes
    .venv/bin/python benchmarks/profile_training.py --overhead 64 --alternate 3    # about 6 minutes
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from profile_generation import add_batch_args, generation_batch, self_time  # noqa: E402

GROUPS = {"matmul": ("aten::mm", "aten::addmm", "aten::bmm"),
          "attention": ("aten::_scaled_dot_product", "aten::scaled_dot_product"),
          "vocabulary": ("aten::_log_softmax", "aten::log_softmax", "aten::gather", "aten::scatter",
                         "aten::_softmax", "aten::logsumexp", "aten::index")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_batch_args(ap)
    ap.add_argument("--micro", type=int, default=16)
    ap.add_argument("--overhead", type=int, default=0, help="train.micro_batch_overhead_tokens (0: --micro rows each)")
    ap.add_argument("--share-prompts", action="store_true",
                    help="train.share_prompts: each distinct prompt runs once (SharedPrompts), micro-batches cut "
                         "by response length")
    ap.add_argument("--alternate", type=int, default=0, metavar="K",
                    help="K rounds of padded and shared passes, alternating, instead of the profile")
    ap.add_argument("--compile-layers", action="store_true",
                    help="torch.compile each decoder layer (dynamic shapes) and time one warm-up pass first")
    args = ap.parse_args(argv)
    import torch
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoModelForCausalLM

    from hpc_rlhf.roles.experience import Experience, response_logits, response_logprobs
    from hpc_rlhf.roles.shared_prompts import SharedPrompts
    from hpc_rlhf.roles.training import optimizer_steps
    tok, engine, flat, params, seeds = generation_batch(args)
    out = engine.generate(flat, params, seeds)
    del engine
    samples = [Experience(i // args.samples, i % args.samples, list(p), list(c.token_ids), list(c.logprobs), "stop",
                          "", "", None, advantages=[(-1.0) ** i] * len(c.token_ids))
               for i, (p, c) in enumerate(zip(flat, out))]
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model.train()
    pad = tok.pad_token_id or 0
    tokens = sum(len(s.response_ids) for s in samples)

    cuts = {}  # share -> the optimizer step's micro-batches, cut once per mode and reused by every pass

    def cut(share: bool):
        if share not in cuts:
            [cuts[share]] = optimizer_steps(samples, len(samples), args.micro, 1, 0, pad, "cpu", args.overhead, share)
        return cuts[share]

    def passes(share: bool = args.share_prompts) -> dict[str, float]:
        micro_batches = cut(share)
        sec = {"forward_s": 0.0, "backward_s": 0.0}
        shared = SharedPrompts(model, samples, len(micro_batches), pad, "cpu") if share else None
        for part, batch in micro_batches:
            t0 = time.perf_counter()
            logits = shared.logits(part, batch) if shared else response_logits(model, batch)
            logp = response_logprobs(logits, batch)
            adv = torch.zeros_like(logp)
            for b, s in enumerate(part):
                adv[b, :len(s.advantages)] = torch.tensor(s.advantages)
            loss = -(logp * adv * batch.mask).sum() / tokens + (shared.closing() if shared else 0.0)
            t1 = time.perf_counter()
            loss.backward()
            sec["forward_s"] += t1 - t0
            sec["backward_s"] += time.perf_counter() - t1
        sec["grads"] = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return sec

    def positions(share: bool) -> int:
        batches = cut(share)
        if not share:
            return sum(int(b.input_ids.numel()) for _, b in batches)
        return (sum(int(b.mask.numel()) for _, b in batches) +
                len({tuple(s.prompt_ids) for s in samples}) * max(len(s.prompt_ids) for s in samples))

    common = {"lengths": sorted((len(s.prompt_ids) + len(s.response_ids) for s in samples), reverse=True),
              "response_tokens": tokens, "prompt_tokens": sum(len(s.prompt_ids) for s in samples),
              "overhead": args.overhead}
    if args.alternate:
        rounds, diff = [], 0.0
        for _ in range(args.alternate):
            padded, shared = passes(False), passes(True)
            diff = max([diff] + [float((a - b).abs().max()) for a, b in zip(padded.pop("grads"), shared.pop("grads"))])
            rounds.append({"padded": padded, "shared": shared})
            print(json.dumps(rounds[-1]), file=sys.stderr, flush=True)
        total = {k: sorted(sum(r[k].values()) for r in rounds)[len(rounds) // 2] for k in ("padded", "shared")}
        print(json.dumps(common | {
            "positions": {"padded": positions(False), "shared": positions(True)},
            "micro_batches": {"padded": [len(m) for m, _ in cut(False)], "shared": [len(m) for m, _ in cut(True)]},
            "rounds": rounds, "median_s": total, "max_abs_grad_diff": diff}))
        return 0
    warmup_s = None
    if args.compile_layers:
        for layer in model.model.layers:
            layer.compile(dynamic=True)
        t0 = time.perf_counter()
        passes()
        warmup_s = time.perf_counter() - t0
    plain = passes()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        profiled = passes()
    del plain["grads"], profiled["grads"]
    result = common | {"padded_positions": positions(args.share_prompts),
                       "micro_batches": [len(m) for m, _ in cut(args.share_prompts)],
                       "share_prompts": args.share_prompts, "compile_layers": args.compile_layers,
                       "warmup_s": warmup_s, "plain": plain, "profiled": profiled, **self_time(prof, GROUPS, 16)}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
