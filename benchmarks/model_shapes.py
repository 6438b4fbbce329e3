"""The matrix products of a Llama-style model at the shapes an RL step runs them, timed on this CPU.

``machine_limits.py`` measures the peak of square ``torch.mm``; a model's own products are thinner (a decode
step multiplies a batch of 64 rows by each weight) and may run slower.  This script times each of them:

- decode: each weight of the lean decoder (query/key/value and gate/up packed) and the output head, at
  ``--decode-rows`` rows (the rows still decoding), multiplied as the decoder does (``lean/decoder.py:Packed`` and
  ``_matmul``: at most ``few_rows.MAX_ROWS`` rows by the few-row kernel and more by oneDNN's linear on
  reordered weights on the CPU in fp32, else ``W @ x^T``), and as plain
  ``W @ x^T`` beside it (``decode_w_xt``);
- training: the forward ``F.linear(x, W)`` and the two backward products (input gradient ``g @ W``, weight
  gradient ``g.T @ x``) of each linear layer of the transformers model, at ``--train-rows`` tokens per
  micro-batch.

Each product's FLOP/s and, per setting, the step's rate: the FLOPs of one layer's products times the layer
count plus the head's, over their summed times.  That is the rate the step's matrix work can reach at these
shapes; ``machine_limits.py``'s fractions use the square peak.  bf16 is timed at the decode rows and at
``--bf16-train-rows`` (its slow paths take seconds per product at full size).

``--model-pass BxT`` also times the whole model (transformers, loaded from ``--model`` in each dtype): the
forward and the backward of a batch of B rows of T random tokens (the best of two after one untimed pass).

    python benchmarks/model_shapes.py --model ~/.cache/hpc_rlhf/real/smollm2-135m-instruct --threads 2
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from machine_limits import _best_time  # noqa: E402


def layer_weights(shape) -> dict:
    """{name: (in, out)} of one decoder layer's linear weights, plus the head, from a Llama-style
    ``hpc_rlhf.models.shape.ModelShape``."""
    h, i, kv = shape.hidden, shape.intermediate, shape.kv_heads * shape.head_dim
    return {"q": (h, h), "k": (h, kv), "v": (h, kv), "o": (h, h), "gate": (h, i), "up": (h, i), "down": (i, h),
            "head": (h, shape.vocab)}


def packed_weights(shape) -> dict:
    """The lean decoder's products: query/key/value and gate/up each one weight."""
    w = layer_weights(shape)
    return {"qkv": (w["q"][0], w["q"][1] + 2 * w["k"][1]), "o": w["o"], "gate_up": (w["gate"][0], 2 * w["gate"][1]),
            "down": w["down"], "head": w["head"]}


def step_rate(per_product: dict, layers: int) -> float:
    """FLOP/s of a step that runs each non-head product ``layers`` times and the head once (pure)."""
    flops = sum(p["flops"] * (1 if name.startswith("head") else layers) for name, p in per_product.items())
    secs = sum(p["flops"] / p["flop_s"] * (1 if name.startswith("head") else layers)
               for name, p in per_product.items())
    return flops / secs


def time_decode(weights: dict, rows: int, dtype, min_s: float, as_decoder: bool = True) -> dict:
    """Each product at ``rows`` rows: as the lean decoder runs it, or (``as_decoder`` False) as ``W @ x^T``."""
    import torch

    from hpc_rlhf.generation.lean import few_rows
    from hpc_rlhf.generation.lean.decoder import Packed, _matmul
    few = few_rows.kernel() if dtype == torch.float32 else None  # the decoder's kernel for a few rows
    out = {}
    for name, (n_in, n_out) in weights.items():
        x, w = torch.randn(rows, n_in).to(dtype), torch.randn(n_out, n_in).to(dtype)
        linear = torch.nn.Linear(n_in, n_out, bias=False, dtype=dtype)
        with torch.no_grad():
            linear.weight.copy_(w)
            packed = Packed([linear])
        fn = (lambda: _matmul(x, packed, few)) if as_decoder else (lambda: w @ x.t())
        flops = 2 * rows * n_in * n_out
        out[name] = {"flops": flops, "flop_s": flops / _best_time(fn, min_s)}
    return out


