"""Preference data: pairs and labelled rows, loss masks on the responses only, chat pairs, bad rows, length policy."""
from __future__ import annotations

import csv
import json

import pytest

from hpc_rlhf.config import load_config
from hpc_rlhf.config.preference import DPOConfig, KTOConfig
from hpc_rlhf.data.preference import build_labelled, build_pairs, load_labelled, load_pairs
from hpc_rlhf.data.rows import BadRows, DataError


def _cfg(cls=DPOConfig, *overrides):
    return load_config(cls, None, ["pretrain=unused", "dataset=mem", *overrides]).data


def _ids(tok, text, special=False):
    return tok(text, add_special_tokens=special)["input_ids"]


def _response(sample):
    return [t for t, m in zip(sample.input_ids, sample.loss_mask) if m]


def test_plain_pair_tokens_and_masks(chatml_tokenizer):
    tok = chatml_tokenizer
    cfg = _cfg(DPOConfig, "input_template=Q: {} A: ")
    rows = [{"prompt": "1+1=", "chosen": "2", "rejected": "three", "extra": 5}]
    (pair,) = build_pairs(rows, "mem", tok, cfg, BadRows("error"))
    prompt = _ids(tok, "Q: 1+1= A: ", special=True)
    assert pair.chosen.input_ids == prompt + _ids(tok, "2") + [tok.eos_token_id]
    assert pair.rejected.input_ids == prompt + _ids(tok, "three") + [tok.eos_token_id]
    assert pair.chosen.loss_mask == [0] * len(prompt) + [1, 1]
    assert _response(pair.rejected) == _ids(tok, "three") + [tok.eos_token_id]
    assert pair.margin is None and pair.source == "mem row 1"
    assert len(pair) == len(pair.chosen) + len(pair.rejected)


def test_bos_tokenizer_puts_bos_on_the_prompt_only(bos_tokenizer):
    (pair,) = build_pairs([{"prompt": "hi", "chosen": "a", "rejected": "b"}], "mem", bos_tokenizer, _cfg(),
                          BadRows("error"))
    bos = bos_tokenizer.convert_tokens_to_ids("<|bos|>")
    assert pair.chosen.input_ids.count(bos) == 1 and pair.chosen.input_ids[0] == bos
    assert _response(pair.chosen) == _ids(bos_tokenizer, "a") + [bos_tokenizer.eos_token_id]


def test_no_prompt_column_in_plain_mode(chatml_tokenizer):
    (pair,) = build_pairs([{"chosen": "good answer", "rejected": "bad answer"}], "mem", chatml_tokenizer,
                          _cfg(DPOConfig, "prompt_key=null"), BadRows("error"))
    # nothing predicts the first token, so it is not a target
    assert pair.chosen.loss_mask[0] == 0 and all(pair.chosen.loss_mask[1:])


def test_bad_rows_are_skipped_with_file_and_row(chatml_tokenizer):
    rows = [{"prompt": "ok", "chosen": "a", "rejected": "b"},
            {"prompt": "no rejected", "chosen": "a"},
            {"prompt": "", "chosen": "a", "rejected": "b"},
            {"prompt": "x", "chosen": 3, "rejected": "b"},
            {"prompt": "long", "chosen": "y" * 80, "rejected": "b"},
            {"prompt": "ok too", "chosen": "c", "rejected": "d"}]
    bad = BadRows("skip")
    pairs = build_pairs(rows, "pairs.jsonl", chatml_tokenizer, _cfg(DPOConfig, "max_len=32"), bad)
    assert [p.source for p in pairs] == ["pairs.jsonl row 1", "pairs.jsonl row 6"]
    assert bad.counts() == {"missing_key": 1, "empty": 1, "wrong_type": 1, "too_long": 1}
    summary = bad.summary()
    for row in (2, 3, 4, 5):
        assert f"pairs.jsonl row {row}" in summary
    with pytest.raises(DataError, match=r"pairs\.jsonl row 2: missing key 'rejected'"):
        build_pairs(rows, "pairs.jsonl", chatml_tokenizer, _cfg(DPOConfig, "max_len=32"), BadRows("error"))


