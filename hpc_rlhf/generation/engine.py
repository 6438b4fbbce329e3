"""The rollout engine interface: token ids in, completions (tokens, log-probabilities) out."""
from __future__ import annotations

import abc
import hashlib
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
WORK_KEYS = ("prompt_tokens_prefilled", "tokens_generated")  # RolloutEngine.work_done


@dataclass
class SamplingParams:
    """How to pick each new token.

    Order of the transforms: temperature, then top-k, then top-p.  ``temperature == 0`` means greedy
    (top-k and top-p are then irrelevant); ``top_k == 0`` and ``top_p == 1`` switch those filters off.
    Top-p keeps the smallest set of most likely tokens whose probability reaches ``top_p``.
    Generation of a row ends at the first token in ``stop_token_ids`` (which is kept in the output)
    or after ``max_new_tokens`` tokens.  Before ``min_new_tokens`` new tokens no stop token is sampled (its
    probability is set to 0 before the other transforms); the log-probabilities a completion reports stay those
    of the unmodified distribution.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 64
    stop_token_ids: list[int] = field(default_factory=list)
    min_new_tokens: int = 0

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(f"min_new_tokens must be in [0, max_new_tokens={self.max_new_tokens}], got "
                             f"{self.min_new_tokens}")
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class Completion:
    """One generated sample.

    ``token_ids`` are the new tokens only (the stop token included when ``finish_reason == "stop"``);
    ``logprobs[i]`` is log p(token_ids[i]) under the unmodified model distribution (temperature 1,
    no top-k / top-p), as the engine computed it.  ``finish_reason`` is ``"stop"`` or ``"length"``.
    """

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str


class RolloutEngine(abc.ABC):
    """Generates completions for token-id prompts and takes weight updates from the trainer.

    A sample depends only on its prompt, its seed and the weights: not on the other prompts in the
    call, their order or the batch size (up to floating-point differences of batched kernels).
    """

    weight_version: int = 0

    def count_work(self, prompt_tokens_prefilled: int, tokens_generated: int) -> None:
        """Add one generate call's work to the engine's counters (``work_done``): the prompt tokens it ran through
        the model (a prompt prefilled once for several samples, or found in a prefix cache, counts once or not at
        all) and the tokens it generated."""
        work = self.__dict__.setdefault("_work", dict.fromkeys(WORK_KEYS, 0))
        work["prompt_tokens_prefilled"] += int(prompt_tokens_prefilled)
        work["tokens_generated"] += int(tokens_generated)

    def work_done(self) -> dict[str, int]:
        """The work of every generate call since the engine was built: {"prompt_tokens_prefilled",
        "tokens_generated"} (a copy; the difference of two readings is the work between them)."""
        return dict(self.__dict__.get("_work", dict.fromkeys(WORK_KEYS, 0)))

    @abc.abstractmethod
    def generate(self, prompts: list[list[int]], params: SamplingParams, seeds: list[int]) -> list[Completion]:
        """One completion per prompt, in the order of ``prompts``; ``seeds[i]`` drives sample ``i``."""

    @abc.abstractmethod
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy in one chunk of parameters by Hugging Face name; raise on an unknown name or a shape mismatch.

        A weight update is ``begin_weight_update()``, any number of ``load_weights`` chunks (one per
        broadcast bucket), then ``finish_weight_update()``; :meth:`update_weights` does all three.
        """

    def begin_weight_update(self) -> None:
        """Prepare for the chunks of one update (an engine that post-processes weights starts here)."""

    def finish_weight_update(self) -> None:
        """All chunks are in: make them the weights the next ``generate`` uses; bump ``weight_version``."""
        self.weight_version += 1

    def shareable(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> bool:
        """Whether :meth:`share_weights` can take these tensors (shared memory another process writes) as the
        parameters of the same names.  False for an engine that keeps its weights in a layout of its own."""
        return False

    def share_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Take ``named_tensors`` as the parameters of the same names (:meth:`shareable` said it can): later
        updates write them in place between ``begin_weight_update`` and ``finish_weight_update``."""
        raise NotImplementedError(f"{type(self).__name__} keeps its own weights")

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.begin_weight_update()
        self.load_weights(named_tensors)
        self.finish_weight_update()

    @abc.abstractmethod
    def probe_logprobs(self, prompt_ids: list[int], response_ids: list[int]) -> list[float]:
        """log p(response_ids[i] | prompt_ids + response_ids[:i]) for each i, teacher-forced, under the weights the
        next ``generate`` uses and through the same computation (temperature 1, no filtering): what the weight
        sync's receipt compares with the actor's (``roles/sync.py``)."""

    @abc.abstractmethod
    def part_checksums(self) -> dict[str, float] | None:
        """``tensor_part_checksum`` of each weight the engine generates with, by Hugging Face name (or, for an
        engine that repacks them, of each tensor it loaded); None where the engine keeps none."""

    def state_checksum(self) -> float:
        """``tensor_checksum`` of the weights: ``combine_checksums`` of ``part_checksums``."""
        parts = self.part_checksums()
        if parts is None:
            raise RuntimeError(f"{type(self).__name__} keeps no checksums of its weights (built without "
                               f"track_checksums)")
        return combine_checksums(parts)

    def sleep(self) -> None:
        """Release memory the engine can rebuild (caches, possibly weights) while the trainer runs."""

    def wake(self) -> None:
        """Undo :meth:`sleep`."""


_PHI = 0.6180339887498949


def tensor_part_checksum(t: torch.Tensor, chunk: int = 1 << 22) -> float:
    """float64 sum(t_j * w_j) over the elements of one tensor, w_j = 1 + frac(j * golden ratio) in [1, 2).

    Changing any single element changes the sum, and swapping two elements almost surely does too.
    Works in chunks so the float64 copy stays small."""
    flat = t.detach().reshape(-1)
    total = 0.0
    for start in range(0, flat.numel(), chunk):
        part = flat[start:start + chunk].to(torch.float64)
        idx = torch.arange(start, start + part.numel(), dtype=torch.float64, device=part.device)
        total += float((part * (1.0 + torch.frac(idx * _PHI))).sum())
    return total


def combine_checksums(parts: dict[str, float]) -> float:
    """Per-tensor checksums combined in name order, tensor k weighted by 1 + frac((k + 1) * sqrt 2), so
    that exchanging two tensors of the same shape changes the result too."""
    return sum(parts[name] * (1.0 + math.modf((k + 1) * math.sqrt(2.0))[0])
               for k, name in enumerate(sorted(parts)))


def tensor_checksum(named: Iterable[tuple[str, torch.Tensor]]) -> float:
    """Checksum of named tensors: ``combine_checksums`` of their ``tensor_part_checksum``; the same on
    the sender (actor) and on any engine, whatever order or chunking the tensors come in."""
    return combine_checksums({name: tensor_part_checksum(t) for name, t in named})

_MASK63 = (1 << 63) - 1


def sample_seed(base_seed: int, step: int, prompt_index: int, sample_index: int) -> int:
    """A 63-bit seed for one sample: blake2b of the four numbers (each as 16 signed little-endian bytes).

    The result depends only on the four numbers (not on the process, the platform or the Python hash
    seed), so a sample can be reproduced without replaying the samples before it.
    """
    data = b"".join(int(x).to_bytes(16, "little", signed=True)
                    for x in (base_seed, step, prompt_index, sample_index))
    digest = hashlib.blake2b(data, digest_size=8, person=b"hpc_rlhf.seed").digest()
    return int.from_bytes(digest, "little") & _MASK63
