"""The sync phase: the actor's new weights reach the rollout engines (broadcast, or a load when colocated).

``WeightSync`` keeps what the phase carries from one step to the next: whether the frozen base of a LoRA
actor has been sent (it goes once; the merged LoRA layers go every step) and, with
``log.check_weight_sync``, the checksum of every tensor sent so far, so the sender's checksum covers
everything the engines hold.

The receipt (``log.sync_receipt``): after each sync every rollout engine computes the log-probs of a fixed
probe, teacher-forced, as it will generate (``RolloutEngine.probe_logprobs``), and the actor the same
(``Actor.probe_logprobs``); one exchange over ``control`` gives every rank every result.  An engine further than
the tolerance from its actor (the actor leader's, or its own rank's when colocated) stops the run: the actor
ranks walk the sync's buckets once more for a checksum of each tensor, the engine checksums what it holds, and
the engine's rank raises ``WeightSyncError`` naming the first tensor that differs and its bucket.
"""
from __future__ import annotations

import math
import random
import time

import torch

from ..distributed.weight_sync import BUCKET_BYTES
from ..distributed.weight_sync.channel import Channel, actor_buckets, receive_weights, send_weights
from ..distributed.weight_sync.plan import full_items, largest_bucket_bytes, lora_items
from ..config.sections import LogConfig, ModelConfig
from ..distributed.worlds import RoleContext
from ..generation.engine import combine_checksums, tensor_part_checksum

PROBE_PROMPT, PROBE_RESPONSE = 12, 4  # the receipt's probe: a prompt, then the tokens whose log-probs are compared
# The tolerance when log.sync_receipt_tolerance is unset, by the sync's dtype: far enough above the rounding
# differences between the actor's forward and an engine's that a run is never stopped for them.  On SmolLM2-135M
# (CPU, 8 random-token probes; docs/runs/perf/sync_receipt_smollm2_cpu.json, benchmarks/sync_receipt.py) those
# reached 4e-5 in fp32 and 0.2 in bf16, while a down_proj negated moved the log-probs by 7 to 12 and a middle
# layer's o_proj zeroed by 0.4 to 0.5: fp32 catches all three, bf16 the gross failures only (a tensor lost,
# stale, negated or mislaid); a lower tolerance catches finer ones at the risk of stopping a sound run.
RECEIPT_TOLERANCE = {torch.float32: 1e-2, torch.bfloat16: 1.0}


class WeightSyncError(RuntimeError):
    """A rollout engine does not generate with the weights the actor sent (the receipt)."""


def probe_tokens(vocab_size: int) -> tuple[list[int], list[int]]:
    """The receipt's probe, the same on every rank: PROBE_PROMPT + PROBE_RESPONSE token ids below ``vocab_size``
    drawn with a fixed seed (random tokens: their log-probs are low, and move far when a weight is wrong)."""
    rng = random.Random(0)
    ids = [rng.randrange(vocab_size) for _ in range(PROBE_PROMPT + PROBE_RESPONSE)]
    return ids[:PROBE_PROMPT], ids[PROBE_PROMPT:]


def probe_gap(actor: list[float], engine: list[float]) -> float:
    """max_i |engine_i - actor_i| over the probe's tokens; inf where a value is not a number."""
    if len(actor) != len(engine):
        raise WeightSyncError(f"the weight sync receipt: the rollout engine gave {len(engine)} log-probs of the probe "
                              f"for {len(actor)} tokens")
    gaps = [abs(e - a) for a, e in zip(actor, engine)]
    return max((math.inf if math.isnan(g) else g for g in gaps), default=0.0)


def first_difference(sent: list[tuple[str, int, float]], held: dict[str, float]) -> tuple[str, int] | None:
    """The first tensor, in the order sent (name, bucket, checksum), whose checksum in ``held`` (by name) is not the
    one sent (relative 1e-9: float64 sums of the same values): (name, bucket); None when every tensor held
    matches.  A name the engine does not hold (a tied alias) is passed over."""
    for name, bucket, checksum in sent:
        if name in held and not math.isclose(held[name], checksum, rel_tol=1e-9, abs_tol=1e-12):
            return name, bucket
    return None


def receipt_failure(rollout_rank: int, gap: float, tolerance: float, sent: list[tuple[str, int, float]],
                    held: dict[str, float] | None) -> str:
    """The one line that stops the run: the rollout rank, the gap, and the first tensor that differs from the one
    sent (``first_difference``) or why none is named."""
    head = (f"the weight sync receipt: rollout rank {rollout_rank}'s log-probs of the probe differ from the actor's "
            f"by {gap:.3g} (tolerance {tolerance:g}); ")
    if held is None:
        return head + "its engine keeps no checksums to name the tensor (vLLM: set log.check_weight_sync)"
    found = first_difference(sent, held)
    if found is None:
        return head + (f"each of the {len(sent)} tensors sent is held unchanged: the engine generates with other "
                       f"weights than the ones it holds")
    buckets = sent[-1][1] + 1
    return head + f"its {found[0]} (bucket {found[1]} of {buckets}) differs from the one sent"


