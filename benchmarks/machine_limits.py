"""This machine's limits for an RL step, measured with torch, and the fractions of them a step reaches.

Measured (``measure``; with ``--threads`` torch threads, 2 by default: the benchmark's setting):

- ``matmul_flops``: peak ``torch.mm`` FLOP/s (2·n³ per product of two n×n matrices), the best over a few
  square sizes, in fp32 and bf16;
- ``copy_bytes_per_s``: bytes copied per second by ``dst.copy_(src)`` of a large fp32 tensor (each byte is
  read once and written once, so the memory traffic is twice this figure);
- with ``--device cuda``, the same on the GPU (larger sizes; each timed call ends with a synchronize), the
  copy in the GPU's memory;
- with ``--broadcast-mib``, ``gloo_broadcast_bytes_per_s``: a gloo broadcast between two local processes
  (the transport of a weight sync between ranks on CPU).

The pure functions below turn those into the limits of the issue's targets (each returns a fraction:
1.0 = at the limit, 0.5 = twice as long as the limit allows):

- ``decode_limit_s``: the least time a generation can take: every decode step reads the weights once (at
  the copy traffic rate), and every token costs 2 × matmul parameters FLOPs (prefill and decode, at the
  peak matmul rate); the larger of the two binds;
- ``train_fraction``: 6 × parameters × tokens of the step over the training time, against the peak;
- ``sync_fraction``: the model's bytes over the weight-sync time, against the copy bandwidth.

    python benchmarks/machine_limits.py --threads 2       # one JSON line on stdout
"""
from __future__ import annotations

import argparse
import json
import math
import time

FP32_SIZES = (256, 512, 1024, 2048)
BF16_SIZES = (256, 512, 1024)  # bf16 mm is many times slower on CPUs without AMX: bigger sizes take seconds each
CUDA_SIZES = (2048, 4096, 8192)  # a GPU reaches its peak only on large products
COPY_MIB = 256
CUDA_COPY_MIB = 2048


def _best_time(fn, min_s: float, min_reps: int = 2, sync=None) -> float:
    """The shortest of repeated calls of ``fn``, after one untimed call, repeating for at least ``min_s``;
    ``sync`` (a GPU's synchronize) ends every call."""
    sync = sync or (lambda: None)
    fn()
    sync()
    best, spent, reps = math.inf, 0.0, 0
    while spent < min_s or reps < min_reps:
        t0 = time.perf_counter()
        fn()
        sync()
        dt = time.perf_counter() - t0
        best, spent, reps = min(best, dt), spent + dt, reps + 1
    return best


def _sync(device: str):
    import torch
    return torch.cuda.synchronize if device == "cuda" else None


def matmul_flops(dtype, sizes, min_s: float = 0.3, device: str = "cpu") -> dict:
    """{"peak": best FLOP/s over ``sizes``, "at": the size that gave it, "per_size": {n: FLOP/s}}."""
    import torch
    per_size = {}
    for n in sizes:
        g = torch.Generator().manual_seed(n)
        a = torch.randn(n, n, generator=g).to(device=device, dtype=dtype)
        b = torch.randn(n, n, generator=g).to(device=device, dtype=dtype)
        out = torch.empty(n, n, dtype=dtype, device=device)
        per_size[n] = 2 * n ** 3 / _best_time(lambda: torch.mm(a, b, out=out), min_s, sync=_sync(device))
    at = max(per_size, key=per_size.get)
    return {"peak": per_size[at], "at": at, "per_size": per_size}


def copy_bandwidth(mib: int = COPY_MIB, min_s: float = 0.5, device: str = "cpu") -> float:
    """Bytes copied per second by ``copy_`` of a ``mib`` MiB fp32 tensor (best of repeated copies)."""
    import torch
    n = mib * 2 ** 20 // 4
    src = torch.rand(n, device=device)
    dst = torch.empty(n, device=device)
    return mib * 2 ** 20 / _best_time(lambda: dst.copy_(src), min_s, sync=_sync(device))


def measure(threads: int = 2, fp32_sizes=FP32_SIZES, bf16_sizes=BF16_SIZES, copy_mib: int = COPY_MIB,
            device: str = "cpu") -> dict:
    import torch
    torch.set_num_threads(threads)
    if device == "cuda":
        fp32_sizes = bf16_sizes = CUDA_SIZES
        copy_mib = max(copy_mib, CUDA_COPY_MIB)
    fp32 = matmul_flops(torch.float32, fp32_sizes, device=device)
    bf16 = matmul_flops(torch.bfloat16, bf16_sizes, device=device)
    return {"threads": threads, "torch": torch.__version__, "device": device,
            **({"gpu": torch.cuda.get_device_name()} if device == "cuda" else {}),
            "matmul_flops_fp32": fp32["peak"], "matmul_fp32_at": fp32["at"],
            "matmul_flops_bf16": bf16["peak"], "matmul_bf16_at": bf16["at"],
            "matmul_flops_fp32_per_size": fp32["per_size"], "matmul_flops_bf16_per_size": bf16["per_size"],
            "copy_bytes_per_s": copy_bandwidth(copy_mib, device=device), "copy_mib": copy_mib}


