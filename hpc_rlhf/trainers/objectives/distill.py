"""Knowledge distillation: an SFT-style student trained on CE mixed with a divergence to the teacher per token.

The teacher is a frozen full copy on every rank.  The loss is `distill_loss` per response token, a mean over
every response token of the step (all ranks, all micro-batches), like `sft`.

On-policy steps (GKD, ``objective.lmbda`` > 0): a step drawn from (train.seed, step) trains on responses the student
generates to the prompts of the step's samples instead of the data's responses.  Every rank loads the student's
current weights into its generation engine (``rollout.engine``, through the generation port), samples its share of
the step, each sample seeded by its place in the step, and the ranks exchange the samples: the step is the same
whatever the rank count and the micro-batches, and a resumed run makes the same samples.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Sequence

import torch

from ...algorithms.distill import distill_loss
from ...data.packing import collate_padded
from ...data.sft import Sample
from ...distributed.collectives import all_gather_objects
from ...distributed.weight_sync import BUCKET_BYTES
from ...distributed.weight_sync.channel import actor_buckets, send_weights
from ...distributed.weight_sync.plan import full_items, lora_items
from ...generation.engine import SamplingParams, sample_seed
from ...generation.factory import engine_choice, make_engine
from ...models.loading import load_causal_lm
from ...roles.rollout import stop_token_ids
from .common import OFFLINE_OBJECTIVES, LossOut, StepView
from .per_unit_mean import StepUnits, as_item_mean
from .sft import ResponseTokenMean

log = logging.getLogger("hpc_rlhf.offline")

@dataclass
class StudentSample(Sample):
    """A response the student generated to a data sample's prompt (its loss has no CE term)."""


@dataclass
class StepTokens(StepUnits):
    student: bool  # the step's responses are the student's own


def student_step(seed: int, step: int, lmbda: float) -> bool:
    """Whether optimizer step ``step`` (0-based) trains on the student's responses: u < λ, u in [0, 1) drawn from a
    hash of (seed, step) (``sample_seed``), so every rank, and a resumed run, decides the same."""
    return sample_seed(seed, step, -1, 0) / 2.0**63 < lmbda


def prompt_of(sample: Sample) -> list[int]:
    """The tokens before the sample's first target: its prompt (chat rows: the turns before the first answer)."""
    return sample.input_ids[:sample.loss_mask.index(1)]


class StudentSampler:
    """This rank's generation engine for the student (``rollout.engine``) and the on-policy samples of a step."""

    def __init__(self, cfg, tokenizer, device, is_main: bool):
        r, m = cfg.rollout, cfg.model
        if is_main:
            spec, why = engine_choice(r, m.pretrain, device)
            log.info("the student's generation engine: %s (%s)", spec.name, why)
        self.engine = make_engine(r, m.pretrain, m.param_dtype, device, r.max_batch_size, seed=cfg.train.seed)
        self.params = SamplingParams(max_new_tokens=r.generate_max_len,
                                     stop_token_ids=stop_token_ids(m.pretrain, tokenizer))
        self.seed, self.max_len, self.lora = cfg.train.seed, cfg.data.max_len, m.lora_rank > 0
        self.dtype = torch.bfloat16 if m.param_dtype == "bf16" else torch.float32
        self.base_loaded = False  # LoRA: the frozen base goes in once, the merged LoRA layers every time

    def load_student(self, engine) -> None:
        """The student's current weights into the engine (collective over the ranks under ZeRO-3)."""
        module = engine.module
        items = lora_items(module, include_frozen=not self.base_loaded) if self.lora else full_items(module)
        buckets = actor_buckets(items, engine.zero_optimization_stage() == 3, self.dtype, BUCKET_BYTES, send=False)
        send_weights(None, buckets, is_leader=False, local_engine=self.engine)
        self.base_loaded = True

    def step_view(self, engine, view: StepView, step: int) -> StepView:
        """``view`` with every sample's response replaced by one the student samples now; this rank samples its
        share, seeded by (train.seed, step, place in the step), and the ranks exchange them."""
        self.load_student(engine)
        places = view.my_positions
        prompts = [prompt_of(view.items[k]) for k in places]
        outs = self.engine.generate(prompts, self.params, [sample_seed(self.seed, step, k, 0) for k in places])
        mine = []
        for k, p, out in zip(places, prompts, outs):
            response = out.token_ids[:self.max_len - len(p)]
            mine.append(StudentSample(p + response, [0] * len(p) + [1] * len(response),
                                      f"{view.items[k].source}, the student's response"))
        parts = all_gather_objects(mine)
        return StepView([parts[k % view.world][k // view.world] for k in range(len(view.items))], view.rank,
                        view.world)


@OFFLINE_OBJECTIVES.register("kd")
class Distill(ResponseTokenMean):
    def prepare(self, datasets: Sequence[list]) -> None:
        teacher_cfg = dataclasses.replace(self.cfg.model, pretrain=self.cfg.objective.teacher_pretrain,
                                          gradient_checkpointing=False, lora_rank=0, load_in_4bit=False)
        self.teacher = load_causal_lm(teacher_cfg, trainable=False).to(self.device)
        self.sampler = (StudentSampler(self.cfg, self.tokenizer, self.device, self.de.is_main)
                        if self.cfg.objective.lmbda > 0 else None)

    def step_items(self, engine, view: StepView, step: int) -> StepView:
        o = self.cfg.objective
        if self.sampler is None or not student_step(self.cfg.train.seed, step, o.lmbda):
            return view
        return self.sampler.step_view(engine, view, step)

    def step_context(self, engine, view: StepView) -> StepTokens:
        units = super().step_context(engine, view)
        return StepTokens(units.units, units.items, any(isinstance(s, StudentSample) for s in view.items))

    def loss(self, engine, samples: list, ctx: StepTokens) -> LossOut:
        o = self.cfg.objective
        batch = collate_padded(samples, self.pad_id).to(self.device)
        inputs = dict(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                      position_ids=batch.position_ids, use_cache=False)
        student = engine(**inputs).logits[:, :-1]
        with torch.no_grad():
            teacher = self.teacher(**inputs).logits[:, :-1]
        labels = batch.labels[:, 1:]
        mask = labels != -100
        mean, m = distill_loss(student, teacher, labels.clamp(min=0), mask, kd_coef=o.kd_coef,
                               temperature=o.temperature, beta=o.beta, supervised=not ctx.student)
        n = float(m["tokens"])
        stats = {k: (float(m[k]) * n, n) for k in ("ce", "kl") if k in m}
        stats["tokens_per_sample"] = (n, float(len(samples)))
        return LossOut(as_item_mean(mean * n, ctx, len(samples)), len(samples), stats)

    def step_metrics(self, ctx: StepTokens) -> dict[str, float]:
        return {"student_step": float(ctx.student)} if self.sampler is not None else {}
