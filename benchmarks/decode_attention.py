"""One decode step's attention for one layer, as the lean decoder computes it on the CPU in fp32: PyTorch's operations
(``lean/decoder.py:split_attention`` over a shared prompt prefix, ``grouped_attention`` without one) against the
compiled kernel (``few_rows`` ``attend_one``), at the shapes of the GRPO benchmark's batch.

Rows ``--rows`` (each prompt's ``--samples`` rows share its prefix of ``--prefix`` slots), each with its own
``--slots`` cached slots (views of a longer cache, as the decoder passes them), SmolLM2-135M's heads by default (9
query heads, 3 key/value heads of 64).  A tenth of the own slots and a fifth of the prefix's are masked.  Each
setting: both ways' best time over repeated calls, their largest difference, and the rate at which the kernel reads
the rows' own keys and values (the part that no two rows share, which it must read from memory).  One JSON line last.

    .venv/bin/python benchmarks/decode_attention.py            # about 30 s
    .venv/bin/python benchmarks/decode_attention.py --no-prefix --rows 8
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from machine_limits import _best_time  # noqa: E402


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def setting(mod, rows: int, samples: int, prefix: int, slots: int, heads: int, kv_heads: int, dim: int,
            min_s: float, seed: int) -> dict:
    import torch

    from hpc_rlhf.generation.lean import decoder as ld
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, heads, 1, dim, generator=g)
    k = torch.randn(rows, kv_heads, slots + 16, dim, generator=g)[:, :, :slots]
    v = torch.randn(rows, kv_heads, slots + 16, dim, generator=g)[:, :, :slots]
    own = torch.rand(rows, slots, generator=g) > 0.1
    own[:, -1] = True  # the slot just written
    scale = dim ** -0.5
    if prefix:
        count = max(1, rows // samples)
        pk = [torch.randn(count, kv_heads, prefix, dim, generator=g)]
        pv = [torch.randn(count, kv_heads, prefix, dim, generator=g)]
        shared = ld.SharedPrefix(pk, pv, torch.rand(count, prefix, generator=g) > 0.2,
                                 [min(b // samples, count - 1) for b in range(rows)])
        mask = ld._additive(own[:, None, None], torch.float32)

        def torch_ops():
            return ld.split_attention(q, shared, 0, k, v, mask, scale)
        extra = (pk[0], pv[0], shared.valid, shared.row)
    else:
        def torch_ops():
            return ld.grouped_attention(q, k, v, own[:, None, None], scale)
        extra = ()

    def kernel():
        return mod.attend_one(q[:, :, 0], k, v, own, scale, *extra)
    diff = (torch_ops().reshape(rows, -1) - kernel()).abs().max().item()
    ops_s, kernel_s = _best_time(torch_ops, min_s), _best_time(kernel, min_s)
    own_bytes = 2 * rows * kv_heads * slots * dim * 4
    return {"rows": rows, "prefix": prefix, "slots": slots, "torch_ms": 1e3 * ops_s, "kernel_ms": 1e3 * kernel_s,
            "speedup": ops_s / kernel_s, "max_abs_diff": diff, "kernel_own_gb_per_s": own_bytes / kernel_s / 1e9}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=ints, default=[64, 32, 8], help="comma-separated row counts")
    ap.add_argument("--slots", type=ints, default=[8, 64, 128, 250], help="comma-separated own slot counts")
    ap.add_argument("--samples", type=int, default=8, help="rows per prompt (sharing its prefix)")
    ap.add_argument("--prefix", type=int, default=78, help="the prompt's cached slots (the benchmark's mean)")
    ap.add_argument("--no-prefix", action="store_true", help="no shared prefix: every slot is the row's own")
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--min-s", type=float, default=0.5, help="time each way for at least this long")
    args = ap.parse_args(argv)
    import torch

    from hpc_rlhf.generation.lean import few_rows
    torch.set_num_threads(args.threads)
    mod = few_rows.kernel()
    if mod is None:
        raise SystemExit("decode_attention: the few-row kernel cannot be built here (the warning above says why)")
    prefix = 0 if args.no_prefix else args.prefix
    out = []
    for rows in args.rows:
        for slots in args.slots:
            r = setting(mod, rows, args.samples, prefix, slots, args.heads, args.kv_heads, args.head_dim,
                        args.min_s, seed=rows * 1000 + slots)
            print(f"rows {rows:3d}, prefix {prefix}, own slots {slots:3d}: PyTorch {r['torch_ms']:.3f} ms, kernel "
                  f"{r['kernel_ms']:.3f} ms ({r['speedup']:.2f}x; own keys and values at "
                  f"{r['kernel_own_gb_per_s']:.1f} GB/s), largest difference {r['max_abs_diff']:.1e}", file=sys.stderr)
            out.append(r)
    print(json.dumps({"benchmark": "decode_attention", "threads": args.threads, "torch": torch.__version__,
                      "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
                      "samples_per_prompt": args.samples, "settings": out}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
