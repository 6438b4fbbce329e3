"""A decode step's matrix products, as the lean decoder computes them on the CPU in fp32: oneDNN with reordered
weights (``torch.ops.mkldnn._linear_pointwise``, the decoder's way without the kernel) against the compiled
kernel's panels (``few_rows`` ``linear_panels``), at a model's shapes, against this machine's peak.

SmolLM2-135M's shapes by default (hidden 576, MLP 1536, 9 query and 3 key/value heads of 64, a 49,152-token
vocabulary, 30 layers): query/key/value in one product, the output projection, gate/up in one, down, and the head.
Each product cycles through ``--copies`` copies of its weight, so that every call reads its weight from memory as a
decode step does (a step reads each layer's weights once); the head has one copy, larger than the caches.  For each
row count: both ways' best time per product and their GFLOP/s, the largest difference from float64, and a whole
step's products (each layer's four times the layers, plus the head) against the fp32 matmul peak measured in the
same run (``machine_limits.matmul_flops``, square products).  One JSON line last.

    .venv/bin/python benchmarks/decode_products.py             # about 2 minutes
    .venv/bin/python benchmarks/decode_products.py --rows 64 --threads 1
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
import machine_limits as ml  # noqa: E402


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def shapes(hidden: int, mlp: int, heads: int, kv_heads: int, head_dim: int, vocab: int) -> dict[str, tuple[int, int]]:
    """A Llama layer's products and the head as (outputs, inputs), query/key/value and gate/up stacked (pure)."""
    return {"qkv": ((heads + 2 * kv_heads) * head_dim, hidden), "o": (hidden, heads * head_dim),
            "gate_up": (2 * mlp, hidden), "down": (hidden, mlp), "head": (vocab, hidden)}


def product(mod, rows: int, out: int, inp: int, copies: int, min_s: float, seed: int) -> dict:
    """One product's two ways at ``rows`` rows, each call on the next of ``copies`` weight copies."""
    import torch
    g = torch.Generator().manual_seed(seed)
    weights = [torch.randn(out, inp, generator=g) * inp ** -0.5 for _ in range(copies)]
    x = torch.randn(rows, inp, generator=g)
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in weights]
    panels = [mod.pack_panels([w]) for w in weights]
    turn = [0]

    def next_copy() -> int:
        turn[0] = (turn[0] + 1) % copies
        return turn[0]

    def by_onednn():
        return torch.ops.mkldnn._linear_pointwise(x, onednn[next_copy()], None, "none", [], "")

    def by_panels():
        return mod.linear_panels(x, panels[next_copy()], out)
    want = x.double() @ weights[0].double().t()
    turn[0] = copies - 1
    diff_onednn = (by_onednn().double() - want).abs().max().item()
    turn[0] = copies - 1
    diff_panels = (by_panels().double() - want).abs().max().item()
    onednn_s, panels_s = ml._best_time(by_onednn, min_s), ml._best_time(by_panels, min_s)
    flops = 2 * rows * out * inp
    return {"onednn_ms": 1e3 * onednn_s, "panels_ms": 1e3 * panels_s, "onednn_gflops": flops / onednn_s / 1e9,
            "panels_gflops": flops / panels_s / 1e9, "max_abs_diff_onednn": diff_onednn,
            "max_abs_diff_panels": diff_panels}


def step_products(per: dict[str, dict], layers: int, way: str) -> float:
    """A decode step's products in seconds: the four of a layer ``layers`` times, plus the head (pure)."""
    return sum(r[f"{way}_ms"] * (1 if name == "head" else layers) for name, r in per.items()) / 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=ints, default=[64, 32, 16, 9], help="comma-separated row counts")
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--mlp", type=int, default=1536)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--copies", type=int, default=8, help="weight copies a layer's product cycles through")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--min-s", type=float, default=0.5, help="time each way of each product for at least this long")
    args = ap.parse_args(argv)
    import torch

    from hpc_rlhf.generation.lean import few_rows
    torch.set_num_threads(args.threads)
    mod = few_rows.kernel()
    if mod is None:
        raise SystemExit("decode_products: the kernel cannot be built here (the warning above says why)")
    peak = ml.matmul_flops(torch.float32, ml.FP32_SIZES)["peak"]
    print(f"fp32 matmul peak {peak / 1e9:.1f} GFLOP/s ({args.threads} threads)", file=sys.stderr)
    table = shapes(args.hidden, args.mlp, args.heads, args.kv_heads, args.head_dim, args.vocab)
    params = sum(o * i * (1 if name == "head" else args.layers) for name, (o, i) in table.items())
    out = []
    for rows in args.rows:
        per = {}
        for name, (o, i) in table.items():
            per[name] = r = product(mod, rows, o, i, 1 if name == "head" else args.copies, args.min_s,
                                    seed=rows * 100 + len(per))
            print(f"rows {rows:3d} {name:8s} {i:5d} -> {o:5d}: oneDNN {r['onednn_ms']:7.3f} ms "
                  f"({r['onednn_gflops']:5.1f} GFLOP/s), panels {r['panels_ms']:7.3f} ms "
                  f"({r['panels_gflops']:5.1f}); differences {r['max_abs_diff_onednn']:.1e}, "
                  f"{r['max_abs_diff_panels']:.1e}", file=sys.stderr)
        at_peak = 2 * rows * params / peak
        step = {way: step_products(per, args.layers, way) for way in ("onednn", "panels")}
        print(f"rows {rows:3d} step: oneDNN {1e3 * step['onednn']:.1f} ms ({at_peak / step['onednn']:.2f} of the "
              f"peak), panels {1e3 * step['panels']:.1f} ms ({at_peak / step['panels']:.2f})", file=sys.stderr)
        out.append({"rows": rows, "products": per, "step_onednn_s": step["onednn"], "step_panels_s": step["panels"],
                    "step_at_peak_s": at_peak, "onednn_vs_peak": at_peak / step["onednn"],
                    "panels_vs_peak": at_peak / step["panels"]})
    print(json.dumps({"benchmark": "decode_products", "threads": args.threads, "torch": torch.__version__,
                      "matmul_flops_fp32": peak, "layers": args.layers, "matmul_params": params,
                      "shapes": {k: list(v) for k, v in table.items()}, "copies": args.copies, "settings": out}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
