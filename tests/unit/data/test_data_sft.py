"""Rows -> SFT samples (loss masks, bad rows), load_sft_data, and mixing.

The test tokenizer has one token per byte, so expected masks can be written out by hand.
"""
from __future__ import annotations

import json
from collections import Counter

import datasets
import pytest

from hpc_rlhf.config.sections import DataConfig
from hpc_rlhf.data.mixing import mix
from hpc_rlhf.data.rows import TOKENIZE_ROWS, BadRows, DataError, in_chunks
from hpc_rlhf.data.sft import build_sft_samples, load_sft_data

EOS = "<|endoftext|>"


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))


def cfg(**kw) -> DataConfig:
    kw.setdefault("dataset", ["unused"])
    return DataConfig(**kw)


def pieces(tok, *parts: tuple[str, int]) -> tuple[list[int], list[int]]:
    """Expected ids and mask from (text, trained) pieces (exact for the byte-per-token tokenizer)."""
    ids, mask = [], []
    for text, trained in parts:
        p = tok(text, add_special_tokens=False)["input_ids"]
        ids += p
        mask += [trained] * len(p)
    return ids, mask


def build(rows, tok, bad=None, **kw):
    return build_sft_samples(rows, "train.jsonl", tok, cfg(**kw), bad or BadRows("skip"))


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


# ---- loss masks ---------------------------------------------------------------------------------

def test_plain_prompt_response_mask(chatml_tokenizer):
    (s,) = build([{"input": "Hi", "output": "Yo"}], chatml_tokenizer)
    assert chatml_tokenizer.convert_ids_to_tokens(s.input_ids) == ["H", "i", "Y", "o", EOS]
    assert s.loss_mask == [0, 0, 1, 1, 1]
    assert s.source == "train.jsonl row 1"


def test_input_template(chatml_tokenizer):
    (s,) = build([{"q": "2+2?", "a": "4"}], chatml_tokenizer, input_key="q", output_key="a",
                 input_template="User: {}\nAssistant: ")
    assert (s.input_ids, s.loss_mask) == pieces(chatml_tokenizer, ("User: 2+2?\nAssistant: ", 0), ("4" + EOS, 1))
    assert sum(s.loss_mask) == 2


def test_front_special_token_is_not_a_target(bos_tokenizer):
    (s,) = build([{"input": "Hi", "output": "Yo"}], bos_tokenizer)
    bos = bos_tokenizer.convert_tokens_to_ids("<|bos|>")
    assert s.input_ids[0] == bos and s.input_ids[-1] == bos_tokenizer.eos_token_id
    assert s.loss_mask == [0, 0, 0, 1, 1, 1]


def test_pretrain_mode(chatml_tokenizer, bos_tokenizer):
    (s,) = build([{"text": "abc"}], chatml_tokenizer, input_key="text", pretrain_mode=True)
    assert s.input_ids == pieces(chatml_tokenizer, ("abc" + EOS, 1))[0]
    assert s.loss_mask == [0, 1, 1, 1]
    (s,) = build([{"text": "abc"}], bos_tokenizer, input_key="text", pretrain_mode=True)
    assert s.loss_mask == [0, 1, 1, 1, 1]


CONVO = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"},
         {"role": "assistant", "content": "Ciao"}]


def test_chat_multi_turn_mask_covers_assistant_contents_and_end_of_turn(chatml_tokenizer):
    (s,) = build([{"messages": CONVO}], chatml_tokenizer, input_key="messages", output_key=None,
                 apply_chat_template=True)
    expected = pieces(
        chatml_tokenizer,
        ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", 0),
        ("Hello!<|im_end|>", 1),
        ("\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n", 0),
        ("Ciao<|im_end|>", 1),
        ("\n", 0))
    assert (s.input_ids, s.loss_mask) == expected
    trained = [t for t, m in zip(s.input_ids, s.loss_mask) if m]
    assert chatml_tokenizer.decode(trained) == "Hello!<|im_end|>Ciao<|im_end|>"


def test_chat_output_key_string_or_list(chatml_tokenizer):
    rows = [{"prompt": CONVO[:2], "answer": "Hello!"},
            {"prompt": CONVO[:2], "answer": CONVO[2:]}]
    a, b = build(rows, chatml_tokenizer, input_key="prompt", output_key="answer", apply_chat_template=True)
    decode = chatml_tokenizer.decode
    assert decode([t for t, m in zip(a.input_ids, a.loss_mask) if m]) == "Hello!<|im_end|>"
    assert decode([t for t, m in zip(b.input_ids, b.loss_mask) if m]) == "Hello!<|im_end|>Ciao<|im_end|>"