def _broadcast_worker(rank: int, init: str, n: int, reps: int, out) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    t = torch.rand(n) if rank == 0 else torch.empty(n)
    dist.broadcast(t, 0)  # warm-up: connections and buffers
    best = math.inf
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        dist.broadcast(t, 0)
        best = min(best, time.perf_counter() - t0)
    if rank == 1:
        out.put(best)
    dist.barrier()
    dist.destroy_process_group()


def broadcast_bandwidth(mib: int = 64, reps: int = 5) -> float:
    """Bytes per second of a gloo broadcast of a ``mib`` MiB fp32 tensor between two local processes with one
    thread each (the best of ``reps``, timed on the receiver): the transport of a weight sync between ranks on
    CPU, over TCP on the loopback device."""
    import multiprocessing as mp
    import tempfile
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        init = f"file://{d}/store"
        procs = [ctx.Process(target=_broadcast_worker, args=(r, init, mib * 2 ** 20 // 4, reps, out)) for r in (0, 1)]
        for p in procs:
            p.start()
        best = out.get(timeout=300)
        for p in procs:
            p.join(timeout=60)
    return mib * 2 ** 20 / best


# -- the limits and fractions (pure) -----------------------------------------------------------------------

def decode_limit_s(generated_tokens: float, prompt_tokens: float, batch: int, weight_bytes: float,
                   matmul_params: float, peak_flops: float, copy_bytes_per_s: float) -> dict:
    """The least time to prefill ``prompt_tokens`` and generate ``generated_tokens`` at ``batch`` rows per decode
    step: {"weight_read_s", "matmul_s", "limit_s", "binds"}.

    - weight read: ceil(generated_tokens / batch) decode steps (the fewest possible: every row of every step
      busy), each reading ``weight_bytes`` once; a read is half of a copy's traffic, so it runs at
      2 × ``copy_bytes_per_s``;
    - matmul: 2 × ``matmul_params`` FLOPs per token, prefill and decode, at ``peak_flops``.
    """
    if batch < 1:
        raise ValueError(f"decode_limit_s: batch must be >= 1, got {batch}")
    if peak_flops <= 0 or copy_bytes_per_s <= 0:
        raise ValueError("decode_limit_s: peak_flops and copy_bytes_per_s must be > 0")
    steps = math.ceil(generated_tokens / batch)
    read_s = steps * weight_bytes / (2 * copy_bytes_per_s)
    mm_s = 2 * matmul_params * (generated_tokens + prompt_tokens) / peak_flops
    return {"weight_read_s": read_s, "matmul_s": mm_s, "limit_s": max(read_s, mm_s),
            "binds": "weight_read" if read_s > mm_s else "matmul"}


def fraction(limit_s: float, measured_s: float) -> float | None:
    """limit / measured: 1.0 at the limit, 0.5 at twice it; None when nothing was measured (measured_s <= 0)."""
    return limit_s / measured_s if measured_s > 0 else None


def train_fraction(params: float, tokens: float, train_s: float, peak_flops: float) -> float | None:
    """Training FLOP/s (6 × params × tokens / train_s) over the peak matmul FLOP/s; None when train_s <= 0."""
    return fraction(6 * params * tokens / peak_flops, train_s)


def sync_fraction(model_bytes: float, sync_s: float, copy_bytes_per_s: float) -> float | None:
    """Weight-sync bytes per second (model_bytes / sync_s) over the copy bandwidth; None when sync_s <= 0."""
    return fraction(model_bytes / copy_bytes_per_s, sync_s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    ap.add_argument("--copy-mib", type=int, default=COPY_MIB, help="size of the copied tensor in MiB")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where to measure (default cpu)")
    ap.add_argument("--broadcast-mib", type=int, default=0,
                    help="also time a gloo broadcast of this many MiB between two local processes (0: no)")
    args = ap.parse_args()
    if args.threads < 1 or args.copy_mib < 1 or args.broadcast_mib < 0:
        raise SystemExit("machine_limits: --threads and --copy-mib must be >= 1, --broadcast-mib >= 0")
    out = measure(args.threads, copy_mib=args.copy_mib, device=args.device)
    if args.broadcast_mib:
        out["gloo_broadcast_bytes_per_s"] = broadcast_bandwidth(args.broadcast_mib)
        out["gloo_broadcast_mib"] = args.broadcast_mib
    print(json.dumps(out))


if __name__ == "__main__":
    main()
