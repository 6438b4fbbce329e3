"""Held-out exact-match accuracy by greedy generation."""
from __future__ import annotations

import torch


@torch.no_grad()
def greedy_answers(model, tokenizer, prompts: list[str], max_new_tokens: int = 6, batch_size: int = 256) -> list[str]:
    model.eval()
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    out: list[str] = []
    try:
        for i in range(0, len(prompts), batch_size):
            enc = tokenizer(prompts[i:i + batch_size], return_tensors="pt", padding=True)
            gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id)
            new = gen[:, enc["input_ids"].shape[1]:]
            out += [t.strip() for t in tokenizer.batch_decode(new, skip_special_tokens=True)]
    finally:
        tokenizer.padding_side = side
    return out


def exact_match_accuracy(model, tokenizer, rows: list[dict]) -> float:
    answers = greedy_answers(model, tokenizer, [r["input"] for r in rows])
    return sum(a == r["label"] for a, r in zip(answers, rows)) / max(len(rows), 1)
