"""The weight sync between two local ranks, by transport, against this machine's copy bandwidth.

Two spawned gloo processes with ``--threads`` torch threads each (1: the benchmark's async side gives each
rank one core of two): rank 0 is the actor leader with the model's parameters, rank 1 a rollout rank with
a transformers engine of the same model.  Each transport runs ``--reps`` timed syncs after one warm-up,
through the same ``send_weights`` / ``receive_weights`` as `train rl` (64 MiB buckets):

- ``broadcast``: every bucket packed, then broadcast over gloo (TCP on the loopback device);
- ``slots``: every bucket packed into a shared-memory slot the rollout rank loads from
  (``distributed/weight_sync/slots.py``; what a vLLM engine gets); only the names and shapes go over gloo;
- ``shared_weights``: the engine's parameters are views of a shared-memory file, which the leader writes with
  every CPU of its process while the rollout rank waits (``distributed/weight_sync/shared.py``; what `train rl`
  does with the transformers engine on one host): one copy.

Beside them, in the same processes: ``pack_s``, the leader packing every bucket with nothing sent, and
``load_s``, the rollout rank loading a whole model's tensors into its engine: the two copies any transport
makes.  ``copy_bytes_per_s`` is ``machine_limits.copy_bandwidth`` with 2 threads (the limit of the issue's
target) and with one.  Prints one JSON line.

    .venv/bin/python benchmarks/weight_sync.py        # SmolLM2-135M, fp32, 5 syncs per transport: about 20 s
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

TRANSPORTS = ("broadcast", "slots", "shared_weights")
REAL = Path(os.environ.get("HPC_RLHF_ASSETS", "~/.cache/hpc_rlhf/real")).expanduser()  # scripts/real_assets.sh


def _rank(rank: int, port: int, model: str, threads: int, reps: int, out) -> None:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from hpc_rlhf.distributed.weight_sync import BUCKET_BYTES
    from hpc_rlhf.distributed.weight_sync import channel as ch
    from hpc_rlhf.distributed.weight_sync.plan import full_items, largest_bucket_bytes
    from hpc_rlhf.distributed.collectives import Bridge
    from hpc_rlhf.generation.factory import transformers_engine
    torch.set_num_threads(threads)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=300))
    bridge = Bridge("weights", [0, 1], rank, store, 300)
    dtype = torch.float32
    if rank == 0:
        items = full_items(AutoModelForCausalLM.from_pretrained(model, dtype=dtype))
        slot_bytes = largest_bucket_bytes(items, dtype, BUCKET_BYTES)
    else:
        engine = transformers_engine(model, dtype="fp32")
    result = {}
    for transport in TRANSPORTS:
        channel = {"broadcast": None, "slots": ch.Channel(share=False), "shared_weights": ch.Channel()}[transport]
        times = []
        for _ in range(reps + 1):
            bridge.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                ch.send_weights(bridge, ch.actor_buckets(items, False, dtype, BUCKET_BYTES, channel), True,
                                channel=channel, slot_bytes=slot_bytes, specs=[it.spec for it in items], dtype=dtype)
            else:
                ch.receive_weights(bridge, engine, dtype, channel)
            bridge.barrier()  # the leader's send ends before the last load: time until both are done
            times.append(time.perf_counter() - t0)
        result[transport] = times[1:]
        if channel is not None:  # whether the transport asked for was the one used
            want = {"slots": "slots", "shared_weights": "shared"}[transport]
            result[f"{transport}_mapped"] = channel.transport.name == want
    if rank == 0:
        buckets = list(ch.actor_buckets(items, False, dtype, BUCKET_BYTES))  # warm: the allocator
        t0 = time.perf_counter()
        buckets = list(ch.actor_buckets(items, False, dtype, BUCKET_BYTES))
        result["pack_s"] = time.perf_counter() - t0
        result["bytes"] = sum(b.flat.numel() * b.flat.element_size() for b in buckets)
    else:
        named = [(n, p.detach().clone()) for n, p in engine.model.named_parameters()]
        engine.load_weights(named)
        t0 = time.perf_counter()
        engine.load_weights(named)
        result["load_s"] = time.perf_counter() - t0
    out.put((rank, result))
    bridge.barrier()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(REAL / "smollm2-135m-instruct"))
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    ap.add_argument("--reps", type=int, default=5, help="timed syncs per transport (default 5)")
    args = ap.parse_args()
    import multiprocessing as mp
    import socket

    import machine_limits
    import torch
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, args.model, args.threads, args.reps, q)) for r in (0, 1)]
    for p in procs:
        p.start()
    results = dict(q.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=120)
        if p.exitcode != 0:
            raise SystemExit(f"weight_sync: rank {procs.index(p)} exited with {p.exitcode}")
    copy = {}
    for threads in (2, 1):
        torch.set_num_threads(threads)
        copy[threads] = machine_limits.copy_bandwidth()
    leader, rollout = results[0], results[1]
    nbytes = leader["bytes"]
    out = {"benchmark": "weight_sync", "model": Path(args.model).name, "bytes": nbytes,
           "threads_per_rank": args.threads, "reps": args.reps,
           "copy_bytes_per_s": copy[2], "copy_bytes_per_s_1_thread": copy[1],
           "pack_s": leader["pack_s"], "load_s": rollout["load_s"], "slots_mapped": leader["slots_mapped"],
           "shared_weights_mapped": leader["shared_weights_mapped"]}
    for transport in TRANSPORTS:
        med = statistics.median(leader[transport])
        out[transport] = {"median_s": med, "best_s": min(leader[transport]), "bytes_per_s": nbytes / med,
                          "fraction_of_copy": machine_limits.sync_fraction(nbytes, med, copy[2])}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
