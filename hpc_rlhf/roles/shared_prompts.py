"""One pass over each distinct prompt of an optimizer step, shared by all of its samples' micro-batches.

A GRPO step holds n samples of every prompt.  Padded training runs each sample's prompt through the model
again (in a GRPO step of SmolLM2-135M on ASDiv: 4024 of 10571 positions, 8 copies of each of 8 prompts).  Under
causal attention a prompt's hidden states do not depend on what follows it, so they are the same in every copy.
Here the step's distinct prompts go through the model once; each micro-batch then runs its responses only,
attending to their prompt's keys and values (the prompt pass's cache, gathered per row), and the logit that
predicts a response's first token is the prompt pass's last position.

The gradient is the same.  Every micro-batch but the last reads detached copies of the prompt pass's outputs
(its keys, values and last hidden states), whose gradients accumulate over those backward passes; the last one
reads the live outputs and adds a term of value 0 whose gradient hands the accumulated gradients to them, so its
backward carries the prompt pass's whole gradient through the prompt pass once.  Each backward is still one
``engine.backward``, as gradient accumulation needs.
"""
from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from transformers import DynamicCache

from .experience import Experience, RLBatch, response_logits, response_logprobs
from .training import (combine, optimizer_steps, per_sample, positions_trained, run_optimizer_step,
                       summed_positions)


