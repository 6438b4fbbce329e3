"""The broadcast transport: the leader packs each bucket into one flat tensor and broadcasts it over the bridge
(NCCL on GPUs, gloo on CPUs, any hosts); each rollout rank receives it and loads its views into the engine.  One
broadcast per bucket instead of one per parameter."""
from __future__ import annotations

import torch

from ..collectives import Bridge
from .plan import Bucket, ParamSpec, unpack
from .transport import Transport, end_specs, receive_specs, send_specs


class Broadcast(Transport):
    name = "broadcast"

    def pack(self, k: int, specs: list[ParamSpec], parts: list[torch.Tensor],
             dtype: torch.dtype) -> tuple[torch.Tensor, list[torch.Tensor]]:
        flat = torch.cat([t.reshape(-1).to(dtype) for t in parts])
        return flat, [t for _, t in unpack(specs, flat)]

    def send(self, bridge: Bridge, bucket: Bucket, k: int) -> None:
        send_specs(bridge, bucket)
        bridge.broadcast(bucket.flat.to(bridge.device), 0)

    def end(self, bridge: Bridge, count: int) -> None:
        end_specs(bridge)

    def receive(self, bridge: Bridge, engine, dtype: torch.dtype) -> int:
        count = 0
        while (specs := receive_specs(bridge)) is not None:
            flat = torch.empty(sum(s.numel for s in specs), dtype=dtype, device=bridge.device)
            bridge.broadcast(flat, 0)
            engine.load_weights(unpack(specs, flat))
            count += 1
        return count
