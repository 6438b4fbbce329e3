"""Where a generation's time goes: the transformers engine (its lean decoder) under ``torch.profiler``.

One batch of ``--prompts`` ASDiv prompts × ``--samples`` samples (the model's chat template), up to
``--max-new-tokens`` at temperature 1, timed once without the profiler and once with it.  The operators'
self time is grouped: matrix products, attention (every operator inside the lean decoder's attention
functions, whatever its name), sampling (the softmax, running sums and search of the engine's
inverse-distribution draw; generate's softmax and multinomial draw; argmax; the log-softmax of the chosen
tokens), everything else.  One JSON line last on stdout.

``--device cuda`` runs it on the GPU (the profile then also records the GPU: kernels launched and their time
per generated token); ``--dtype bf16`` in bf16; ``--random-init`` with random weights of the model's shape (for
a machine its weights cannot reach; every row then runs to ``--max-new-tokens``); ``--no-stop`` makes every row
run to ``--max-new-tokens`` (the same work in every run, where sampled lengths differ by the last bits of the
logits); ``--no-shared-prefix`` makes a prompt's samples copy its prefilled cache (the lean decoder's path before
it shared it), and ``--alternate K`` profiles nothing but times K rounds of the generation copying then sharing it,
one after the other (``--alternate-what few_row_kernel``: without, then with the few-row kernel);
``--no-few-row-kernel`` leaves the kernel out (``few_rows``); ``--compare-hf`` also times transformers' ``generate``
(sampling at temperature 1, the same rows, as many new tokens as the engine's longest row) on the same model, so
that the two are compared per decode step on the same device.

    .venv/bin/python benchmarks/profile_generation.py     # SmolLM2-135M, 8 x 8 x 256: about 4 minutes
    python benchmarks/profile_generation.py --device cuda --dtype bf16 --random-init --compare-hf
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

REAL = Path(os.environ.get("HPC_RLHF_ASSETS", "~/.cache/hpc_rlhf/real")).expanduser()  # scripts/real_assets.sh
GROUPS = {"matmul": ("aten::mm", "aten::addmm", "aten::bmm", "mkldnn::_linear_pointwise"),
          "attention": ("aten::_scaled_dot_product", "aten::scaled_dot_product"),
          "sampling": ("aten::uniform_", "aten::exponential_", "aten::log_", "aten::neg_", "aten::argmax",
                       "aten::_log_softmax", "aten::_softmax", "aten::multinomial",
                       "aten::cumsum", "aten::searchsorted")}


# profiler ranges whose operators all count in one group: the lean decoder's attention is several operators
# (matrix products and a softmax, `lean/decoder.py:split_attention`) that by name would fall in other groups, and the
# few-row kernels (`few_rows`) are calls the profiler does not see as operators
ATTENTION_RANGE = "lean_decoder.attention"
PRODUCTS_RANGE = "few_rows.products"
RANGES = {ATTENTION_RANGE: "attention", PRODUCTS_RANGE: "matmul"}


def group_of(op: str, groups: dict[str, tuple[str, ...]] = GROUPS) -> str:
    """The group an operator's name falls in (pure)."""
    return next((name for name, prefixes in groups.items() if op.startswith(prefixes)), "other")


def event_group(op: str, enclosing: list[str], groups: dict[str, tuple[str, ...]] = GROUPS,
                ranges: dict[str, str] = RANGES) -> str:
    """The group of operator ``op`` that runs inside the events ``enclosing`` (names, innermost first): that of
    the innermost of them (or ``op`` itself) named in ``ranges``, else its name's (pure)."""
    return next((ranges[name] for name in (op, *enclosing) if name in ranges), None) or group_of(op, groups)


def label_attention() -> None:
    """Run the lean decoder's attention functions and the few-row kernel's attention inside the ``ATTENTION_RANGE``
    profiler range, and the kernel's products inside ``PRODUCTS_RANGE``."""
    import torch

    from hpc_rlhf.generation.lean import decoder, few_rows
    def in_range(inner, name: str):
        def ranged(*args, **kwargs):
            with torch.profiler.record_function(name):
                return inner(*args, **kwargs)
        return ranged
    for name in ("grouped_attention", "split_attention"):
        setattr(decoder, name, in_range(getattr(decoder, name), ATTENTION_RANGE))
    kernel = few_rows.kernel()  # the decoder's module (built once per process)
    if kernel is not None:
        kernel.attend_one = in_range(kernel.attend_one, ATTENTION_RANGE)
        kernel.linear_rows = in_range(kernel.linear_rows, PRODUCTS_RANGE)
        kernel.linear_panels = in_range(kernel.linear_panels, PRODUCTS_RANGE)


