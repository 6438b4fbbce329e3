"""SFT variants end to end through `hpc-rlhf train sft`: LoRA + lora-merge, QLoRA, ZeRO-3 with bf16 on
2 ranks, optimizer offload, activation checkpointing, token-budget packed micro-batches, chat data,
bad rows and offline hub names.

Every CLI run costs seconds of start-up, so each run is a module-scoped fixture shared by the tests
that read it; runs are tiny (hidden 32, 2 layers, 24 rows, 3 steps).
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

N_ROWS = 24  # 3 steps of 8


def _rows(n: int = N_ROWS) -> list[dict]:
    rows = []
    for i in range(n):
        a, b = 10 + 3 * i, 40 + 7 * i % 50
        rows.append({"input": f"{a}+{b}=", "output": str(a + b)})
    return rows


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _cli(args: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hpc_rlhf.cli", *args], capture_output=True, text=True,
                          timeout=300, env=None if env is None else {**os.environ, **env})


def _train(config: dict, root: Path, *extra: str, nproc: int = 1, env: dict | None = None):
    cfg_file = root / f"cfg-{len(list(root.glob('cfg-*')))}.yaml"
    cfg_file.write_text(yaml.safe_dump(config))
    return _cli(["train", "sft", "--config", str(cfg_file), f"launch.nproc={nproc}", *extra], env)


def _run(config: dict, root: Path, name: str, *extra: str, nproc: int = 1) -> tuple[Path, list[dict]]:
    """A run that must succeed; returns its save_path and the logged metrics."""
    save = root / name
    proc = _train(config, root, f"save_path={save}", f"ckpt_path={root / (name + '_ckpt')}", *extra, nproc=nproc)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return save, [json.loads(x) for x in (save / "metrics.jsonl").read_text().splitlines()]


def _losses(metrics: list[dict]) -> list[float]:
    return [m["loss"] for m in metrics if "loss" in m]


@pytest.fixture(scope="module")
def base(tiny_dir, tmp_path_factory):
    """(root, config) shared by the runs: ZeRO-2, fp32, 24 rows, 3 steps of 8 samples in micro-batches of 2."""
    root = tmp_path_factory.mktemp("variants")
    data = _write_jsonl(root / "train.jsonl", _rows())
    config = {"model": {"pretrain": str(tiny_dir), "param_dtype": "fp32"},
              "data": {"dataset": [str(data)], "max_len": 32},
              "train": {"train_batch_size": 8, "micro_train_batch_size": 2, "max_steps": 3,
                        "learning_rate": 1e-2, "zero_stage": 2, "seed": 3},
              "ckpt": {"save_path": str(root / "unused"), "ckpt_path": str(root / "unused_ckpt")},
              "log": {"logging_steps": 1, "progress_bar": "off", "use_tensorboard": False}}
    return root, config


@pytest.fixture(scope="module")
def reference_run(base):
    """The plain run the equivalence tests compare with: 1 rank, padded fixed micro-batches of 2."""
    root, config = base
    return _run(config, root, "reference")[1]


# --- LoRA ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def lora_run(base):
    root, config = base
    save, metrics = _run(config, root, "lora", "lora_rank=8", "zero_stage=2")
    merged = root / "lora_merged"
    proc = _cli(["lora-merge", str(save), str(merged)])
    assert proc.returncode == 0, proc.stderr[-4000:]
    return save, merged, metrics


def test_lora_saves_a_trained_adapter(lora_run, tiny_dir):
    save, _, metrics = lora_run
    assert (save / "adapter_config.json").is_file() and not (save / "model.safetensors").exists()
    adapter_cfg = json.loads((save / "adapter_config.json").read_text())
    assert adapter_cfg["peft_type"] == "LORA" and adapter_cfg["r"] == 8
    assert adapter_cfg["base_model_name_or_path"] == str(tiny_dir)
    weights = load_file(save / "adapter_model.safetensors")
    lora_b = {k: v for k, v in weights.items() if "lora_B" in k}
    assert len(lora_b) == 2 * 7  # every linear layer of both decoder layers (not the head)
    # lora_B starts at zero: non-zero everywhere means every adapter was trained
    assert all(v.abs().max() > 0 for v in lora_b.values())
    losses = _losses(metrics)
    assert len(losses) == 3 and losses[-1] < losses[0]


def test_lora_merge_gives_the_peft_model(lora_run, tiny_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer
    save, merged, _ = lora_run
    ids = AutoTokenizer.from_pretrained(merged)(["12+34=46", "17+28=45"], return_tensors="pt").input_ids
    base_model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    with torch.no_grad():
        base_logits = base_model(input_ids=ids).logits
        peft_logits = PeftModel.from_pretrained(base_model, str(save)).eval()(input_ids=ids).logits
        merged_logits = AutoModelForCausalLM.from_pretrained(merged).eval()(input_ids=ids).logits
    torch.testing.assert_close(merged_logits, peft_logits, atol=1e-5, rtol=0)
    assert (merged_logits - base_logits).abs().max() > 1e-3  # the adapter changed the model


# --- QLoRA --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def qlora_run(base):
    """4-bit base + LoRA on ZeRO-2 (all stages run on CPU), evaluated after every step."""
    root, config = base
    return _run(config, root, "qlora", "lora_rank=8", "load_in_4bit=true", "zero_stage=2",
                "eval_split_ratio=0.2", "eval_steps=1")


def test_qlora_trains_through_deepspeed(qlora_run):
    save, metrics = qlora_run
    steps = [m for m in metrics if "loss" in m]
    assert len(steps) == 3 and all("eval_loss" in m for m in steps)
    assert all(torch.isfinite(torch.tensor([m["loss"], m["grad_norm"], m["eval_loss"]])).all() for m in steps)
    assert steps[-1]["loss"] < steps[0]["loss"]
    weights = load_file(save / "adapter_model.safetensors")
    assert all(v.abs().max() > 0 for k, v in weights.items() if "lora_B" in k)


def _qlora_grads(model, ids) -> dict[str, torch.Tensor]:
    model.zero_grad()
    model(input_ids=ids).logits.float().logsumexp(-1).mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def test_qlora_evaluation_keeps_gradients(tiny_dir):
    """bitsandbytes may repack 4-bit weights for an inference kernel (no autograd) on an eval pass."""
    from hpc_rlhf.config.sections import ModelConfig
    from hpc_rlhf.models.loading import load_causal_lm
    model = load_causal_lm(ModelConfig(pretrain=str(tiny_dir), param_dtype="fp32", lora_rank=4, load_in_4bit=True))
    ids = torch.tensor([[3, 50, 60, 70, 80, 90, 100, 7]])
    before = _qlora_grads(model, ids)
    model.eval()
    with torch.no_grad():
        model(input_ids=ids)
    model.train()
    after = _qlora_grads(model, ids)
    for name, g in before.items():
        torch.testing.assert_close(after[name], g, atol=1e-6, rtol=1e-5, msg=lambda m: f"{name}: {m}")


# --- ZeRO-3 with bf16 parameters on 2 ranks -----------------------------------------------------------

@pytest.fixture(scope="module")
def zero3_run(base):
    root, config = base
    return _run(config, root, "zero3", "zero_stage=3", "param_dtype=bf16", nproc=2)


def test_zero3_bf16_two_ranks_exports_full_weights(zero3_run, tiny_dir):
    from transformers import AutoModelForCausalLM
    save, metrics = zero3_run
    losses = _losses(metrics)
    assert len(losses) == 3 and losses[-1] < losses[0] - 0.2
    initial = load_file(Path(tiny_dir) / "model.safetensors")
    saved = load_file(save / "model.safetensors")
    assert sorted(saved) == sorted(initial)
    for name, w in saved.items():
        assert w.dtype == torch.bfloat16 and w.shape == initial[name].shape and w.numel() > 0, name
        assert torch.isfinite(w.float()).all(), name
        # trained: further from the initial weights than bf16 rounding
        assert (w.float() - initial[name].to(torch.bfloat16).float()).abs().max() > 1e-3, name
    model = AutoModelForCausalLM.from_pretrained(save)
    assert model.dtype == torch.bfloat16
    for name, p in model.state_dict().items():
        torch.testing.assert_close(p, saved[name], atol=0, rtol=0)


def _first_updates(model_dir: str) -> dict[int, float]:
    """Mean |change| / lr of one weight matrix after one bf16 optimizer step, per ZeRO stage."""
    from hpc_rlhf.config import SFTConfig, load_config
    from hpc_rlhf.engines.deepspeed_strategy import build_engine
    from hpc_rlhf.models.loading import load_causal_lm
    out = {}
    for stage in (0, 2):
        cfg = load_config(SFTConfig, None, [f"pretrain={model_dir}", "dataset=mem", "param_dtype=bf16",
                                            f"zero_stage={stage}", "learning_rate=1e-2", "lr_warmup_ratio=0",
                                            "lr_scheduler=constant_with_warmup", "train_batch_size=1"])
        engine = build_engine(load_causal_lm(cfg.model), cfg.train, cfg.train.learning_rate, "bf16", 4, 1)
        weight = engine.module.model.layers[0].mlp.up_proj.weight
        before = weight.detach().float().clone()
        loss = engine(input_ids=torch.tensor([[3, 50, 60, 70, 80, 90]])).logits.float().logsumexp(-1).mean()
        engine.backward(loss, scale_wrt_gas=False)
        engine.step()
        out[stage] = ((weight.detach().float() - before).abs().mean() / 1e-2).item()
    return out


def test_zero0_bf16_first_update_is_adams(tiny_dir):
    """ZeRO-0 with bf16 runs DeepSpeed's unfused bf16 wrapper, which steps Adam once on zero gradients
    to allocate its states; uncorrected, Adam's bias correction made the first updates ~27% smaller."""
    from _dist import run_ranks
    updates = run_ranks(_first_updates, 1, str(tiny_dir))[0]
    assert updates[2] == pytest.approx(1.0, abs=0.02)  # Adam's first step moves every weight by ~lr
    assert updates[0] == pytest.approx(updates[2], rel=0.02)


