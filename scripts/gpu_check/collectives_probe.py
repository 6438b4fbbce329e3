"""One rank of the collectives check: ``python -m gpu_check.collectives_probe BACKEND`` with RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT set.  Rank r uses GPU r (modulo the count; the CPU on a machine without CUDA,
where the tests run it over gloo), joins a default group of BACKEND
and a ``Bridge`` of BACKEND over every rank, sends CPU and CUDA tensors through
``hpc_rlhf.distributed.collectives`` and checks the sums, maxima, broadcasts and objects by hand-derived values:
with n ranks, every rank contributing r + 1 sums to n(n + 1)/2, and 10r + 3 has the maximum 10(n - 1) + 3.
Prints its figures as one JSON line; an unexpected value raises (exit code 1)."""
from __future__ import annotations

import datetime
import json
import os
import sys

import torch
import torch.distributed as dist

from hpc_rlhf.distributed import collectives

TIMEOUT_S = 60


def expect(ok: bool, what: str) -> None:
    if not ok:
        raise AssertionError(what)


def default_group(rank: int, n: int, device: torch.device) -> dict:
    total = n * (n + 1) / 2
    on_cpu = torch.tensor([rank + 1.0])
    on_gpu = torch.tensor([rank + 1.0], device=device)
    collectives.all_reduce_(on_cpu)
    collectives.sum_over_ranks(on_gpu)
    expect(on_cpu.device.type == "cpu" and on_cpu.item() == total, f"all_reduce_ of a CPU tensor: {on_cpu}")
    expect(on_gpu.device == device and on_gpu.item() == total, f"sum_over_ranks of a CUDA tensor: {on_gpu}")
    top = collectives.max_over_ranks(10 * rank + 3)
    expect(top == 10 * (n - 1) + 3, f"max_over_ranks: {top}")
    values = collectives.sum_values([1.5, float(rank)])
    expect(values == [1.5 * n, n * (n - 1) / 2], f"sum_values: {values}")
    collectives.barrier()
    return {"default_group": dist.get_backend(), "default_group_ranks": collectives.world_size(),
            "backend_device": str(collectives.backend_device(dist.get_backend()))}


def bridge(rank: int, n: int, store: dist.Store, backend: str, device: torch.device) -> dict:
    b = collectives.Bridge("probe", list(range(n)), rank, store, TIMEOUT_S, backend)
    sent = torch.full((1024,), 7.0 + rank, device=device, dtype=torch.bfloat16)
    b.broadcast(sent, 0)
    expect(sent.device == device and bool(torch.all(sent == 7.0)), "Bridge.broadcast of a CUDA bf16 tensor")
    for t in (torch.tensor([rank + 1.0], device=device), torch.tensor([rank + 1.0])):
        b.all_reduce(t)
        expect(t.item() == n * (n + 1) / 2, f"Bridge.all_reduce on {t.device}: {t}")
    expect(b.max(10 * rank + 3) == 10 * (n - 1) + 3, "Bridge.max")
    gathered = b.all_gather_object({"rank": rank, "pad": "x" * 100 * rank})  # different sizes on each rank
    expect([g["rank"] for g in gathered] == list(range(n)), f"Bridge.all_gather_object: {gathered}")
    got = b.broadcast_object({"from": 0, "step": 3} if rank == 0 else None, 0)
    expect(got == {"from": 0, "step": 3}, f"Bridge.broadcast_object: {got}")
    b.barrier()
    return {"bridge": backend, "bridge_ranks": n, "bridge_device": str(b.device)}


def main(backend: str) -> None:
    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), n, rank == 0, timeout=timeout)
    dist.init_process_group(backend, store=dist.PrefixStore("world", store), rank=rank, world_size=n,
                            timeout=timeout)
    figures = {"device": str(device), **default_group(rank, n, device), **bridge(rank, n, store, backend, device)}
    dist.destroy_process_group()
    print(json.dumps(figures), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