def time_train(weights: dict, rows: int, dtype, min_s: float) -> dict:
    """Forward and both backward products of each linear layer (nn.Linear keeps W as [out, in])."""
    import torch
    import torch.nn.functional as F
    out = {}
    for name, (n_in, n_out) in weights.items():
        x, w = torch.randn(rows, n_in).to(dtype), torch.randn(n_out, n_in).to(dtype)
        g = torch.randn(rows, n_out).to(dtype)
        flops = 2 * rows * n_in * n_out
        for part, fn in (("fwd", lambda: F.linear(x, w)), ("grad_in", lambda: g @ w), ("grad_w", lambda: g.t() @ x)):
            key = name + "." + part if name != "head" else "head." + part
            out[key] = {"flops": flops, "flop_s": flops / _best_time(fn, min_s, min_reps=1)}
    return out


def model_pass(path: str, dtype, batch: int, tokens: int) -> dict:
    """{"forward_s", "backward_s"}: the best of two timed passes of the model in ``dtype`` (after one untimed)."""
    import time

    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(Path(path).expanduser()), dtype=dtype)
    ids = torch.randint(0, model.config.vocab_size, (batch, tokens), generator=torch.Generator().manual_seed(0))
    best = {"forward_s": float("inf"), "backward_s": float("inf")}
    for rep in range(3):
        t0 = time.perf_counter()
        loss = model(input_ids=ids).logits.float().mean()
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        model.zero_grad(set_to_none=True)
        if rep:
            best = {"forward_s": min(best["forward_s"], t1 - t0), "backward_s": min(best["backward_s"], t2 - t1)}
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a Llama-style model folder")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode-rows", default="64,32,16,8,4", help="rows of a decode step, comma separated")
    ap.add_argument("--train-rows", type=int, default=3072, help="tokens per training micro-batch (fp32)")
    ap.add_argument("--bf16-train-rows", type=int, default=256, help="tokens per training micro-batch (bf16)")
    ap.add_argument("--min-s", type=float, default=0.2, help="time each product for at least this long")
    ap.add_argument("--model-pass", default="", help="BxT: also time the model's forward and backward (e.g. 8x100)")
    args = ap.parse_args(argv)
    import torch

    from hpc_rlhf.models.shape import model_shape
    torch.set_num_threads(args.threads)
    shape = model_shape(str(Path(args.model).expanduser()))
    layers = shape.layers
    result = {"model": str(args.model), "threads": args.threads, "torch": torch.__version__, "layers": layers,
              "decode": {}, "decode_w_xt": {}, "train": {}}
    for dtype, tag in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        for rows in (int(r) for r in args.decode_rows.split(",")):
            for key, as_decoder in (("decode", True), ("decode_w_xt", False)):
                per = time_decode(packed_weights(shape), rows, dtype, args.min_s, as_decoder)
                result[key][f"{tag}@{rows}"] = {"step_flop_s": step_rate(per, layers),
                                                "per_product": {k: v["flop_s"] for k, v in per.items()}}
                print(f"{key} {tag} rows {rows}: {result[key][f'{tag}@{rows}']['step_flop_s'] / 1e9:.0f} GFLOP/s",
                      file=sys.stderr)
        rows = args.train_rows if dtype == torch.float32 else args.bf16_train_rows
        per = time_train(layer_weights(shape), rows, dtype, args.min_s)
        result["train"][f"{tag}@{rows}"] = {"step_flop_s": step_rate(per, layers),
                                            "per_product": {k: v["flop_s"] for k, v in per.items()}}
        print(f"train {tag} rows {rows}: {result['train'][f'{tag}@{rows}']['step_flop_s'] / 1e9:.0f} GFLOP/s",
              file=sys.stderr)
    if args.model_pass:
        b, t = (int(x) for x in args.model_pass.lower().split("x"))
        result["model_pass"] = {f"{tag}@{b}x{t}": model_pass(args.model, dtype, b, t)
                                for dtype, tag in ((torch.float32, "fp32"), (torch.bfloat16, "bf16"))}
        print(f"model pass {b}x{t}: {result['model_pass']}", file=sys.stderr)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