def test_chat_string_prompt_is_the_user_turn(chatml_tokenizer):
    """A plain-string input_key is one user message (as for RL prompts); only the answer is trained."""
    [s] = build([{"prompt": "2+2?", "answer": "4"}], chatml_tokenizer, input_key="prompt", output_key="answer",
                apply_chat_template=True)
    assert chatml_tokenizer.decode(s.input_ids) == ("<|im_start|>user\n2+2?<|im_end|>\n"
                                                    "<|im_start|>assistant\n4<|im_end|>\n")
    assert chatml_tokenizer.decode([t for t, m in zip(s.input_ids, s.loss_mask) if m]) == "4<|im_end|>"


def test_chat_template_override_and_prefix_check(chatml_tokenizer):
    simple = ("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
              "{% if add_generation_prompt %}[assistant]{% endif %}")
    (s,) = build([{"messages": CONVO[1:3]}], chatml_tokenizer, input_key="messages", output_key=None,
                 apply_chat_template=True, tokenizer_chat_template=simple)
    assert (s.input_ids, s.loss_mask) == pieces(chatml_tokenizer, ("[user]Hi[assistant]", 0), ("Hello!", 1))
    # a template that drops earlier assistant turns breaks the prefix property: a clear error, not a wrong mask
    dropping = ("{% for m in messages %}{% if m.role == 'assistant' and not loop.last %}[assistant]"
                "{% else %}[{{ m.role }}]{{ m.content }}{% endif %}{% endfor %}")
    with pytest.raises(DataError, match=r"train.jsonl row 1: the chat template renders the first 2 message\(s\) "
                                        r"as text that is not a prefix"):
        build([{"messages": CONVO[1:]}], chatml_tokenizer, input_key="messages", output_key=None,
              apply_chat_template=True, tokenizer_chat_template=dropping)


# ---- bad rows -----------------------------------------------------------------------------------

def test_bad_rows_plain(chatml_tokenizer):
    rows = [{"input": "ok", "output": "fine"},          # 1 good
            {"input": "q"},                              # 2 missing output
            {"input": "q", "output": "  "},              # 3 empty
            {"input": "q", "output": 5},                 # 4 wrong type
            {"input": "q", "output": "x" * 20},          # 5 too long: 1 + 20 + 1 tokens > 16
            {"input": None, "output": "y"}]              # 6 missing input
    bad = BadRows("skip")
    samples = build(rows, chatml_tokenizer, bad=bad, max_len=16)
    assert [s.source for s in samples] == ["train.jsonl row 1"]
    assert bad.counts() == {"missing_key": 2, "empty": 1, "wrong_type": 1, "too_long": 1}
    summary = bad.summary()
    assert "train.jsonl row 2: missing key 'output' (data.output_key); the row has keys: input; train.jsonl row 6: " \
        "missing key 'input' (data.input_key); the row has keys: output" in summary
    assert "train.jsonl row 3: empty 'output'" in summary
    assert "train.jsonl row 4: 'output' is int, expected a string" in summary
    assert "train.jsonl row 5: 22 tokens, more than max_len 16" in summary
    with pytest.raises(DataError, match=r"^train.jsonl row 2: missing key 'output'"):
        build(rows, chatml_tokenizer, bad=BadRows("error"), max_len=16)


def test_in_chunks_is_lazy_and_keeps_every_item():
    pulled = []

    def items():
        for i in range(7):
            pulled.append(i)
            yield i

    chunks = in_chunks(items(), 3)
    assert next(chunks) == [0, 1, 2] and pulled == [0, 1, 2]  # nothing read ahead of the first chunk
    assert list(chunks) == [[3, 4, 5], [6]]
    assert list(in_chunks([], 3)) == []


