"""The sync phase: the actor's new weights reach the rollout engines (broadcast, or a load when colocated).

``WeightSync`` keeps what the phase carries from one step to the next: whether the frozen base of a LoRA
actor has been sent (it goes once; the merged LoRA layers go every step) and, with
``log.check_weight_sync``, the checksum of every tensor sent so far, so the sender's checksum covers
everything the engines hold.
"""
from __future__ import annotations

import time

import torch

from ..distributed.weight_sync import BUCKET_BYTES
from ..distributed.weight_sync.channel import Channel, actor_buckets, receive_weights, send_weights
from ..distributed.weight_sync.plan import full_items, largest_bucket_bytes, lora_items
from ..config.sections import ModelConfig
from ..distributed.worlds import RoleContext
from ..generation.engine import combine_checksums, tensor_part_checksum


class WeightSync:
    def __init__(self, model: ModelConfig, check: bool, ctx: RoleContext, actor, rollout):
        """``model``: the actor's (LoRA, dtype); ``check``: log.check_weight_sync."""
        self.ctx, self.actor, self.rollout = ctx, actor, rollout
        self.lora = model.lora_rank > 0
        self.check = check
        self.dtype = torch.bfloat16 if model.param_dtype == "bf16" else torch.float32
        self.base_sent = False
        self.sent_parts: dict[str, float] = {}  # checksum of every tensor sent so far (check_weight_sync)
        self.channel = Channel()  # the shared weights or slots of the weights bridge, once mapped (CPU, one host)

    def run(self) -> dict[str, float]:
        """Actor -> rollout, on every rank of either.  Returns the phase's time and, with check_weight_sync,
        the checksum sent (actor leader) or loaded (each rollout rank)."""
        t0 = time.time()
        out: dict[str, float] = {}
        if self.actor is not None:
            out = self._send()  # the leader: time/weight_sync_wait_s, its wait for the rollout ranks
        elif self.rollout is not None and self.ctx.plan.has("actor"):  # no actor: `hpc-rlhf eval`
            receive_weights(self.ctx.weights, self.rollout.engine, self.dtype, self.channel)
        if self.rollout is not None and self.check:
            out[f"sync/checksum_loaded/{self.ctx.role_rank('rollout')}"] = self.rollout.engine.state_checksum()
        out["time/weight_sync_s"] = time.time() - t0
        return out

    def _send(self) -> dict[str, float]:
        leader = self.ctx.role_rank("actor") == 0
        zero3 = self.actor.engine.zero_optimization_stage() == 3
        # LoRA: the merged LoRA layers every time, the frozen rest of the base only the first time
        items = (lora_items(self.actor.module, include_frozen=not self.base_sent) if self.lora
                 else full_items(self.actor.module))
        track = leader and self.check

        def tracked(buckets):
            for b in buckets:
                if track:
                    self.sent_parts.update((n, tensor_part_checksum(t)) for n, t in b.named())
                yield b
        # the leader writes into the shared weights or slots, when the rollout ranks have mapped them
        buckets = actor_buckets(items, zero3, self.dtype, BUCKET_BYTES, self.channel if leader else None,
                                send=leader and self.ctx.weights is not None)
        sent = send_weights(self.ctx.weights, tracked(buckets), is_leader=leader,
                            local_engine=self.rollout.engine if self.rollout is not None else None,
                            channel=self.channel, slot_bytes=largest_bucket_bytes(items, self.dtype, BUCKET_BYTES),
                            specs=[it.spec for it in items], dtype=self.dtype)
        self.base_sent = True
        out = {"time/weight_sync_wait_s": sent.wait_s} if self.ctx.weights is not None and leader else {}
        if track:  # over every tensor the engines hold: the ones sent now and the frozen ones sent before
            out |= {"sync/checksum_sent": combine_checksums(self.sent_parts),
                    "sync/numel_sent": float(sum(it.spec.numel for it in items))}
        return out
