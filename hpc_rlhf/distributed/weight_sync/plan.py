"""What a weight sync sends: each tensor's name and full shape, how to compute it from the actor's parameters (a
LoRA actor's layers merged), and the buckets they are packed into (consecutive tensors, at most ``BUCKET_BYTES`` a
bucket), the same plan on every actor rank."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch




@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def hf_name(name: str) -> str:
    """The Hugging Face parameter name inside DeepSpeed / compile wrappers."""
    for prefix in ("module.", "_orig_mod."):
        while name.startswith(prefix):
            name = name[len(prefix):]
    return name


def full_shape(p: torch.nn.Parameter) -> tuple[int, ...]:
    return tuple(getattr(p, "ds_shape", p.shape))


def plan_buckets(specs: list[ParamSpec], bucket_bytes: int, itemsize: int) -> list[list[int]]:
    """Consecutive parameters grouped so each bucket holds at most ``bucket_bytes`` (a larger single
    parameter gets a bucket of its own)."""
    buckets, current, size = [], [], 0
    for i, s in enumerate(specs):
        nbytes = s.numel * itemsize
        if current and size + nbytes > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


def gathered(params: list[torch.nn.Parameter], zero3: bool):
    if not zero3:
        return contextlib.nullcontext()
    import deepspeed
    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)


@dataclass(frozen=True)
class SyncItem:
    """One tensor to send: its name and full shape, the parameters it is computed from (gathered
    together under ZeRO-3) and how to compute it from them."""
    spec: ParamSpec
    params: tuple[torch.nn.Parameter, ...]
    value: Callable[[], torch.Tensor]


def full_items(module: torch.nn.Module) -> list[SyncItem]:
    """Every parameter as it is."""
    return [SyncItem(ParamSpec(hf_name(n), full_shape(p)), (p,), lambda p=p: p) for n, p in module.named_parameters()]


def lora_items(module: torch.nn.Module, include_frozen: bool) -> list[SyncItem]:
    """A peft LoRA model as the rollout engine needs it: the weight of every LoRA-wrapped layer merged
    (W + scale * B @ A, computed, the actor's modules untouched), under its base model name; the frozen
    rest of the base (embeddings, norms, head, biases) only when ``include_frozen`` (the first sync:
    it never changes, so it is never sent again)."""
    from peft.tuners.lora import LoraLayer
    items, covered = [], set()
    for mname, m in module.named_modules():
        if not (isinstance(m, LoraLayer) and hasattr(m, "base_layer")):
            continue
        covered |= {id(p) for p in m.parameters()}
        adapters = list(m.active_adapters)
        base = m.base_layer.weight
        params = (base, *[p for p in m.parameters() if p.requires_grad])

        def merged(m=m, base=base, adapters=adapters):
            w = base.detach()
            for a in adapters:
                w = w + m.get_delta_weight(a).detach().to(w.dtype)
            return w
        items.append(SyncItem(ParamSpec(_base_name(mname) + ".weight", full_shape(base)), params, merged))
        bias = getattr(m.base_layer, "bias", None)
        if include_frozen and bias is not None:
            items.append(SyncItem(ParamSpec(_base_name(mname) + ".bias", full_shape(bias)), (bias,),
                                  lambda b=bias: b))
    if include_frozen:
        items += [SyncItem(ParamSpec(_base_name(n), full_shape(p)), (p,), lambda p=p: p)
                  for n, p in module.named_parameters() if id(p) not in covered]
    return items


def _base_name(name: str) -> str:
    """The base model's parameter name inside a peft (and DeepSpeed) wrapper."""
    name = hf_name(name)
    return name[len("base_model.model."):] if name.startswith("base_model.model.") else name


@dataclass(frozen=True)
class Bucket:
    """One bucket of a sync: its specs, its tensors end to end in the sync's dtype (``flat``; None when they
    went straight into shared weights) and each spec's tensor (views of ``flat``, or of the shared weights)."""
    specs: list[ParamSpec]
    flat: torch.Tensor | None
    tensors: list[torch.Tensor]

    def named(self) -> list[tuple[str, torch.Tensor]]:
        return [(s.name, t) for s, t in zip(self.specs, self.tensors)]


def largest_bucket_bytes(items: list[SyncItem], dtype: torch.dtype, bucket_bytes: int) -> int:
    """The bytes of the largest bucket ``actor_buckets`` packs (a parameter larger than a bucket is one)."""
    specs = [it.spec for it in items]
    return max((sum(specs[i].numel for i in b) * dtype.itemsize
                for b in plan_buckets(specs, bucket_bytes, dtype.itemsize)), default=0)


def unpack(specs: list[ParamSpec], flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    out, offset = [], 0
    for s in specs:
        out.append((s.name, flat[offset:offset + s.numel].view(s.shape)))
        offset += s.numel
    return out
