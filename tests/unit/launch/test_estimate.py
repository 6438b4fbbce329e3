"""`hpc-rlhf plan` at the seed's scale: Table 3's placements fit, the 7B row's memory equals the hand count, a
placement that cannot fit is refused with its numbers, the roofline's phases equal hand-derived values, the
calibration and the comparison with Table 5 are current, and `--auto` is quick."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import get_args, get_type_hints

import pytest

from hpc_rlhf.commands import load_config, placement_plan
from hpc_rlhf.config.gpus import GPUS, GpuSpec
from hpc_rlhf.config.rl import PlanConfig
from hpc_rlhf.launch import estimate
from hpc_rlhf.models.shape import ModelShape

ROOT = Path(__file__).resolve().parents[3]
SCALE = ROOT / "examples" / "scale"
sys.path.insert(0, str(ROOT / "benchmarks"))


def _setup(size: str, *overrides: str):
    cfg = load_config("train rl", str(SCALE / f"llama2-{size}-ppo.yaml"), list(overrides))
    return estimate.from_config(cfg, placement_plan("train rl", cfg))


@pytest.mark.parametrize("size,gpus", [("7b", 16), ("13b", 32), ("34b", 32), ("70b", 32)])
def test_each_table3_row_fits_its_80gb_gpus(size, gpus):
    models, layout, work, machine = _setup(size)
    assert layout.gpus == gpus
    fit = estimate.fits(models, layout, work, machine.gpu)
    assert [f.group for f in fit] == ["actor", "reference", "critic", "reward", "rollout"]
    assert all(f.fits for f in fit), [(f.group, f.per_gpu / 2 ** 30) for f in fit if not f.fits]


def test_the_7b_row_memory_equals_the_hand_count():
    models, layout, work, machine = _setup("7b")
    # LLaMA2-7B: h 4096, 32 layers, 32 heads = 32 kv heads of 128, MLP 11008, vocabulary 32000, untied head:
    #   per layer 4 h^2 (attention) + 3 h i (MLP) + 2 h (norms) = 67,108,864 + 135,266,304 + 8,192 = 202,383,360
    #   N = 32 x 202,383,360 + 2 x 32000 x 4096 (embedding, head) + 4096 (final norm) = 6,738,415,616
    n = 6_738_415_616
    assert models.actor.params == n
    fit = {f.group: f for f in estimate.fits(models, layout, work, machine.gpu)}
    runtime = 2 ** 29
    # actor, 4 GPUs, ZeRO-2, bf16, Adam offloaded, micro-batch 8 of 2048 tokens, checkpointing, 1024 logit rows:
    weights, grads = 2 * n, 2 * n // 4                               # 13,476,831,232 and 3,369,207,808
    act = 2 * 8 * 2048 * 4096 * 32 + 2 * (11 * 4096 + 3 * 4096 + 4 * 11008) * 8 * 2048  # 4,294,967,296 + 3,321,888,768
    logits = 3 * 4 * 8 * 1024 * 32000                                 # 3,145,728,000
    actor = weights + grads + act + logits + runtime                  # 28,145,494,016 (26.21 GiB)
    critic = weights + grads + act + runtime                          # 24,999,766,016 (23.28 GiB)
    frozen = weights + runtime                                        # 14,013,702,144 (ZeRO-2: not sharded)
    # engine: 0.9 x 81,920 MiB - weights - runtime, in 2 x 32 x 32 x 128 x 2 = 524,288 bytes a token: 120,726 tokens
    kv_tokens = (0.9 * 81920 * 2 ** 20 - weights - runtime) // 524_288
    for group, expected in (("actor", actor), ("critic", critic), ("reference", frozen), ("reward", frozen)):
        assert fit[group].per_gpu == pytest.approx(expected, rel=0.01), group
    assert fit["actor"].parts["optimizer (CPU)"] == pytest.approx(12 * n / 4, rel=0.01)  # fp32 master + 2 moments
    assert estimate.engine_capacity(models, layout, work, machine.gpu) == pytest.approx(kv_tokens, rel=0.01)
    assert fit["rollout"].parts["weights"] == weights


def _plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hpc_rlhf.cli", "plan", "rl", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)


@pytest.mark.parametrize("args,message", [
    ((str(SCALE / "llama2-7b-ppo.yaml"), "--gpus", "16"), "--gpus 16: give a positive count, with --auto"),
    ((str(ROOT / "examples" / "ppo.yaml"), "--estimate"), "--estimate and --auto need a `train rl` config with "
                                                           "plan.gpu set")])
def test_estimate_flags_without_what_they_need_stop_with_one_line(args, message):
    run = _plan("--config", *args)
    assert run.returncode == 2 and message in run.stderr and run.stderr.count("\n") == 1, run.stderr


def test_a_70b_actor_on_two_gpus_without_offload_is_refused_with_its_numbers():
    config = str(SCALE / "llama2-70b-ppo.yaml")
    run = _plan("--config", config, "placement.actor_num_ranks=2", "train.adam_offload=false")
    assert run.returncode == 2, run.stderr
    # ZeRO-3 on 2 GPUs: 2N/2 weights + 2N/2 gradients + 12N/2 Adam states = 8N = 551.8 GB = 513.9 GiB, plus
    # activations, logits and the runtime: 518.08 GiB
    assert "error: actor on 2 x a800-80g (80.00 GiB): needs 518.08 GiB per GPU" in run.stderr
    assert run.stderr.count("\n") == 1
    assert "actor        2 GPUs  518.08 GiB  DOES NOT FIT" in run.stdout
    ok = _plan("--config", config)
    assert ok.returncode == 0 and "DOES NOT FIT" not in ok.stdout


GPU = GpuSpec("test", memory_bytes=100 * 10 ** 9, bf16_flops=1e15, hbm_bytes_per_s=1e12, nvlink_bytes_per_s=400e9,
              pcie_bytes_per_s=50e9, network_bytes_per_s=25e9)
ONE = estimate.Calibration(matmul=1.0, hbm=1.0, train=1.0, link=1.0, layer_step_s=0.0)
SHAPE = ModelShape(params=10 ** 9, hidden=1000, layers=10, kv_heads=2, head_dim=50, vocab=1000)  # kv 4,000 B/token
WORK = estimate.Workload(prompts=8, samples=2, prompt_len=100, response_len=50, max_len=200, max_response=100,
                         micro_batch=2, train_batch=8, epochs=1, checkpointing=False, dtype="bf16", gpu_util=0.5,
                         engine_batch=4)
MODELS = estimate.Models(actor=SHAPE, critic=SHAPE, reference=SHAPE, reward=None)
LAYOUT = estimate.Layout(actor=2, critic=2, reference=1, reward=0, engines=2, tp=1, zero_stage=2, offload=False)
MACHINE = estimate.Machine(GPU, gpus_per_node=8)


def test_the_phases_of_a_small_case_equal_the_hand_derivation():
    est = estimate.estimate(MODELS, LAYOUT, WORK, MACHINE, ONE)
    # generation: 16 sequences on 2 engines, 8 each, 4 at once (engine_batch) in 2 waves of 50 decode steps.
    #   prefill 2 N x 8 x 100 / 1e15 = 1.6 ms; a decode step reads 2e9 weight bytes + 4 x (100 + 25) x 4,000 =
    #   2,002,000,000 bytes at 1e12 B/s = 2.002 ms (the 8e9 FLOPs take 8 us); 100 steps: 0.2002 s
    assert est["generation"] == pytest.approx(0.0016 + 0.2002)
    # weight sync: 2e9 bytes, the job (7 GPUs) fits a node: NVLink one way 200e9 B/s: 0.01 s
    assert est["weight sync"] == pytest.approx(0.01)
    # logits: 16 x 150 = 2,400 tokens; actor 2 N x 2,400 / (2 GPUs x 1e15) = 2.4 ms; the reference alone on 1 GPU:
    #   4.8 ms (the slowest group)
    assert est["logits and reward"] == pytest.approx(0.0048)
    # training: 6 N x 2,400 / 2e15 = 7.2 ms; ZeRO-2: 2 optimizer steps (16 / 8) each reduce-scattering
    #   2e9 x 1/2 bytes over 200e9 B/s = 5 ms: 17.2 ms
    assert est["training"] == pytest.approx(0.0072 + 0.01)
    assert est["total"] == pytest.approx(0.2018 + 0.01 + 0.0048 + 0.0172)
    # checkpointing: 8 N per token instead of 6; ZeRO-3 adds 3 gathers per micro-batch (16 / (2 x 2) = 4) and the
    #   sync's gather on the actor's 2 GPUs; Adam offloaded adds 2 x 2e9 / 2 bytes over PCIe (50e9) a step
    z3 = estimate.estimate(MODELS, replace(LAYOUT, zero_stage=3, offload=True), replace(WORK, checkpointing=True),
                           MACHINE, ONE)
    assert z3["training"] == pytest.approx(0.0096 + 3 * 4 * 0.005 + 2 * 0.005 + 2 * 0.04)
    assert z3["weight sync"] == pytest.approx(0.005 + 0.01)
    # a job of two nodes sends the weights over the network (25e9 B/s): 0.08 s
    assert estimate.estimate(MODELS, LAYOUT, WORK, replace(MACHINE, gpus_per_node=4), ONE)["weight sync"] \
        == pytest.approx(0.08)


def test_an_engine_whose_weights_fill_its_share_of_the_gpu_cannot_generate():
    small = replace(WORK, gpu_util=0.02)  # 2 GB: the weights alone
    assert estimate.generation_s(MODELS, LAYOUT, small, MACHINE, ONE) == float("inf")
    assert not [f for f in estimate.fits(MODELS, LAYOUT, small, GPU) if f.group == "rollout"][0].fits


def test_the_gpu_option_names_every_spec_and_only_them():
    assert set(get_args(get_type_hints(PlanConfig)["gpu"])) == {"none", *GPUS}


def test_the_calibration_is_the_records_own():
    from plan_calibration import calibration
    measured = calibration()
    assert estimate.CALIBRATION == estimate.Calibration(**{k: measured[k] for k in vars(estimate.CALIBRATION)})
    assert json.loads((ROOT / "docs" / "runs" / "plan" / "calibration.json").read_text()) == measured


def test_the_table5_comparison_record_is_current():
    from plan_vs_paper import PAPER, compare
    record = json.loads((ROOT / "docs" / "runs" / "plan" / "table5.json").read_text())
    assert record["rows"] == {s: compare(s) for s in PAPER}


def test_auto_chooses_a_fitting_placement_no_slower_than_the_seeds_in_under_10_s():
    for size, gpus in (("7b", 16), ("70b", 32)):
        t0 = time.monotonic()
        run = _plan("--config", str(SCALE / f"llama2-{size}-ppo.yaml"), "--estimate", "--auto", "--gpus", str(gpus))
        assert run.returncode == 0, run.stderr
        assert time.monotonic() - t0 < 10
        assert f"placement from throughput on {gpus} x a800-80g (config's placement | chosen):" in run.stdout
        models, layout, work, machine = _setup(size)
        chosen, est = estimate.search(gpus, models, work, machine)
        assert chosen.gpus == gpus and all(f.fits for f in estimate.fits(models, chosen, work, machine.gpu))
        assert est["total"] <= estimate.estimate(models, layout, work, machine)["total"]
        assert "overrides for the chosen one: " + " ".join(chosen.overrides()) in run.stdout
