"""Process groups that span roles, built from the shared TCPStore, outside every role's own world.

A bridge is a stand-alone ProcessGroup (gloo on CPU, NCCL for GPU tensors) over an ordered list
of global ranks; its methods take indices into that list.  Python objects travel pickled as
uint8 tensors (sizes first, then one padded all-gather).
"""
from __future__ import annotations

import datetime
import pickle
from typing import Any

import torch
import torch.distributed as dist


class Bridge:
    def __init__(self, name: str, members: list[int], global_rank: int, store: dist.Store, timeout_s: float,
                 backend: str = "gloo"):
        self.name, self.members = name, list(members)
        self.index = self.members.index(global_rank)
        self.size = len(self.members)
        prefixed = dist.PrefixStore(f"bridge/{name}", store)
        timeout = datetime.timedelta(seconds=timeout_s)
        if backend == "nccl":
            self.pg = dist.ProcessGroupNCCL(prefixed, self.index, self.size)
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.pg = dist.ProcessGroupGloo(prefixed, self.index, self.size, timeout)
            self.device = torch.device("cpu")

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self.pg.broadcast([tensor], opts).wait()
        return tensor

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        self.pg.allreduce([tensor], opts).wait()
        return tensor

    def barrier(self) -> None:
        self.all_reduce(torch.zeros(1, device=self.device))

    def all_gather_object(self, obj: Any) -> list[Any]:
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        self.pg.allgather([sizes], [torch.tensor([data.numel()], dtype=torch.int64)]).wait()
        longest = int(max(s.item() for s in sizes))
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[:data.numel()] = data
        out = [torch.zeros(longest, dtype=torch.uint8) for _ in range(self.size)]
        self.pg.allgather([out], [padded]).wait()
        return [pickle.loads(o[:int(s.item())].numpy().tobytes()) for o, s in zip(out, sizes)]

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
