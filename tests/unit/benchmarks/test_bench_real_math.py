"""The pure functions of benchmarks/grpo_real_vs_trl.py and benchmarks/machine_limits.py, hand-derived values."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[3] / "benchmarks"
sys.path.insert(0, str(BENCH))

import grpo_real_vs_trl as bench  # noqa: E402
import machine_limits as ml  # noqa: E402


def test_decode_limit_weight_read_binds():
    # 100 tokens at batch 8: ceil(100/8) = 13 decode steps x 1000 bytes at 2 x 50 B/s = 130 s;
    # matmul: 2 x 10 params x (100 + 28) tokens / 100 FLOP/s = 25.6 s
    out = ml.decode_limit_s(100, 28, 8, 1000, 10, 100, 50)
    assert out == pytest.approx({"weight_read_s": 130.0, "matmul_s": 25.6, "limit_s": 130.0, "binds": "weight_read"})


def test_decode_limit_matmul_binds():
    # the same at 1 FLOP/s: matmul 2560 s > read 130 s
    out = ml.decode_limit_s(100, 28, 8, 1000, 10, 1, 50)
    assert out["limit_s"] == pytest.approx(2560.0) and out["binds"] == "matmul"
    # exactly one decode step when the tokens fill one batch: 8 tokens at batch 8 -> 1 x 1000 / 100 = 10 s
    assert ml.decode_limit_s(8, 0, 8, 1000, 10, 100, 50)["weight_read_s"] == pytest.approx(10.0)


def test_decode_limit_bad_input():
    with pytest.raises(ValueError, match="batch must be >= 1"):
        ml.decode_limit_s(10, 0, 0, 1, 1, 1, 1)
    with pytest.raises(ValueError, match="must be > 0"):
        ml.decode_limit_s(10, 0, 1, 1, 1, 0, 1)


def test_train_and_sync_fractions():
    # 6 x 10 params x 5 tokens = 300 FLOP: 3 s at 100 FLOP/s, took 2 s -> 1.5
    assert ml.train_fraction(10, 5, 2, 100) == pytest.approx(1.5)
    assert ml.train_fraction(10, 5, 0, 100) is None
    # 400 bytes at 400 B/s = 1 s, took 2 s -> 0.5
    assert ml.sync_fraction(400, 2, 400) == pytest.approx(0.5)
    assert ml.sync_fraction(400, 0.0, 400) is None
    assert ml.fraction(3, 4) == pytest.approx(0.75)


def test_trl_phase_split():
    assert bench.trl_phase_split(10, 4, 3) == pytest.approx(
        {"generation": 3, "weight sync": 0, "log-probs and reward": 1, "training": 6, "other": 0})
    # a generate timer above the collect timer is capped at it; a step shorter than the collect trains 0 s
    assert bench.trl_phase_split(1, 2, 3) == pytest.approx(
        {"generation": 2, "weight sync": 0, "log-probs and reward": 0, "training": 0, "other": 0})


def test_timed_steps():
    assert bench.timed_steps([1, 2, 3, 4], 1, drop_last=False) == [2, 3, 4]
    assert bench.timed_steps([1, 2, 3, 4], 1, drop_last=True) == [2, 3]
    with pytest.raises(SystemExit, match="no timed step"):
        bench.timed_steps([1, 2], 1, drop_last=True)


def test_phase_means_medians_shares():
    a = {"generation": 1, "weight sync": 0, "log-probs and reward": 2, "training": 3, "other": 0}
    b = {"generation": 3, "training": 5}  # missing phases count as 0
    assert bench.mean_phases([a, b]) == pytest.approx(
        {"generation": 2, "weight sync": 0, "log-probs and reward": 1, "training": 4, "other": 0})
    c = {"generation": 10, "training": 1, "other": 7}
    assert bench.median_phases([a, b, c]) == pytest.approx(
        {"generation": 3, "weight sync": 0, "log-probs and reward": 0, "training": 3, "other": 0})
    assert bench.shares({"generation": 1, "training": 3}) == pytest.approx({"generation": 0.25, "training": 0.75})
    assert bench.shares({"generation": 0.0}) == {}


def work(generated, prefilled, trained):
    return {"tokens_generated": generated, "prompt_tokens_prefilled": prefilled, "positions_trained": trained}


def test_round_summary():
    ph = {"generation": 2, "weight sync": 0, "log-probs and reward": 1, "training": 4, "other": 1}
    recs = [{"step_s": 20, "phases": ph, "rollout_generate_s": 9, **work(10, 99, 99), "reward_mean": 0.0,
             "response_length_mean": 5},
            {"step_s": 8, "phases": ph, "rollout_generate_s": 2, **work(40, 12, 52), "reward_mean": 0.5,
             "response_length_mean": 20, "weight_sync_s": 0.5},
            {"step_s": 12, "phases": ph, "rollout_generate_s": 3, **work(60, 20, 80), "reward_mean": 1.0,
             "response_length_mean": 30, "weight_sync_s": 1.5}]
    out = bench.round_summary(recs, warmup=1, drop_last=False)
    # timed: steps 2 and 3; reward and length over all three
    assert out["s_per_step"] == pytest.approx(10)
    assert out["tokens_generated"] == pytest.approx(50)
    assert out["prompt_tokens_prefilled"] == pytest.approx(16)  # (12 + 20) / 2, the counters' own
    assert out["positions_trained"] == pytest.approx(66)
    assert out["tokens_generated_per_s"] == pytest.approx(5)
    assert out["generation_tokens_per_s"] == pytest.approx(50 / 2.5)
    assert out["weight_sync_s"] == pytest.approx(1.0)
    assert out["reward_mean"] == pytest.approx(0.5)
    assert out["response_length_mean"] == pytest.approx(55 / 3)


def test_work_of_each_side_from_its_own_counters():
    row = {"rollout/tokens_generated": 300.0, "rollout/prompt_tokens_prefilled": 40.0,
           "actor/positions_trained": 340.0, "response_length/mean": 999.0}
    assert bench.ours_work(row) == work(300.0, 40.0, 340.0)
    # TRL: generate prefills every sample's prompt (8 copies of a 5-token prompt: 40) and trains prompt + completion
    assert bench.trl_work(300, 40) == work(300, 40, 340)


def test_equal_work_ratio_and_its_note():
    # 98 tokens against 100: within 2%; 97: outside, with the reason
    assert bench.equal_work({"tokens_generated": 98.0}, {"tokens_generated": 100.0}) == {
        "tokens_ratio": pytest.approx(0.98), "tokens_within_2pct": True}
    off = bench.equal_work({"tokens_generated": 103.0}, {"tokens_generated": 100.0})
    assert off["tokens_ratio"] == pytest.approx(1.03) and off["tokens_within_2pct"] is False
    assert "speedup_per_token" in off["tokens_note"]
    assert bench.equal_work({"tokens_generated": 5.0}, {"tokens_generated": 0.0})["tokens_ratio"] is None


def test_fractions_of_a_side():
    side = {**work(100, 28, 128), "rollout_generate_s": 260, "phases": {"training": 153.6}, "weight_sync_s": 40}
    info = {"weight_bytes": 1000, "matmul_params": 10}
    limits = {"matmul_flops_fp32": 100, "copy_bytes_per_s": 50}
    f = bench.fractions(side, info, limits, batch=8, between_ranks=True)
    # decode: limit 130 s (weight read, above) / 260 s; train: 6 x 10 x 128 positions / 100 = 76.8 s / 153.6 s;
    # sync: 1000 B / 50 B/s = 20 s / 40 s
    assert f["decode_vs_limit"] == pytest.approx(0.5) and f["decode_limit_binds"] == "weight_read"
    assert f["train_vs_peak_fp32"] == pytest.approx(0.5)
    assert f["weight_sync_vs_copy"] == pytest.approx(0.5)
    # bf16: against the bf16 peak (400 FLOP/s): matmul 2 x 10 x 128 / 400 = 6.4 s < read 130 s still binds;
    # train 76.8 x 100 / 400 = 19.2 s / 153.6 s = 0.125, under the dtype's own key
    limits["matmul_flops_bf16"] = 400
    f = bench.fractions(side, info, limits, batch=8, between_ranks=True, dtype="bf16")
    assert f["train_vs_peak_bf16"] == pytest.approx(0.125) and "train_vs_peak_fp32" not in f
    assert f["decode_vs_limit"] == pytest.approx(0.5)
    assert bench.targets({"sides": {"s": {"fractions": f}}})["s"]["train_ge_half_peak"] is False


def test_fractions_credit_only_the_work_counted():
    """The same step times with fewer positions trained and prompt tokens prefilled (a prompt run once for its
    samples) give lower fractions: nothing is credited that the counters did not see.  Matmul-bound decode at
    1 FLOP/s: 2 x 10 x (100 + 28) = 2560 s of limit against 5120 s measured = 0.5; with 4 prompt tokens prefilled
    instead of 28, 2 x 10 x 104 = 2080 s = 0.40625.  Training 6 x 10 x 128 / 1 = 7680 s against 15360 s = 0.5;
    with 104 positions 6240 s = 0.40625."""
    limits = {"matmul_flops_fp32": 1, "copy_bytes_per_s": 50}
    info = {"weight_bytes": 1000, "matmul_params": 10}
    full = {**work(100, 28, 128), "rollout_generate_s": 5120, "phases": {"training": 15360}, "weight_sync_s": 0}
    once = full | work(100, 4, 104)
    f, g = (bench.fractions(s, info, limits, batch=8, between_ranks=False) for s in (full, once))
    assert f["decode_vs_limit"] == pytest.approx(0.5) and g["decode_vs_limit"] == pytest.approx(0.40625)
    assert f["train_vs_peak_fp32"] == pytest.approx(0.5) and g["train_vs_peak_fp32"] == pytest.approx(0.40625)


def test_memory_ratio_and_summary():
    assert bench.memory_ratio(120, 100) == pytest.approx(1.2)
    assert bench.memory_ratio(120, 0) is None
    plan = {"0": {"roles": ["actor", "reward"], "planned_bytes": 100}, "1": {"roles": ["rollout"], "planned_bytes": 50}}
    out = bench.memory_summary([{"main": 10, "0": 90, "1": 40}, {"main": 12, "0": 110, "1": 30}], plan)
    # the max over rounds per rank; "main" of a multi-rank run is the launcher
    assert out["rank 0"]["measured_over_plan"] == pytest.approx(1.1)
    assert out["rank 1"]["measured_over_plan"] == pytest.approx(0.8)
    assert out["main"] == {"peak_rss_bytes": 12, "roles": ["launcher"]}
    # a single-rank run has no RANK in its environment: its "main" process is rank 0
    single = bench.memory_summary([{"main": 150}], {"0": {"roles": ["actor"], "planned_bytes": 100}})
    assert single["rank 0"]["measured_over_plan"] == pytest.approx(1.5)


def test_proc_parsers():
    assert bench.parse_ppid("123 (odd ) name) S 45 123 123 0 -1") == 45
    assert bench.parse_hwm_bytes("VmPeak:\t   10 kB\nVmHWM:\t    2048 kB\nVmRSS:\t 1 kB\n") == 2048 * 1024
    assert bench.parse_hwm_bytes("Name:\tzombie\n") == 0
    with pytest.raises(ValueError, match="unexpected unit"):
        bench.parse_hwm_bytes("VmHWM:\t 2 MB\n")


def test_targets():
    def side(speed, dec, train, sync=None, between=False, ratios=()):
        return {"speedup": speed, "fractions": {"decode_vs_limit": dec, "train_vs_peak_fp32": train,
                                                "weight_sync_vs_copy": sync, "weight_sync_between_ranks": between},
                "memory": {f"rank {i}": {"measured_over_plan": r} for i, r in enumerate(ratios)}}
    result = {"sides": {"trl": side(1.0, 0.2, 0.1), "hpc_rlhf": side(1.6, 0.5, 0.49, ratios=(1.2,)),
                        "hpc_rlhf_async": side(3.2, None, 0.6, sync=0.4, between=True, ratios=(0.7, 1.0))}}
    t = bench.targets(result)
    assert t["best_side"] == "hpc_rlhf_async" and t["best_speedup_ge_3.1"] is True
    assert t["on_policy_speedup_ge_1.5"] is True
    assert t["hpc_rlhf"] == {"decode_within_2x": True, "train_ge_half_peak": False, "memory_within_20pct": True}
    assert t["hpc_rlhf_async"] == {"decode_within_2x": None, "train_ge_half_peak": True,
                                   "weight_sync_ge_half_copy": False, "memory_within_20pct": False}


def test_a_cut_off_run_is_rebuilt_from_its_kept_rounds(tmp_path, monkeypatch):
    """--from-keep: the rounds that ended (TRL 2, hpc_rlhf 1, async none) give medians, speed-ups over the rounds
    both sides ran, each side's stop tokens (TRL's from its records) and where it was rebuilt from; a side without
    a round is left out, not reported as 0."""
    import json
    monkeypatch.setattr(bench, "hpc_stop_tokens", lambda model: [2, 7])

    def summary(step_s):
        return {"s_per_step": step_s, "phases": {"generation": step_s - 1, "training": 1.0},
                **work(100.0, 28.0, 128.0), "tokens_generated_per_s": 100 / step_s,
                "generation_tokens_per_s": None, "rollout_generate_s": step_s - 1, "weight_sync_s": 0.0,
                "reward_mean": 0.0, "response_length_mean": 12.0}
    rows = [("trl", 0, 12.0), ("hpc_rlhf", 0, 2.0), ("trl", 1, 8.0)]
    (tmp_path / "rounds.jsonl").write_text("".join(
        json.dumps({"side": s, "round": r, "summary": summary(t), "peak_rss_bytes": {"main": 5},
                    "records": [{"stop_token_ids": [2]}] if s == "trl" else []}) + "\n" for s, r, t in rows))
    (tmp_path / "limits.json").write_text(json.dumps({"matmul_flops_bf16": 400.0, "matmul_flops_fp32": 100.0,
                                                      "copy_bytes_per_s": 50.0}))
    args = bench.parse_args(["--sides", "trl,hpc_rlhf,hpc_rlhf_async", "--dtype", "bf16", "--steps", "4",
                             "--warmup", "1", "--from-keep", str(tmp_path)])
    info = {"params": 10, "matmul_params": 10, "tied_embeddings": True, "weight_bytes": 20}
    got = bench.from_keep(args, tmp_path, args.sides, "m", tmp_path / "d.jsonl", [20, 36], info, {})
    assert list(got["sides"]) == ["trl", "hpc_rlhf"]
    assert got["config"]["rounds_run"] == {"trl": 2, "hpc_rlhf": 1, "hpc_rlhf_async": 0}
    assert got["config"]["prompt_tokens_mean"] == 28 and got["config"]["prompt_max_len"] == 36
    assert got["sides"]["trl"]["s_per_step"] == pytest.approx(10.0)  # median of 12 and 8
    assert got["sides"]["hpc_rlhf"]["speedup"] == pytest.approx(5.0)
    assert got["sides"]["hpc_rlhf"]["speedup_per_round"] == [pytest.approx(6.0)]  # round 1 only: 12 / 2
    assert got["targets"]["best_side"] == "hpc_rlhf" and got["targets"]["best_speedup_ge_3.1"] is True
    assert got["rebuilt_from"] == str(tmp_path) and "stopped" not in got
    assert got["config"]["stop_token_ids"] == {"trl": [2], "hpc_rlhf": [2, 7], "hpc_rlhf_async": [2, 7]}
    (tmp_path / "rounds.jsonl").write_text(json.dumps({"side": "odd", "round": 0, "summary": summary(1.0),
                                                       "records": [], "peak_rss_bytes": {}}) + "\n")
    with pytest.raises(SystemExit, match="line 1: side 'odd'"):
        bench.from_keep(args, tmp_path, args.sides, "m", tmp_path / "d.jsonl", [20, 36], info, {})
    (tmp_path / "limits.json").unlink()
    with pytest.raises(SystemExit, match="limits.json is missing"):
        bench.from_keep(args, tmp_path, args.sides, "m", tmp_path / "d.jsonl", [20, 36], info, {})


def test_model_shapes_weights_and_step_rate():
    import model_shapes as ms

    from hpc_rlhf.models.shape import ModelShape
    cfg = ModelShape(params=0, hidden=8, layers=3, kv_heads=2, head_dim=2, vocab=50, intermediate=20)
    # head dim 2, so key and value are 2 heads x 2 = 4 wide; packed: qkv 8 + 2 x 4 = 16, gate_up 2 x 20
    assert ms.layer_weights(cfg) == {"q": (8, 8), "k": (8, 4), "v": (8, 4), "o": (8, 8), "gate": (8, 20),
                                     "up": (8, 20), "down": (20, 8), "head": (8, 50)}
    assert ms.packed_weights(cfg) == {"qkv": (8, 16), "o": (8, 8), "gate_up": (8, 40), "down": (20, 8),
                                      "head": (8, 50)}
    # 3 layers of a (100 FLOPs at 10 FLOP/s: 10 s) and one head (600 FLOPs at 20 FLOP/s: 30 s):
    # (300 + 600) FLOPs / (30 + 30) s = 15 FLOP/s
    per = {"a": {"flops": 100, "flop_s": 10.0}, "head.fwd": {"flops": 600, "flop_s": 20.0}}
    assert ms.step_rate(per, 3) == pytest.approx(15.0)


def test_rounds_label():
    assert bench.rounds_label({"rounds": 3}) == "3 round(s)"
    assert bench.rounds_label({"rounds": 3, "rounds_run": {"trl": 3, "hpc_rlhf": 3}}) == "3 round(s)"
    # stopped in round 3: both sides hold 2 of the 3 planned; a side that ran none is left out
    assert bench.rounds_label({"rounds": 3, "rounds_run": {"trl": 2, "hpc_rlhf": 2, "x": 0}}) == "2 of 3 rounds"
    assert bench.rounds_label({"rounds": 3, "rounds_run": {"trl": 2, "hpc_rlhf": 1}}) == "1-2 of 3 rounds"


def test_profile_generation_groups():
    import profile_generation as pg
    assert pg.group_of("aten::mm") == "matmul" and pg.group_of("aten::addmm") == "matmul"
    assert pg.group_of("mkldnn::_linear_pointwise") == "matmul"  # the lean decoder's products on the CPU
    assert pg.group_of("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention"
    assert pg.group_of("aten::uniform_") == "sampling" and pg.group_of("aten::argmax") == "sampling"
    assert pg.group_of("aten::cumsum") == "sampling" and pg.group_of("aten::searchsorted") == "sampling"
    assert pg.group_of("aten::matmul") == "other"  # the dispatcher above aten::mm: its own time only
    assert pg.group_of("aten::add") == "other"
    # inside the lean decoder's attention range its products and softmax count as attention, not matmul/sampling
    assert pg.event_group("aten::bmm", ["aten::matmul", pg.ATTENTION_RANGE, "generate"]) == "attention"
    assert pg.event_group("aten::_softmax", [pg.ATTENTION_RANGE]) == "attention"
    assert pg.event_group(pg.ATTENTION_RANGE, []) == "attention"  # the range's own time
    assert pg.event_group("aten::_softmax", ["generate"]) == "sampling"
    assert pg.event_group("mkldnn::_linear_pointwise", []) == "matmul"
    # the few-row kernels' calls, which the profiler sees only as the ranges around them
    assert pg.event_group(pg.PRODUCTS_RANGE, ["generate"]) == "matmul"
    assert pg.event_group("aten::empty", [pg.PRODUCTS_RANGE]) == "matmul"


def test_decode_attention_benchmark_compares_equal_results():
    """benchmarks/decode_attention.py at a tiny shape: the kernel and PyTorch's operations agree, with a shared
    prefix (2 prompts of 2 rows) and without one, and each setting reports both times."""
    import decode_attention as da

    from hpc_rlhf.generation.lean import few_rows
    mod = few_rows.kernel()
    for prefix in (5, 0):
        r = da.setting(mod, rows=4, samples=2, prefix=prefix, slots=9, heads=4, kv_heads=2, dim=16, min_s=0.0,
                       seed=1)
        assert r["max_abs_diff"] < 1e-5 and r["torch_ms"] > 0 and r["kernel_ms"] > 0
        assert r["rows"] == 4 and r["prefix"] == prefix and r["slots"] == 9


def test_decode_products_benchmark_compares_equal_results():
    """benchmarks/decode_products.py at a tiny shape: both ways agree with float64, each product reports both times,
    and a step's products count each layer's four ``layers`` times and the head once."""
    import decode_products as dp

    from hpc_rlhf.generation.lean import few_rows
    table = dp.shapes(hidden=16, mlp=24, heads=2, kv_heads=1, head_dim=8, vocab=50)
    assert table == {"qkv": (32, 16), "o": (16, 16), "gate_up": (48, 16), "down": (16, 24), "head": (50, 16)}
    per = {name: dp.product(few_rows.kernel(), 9, o, i, copies=2, min_s=0.0, seed=3) for name, (o, i) in table.items()}
    for r in per.values():
        assert r["max_abs_diff_onednn"] < 1e-5 and r["max_abs_diff_panels"] < 1e-5
        assert r["onednn_ms"] > 0 and r["panels_ms"] > 0
    fake = {name: {"panels_ms": 1.0 if name == "head" else 2.0} for name in table}
    assert dp.step_products(fake, layers=3, way="panels") == (4 * 3 * 2.0 + 1.0) / 1e3


def test_profile_training_groups():
    import profile_generation as pg
    import profile_training as pt
    assert pg.group_of("aten::_log_softmax_backward_data", pt.GROUPS) == "vocabulary"
    assert pg.group_of("aten::gather", pt.GROUPS) == "vocabulary"
    assert pg.group_of("aten::uniform_", pt.GROUPS) == "other"  # sampling is generation's group, not training's
    assert pg.group_of("aten::mm", pt.GROUPS) == "matmul"


def test_a_time_limit_signal_ends_the_run_with_the_rounds_before_it(tmp_path, monkeypatch, capsys):
    """SIGTERM (what `timeout` sends) during hpc_rlhf's first round: the JSON line still comes, with TRL's round,
    without the side that did not end a round, and says where the run stopped; limits.json and rounds.jsonl are
    kept."""
    import json
    import os
    import signal
    import types

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1", "answer": "2"}\n' * 16)  # steps x prompts rows: 2 x 8
    limits = {"matmul_flops_fp32": 100.0, "matmul_flops_bf16": 100.0, "copy_bytes_per_s": 50.0}
    monkeypatch.setattr(bench, "prompt_lengths", lambda model, data: [20, 36])
    monkeypatch.setattr(bench, "model_info", lambda model, dtype: {"params": 10, "matmul_params": 10,
                                                                  "tied_embeddings": True, "weight_bytes": 40})
    monkeypatch.setattr(bench, "side_available", lambda side, args: None)
    monkeypatch.setattr(bench, "planned_memory", lambda config: {})
    monkeypatch.setattr(bench, "hpc_stop_tokens", lambda model: [2])
    monkeypatch.setattr(bench.subprocess, "run", lambda *a, **k: types.SimpleNamespace(stdout=json.dumps(limits)))
    ph = {"generation": 9.0, "weight sync": 0.0, "log-probs and reward": 0.0, "training": 1.0, "other": 0.0}
    step = {"step_s": 10.0, "phases": ph, "rollout_generate_s": 9.0, **work(100, 28, 128), "reward_mean": 0.0,
            "response_length_mean": 12.0, "stop_token_ids": [2]}
    monkeypatch.setattr(bench, "trl_round", lambda *a: ([step, step], {"main": 1}))

    def stopped_round(*a):
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("the signal did not stop the round")
    monkeypatch.setattr(bench, "ours_round", stopped_round)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        bench.main(["--sides", "trl,hpc_rlhf", "--steps", "2", "--warmup", "1", "--rounds", "2",
                    "--model", str(model), "--data", str(data), "--keep", str(tmp_path / "keep")])
    finally:
        signal.signal(signal.SIGTERM, previous)
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert got["stopped"] == "SIGTERM in round 1/2: hpc_rlhf"
    assert list(got["sides"]) == ["trl"] and got["config"]["rounds_run"] == {"trl": 1, "hpc_rlhf": 0}
    assert got["sides"]["trl"]["s_per_step"] == 10.0
    assert json.loads((tmp_path / "keep" / "limits.json").read_text()) == limits
    assert [json.loads(x)["side"] for x in (tmp_path / "keep" / "rounds.jsonl").read_text().splitlines()] == ["trl"]


def test_trl_gets_the_wait_policy_of_hpc_rlhfs_ranks(monkeypatch):
    from hpc_rlhf.distributed import openmp
    monkeypatch.setattr(openmp, "usable_cpus", lambda: 4)
    assert bench.trl_openmp(False, {}) == {"OMP_WAIT_POLICY": "ACTIVE"}  # torch's 4 threads on 4 CPUs
    assert bench.trl_openmp(False, {"OMP_NUM_THREADS": "8"}) == {}  # more threads than CPUs: libgomp's default
    assert bench.trl_openmp(True, {}) == {}  # --trl-omp-default
    assert bench.trl_openmp(False, {"OMP_WAIT_POLICY": "PASSIVE"}) == {}  # the user's, inherited as it is
    assert bench.trl_openmp(False, {"GOMP_SPINCOUNT": "300000"}) == {}
    monkeypatch.setattr(openmp, "usable_cpus", lambda: 1)
    assert bench.trl_openmp(False, {}) == {}  # one thread: no worker waits
