"""`hpc-rlhf score`: reward-model scores of jsonl rows (prompt + response), sharded over ranks, rows kept in order.

A row is scored as ``tokens(prompt) + tokens(response, no special tokens) [+ EOS]``: the sequence
`hpc-rlhf train rm` trains the model on.
"""
from __future__ import annotations

import logging
import time

from ..config.pipelines import RewardModelConfig, ScoreConfig
from ..data.rows import DataError, missing_key
from ..distributed.process_group import shutdown
from ..models.loading import load_tokenizer
from ..models.paths import resolve_pretrained
from ..rewards.model import RewardModelScorer
from .common import PartWriter, device, join, read_jsonl, shard_bounds

log = logging.getLogger("hpc_rlhf.score")


def encode_for_reward(tokenizer, prompt: str, response: str, append_eos: bool = True) -> list[int]:
    """The prompt with the tokenizer's special tokens, unless it already starts with the ones the tokenizer
    would put in front (a chat-rendered prompt from `hpc-rlhf generate` whose template writes the bos): no
    doubled bos.  Then the response without special tokens, then EOS."""
    own = list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    ids = list(tokenizer(prompt)["input_ids"])
    front = len(ids) - len(own)
    if front > 0 and ids[front:] == own and own[:front] == ids[:front]:
        ids = own
    ids += list(tokenizer(response, add_special_tokens=False)["input_ids"])
    if append_eos and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return ids


def make_scorer(cfg: RewardModelConfig, dev):
    return RewardModelScorer(cfg.reward_pretrain, dtype=cfg.reward_dtype, device=str(dev),
                             batch_size=cfg.reward_batch_size, normalize=cfg.normalize_reward)


def run_score(cfg: ScoreConfig) -> dict:
    de = join(cfg.launch.backend)
    try:
        t0 = time.time()
        d = cfg.data
        rows = read_jsonl(d.input_path)
        for n, r in enumerate(rows, 1):
            for option in ("prompt_key", "response_key"):
                key = getattr(d, option)
                if r.get(key) is None:
                    raise DataError(f"{d.input_path} row {n}: {missing_key(r, key, 'data.' + option)}")
                if not isinstance(r[key], str):
                    raise DataError(f"{d.input_path} row {n}: {key!r} is {type(r[key]).__name__}, expected a string")
        lo, hi = shard_bounds(len(rows), de.rank, de.world_size)
        tokenizer = load_tokenizer(resolve_pretrained(cfg.reward.reward_pretrain))
        scorer = make_scorer(cfg.reward, device(de))
        writer = PartWriter(d.output_path, de)
        chunk = 16 * cfg.reward.reward_batch_size
        for start in range(lo, hi, chunk):
            part = rows[start:min(hi, start + chunk)]
            seqs = [encode_for_reward(tokenizer, r[d.prompt_key], r[d.response_key], cfg.reward.append_eos)
                    for r in part]
            for r, s in zip(part, scorer.score_tokens(seqs).tolist()):
                writer.write({**r, d.reward_key: s})
        writer.finish()
        stats = {"rows": len(rows), "seconds": round(time.time() - t0, 2)}
        if de.is_main:
            log.info("wrote %s: %s", d.output_path, stats)
        return stats
    finally:
        if de.world_size > 1:
            shutdown()