def supports(model: torch.nn.Module) -> str | None:
    """None if ``SharedPrompts`` can run this model, else why not."""
    inner = getattr(model, "module", model)
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    if head is None:
        return f"{type(inner).__name__} has no output head to pick positions at"
    checkpointing = (inner.is_activation_checkpointing if hasattr(inner, "is_activation_checkpointing")
                     else getattr(inner, "is_gradient_checkpointing", False))
    if checkpointing:
        return "gradient checkpointing turns the key/value cache off in training"
    config = getattr(inner, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        return f"{type(inner).__name__} is not a decoder-only transformers model"
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    types = set(getattr(text, "layer_types", None) or ["full_attention"])
    if types != {"full_attention"} or (getattr(text, "sliding_window", None) and
                                       getattr(text, "use_sliding_window", True)):
        return f"{getattr(text, 'model_type', type(inner).__name__)} has layers other than full attention"
    return None


def sharing(model: torch.nn.Module, enabled: bool, role: str, zero_stage: int = 0) -> bool:
    """Whether ``role`` shares its prompt passes (``train.share_prompts`` on and the model able to); a line
    saying why not when it is on and the model is not."""
    why = supports(model) if zero_stage < 3 else "ZeRO-3 gathers the parameters per forward"
    if enabled and why is not None:
        print(f"[{role}] train.share_prompts is on but each sample runs its prompt: {why}", flush=True)
    return enabled and why is None


def saved_positions(samples: list[Experience]) -> int:
    """The prompt positions that one pass per distinct prompt saves: every sample's prompt, less each distinct
    prompt once (pure)."""
    return sum(len(s.prompt_ids) for s in samples) - sum(len(p) for p in {tuple(s.prompt_ids) for s in samples})


def worth_sharing(samples: list[Experience], min_positions: int, at_most: int | None = None) -> bool:
    """Whether sharing the prompt pass pays here: some prompt has more than one sample, the positions it saves
    (``saved_positions``) reach ``min_positions`` (the prompt pass is a pass of its own, with its own operations:
    below that it costs more than it saves, ``train.share_prompts_min_positions``), and, with ``at_most``, there
    are at most that many distinct prompts.  In training the prompt pass keeps its activations until the
    optimizer step's last backward: with at most ``micro_train_batch_size`` prompts beside a micro-batch of
    responses they take no more than a micro-batch of whole samples, which is what ``hpc-rlhf plan`` counts."""
    distinct = len({tuple(s.prompt_ids) for s in samples})
    return (distinct < len(samples) and saved_positions(samples) >= min_positions
            and (at_most is None or distinct <= at_most))


def outputs_per_sample(model: torch.nn.Module, samples: list[Experience], micro: int, pad_id: int, device,
                       share: bool, min_positions: int,
                       fn: Callable[[torch.Tensor, RLBatch], torch.Tensor],
                       lockstep: bool = False) -> list[list[float]]:
    """``fn(out, batch)`` -> [B, R] per sample (``per_sample``, no gradient, ``lockstep`` passed on), ``out`` the
    output head's outputs at the picked positions [N, ...] (``response_logits``); with ``share`` where it pays
    (``worth_sharing`` with ``min_positions``), one prompt pass for all of them and micro-batches of responses cut by
    response length."""
    shared = (SharedPrompts(model, samples, 0, pad_id, device) if share and worth_sharing(samples, min_positions)
              else None)

    def run(part: list[Experience], batch: RLBatch) -> torch.Tensor:
        return fn(shared.logits(part, batch) if shared else response_logits(model, batch), batch)
    return per_sample(model, samples, micro, pad_id, device, run, responses_only=shared is not None,
                      lockstep=lockstep)


def logprobs_per_sample(model: torch.nn.Module, samples: list[Experience], micro: int, pad_id: int, device,
                        temperature: float, share: bool, min_positions: int = 0,
                        lockstep: bool = False) -> list[list[float]]:
    """Each sample's response log-probs (``outputs_per_sample``)."""
    return outputs_per_sample(model, samples, micro, pad_id, device, share, min_positions,
                              lambda logits, batch: response_logprobs(logits, batch, temperature), lockstep)


class SharedPrompts:
    """The prompt pass of one optimizer step's ``samples`` and the logits of its micro-batches' responses.

    ``logits`` is called once per micro-batch, ``calls`` times in all; ``closing`` gives the term the last
    micro-batch's loss adds (0 with the prompt pass's gradient; a zero without a gradient)."""

    def __init__(self, model: torch.nn.Module, samples: list[Experience], calls: int, pad_id: int, device):
        self.index: dict[tuple[int, ...], int] = {}
        for s in samples:
            if not s.prompt_ids:
                raise ValueError(f"sample (prompt {s.prompt_index}, sample {s.sample_index}) has an empty prompt: "
                                 f"there is no position whose logits predict its first response token")
            self.index.setdefault(tuple(s.prompt_ids), len(self.index))
        self.model, self.calls, self.pad_id, self.device = model, calls, pad_id, device
        self.head = getattr(model, "module", model).get_output_embeddings()
        self.done = 0
        self.live: list[torch.Tensor] | None = None   # keys and values per layer, then the last hidden states
        self.leaves: list[torch.Tensor] = []

    @property
    def distinct(self) -> int:
        return len(self.index)

    def _prompt_pass(self) -> None:
        prompts = list(self.index)
        P = max(map(len, prompts))
        ids = torch.full((len(prompts), P), self.pad_id, dtype=torch.long)
        att = torch.zeros((len(prompts), P), dtype=torch.long)
        for u, p in enumerate(prompts):
            ids[u, :len(p)] = torch.tensor(p)
            att[u, :len(p)] = 1
        self.lengths = att.sum(1).to(self.device)
        self.att = att.to(self.device)
        last = {}

        def keep_last(_module, args):
            h = args[0]
            last["h"] = h[torch.arange(h.size(0), device=h.device), self.lengths - 1]
            return (h[:, :0], *args[1:])  # the head runs on no position here

        handle = self.head.register_forward_pre_hook(keep_last)
        try:
            out = self.model(input_ids=ids.to(self.device), attention_mask=self.att,
                             position_ids=torch.arange(P, device=self.device).expand(len(prompts), P), use_cache=True)
        finally:
            handle.remove()
        self.live = [t for layer in out.past_key_values.layers for t in (layer.keys, layer.values)] + [last["h"]]
        if torch.is_grad_enabled():
            self.leaves = [t.detach().requires_grad_() for t in self.live]

    def logits(self, samples: list[Experience], batch: RLBatch) -> torch.Tensor:
        """The logits [N, V] that predict ``batch``'s picked response tokens (as ``response_logits`` gives)."""
        if self.live is None:
            self._prompt_pass()
        self.done += 1
        src = self.leaves if self.leaves and self.done < self.calls else self.live
        u = torch.tensor([self.index[tuple(s.prompt_ids)] for s in samples], device=self.device)
        B, R = batch.mask.shape[0], max(batch.mask.shape[1], 1)  # a batch of empty responses runs one pad
        ids = torch.full((B, R), self.pad_id, dtype=torch.long)
        att = torch.zeros((B, R), dtype=torch.long)
        for b, s in enumerate(samples):
            ids[b, :len(s.response_ids)] = torch.tensor(s.response_ids)
            att[b, :len(s.response_ids)] = 1
        att = att.to(self.device)
        # index_select, not src[u]: its backward adds a prompt's rows in order (index_add_), where indexing's
        # (index_put_ with accumulate) adds them in a thread-dependent order, and the gradient varied run to run
        rows = [t.index_select(0, u) for t in src]
        cache = DynamicCache(ddp_cache_data=[(rows[i], rows[i + 1]) for i in range(0, len(rows) - 1, 2)])
        first = rows[-1].unsqueeze(1)
        picked = torch.nn.functional.pad(batch.picked, (0, R - batch.mask.shape[1]))

        def pick(_module, args):  # token 0 from the prompt's last position, token j from response position j-1
            return (torch.cat([first.to(args[0].dtype), args[0][:, :-1]], dim=1)[picked], *args[1:])

        handle = self.head.register_forward_pre_hook(pick)
        try:
            logits = self.model(input_ids=ids.to(self.device), past_key_values=cache,
                                attention_mask=torch.cat([self.att[u], att], dim=1),
                                position_ids=self.lengths[u].unsqueeze(1) + torch.arange(R, device=self.device),
                                use_cache=True).logits
        finally:
            handle.remove()
        if logits.dim() != 2 or logits.size(0) != int(picked.sum()):
            raise RuntimeError(f"{type(self.head).__name__}'s output gave logits of shape {tuple(logits.shape)} for "
                               f"{int(picked.sum())} picked positions: the model reshapes the head's output, which "
                               f"SharedPrompts cannot pick from (train.share_prompts=false)")
        return logits

    def closing(self) -> torch.Tensor | float:
        """For the last micro-batch's loss: Σ live · (gradient accumulated at the detached copies), minus its own
        value.  0 elsewhere."""
        if self.done < self.calls or not self.leaves:
            return 0.0
        terms = [(t * leaf.grad).sum() for t, leaf in zip(self.live, self.leaves) if leaf.grad is not None]
        if not terms:
            return 0.0
        total = torch.stack(terms).sum()
        return total - total.detach()


def train_steps(engine, model: torch.nn.Module, samples: list[Experience], t, world_size: int, seed: int,
                pad_id: int, device, share_prompts: bool, micro_loss: Callable,
                loss_norm: float | None) -> tuple[dict[str, float], float]:
    """One train call of a role (the actor's or the critic's): every optimizer step over ``samples`` (``t``: the
    run's ``train`` section; micro-batches of this rank's share, ``seed`` their order), each step's distinct
    prompts run once by ``model`` when ``share_prompts`` and sharing pays (``worth_sharing``); ``micro_loss(batch,
    shared=...)`` is the role's loss.  (the steps' combined metrics, the positions trained summed over ranks)."""
    share = share_prompts and worth_sharing(samples, t.share_prompts_min_positions, t.micro_train_batch_size)
    history, positions = [], 0
    for micro in optimizer_steps(samples, t.train_batch_size // world_size, t.micro_train_batch_size, t.max_epochs,
                                 seed, pad_id, device, t.micro_batch_overhead_tokens, share):
        step_samples = [s for part, _ in micro for s in part]
        shared = SharedPrompts(model, step_samples, len(micro), pad_id, device) if share else None
        history.append(run_optimizer_step(engine, micro, partial(micro_loss, shared=shared), world_size, loss_norm))
        positions += positions_trained(step_samples, share)
    return combine(history), summed_positions(positions)