def test_a_pair_whose_chosen_equals_rejected_is_a_bad_row(chatml_tokenizer, tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [
        {"prompt": "1+1=", "chosen": "two", "rejected": "three"},
        {"prompt": "2+2=", "chosen": "four", "rejected": "four"}]))
    cfg = load_config(DPOConfig, None, ["pretrain=unused", f"dataset={path}"]).data
    train, _, bad = load_pairs(cfg, chatml_tokenizer, seed=0)
    assert [p.source for p in train] == [f"{path} row 1"] and bad.counts() == {"identical": 1}
    assert bad.summary() == f"identical: 1 row skipped, e.g. {path} row 2: 'chosen' and 'rejected' are the same " \
                            "response: the pair prefers nothing"
    with pytest.raises(DataError, match=rf"^{path} row 2: 'chosen' and 'rejected' are the same response"):
        load_pairs(load_config(DPOConfig, None, ["pretrain=unused", f"dataset={path}", "bad_rows=error"]).data,
                   chatml_tokenizer, seed=0)
    # chat: the rendered responses are compared (a string is one assistant message)
    bad = BadRows("skip")
    rows = [{"prompt": "3+3=", "chosen": [{"role": "assistant", "content": "six"}], "rejected": "six"}]
    assert build_pairs(rows, "mem", chatml_tokenizer, _cfg(DPOConfig, "apply_chat_template=true"), bad) == []
    assert bad.counts() == {"identical": 1}


def test_truncation_policy(chatml_tokenizer):
    tok = chatml_tokenizer
    cfg = _cfg(DPOConfig, "max_len=12", "truncate_responses=true")
    rows = [{"prompt": "abcd", "chosen": "0123456789", "rejected": "xyz"},
            {"prompt": "abcd", "chosen": "same-prefix-1", "rejected": "same-prefix-2"},
            {"prompt": "a prompt longer than twelve", "chosen": "a", "rejected": "b"}]
    bad = BadRows("skip")
    pairs = build_pairs(rows, "mem", tok, cfg, bad)
    assert len(pairs) == 1
    assert pairs[0].chosen.input_ids == _ids(tok, "abcd") + _ids(tok, "01234567")  # cut, eos dropped
    assert len(pairs[0].chosen) == 12 and pairs[0].rejected.input_ids[-1] == tok.eos_token_id
    assert bad.counts() == {"too_long": 2}
    assert "identical within max_len" in bad.summary() and "the prompt alone is" in bad.summary()


def test_margin_column(chatml_tokenizer, tmp_path):
    path = tmp_path / "pairs.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["prompt", "chosen", "rejected", "m"])
        w.writerow(["p", "a", "b", "0.5"])
        w.writerow(["p", "a", "b", "lots"])
        w.writerow(["p", "a", "b", "-2"])
    cfg = load_config(DPOConfig, None, ["pretrain=unused", f"dataset={path}"]).data
    train, evals, bad = load_pairs(cfg, chatml_tokenizer, seed=0, margin_key="m")
    assert [p.margin for p in train] == [0.5, -2.0] and evals == []
    assert bad.counts() == {"wrong_type": 1} and f"{path} row 2" in bad.summary()
    rows = [{"prompt": "p", "chosen": "a", "rejected": "b"}]
    with pytest.raises(DataError, match="missing key 'm'"):
        build_pairs(rows, "mem", chatml_tokenizer, cfg, BadRows("error"), margin_key="m")


