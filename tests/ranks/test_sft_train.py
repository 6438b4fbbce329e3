"""SFT trainer equivalences: gradient normalisation, N ranks vs 1, exact resume, and the saved outputs."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from _dist import grads_at_step, run_ranks

ROWS = [  # different lengths, so a per-micro-batch mean would differ from the step's token mean
    {"input": "1+1=", "output": "2"},
    {"input": "12+34=", "output": "46"},
    {"input": "what is seven plus eight? ", "output": "fifteen, written 15"},
    {"input": "99+1=", "output": "100"},
]


def _grads(model_dir: str, overrides: list[str]):
    from hpc_rlhf.config import SFTConfig, load_config
    from hpc_rlhf.data.batching import EpochSampler
    from hpc_rlhf.data.rows import BadRows
    from hpc_rlhf.data.sft import build_sft_samples
    from hpc_rlhf.distributed.env import read_env
    from hpc_rlhf.engines.deepspeed_strategy import build_engine
    from hpc_rlhf.models.loading import load_tokenizer
    from hpc_rlhf.trainers.objectives import OFFLINE_OBJECTIVES
    from hpc_rlhf.trainers.objectives.common import StepView
    from hpc_rlhf.trainers.offline import train_step

    cfg = load_config(SFTConfig, None, [f"pretrain={model_dir}", "dataset=mem", "param_dtype=fp32",
                                        "train_batch_size=4", "zero_stage=0", "max_norm=0", "max_len=64",
                                        *overrides])
    torch.manual_seed(0)
    de = read_env()
    tokenizer = load_tokenizer(model_dir)
    unit = OFFLINE_OBJECTIVES.get("sft")(cfg, de, torch.device("cpu"), tokenizer)
    samples = build_sft_samples(ROWS, "mem", tokenizer, cfg.data, BadRows("error"))
    step = [samples[i] for i in EpochSampler(len(samples), 4, 1, 0, 0).step_indices(0, 0)]
    engine = build_engine(unit.build_model(), cfg.train, cfg.train.learning_rate, "fp32", 1, de.world_size)
    grads = grads_at_step(engine)
    stats = train_step(engine, unit, StepView(step, de.rank, de.world_size))
    return grads, stats["loss"], stats["micro_batches"]


@pytest.mark.slow  # the default suite stays under 12 minutes (moved in issue 16)
def test_gradients_equal_over_ranks_accumulation_and_packing(tiny_dir):
    one_batch = run_ranks(_grads, 1, str(tiny_dir), ["micro_train_batch_size=4"])[0]
    accum4 = run_ranks(_grads, 1, str(tiny_dir), ["micro_train_batch_size=1"])[0]
    ranks2 = run_ranks(_grads, 2, str(tiny_dir), ["micro_train_batch_size=1"])
    packed = run_ranks(_grads, 1, str(tiny_dir), ["packing_samples=true", "micro_batch_tokens=64"])[0]
    assert (one_batch[2], accum4[2], ranks2[0][2]) == (1, 4, 2)
    ref, ref_loss = one_batch[0], one_batch[1]
    for name, (grads, loss) in {"1 rank x 4 accumulation": accum4[:2], "2 ranks x 2": ranks2[0][:2],
                                "packed": packed[:2]}.items():
        assert loss == pytest.approx(ref_loss, abs=1e-6), name
        for k, g in ref.items():
            torch.testing.assert_close(grads[k], g, atol=1e-6, rtol=1e-5, msg=lambda m: f"{name} {k}: {m}")
    # both ranks hold the same reduced gradient
    for k, g in ranks2[0][0].items():
        torch.testing.assert_close(ranks2[1][0][k], g, atol=0, rtol=0)


def _write_data(root: Path, n: int = 24) -> Path:
    path = root / "train.jsonl"
    with open(path, "w") as f:
        for i in range(n):
            a, b = 10 + 3 * i, 40 + 7 * i % 50
            f.write(json.dumps({"input": f"{a}+{b}=", "output": str(a + b)}) + "\n")
    return path


def _run_cli(config: dict, root: Path, nproc: int, *extra: str) -> list[dict]:
    cfg_file = root / f"cfg-{len(list(root.glob('cfg-*')))}.yaml"
    cfg_file.write_text(yaml.safe_dump(config))
    proc = subprocess.run([sys.executable, "-m", "hpc_rlhf.cli", "train", "sft", "--config", str(cfg_file),
                           f"launch.nproc={nproc}", *extra], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    save = Path(dict(a.split("=", 1) for a in extra if a.startswith("save_path=")).get(
        "save_path", config["ckpt"]["save_path"]))
    return [json.loads(x) for x in (save / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def sft_runs(tiny_dir, tmp_path_factory):
    """An uninterrupted 2-rank ZeRO-2 run (checkpoints every 2 steps) and the same on 1 rank."""
    root = tmp_path_factory.mktemp("sft")
    data = _write_data(root)
    config = {"model": {"pretrain": str(tiny_dir), "param_dtype": "fp32"},
              "data": {"dataset": [str(data)], "max_len": 32, "eval_split_ratio": 0.1},
              "train": {"train_batch_size": 8, "micro_train_batch_size": 2, "max_epochs": 2,
                        "learning_rate": 1e-2, "zero_stage": 2, "seed": 3},
              "ckpt": {"save_path": str(root / "full"), "ckpt_path": str(root / "full_ckpt"), "save_steps": 2},
              "log": {"logging_steps": 1, "eval_steps": 3, "progress_bar": "off"}}
    full = _run_cli(config, root, 2)
    single = _run_cli(config, root, 1, f"save_path={root / 'single'}", f"ckpt_path={root / 'single_ckpt'}")
    return root, config, full, single


def test_sft_outputs_and_learning(sft_runs):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    root, config, full, _ = sft_runs
    losses = [m["loss"] for m in full if "loss" in m]
    assert [m["step"] for m in full if "loss" in m] == list(range(1, 7))  # 22 rows / 8 per step -> 3 steps x 2 epochs
    assert losses[-1] < 0.7 * losses[0]
    assert any("eval_loss" in m for m in full)
    save = root / "full"
    assert (save / "model.safetensors").is_file() and (save / "hpc_rlhf_config.yaml").is_file()
    assert list((save / "tensorboard").glob("events.out.tfevents.*"))
    model = AutoModelForCausalLM.from_pretrained(save)
    tok = AutoTokenizer.from_pretrained(save)
    assert model(**tok(["1+2="], return_tensors="pt")).logits.shape[-1] == len(tok)
    ckpts = sorted(p.name for p in (root / "full_ckpt").iterdir())
    assert ckpts == ["global_step2", "global_step4"]
    assert all((root / "full_ckpt" / c / "COMMITTED").is_file() for c in ckpts)


def test_two_ranks_match_one_rank(sft_runs):
    _, _, full, single = sft_runs
    a = [m["loss"] for m in full if "loss" in m]
    b = [m["loss"] for m in single if "loss" in m]
    assert a == pytest.approx(b, abs=1e-5)


def test_resumed_run_logs_the_same_losses(sft_runs):
    root, config, full, _ = sft_runs
    ckpt = root / "resume_ckpt"
    ckpt.mkdir()
    shutil.copytree(root / "full_ckpt" / "global_step2", ckpt / "global_step2")  # stopped after step 2
    resumed = _run_cli(config, root, 2, f"save_path={root / 'resumed'}", f"ckpt_path={ckpt}",
                       "load_checkpoint=true")
    want = {m["step"]: m["loss"] for m in full if "loss" in m and m["step"] > 2}
    got = {m["step"]: m["loss"] for m in resumed if "loss" in m}
    assert sorted(got) == [3, 4, 5, 6]
    for step, loss in want.items():
        assert got[step] == pytest.approx(loss, abs=1e-6), step