# --- optimizer offload, activation checkpointing, token-budget packing: same losses ---------------------

def test_adam_offload_matches(base, reference_run):
    root, config = base
    _, metrics = _run(config, root, "offload", "adam_offload=true", "zero_stage=2")
    assert len(_losses(metrics)) == 3
    assert _losses(metrics) == pytest.approx(_losses(reference_run), abs=1e-5)


def test_gradient_checkpointing_matches(base, reference_run):
    root, config = base
    _, metrics = _run(config, root, "checkpointing", "gradient_checkpointing=true")
    assert _losses(metrics) == pytest.approx(_losses(reference_run), abs=1e-5)


def test_gradient_checkpointing_recomputes(tiny_dir):
    """The loaded model is in training mode, so transformers really checkpoints (recomputes in backward)."""
    from hpc_rlhf.config.sections import ModelConfig
    from hpc_rlhf.models.loading import load_causal_lm
    counts = {}
    for on in (False, True):
        model = load_causal_lm(ModelConfig(pretrain=str(tiny_dir), param_dtype="fp32", gradient_checkpointing=on))
        assert model.training
        act = model.model.layers[0].mlp.act_fn
        calls = []
        forward = act.forward
        act.forward = lambda x: (calls.append(1), forward(x))[1]
        model(input_ids=torch.tensor([[3, 4, 5, 6]])).logits.sum().backward()
        counts[on] = len(calls)
    assert counts == {False: 1, True: 2}