class WeightSync:
    def __init__(self, model: ModelConfig, log: LogConfig, ctx: RoleContext, actor, rollout, vocab_size: int):
        """``model``: the actor's (LoRA, dtype); ``log``: check_weight_sync, sync_receipt and its tolerance (the
        probe drawn below ``vocab_size``)."""
        self.ctx, self.actor, self.rollout = ctx, actor, rollout
        self.lora = model.lora_rank > 0
        self.check = log.check_weight_sync
        self.dtype = torch.bfloat16 if model.param_dtype == "bf16" else torch.float32
        self.base_sent = False
        self.sent_parts: dict[str, float] = {}  # checksum of every tensor sent so far (check_weight_sync)
        self.channel = Channel()  # the shared weights or slots of the weights bridge, once mapped (CPU, one host)
        self.tolerance = ((log.sync_receipt_tolerance or RECEIPT_TOLERANCE[self.dtype])
                          if log.sync_receipt and ctx.plan.has("actor") else None)  # no actor: `hpc-rlhf eval`
        self.probe = probe_tokens(vocab_size)

    def run(self) -> dict[str, float]:
        """Actor -> rollout, on every rank.  Returns the phase's time and, with check_weight_sync, the checksum
        sent (actor leader) or loaded (each rollout rank); with the receipt, its largest gap and its time."""
        t0 = time.time()
        out: dict[str, float] = {}
        items = self._items() if self.actor is not None else []
        if self.actor is not None:
            out = self._send(items)  # the leader: time/weight_sync_wait_s, its wait for the rollout ranks
        elif self.rollout is not None and self.ctx.plan.has("actor"):  # no actor: `hpc-rlhf eval`
            receive_weights(self.ctx.weights, self.rollout.engine, self.dtype, self.channel)
        if self.rollout is not None and self.check:
            out[f"sync/checksum_loaded/{self.ctx.role_rank('rollout')}"] = self.rollout.engine.state_checksum()
        out["time/weight_sync_s"] = time.time() - t0
        if self.tolerance is not None:
            t0 = time.time()
            out["sync/receipt_max_abs_diff"] = self._receipt(items)
            out["time/sync_receipt_s"] = time.time() - t0
        return out

    def _items(self):
        # LoRA: the merged LoRA layers every time, the frozen rest of the base only the first time
        return (lora_items(self.actor.module, include_frozen=not self.base_sent) if self.lora
                else full_items(self.actor.module))

    def _receipt(self, items) -> float:
        """Every rank, collective over ``control`` (and over the actor's world under ZeRO-3): the largest gap between
        an engine's log-probs of the probe and its actor's; raises ``WeightSyncError`` on the first engine's rank
        past the tolerance, after naming what differs (``_locate``)."""
        mine = {}
        if self.actor is not None:
            mine["actor"] = self.actor.probe_logprobs(*self.probe)
        if self.rollout is not None:
            mine["engine"] = self.rollout.engine.probe_logprobs(*self.probe)
        every = self.ctx.control.all_gather_object(mine)
        leader = every[self.ctx.plan.ranks_of("actor")[0]]["actor"]
        gaps = {g: probe_gap(m.get("actor", leader), m["engine"]) for g, m in enumerate(every) if "engine" in m}
        bad = [g for g, gap in gaps.items() if not gap <= self.tolerance]
        if bad:
            self._locate(items, bad[0], gaps[bad[0]])
        return max(gaps.values())

    def _locate(self, items, culprit: int, gap: float) -> None:
        """After a failed receipt, on every rank: the actor ranks walk the sync's buckets again (gathered under
        ZeRO-3) for a checksum of each tensor, the culprit's engine checksums what it holds; one exchange over
        ``control``; the culprit raises."""
        sent = None
        if self.actor is not None:
            zero3 = self.actor.engine.zero_optimization_stage() == 3
            sent = [(name, k, tensor_part_checksum(t)) for k, b in enumerate(
                actor_buckets(items, zero3, self.dtype, BUCKET_BYTES, send=False)) for name, t in b.named()]
        me = self.ctx.global_rank
        leader = self.ctx.plan.ranks_of("actor")[0]
        held = self.rollout.engine.part_checksums() if me == culprit else None
        every = self.ctx.control.all_gather_object((sent, held) if me in (leader, culprit) else None)
        if me == culprit:
            reference = sent if sent is not None else every[leader][0]
            raise WeightSyncError(receipt_failure(self.ctx.role_rank("rollout"), gap, self.tolerance, reference, held))

    def _send(self, items) -> dict[str, float]:
        leader = self.ctx.role_rank("actor") == 0
        zero3 = self.actor.engine.zero_optimization_stage() == 3
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
