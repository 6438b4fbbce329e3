"""Prompt data for RL: rows -> prompt token ids (token-in/token-out), the prompt text and a label."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..algorithms.eval_metrics import dataset_names
from ..config.rl import PromptDataConfig
from .mixing import mix
from .rows import BadRows, DataError
from .sft import _Bad, _ChatRenderer, _check_messages, _get_str, _value
from .sources import load_source


@dataclass
class Prompt:
    prompt_ids: list[int]
    text: str
    label: str | None
    source: str
    dataset: str = ""  # eval prompts: the short name of their source (the file stem), for metric keys


def build_prompts(rows, name: str, tokenizer, cfg: PromptDataConfig, bad: BadRows) -> list[Prompt]:
    chat = _ChatRenderer(tokenizer, None, name) if cfg.apply_chat_template else None
    out = []
    for i, row in enumerate(rows):
        r = i + 1
        try:
            if chat is not None:
                value = _value(row, cfg.input_key, "data.input_key")
                messages = ([{"role": "user", "content": value}] if isinstance(value, str)
                            else _check_messages(value, cfg.input_key))
                text = chat.render(messages, True)
            else:
                text = _get_str(row, cfg.input_key, "data.input_key")
                if cfg.input_template is not None:
                    text = cfg.input_template.format(text)
            label = None
            if cfg.label_key is not None:
                label = str(_value(row, cfg.label_key, "data.label_key"))
            ids = tokenizer(text, add_special_tokens=chat is None)["input_ids"]
            if len(ids) > cfg.prompt_max_len:
                raise _Bad("too_long", f"{len(ids)} tokens > prompt_max_len {cfg.prompt_max_len}")
            if not ids:
                raise _Bad("empty", "the prompt has no tokens")
            out.append(Prompt(ids, text, label, f"{name} row {r}"))
        except _Bad as b:
            bad.add(name, r, b.kind, b.detail)
    return out


def _read(specs: list[str], cfg: PromptDataConfig, tokenizer, bad: BadRows) -> list[list[Prompt]]:
    sources = []
    for spec in specs:
        rows, name = load_source(spec, cfg.prompt_split)
        prompts = build_prompts(rows, name, tokenizer, cfg, bad)
        if not prompts:
            raise DataError(f"{name}: none of its {len(rows)} rows is a usable prompt: {bad.summary(' | ')}")
        sources.append(prompts)
    return sources


def load_prompts(cfg: PromptDataConfig, tokenizer, seed: int) -> tuple[list[Prompt], list[Prompt], BadRows]:
    """Training prompts (mixed by probability, capped by max_samples) and eval prompts."""
    bad = BadRows(cfg.bad_rows)
    train = mix(_read(cfg.prompt_data, cfg, tokenizer, bad), cfg.prompt_data_probs, seed, cfg.max_samples)
    if cfg.max_samples is not None:
        train = train[:cfg.max_samples]
    evals: list[Prompt] = []
    if cfg.eval_prompt_data:
        sources = _read(cfg.eval_prompt_data, cfg, tokenizer, bad)
        for name, src in zip(dataset_names(cfg.eval_prompt_data), sources):
            for p in src:
                p.dataset = name
        evals = [p for src in sources for p in src]
        if cfg.max_eval_prompts is not None and len(evals) > cfg.max_eval_prompts:
            keep = np.sort(np.random.default_rng(seed).choice(len(evals), cfg.max_eval_prompts, replace=False))
            evals = [evals[i] for i in keep]
    return train, evals, bad