def test_token_budget_packed_two_ranks_matches_padded(base, reference_run):
    root, config = base
    _, metrics = _run(config, root, "packed", "packing_samples=true", "micro_batch_tokens=32", nproc=2)
    assert _losses(metrics) == pytest.approx(_losses(reference_run), abs=1e-5)
    assert [m["tokens"] for m in metrics if "loss" in m] == [m["tokens"] for m in reference_run if "loss" in m]


# --- chat data, with bad rows ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def chat_data(base):
    """Two-turn conversations; row 3 has no messages, row 7 is longer than max_len."""
    root, _ = base
    rows = []
    for i in range(N_ROWS + 2):
        a, b = 10 + 3 * i, 4 + i % 10  # every answer has two digits
        rows.append({"messages": [{"role": "user", "content": f"{a}+{b}"},
                                  {"role": "assistant", "content": str(a + b)},
                                  {"role": "user", "content": "+1"},
                                  {"role": "assistant", "content": str(a + b + 1)}]})
    rows[2] = {"conversation": rows[2]["messages"]}
    rows[6]["messages"][0]["content"] = "1+" * 20 + "1"
    return _write_jsonl(root / "chat.jsonl", rows)


@pytest.fixture(scope="module")
def chat_run(base, chat_data):
    root, config = base
    save = root / "chat"
    proc = _train(config, root, f"dataset={chat_data}", "apply_chat_template=true", "input_key=messages",
                  "output_key=null", "max_len=64", "bad_rows=skip", f"save_path={save}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(x) for x in (save / "metrics.jsonl").read_text().splitlines()], proc.stderr


def test_multi_turn_chat_data_trains(chat_run):
    metrics, _ = chat_run
    steps = [m for m in metrics if "loss" in m]
    assert len(steps) == 3 and steps[-1]["loss"] < steps[0]["loss"]
    # loss on both assistant turns only: 2 digits + <|im_end|>, twice, for each of the 8 samples of a step
    assert [m["tokens"] for m in steps] == [8 * 2 * 3] * 3


def test_bad_rows_skip_reports_counts_and_rows(chat_run, chat_data):
    _, stderr = chat_run
    assert "skipped 2 bad rows" in stderr and f"{N_ROWS} training samples" in stderr
    assert f"missing_key: 1 row skipped, e.g. {chat_data} row 3: missing key 'messages'" in stderr
    assert f"too_long: 1 row skipped, e.g. {chat_data} row 7: " in stderr


def test_bad_rows_error_names_file_and_row(base, chat_data):
    root, config = base
    proc = _train(config, root, f"dataset={chat_data}", "apply_chat_template=true", "input_key=messages",
                  "output_key=null", "max_len=64", "bad_rows=error", f"save_path={root / 'bad_error'}")
    assert proc.returncode == 2
    assert f"hpc-rlhf: {chat_data} row 3: missing key 'messages'" in proc.stderr
    assert "Traceback" not in proc.stderr
    # nothing is written but the attempt record (hpc-rlhf status), which ends with the error
    out = root / "bad_error"
    assert sorted(p.name for p in out.iterdir()) == ["attempts.jsonl"]
    end = json.loads((out / "attempts.jsonl").read_text().splitlines()[-1])
    assert end["event"] == "end" and end["reason"] == "error" and "row 3" in end["error"], end


@pytest.mark.parametrize("override, needle", [
    ("pretrain=some-org/some-model", "config error: model.pretrain: some-org/some-model is not a local folder, "
                                     "and HF_HUB_OFFLINE is set"),
    ("dataset=some-org/some-data", "config error: data.dataset: some-org/some-data is not a local file or folder, "
                                   "and HF_HUB_OFFLINE is set"),
], ids=["pretrain", "dataset"])
def test_offline_hub_name_exits_2(base, override, needle):
    root, config = base
    proc = _train(config, root, override, env={"HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 2, proc.stderr[-4000:]
    assert f"hpc-rlhf: {needle}" in proc.stderr and "Traceback" not in proc.stderr



def _grad_norms(model_dir: str) -> dict:
    """(optimizer_step's norm, the norm of the gradients before the step) per (dtype, ZeRO stage)."""
    from hpc_rlhf.config import SFTConfig, load_config
    from hpc_rlhf.engines.deepspeed_strategy import build_engine, optimizer_step
    from hpc_rlhf.models.loading import load_causal_lm
    out = {}
    for dtype, stage in (("fp32", 0), ("fp32", 2), ("bf16", 0)):
        cfg = load_config(SFTConfig, None, [f"pretrain={model_dir}", "dataset=mem", f"param_dtype={dtype}",
                                            f"zero_stage={stage}", "max_norm=1e-3", "train_batch_size=1"])
        engine = build_engine(load_causal_lm(cfg.model), cfg.train, cfg.train.learning_rate, dtype, 4, 1)
        loss = engine(input_ids=torch.tensor([[3, 50, 60, 70, 80, 90]])).logits.float().logsumexp(-1).mean()
        engine.backward(loss, scale_wrt_gas=False)
        grads = [p.grad.float().norm() for p in engine.module.parameters() if p.grad is not None]
        out[(dtype, stage)] = (optimizer_step(engine), float(torch.stack(grads).norm()) if grads else None)
    return out


def test_grad_norm_is_reported_before_clipping(tiny_dir):
    """optimizer_step gives the gradient norm before clipping for every stage and dtype; DeepSpeed reports
    none for ZeRO-0 in fp32 (the metric used to be NaN there)."""
    from _dist import run_ranks
    norms = run_ranks(_grad_norms, 1, str(tiny_dir))[0]
    for (dtype, stage), (norm, _) in norms.items():
        assert math.isfinite(norm) and norm > 1e-3, (dtype, stage, norm)  # > max_norm: before clipping
    fp32_0, expected = norms[("fp32", 0)]
    assert fp32_0 == pytest.approx(expected, rel=1e-4)
    assert norms[("fp32", 2)][0] == pytest.approx(fp32_0, rel=1e-3)  # DeepSpeed's own figure agrees