def test_rows_across_tokenizer_chunks_keep_order_and_row_numbers(chatml_tokenizer):
    n = 2 * TOKENIZE_ROWS + 5
    bad_at = {TOKENIZE_ROWS + 3, 2 * TOKENIZE_ROWS + 2}  # 1-based rows with a missing output, in chunks 2 and 3
    rows = [{"input": "q"} if r in bad_at else {"input": "q", "output": f"a{r}"} for r in range(1, n + 1)]
    bad = BadRows("skip")
    samples = build(rows, chatml_tokenizer, bad=bad)
    assert [s.source for s in samples] == [f"train.jsonl row {r}" for r in range(1, n + 1) if r not in bad_at]
    last_ids, _ = pieces(chatml_tokenizer, ("q", 0), (f"a{n}", 1))
    assert samples[-1].input_ids == last_ids + [chatml_tokenizer.eos_token_id]
    assert bad.counts() == {"missing_key": 2}


def test_exactly_max_len_is_kept(chatml_tokenizer):
    (s,) = build([{"input": "ab", "output": "cde"}], chatml_tokenizer, max_len=6)
    assert len(s.input_ids) == 6


def test_bad_rows_chat(chatml_tokenizer):
    rows = [{"m": "just text"},                                          # 1 a user turn only: no assistant
            {"m": [{"role": "user"}]},                                    # 2 message without content
            {"m": []},                                                    # 3 empty
            {"m": [{"role": "user", "content": "Hi"}]},                   # 4 no assistant turn
            {"m": CONVO[1:3]}]                                            # 5 good
    bad = BadRows("skip")
    samples = build(rows, chatml_tokenizer, bad=bad, input_key="m", output_key=None, apply_chat_template=True)
    assert [s.source for s in samples] == ["train.jsonl row 5"]
    assert bad.counts() == {"wrong_type": 1, "empty": 3}
    assert "row 1: no assistant message to train on" in bad.summary()
    assert "row 2: 'm' message 1 is not a {role: str, content: str} dict" in bad.summary()
    assert "row 4: no assistant message to train on" in bad.summary()
    raising = "{{ raise_exception('roles must alternate') }}"
    bad = BadRows("skip")
    assert build([{"m": CONVO}], chatml_tokenizer, bad=bad, input_key="m", output_key=None,
                 apply_chat_template=True, tokenizer_chat_template=raising) == []
    assert "the chat template rejected the messages" in bad.summary() and "roles must alternate" in bad.summary()


# ---- load_sft_data ------------------------------------------------------------------------------

def test_load_sft_data_bad_rows_from_file(tmp_path, chatml_tokenizer):
    path = write_jsonl(tmp_path / "train.jsonl", [
        {"input": "a", "output": "b"}, {"input": "c", "output": None}, {"input": "e", "output": ""},
        {"input": "g", "output": "h" * 50}, {"input": "i", "output": "j"}])
    train, evals, bad = load_sft_data(cfg(dataset=[path], max_len=32), chatml_tokenizer, seed=0)
    assert [s.source for s in train] == [f"{path} row 1", f"{path} row 5"] and evals == []
    assert bad.counts() == {"missing_key": 1, "empty": 1, "too_long": 1}
    assert "train.jsonl row 4: 52 tokens, more than max_len 32" in bad.summary()
    with pytest.raises(DataError, match=r"train.jsonl row 2: missing key 'output'"):
        load_sft_data(cfg(dataset=[path], max_len=32, bad_rows="error"), chatml_tokenizer, seed=0)


def test_load_sft_data_empty_training_set(tmp_path, chatml_tokenizer):
    path = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "a", "output": "b"}, {"prompt": "c", "output": "d"}])
    with pytest.raises(DataError) as e:
        load_sft_data(cfg(dataset=[path]), chatml_tokenizer, seed=0)
    assert "no training samples: read 2 rows from" in str(e.value) and "train.jsonl, 2 of them bad" in str(e.value)
    assert "missing_key: 2 rows skipped, e.g. " in str(e.value) and "row 1: missing key 'input'" in str(e.value)


def test_a_missing_key_names_its_option_and_the_keys_the_row_has(tmp_path, chatml_tokenizer):
    # a key no row has: every column of the file is read, so the message lists them
    path = write_jsonl(tmp_path / "train.jsonl", [{"question": "a", "output": "b", "id": 7}])
    with pytest.raises(DataError) as e:
        load_sft_data(cfg(dataset=[path], bad_rows="error"), chatml_tokenizer, seed=0)
    assert str(e.value).startswith(f"{path} row 1: missing key 'input' (data.input_key); the row has keys: "
                                   f"question, output, id (set data.bad_rows=skip")
    with pytest.raises(DataError, match=r"^train\.jsonl row 1: missing key 'messages' \(data\.input_key\); the "
                                        r"row has keys: m "):
        build([{"m": []}], chatml_tokenizer, bad=BadRows("error"), input_key="messages", output_key=None,
              apply_chat_template=True)
    with pytest.raises(DataError, match=r"^train\.jsonl row 1: missing key 'output' \(data\.output_key\); the "
                                        r"row has keys: input "):
        build([{"input": "x"}], chatml_tokenizer, bad=BadRows("error"))


