"""Every collective of the package goes through this module, and only this module calls them.

A group's collectives take tensors on the group's device: NCCL reduces and broadcasts CUDA tensors only
(torch registers it for "cuda"), gloo takes CPU tensors.  The functions here move a tensor to the group's
device and copy the result back into it, so callers build their tensors wherever they like.  A test
(tests/unit/package/test_architecture.py) walks the package's syntax trees and fails if any other module calls a
``torch.distributed`` collective.

Two kinds of group:
- the process's default group (the data-parallel world of a trainer, or of one RL role):
  ``all_reduce_``, ``sum_over_ranks``, ``max_over_ranks``, ``sum_values``, ``barrier``, ``all_gather_objects``;
- a ``Bridge``: a stand-alone process group over an ordered list of global ranks, built from the shared
  TCPStore outside every role's own world (the RL control exchange, the weight broadcast).  Python objects
  travel pickled as uint8 tensors (sizes first, then one padded all-gather).  A bridge of one rank builds no
  process group: its collectives return at once (objects still come back as copies, as from other ranks).
  Gloo runs a collective in threads of its own, which run a large copy as an OpenMP team of their own; a
  second team beside the rank's makes libgomp cut every worker's spinning short
  (docs/runs/perf/*_one_rank_bridge*.json).
"""
from __future__ import annotations

import datetime
import pickle
from typing import Any, Sequence

import torch
import torch.distributed as dist

SUM = dist.ReduceOp.SUM
MAX = dist.ReduceOp.MAX


def backend_device(backend: str) -> torch.device:
    """The device a group of ``backend`` takes tensors on: the current GPU for NCCL, else the CPU."""
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _in_place(t: torch.Tensor, device: torch.device, op) -> torch.Tensor:
    """``op(tensor on device)``, the result copied back into ``t`` when it had to move."""
    if t.device == device:
        op(t)
        return t
    moved = t.to(device)
    op(moved)
    return t.copy_(moved.to(t.device))


# ---- the default group --------------------------------------------------------------------------------------
def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def all_reduce_(t: torch.Tensor, op=SUM) -> torch.Tensor:
    """In-place all-reduce over the default group (returned for chaining); a no-op in a single process."""
    if world_size() == 1:
        return t
    return _in_place(t, backend_device(dist.get_backend()), lambda x: dist.all_reduce(x, op=op))


def sum_over_ranks(t: torch.Tensor) -> torch.Tensor:
    return all_reduce_(t, SUM)


def max_over_ranks(value: int) -> int:
    return int(all_reduce_(torch.tensor([value], dtype=torch.int64), MAX).item())


def sum_values(values: Sequence[float], op=SUM) -> list[float]:
    """Python numbers reduced over the default group, in float64."""
    return all_reduce_(torch.tensor(list(values), dtype=torch.float64), op).tolist()


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()


def all_gather_objects(obj: Any) -> list:
    """``obj`` of every rank of the default group (pickled), in rank order; ``[obj]`` in a single process."""
    if world_size() == 1:
        return [obj]
    out: list = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


# ---- bridges ------------------------------------------------------------------------------------------------
class Bridge:
    """A process group over ``members`` (global ranks); its methods take indices into that list."""

    def __init__(self, name: str, members: list[int], global_rank: int, store: dist.Store, timeout_s: float,
                 backend: str = "gloo"):
        self.name, self.members = name, list(members)
        self.index = self.members.index(global_rank)
        self.size = len(self.members)
        prefixed = dist.PrefixStore(f"bridge/{name}", store)
        timeout = datetime.timedelta(seconds=timeout_s)
        if self.size == 1:
            self.pg = None
        elif backend == "nccl":
            self.pg = dist.ProcessGroupNCCL(prefixed, self.index, self.size)
        else:
            self.pg = dist.ProcessGroupGloo(prefixed, self.index, self.size, timeout)
        self.device = backend_device(backend)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.pg is None:
            return tensor
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        return _in_place(tensor, self.device, lambda x: self.pg.broadcast([x], opts).wait())

    def all_reduce(self, tensor: torch.Tensor, op=SUM) -> torch.Tensor:
        if self.pg is None:
            return tensor
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        return _in_place(tensor, self.device, lambda x: self.pg.allreduce([x], opts).wait())

    def max(self, value: int) -> int:
        return int(self.all_reduce(torch.tensor([value], dtype=torch.int64), MAX).item())

    def barrier(self) -> None:
        self.all_reduce(torch.zeros(1))

    def _all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        if self.pg is None:
            return [t]
        out = [torch.zeros_like(t, device=self.device) for _ in range(self.size)]
        self.pg.allgather([out], [t.to(self.device)]).wait()
        return [o.cpu() for o in out]

    def all_gather_object(self, obj: Any) -> list[Any]:
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        sizes = [int(s.item()) for s in self._all_gather(torch.tensor([data.numel()], dtype=torch.int64))]
        padded = torch.zeros(max(sizes), dtype=torch.uint8)
        padded[:data.numel()] = data
        return [pickle.loads(o[:n].numpy().tobytes()) for o, n in zip(self._all_gather(padded), sizes)]

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        if self.index == src:
            data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            size = torch.tensor([data.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        self.broadcast(size, src)
        if self.index != src:
            data = torch.zeros(int(size.item()), dtype=torch.uint8)
        self.broadcast(data, src)
        return obj if self.index == src else pickle.loads(data.numpy().tobytes())