def test_a_missing_key_names_its_option_and_the_keys_the_row_has(chatml_tokenizer, tmp_path):
    from hpc_rlhf.config.preference import PRMConfig
    from hpc_rlhf.data.process import load_process_data

    def error(path, load, cls, *overrides, **kw) -> str:
        cfg = load_config(cls, None, ["pretrain=unused", f"dataset={path}", "bad_rows=error", *overrides]).data
        with pytest.raises(DataError) as e:
            load(cfg, chatml_tokenizer, seed=0, **kw)
        return str(e.value).split(" (set data.bad_rows=skip")[0]

    path = tmp_path / "qa.jsonl"
    path.write_text(json.dumps({"question": "1+1=", "good": "2", "bad": "3"}) + "\n")
    assert error(path, load_pairs, DPOConfig, "chosen_key=good", "rejected_key=bad") == \
        f"{path} row 1: missing key 'prompt' (data.prompt_key); the row has keys: question, good, bad"
    assert error(path, load_pairs, DPOConfig, "prompt_key=question", "chosen_key=good") == \
        f"{path} row 1: missing key 'rejected' (data.rejected_key); the row has keys: question, good, bad"
    assert error(path, load_pairs, DPOConfig, "prompt_key=question", "chosen_key=good", "rejected_key=bad",
                 margin_key="m") == f"{path} row 1: missing key 'm' (objective.margin_key); the row has keys: " \
                                    "question, good, bad"
    assert error(path, load_pairs, DPOConfig, "apply_chat_template=true", "prompt_key=question",
                 "rejected_key=bad") == f"{path} row 1: missing key 'chosen' (data.chosen_key); the row has " \
                                        "keys: question, good, bad"
    assert error(path, load_labelled, KTOConfig, "prompt_key=question", "completion_key=good") == \
        f"{path} row 1: missing key 'label' (data.label_key); the row has keys: question, good, bad"
    steps = tmp_path / "steps.jsonl"
    steps.write_text(json.dumps({"input": "a <|im_end|>", "steps": ["+"]}) + "\n")
    assert error(steps, load_process_data, PRMConfig, "placeholder=<|im_end|>") == \
        f"{steps} row 1: missing key 'labels' (data.label_key); the row has keys: input, steps"


def test_chat_pairs_sharing_a_prompt_prefix(chatml_tokenizer):
    tok = chatml_tokenizer
    cfg = _cfg(DPOConfig, "apply_chat_template=true", "prompt_key=null")
    system = {"role": "system", "content": "be brief"}
    user = {"role": "user", "content": "2+2?"}
    rows = [{"chosen": [system, user, {"role": "assistant", "content": "4"}],
             "rejected": [system, user, {"role": "assistant", "content": "five"}]},
            {"chosen": [user, {"role": "assistant", "content": "4"}],
             "rejected": [system, user, {"role": "assistant", "content": "5"}]}]
    bad = BadRows("skip")
    (pair,) = build_pairs(rows, "chat.jsonl", tok, cfg, bad)
    prompt = tok.apply_chat_template([system, user], tokenize=False, add_generation_prompt=True)
    assert tok.decode(pair.chosen.input_ids) == prompt + "4<|im_end|>"
    assert tok.decode(_response(pair.chosen)) == "4<|im_end|>"
    assert tok.decode(_response(pair.rejected)) == "five<|im_end|>"
    assert bad.counts() == {"wrong_type": 1} and "must share the prompt" in bad.summary()


def test_chat_pairs_with_a_prompt_column(chatml_tokenizer):
    tok = chatml_tokenizer
    cfg = _cfg(DPOConfig, "apply_chat_template=true")
    rows = [{"prompt": [{"role": "user", "content": "hi"}], "chosen": "hello!", "rejected": "go away"},
            {"prompt": "plain string prompt", "chosen": [{"role": "assistant", "content": "ok"}],
             "rejected": "no"},
            {"prompt": "hi", "chosen": [{"role": "user", "content": "not an answer"}], "rejected": "x"}]
    bad = BadRows("skip")
    first, second = build_pairs(rows, "mem", tok, cfg, bad)
    assert tok.decode(_response(first.chosen)) == "hello!<|im_end|>"
    assert tok.decode(second.chosen.input_ids).startswith("<|im_start|>user\nplain string prompt<|im_end|>")
    assert bad.counts() == {"wrong_type": 1} and "must end with an assistant message" in bad.summary()