def test_load_sft_data_holdout_mixing_and_caps(tmp_path, chatml_tokenizer):
    big = write_jsonl(tmp_path / "big.jsonl", [{"input": f"b{i}", "output": "x"} for i in range(40)])
    small = write_jsonl(tmp_path / "small.jsonl", [{"input": f"s{i}", "output": "y"} for i in range(4)])

    train, evals, _ = load_sft_data(cfg(dataset=[big, small], eval_split_ratio=0.25, max_eval_samples=5),
                                    chatml_tokenizer, seed=3)
    assert len(evals) == 5 and len(train) == 39                 # 44 distinct, 5 held out, in order
    assert not {s.source for s in evals} & {s.source for s in train}
    again = load_sft_data(cfg(dataset=[big, small], eval_split_ratio=0.25, max_eval_samples=5),
                          chatml_tokenizer, seed=3)
    assert [s.source for s in again[1]] == [s.source for s in evals]  # seeded

    train, _, _ = load_sft_data(cfg(dataset=[big, small], dataset_probs=[0.5, 0.5], max_samples=30),
                                chatml_tokenizer, seed=0)
    assert len(train) == 30
    from_small = Counter(s.source for s in train if "small.jsonl" in s.source)
    assert len(from_small) == 4 and sum(from_small.values()) > 8  # the small source is oversampled

    train, evals, _ = load_sft_data(cfg(dataset=[big], eval_dataset=[f"{small}"], max_samples=7,
                                        max_eval_samples=3), chatml_tokenizer, seed=0)
    assert [s.source for s in train] == [f"{big} row {i}" for i in range(1, 8)]
    assert len(evals) == 3 and all("small.jsonl" in s.source for s in evals)


# ---- mixing -------------------------------------------------------------------------------------

def test_mix_without_probs_concatenates():
    assert mix([[1, 2], [3], [4, 5]], None, seed=0, total=None) == [1, 2, 3, 4, 5]
    assert mix([[1, 2], [3], [4, 5]], None, seed=0, total=4) == [1, 2, 3, 4]


def test_mix_proportions_and_oversampling():
    a, b = list(range(100)), list(range(1000, 1010))
    out = mix([a, b], [3.0, 1.0], seed=7, total=4000)
    assert len(out) == 4000 and out == mix([a, b], [3.0, 1.0], seed=7, total=4000)
    assert out != mix([a, b], [3.0, 1.0], seed=8, total=4000)
    from_b = [x for x in out if x >= 1000]
    assert abs(len(from_b) / 4000 - 0.25) < 0.03              # binomial sd is 0.007
    # every pass over a source holds each of its items exactly once: the first in order, later reshuffled
    assert from_b[:10] == b
    passes = [from_b[i:i + 10] for i in range(0, len(from_b) - 9, 10)]
    assert all(sorted(p) == b for p in passes) and any(p != b for p in passes[1:])
    from_a = [x for x in out if x < 1000]
    assert from_a[:100] == a
    assert len(mix([a, b], [1, 1], seed=0, total=None)) == 110
    assert all(x < 1000 for x in mix([a, b], [1, 0], seed=0, total=50))


def test_mix_rejects_empty_source_with_probability():
    with pytest.raises(ValueError, match="source 1 is empty"):
        mix([[1], []], [0.5, 0.5], seed=0, total=3)


def test_load_sft_data_chat_rows_from_jsonl(tmp_path, chatml_tokenizer):
    # Arrow fills keys missing from some messages with None; they must not reach the template
    convo = [dict(CONVO[1], name="alice"), CONVO[2]]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": convo}, {"messages": CONVO}])
    train, _, bad = load_sft_data(cfg(dataset=[path], input_key="messages", output_key=None,
                                      apply_chat_template=True), chatml_tokenizer, seed=0)
    assert bad.total == 0 and len(train) == 2
    decode = chatml_tokenizer.decode
    assert decode([t for t, m in zip(train[0].input_ids, train[0].loss_mask) if m]) == "Hello!<|im_end|>"