def add_batch_args(ap: argparse.ArgumentParser) -> None:
    """The flags of one generation batch (shared with profile_training.py)."""
    ap.add_argument("--model", default=str(REAL / "smollm2-135m-instruct"))
    ap.add_argument("--data", default=str(REAL / "asdiv" / "train.jsonl"))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)


def random_weights(model: str, seed: int = 0):
    """A model of ``model``'s config with random weights (the config's own initialisation, seeded), fp32."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model), dtype=torch.float32)


def generation_batch(args):
    """(tokenizer, engine, prompts × samples, sampling params, seeds) of the batch ``args`` describe: the first
    ``--prompts`` ASDiv prompts in the model's chat template, temperature 1, up to ``--max-new-tokens`` (with
    profile_generation's ``--random-init``, ``--dtype`` and ``--device`` when ``args`` has them)."""
    import torch
    from transformers import AutoTokenizer

    from hpc_rlhf.generation.factory import transformers_engine
    from hpc_rlhf.generation.engine import SamplingParams
    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.model)
    rows = [json.loads(x) for x in Path(args.data).read_text().splitlines() if x.strip()][:args.prompts]
    texts = [tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True,
                                     tokenize=False) for r in rows]
    prompts = tok(texts, add_special_tokens=False)["input_ids"]
    model = random_weights(args.model) if getattr(args, "random_init", False) else args.model
    engine = transformers_engine(model, dtype=getattr(args, "dtype", "fp32"), device=getattr(args, "device", "cpu"),
                      max_batch_size=args.prompts * args.samples)
    params = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens,
                            stop_token_ids=sorted({tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id}))
    flat = [p for p in prompts for _ in range(args.samples)]
    return tok, engine, flat, params, list(range(len(flat)))


def self_time(prof, groups: dict[str, tuple[str, ...]], top_n: int) -> dict:
    """A profile's operator self seconds summed by group (``event_group``: an operator inside a range of
    ``RANGES`` counts in its group), calls by group, and the ``top_n`` operators (the list also printed to
    stderr)."""
    seconds, calls, top = defaultdict(float), defaultdict(int), []
    for e in prof.events():
        enclosing, parent = [], e.cpu_parent
        while parent is not None:
            enclosing.append(parent.name)
            parent = parent.cpu_parent
        group = event_group(e.name, enclosing, groups)
        seconds[group] += e.self_cpu_time_total / 1e6
        calls[group] += 1
    for e in prof.key_averages():
        top.append((e.self_cpu_time_total / 1e6, e.key, e.count))
    top = sorted(top, reverse=True)[:top_n]
    for s, k, n in top:
        print(f"{k:50s} {s:7.2f} s {n:9d} calls", file=sys.stderr)
    return {"self_s": dict(seconds), "calls": dict(calls),
            "top": [{"op": k, "self_s": s, "calls": n} for s, k, n in top]}


def device_time(prof, steps: int) -> dict:
    """GPU kernels of a CUDA profile: how many were launched and their summed time, per decode step."""
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    busy = sum(e.device_time_total for e in kernels) / 1e6
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in kernels:
        by_name[e.name][0] += e.device_time_total / 1e6
        by_name[e.name][1] += 1
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:12]
    return {"kernels_per_step": len(kernels) / steps, "gpu_busy_s": busy, "gpu_busy_s_per_step": busy / steps,
            "top_kernels": [{"kernel": k[:120], "gpu_s": v[0], "calls": v[1]} for k, v in top]}


def set_shared_prefix(engine, on: bool) -> None:
    engine._lean.shared_prefix = on


def set_few_row_kernel(engine, on: bool) -> None:
    engine._lean.few_row_kernel = on
    engine._lean._packed_key = None  # the next start re-packs, and takes the kernel or leaves it


ALTERNATIVES = {"shared_prefix": set_shared_prefix, "few_row_kernel": set_few_row_kernel}


def alternate(engine, flat, params, seeds, rounds: int, sync, what: str = "shared_prefix") -> dict:
    """``rounds`` rounds of the generation with the lean decoder's option ``what`` (``ALTERNATIVES``) off, then on,
    one after the other (no profiler): each run's seconds and tokens, and the median milliseconds per token of
    each way."""
    runs = []
    for _ in range(rounds):
        for on in (False, True):
            ALTERNATIVES[what](engine, on)
            out, s = timed(lambda: engine.generate(flat, params, seeds), sync)
            tokens = sum(len(c.token_ids) for c in out)
            runs.append({what: on, "s": s, "tokens": tokens, "ms_per_token": 1e3 * s / tokens})
            print(f"{what}={on}: {s:.2f} s, {tokens} tokens", file=sys.stderr)
    median = {f"{what}_{'on' if on else 'off'}_ms_per_token": statistics.median(
        r["ms_per_token"] for r in runs if r[what] == on) for on in (False, True)}
    return {"alternate": runs, **median}