def test_labelled_rows_and_mismatched_sequences(chatml_tokenizer):
    tok = chatml_tokenizer
    cfg = _cfg(KTOConfig, "max_len=16")
    rows = [{"prompt": "p1", "completion": "good", "label": True},
            {"prompt": "p2", "completion": "bad", "label": 0},
            {"prompt": "p3", "completion": "ok", "label": "true"},
            {"prompt": "p4", "completion": "meh", "label": "maybe"},
            {"prompt": "p5", "completion": "meh"}]
    bad = BadRows("skip")
    items = build_labelled(rows, "kto.jsonl", tok, cfg, bad)
    assert [r.desirable for r in items] == [True, False, True]
    assert bad.counts() == {"wrong_type": 1, "missing_key": 1}
    seq = items[0].sequence()
    assert seq.input_ids == _ids(tok, "p1") + _ids(tok, "good") + [tok.eos_token_id]
    assert _response(seq) == _ids(tok, "good") + [tok.eos_token_id]
    long = items[1].sequence(_ids(tok, "x" * 40), max_len=16)  # a mismatched completion is cut to max_len
    assert len(long) == 16 and _response(long) == _ids(tok, "x" * 14)


def test_load_split_and_mix(chatml_tokenizer, tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    for path, tag, n in ((a, "a", 30), (b, "b", 10)):
        path.write_text("".join(json.dumps({"prompt": f"{tag}{i}", "chosen": "y", "rejected": "n"}) + "\n"
                                for i in range(n)))
    cfg = load_config(DPOConfig, None, ["pretrain=unused", f"dataset={a},{b}", "eval_split_ratio=0.25",
                                        "dataset_probs=0.5,0.5"]).data
    train, evals, bad = load_pairs(cfg, chatml_tokenizer, seed=3)
    assert len(evals) == 10 and len(train) == 30 and bad.total == 0
    train_src = {p.source for p in train}
    assert not train_src & {p.source for p in evals}
    assert sum(p.source.startswith(str(b)) for p in train) > 8  # the small source is oversampled
    again = load_pairs(cfg, chatml_tokenizer, seed=3)
    assert [p.source for p in again[0]] == [p.source for p in train]

    kto = tmp_path / "kto.jsonl"
    kto.write_text("".join(json.dumps({"prompt": f"q{i}", "completion": "c", "label": i % 2 == 0}) + "\n"
                           for i in range(8)))
    kcfg = load_config(KTOConfig, None, ["pretrain=unused", f"dataset={kto}", f"eval_dataset={kto}",
                                         "max_eval_samples=3"]).data
    train, evals, _ = load_labelled(kcfg, chatml_tokenizer, seed=0)
    assert len(train) == 8 and len(evals) == 3


def test_empty_data_is_an_error(chatml_tokenizer, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "p", "chosen": "a"}) + "\n")
    cfg = load_config(DPOConfig, None, ["pretrain=unused", f"dataset={path}"]).data
    with pytest.raises(DataError, match="no training samples"):
        load_pairs(cfg, chatml_tokenizer, seed=0)


def test_config_errors():
    from hpc_rlhf.config import ConfigError
    from hpc_rlhf.config.preference import RMConfig, SimPOConfig
    with pytest.raises(ConfigError, match="label_smoothing is defined for loss_type sigmoid"):
        load_config(DPOConfig, None, ["pretrain=m", "dataset=d", "loss_type=ipo", "label_smoothing=0.1"])
    with pytest.raises(ConfigError, match="unknown option 'gamma'"):
        load_config(DPOConfig, None, ["pretrain=m", "dataset=d", "gamma=1"])  # a SimPO knob
    with pytest.raises(ConfigError, match="LoRA"):
        load_config(RMConfig, None, ["pretrain=m", "dataset=d", "lora_rank=4"])
    assert load_config(SimPOConfig, None, ["pretrain=m", "dataset=d"]).objective.beta == 2.0