def timed(fn, sync) -> tuple[object, float]:
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - t0


def hf_generate(engine, flat: list[list[int]], new_tokens: int):
    """transformers' generate on the engine's model: the same rows (left-padded), sampling at temperature 1,
    exactly ``new_tokens`` new tokens."""
    import torch
    width = max(len(p) for p in flat)
    ids = torch.tensor([[engine.pad_token_id] * (width - len(p)) + p for p in flat], device=engine.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in flat], device=engine.device)

    def run():
        with torch.no_grad():
            return engine.model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0,
                                         top_k=0, top_p=1.0, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                         pad_token_id=engine.pad_token_id)
    return run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_batch_args(ap)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--random-init", action="store_true", help="random weights of --model's shape (seeded)")
    ap.add_argument("--compare-hf", action="store_true", help="also time transformers' generate (see above)")
    ap.add_argument("--no-stop", action="store_true",
                    help="rows ignore the stop tokens: every row runs to --max-new-tokens, the same work in every run")
    ap.add_argument("--alternate", type=int, default=0, metavar="K",
                    help="no profile: K rounds of the generation with --alternate-what off, then on (see above)")
    ap.add_argument("--alternate-what", choices=sorted(ALTERNATIVES), default="shared_prefix",
                    help="the lean decoder's option that --alternate turns off and on")
    ap.add_argument("--no-few-row-kernel", action="store_true",
                    help="products of a few rows, and their decode steps' attention, through PyTorch's operations "
                         "instead of the few-row kernel (engine.few_row_kernel false)")
    ap.add_argument("--no-shared-prefix", action="store_true",
                    help="the samples of a prompt copy its prefilled cache instead of sharing it (the lean decoder's "
                         "path before shared prefixes, and its path on CUDA and in bf16)")
    args = ap.parse_args(argv)
    import torch
    from torch.profiler import ProfilerActivity, profile
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    tok, engine, flat, params, seeds = generation_batch(args)
    if args.no_stop:
        params = replace(params, stop_token_ids=[])
    if engine._lean is not None:
        set_shared_prefix(engine, not args.no_shared_prefix)
        set_few_row_kernel(engine, not args.no_few_row_kernel)
    elif args.alternate:
        ap.error(f"--alternate: {args.model} does not decode through the lean decoder")
    label_attention()
    engine.generate(flat, replace(params, max_new_tokens=2), seeds)  # warm-up (library set-up, kernel choices)
    if args.alternate:
        print(json.dumps({"device": args.device, "dtype": args.dtype, "no_stop": args.no_stop,
                          **alternate(engine, flat, params, seeds, args.alternate, sync, args.alternate_what)}))
        return 0
    out, plain_s = timed(lambda: engine.generate(flat, params, seeds), sync)
    longest = max(len(c.token_ids) for c in out)
    with profile(activities=activities) as prof:
        _, profiled_s = timed(lambda: engine.generate(flat, params, seeds), sync)
    result = {"device": args.device, "dtype": args.dtype, "random_init": args.random_init,
              "no_stop": args.no_stop, "shared_prefix": not args.no_shared_prefix,
              "few_row_kernel": not args.no_few_row_kernel,
              "tokens": sum(len(c.token_ids) for c in out), "longest": longest,
              "plain_s": plain_s, "plain_s_per_step": plain_s / longest, "profiled_s": profiled_s,
              **self_time(prof, GROUPS, 12), **(device_time(prof, longest) if cuda else {})}
    if args.compare_hf:
        run = hf_generate(engine, flat, longest)
        engine.model.eval()
        timed(run, sync)  # warm-up: its first call sets up what later calls reuse
        _, hf_s = timed(run, sync)
        with profile(activities=activities) as hf_prof:
            _, hf_profiled_s = timed(run, sync)
        result["hf_generate"] = {"plain_s": hf_s, "plain_s_per_step": hf_s / longest, "profiled_s": hf_profiled_s,
                                 **self_time(hf_prof, GROUPS, 12), **(device_time(hf_prof, longest) if cuda else {})}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
