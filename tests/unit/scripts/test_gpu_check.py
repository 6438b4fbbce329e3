"""scripts/gpu_check.sh without CUDA (it says so and exits 0), and the parts of the GPU check that need no
GPU: the plan for a GPU count, the summary's assembly and exit code, running checks, processes and ranks."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "scripts"))

from gpu_check import __main__ as entry  # noqa: E402
from gpu_check import checks, runs, summary  # noqa: E402
from gpu_check.summary import FAILED, NOT_COVERED, PASSED, Result  # noqa: E402


def test_without_cuda_one_json_line_says_so_and_the_exit_code_is_0():
    env = dict(os.environ, PYTHON=sys.executable, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1
    out = json.loads(lines[0])
    assert out["cuda"] is False and out["gpus"] == 0 and out["ok"] is True
    assert out["ran"] == [] and out["passed"] == [] and out["failed"] == []
    assert out["not_covered"] == [{"what": "everything", "why": "torch.cuda.is_available() is false: no CUDA "
                                                                  "device, nothing ran"}]


def test_an_unknown_check_name_is_refused_by_name():
    with pytest.raises(SystemExit) as e:
        entry.main(["--only", "collectives,nonsense"])
    assert e.value.code == 2


def test_one_gpu_runs_the_gloo_bridge_and_says_nccl_across_processes_was_not_covered():
    ran, left_out = summary.plan(gpus=1, vllm_installed=False)
    assert ran == ["collectives", "sft_zero3_bf16_resume", "grpo_colocated_hf", "engine_cpu_cuda",
                   "engine_cuda_graphs", "shared_prompts_cuda", "grpo_bridge_gloo", "deepspeed_no_jit"]
    why = {r.name: r.reason for r in left_out}
    assert set(why) == {"NCCL across processes", "grpo_colocated_vllm", "sft_two_ranks_nccl", "grpo_bridge_nccl"}
    assert why["grpo_colocated_vllm"] == "vllm not installed (not importable)"
    assert "NCCL refuses two ranks on one GPU" in why["NCCL across processes"]
    assert all(r.status == NOT_COVERED for r in left_out)


def test_two_gpus_run_everything_over_nccl():
    ran, left_out = summary.plan(gpus=2, vllm_installed=True)
    assert ran == ["collectives", "sft_zero3_bf16_resume", "grpo_colocated_hf", "engine_cpu_cuda",
                   "engine_cuda_graphs", "shared_prompts_cuda", "grpo_colocated_vllm", "sft_two_ranks_nccl",
                   "grpo_bridge_nccl", "deepspeed_no_jit"]
    assert left_out == []


@pytest.mark.parametrize("gpus", [1, 2, 8])
def test_every_planned_check_is_described_timed_and_implemented(gpus):
    ran, _ = summary.plan(gpus, vllm_installed=True)
    for name in ran:
        assert name in summary.CHECKS and name in entry.TIMEOUT_S and callable(getattr(checks, name))


def test_a_failure_makes_the_summary_not_ok_and_the_exit_code_1():
    results = [Result("collectives", PASSED, 3.0, {"nccl_1_ranks": [{"bridge": "nccl"}]}),
               Result("grpo_colocated_hf", FAILED, 40.0, {"steps": [1, 2]}, "grpo_colocated_hf: logged steps [1, 2]"),
               *summary.plan(1, False)[1]]
    out = summary.assemble({"cuda": True, "gpus": 1}, results, 43.04)
    assert json.loads(json.dumps(out)) == out  # one JSON object
    assert out["ok"] is False and summary.exit_code(out) == 1
    assert out["ran"] == ["collectives", "grpo_colocated_hf"]
    assert out["passed"] == ["collectives"] and out["failed"] == ["grpo_colocated_hf"]
    assert out["results"]["grpo_colocated_hf"] == {"status": FAILED, "seconds": 40.0, "figures": {"steps": [1, 2]},
                                                   "reason": "grpo_colocated_hf: logged steps [1, 2]"}
    assert "NCCL across processes" in [n["what"] for n in out["not_covered"]]
    assert out["seconds"] == 43.0


def test_all_passed_is_ok_and_the_exit_code_0():
    out = summary.assemble({"cuda": True, "gpus": 2}, [Result("collectives", PASSED)], 1.0)
    assert out["ok"] is True and summary.exit_code(out) == 0
    assert out["results"] == {"collectives": {"status": PASSED, "seconds": 0.0}}


def test_run_checks_records_failures_goes_on_and_stops_starting_when_the_budget_is_spent(monkeypatch):
    def broken(ctx, timeout_s):
        raise runs.CheckFailed("wrong sum", {"sum": 2})
    monkeypatch.setattr(checks, "collectives", broken)
    monkeypatch.setattr(checks, "grpo_colocated_hf", lambda ctx, timeout_s: 1 / 0)
    monkeypatch.setattr(checks, "deepspeed_no_jit", lambda ctx, timeout_s: {"built": [], "timeout": timeout_s})
    got = entry.run_checks(["collectives", "grpo_colocated_hf", "deepspeed_no_jit"], None, 100, time.time())
    assert [r.status for r in got] == [FAILED, FAILED, PASSED]
    assert got[0].reason == "wrong sum" and got[0].figures == {"sum": 2}
    assert got[1].reason == "ZeroDivisionError: division by zero"
    assert got[2].figures == {"built": [], "timeout": entry.TIMEOUT_S["deepspeed_no_jit"]}
    late = entry.run_checks(["collectives"], None, 100, time.time() - 90)
    assert late[0].status == NOT_COVERED and "time budget" in late[0].reason


def test_a_process_past_its_time_limit_is_killed_with_its_children(tmp_path):
    marker = tmp_path / "child.pid"
    script = (f"import subprocess, time; open({str(marker)!r}, 'w').write(str(subprocess.Popen(['sleep', '60']).pid));"
              " time.sleep(60)")
    t0 = time.time()
    with pytest.raises(runs.CheckFailed, match="ran past 2 s"):
        runs.run([sys.executable, "-c", script], tmp_path / "logs" / "slow.log", timeout_s=2)
    assert time.time() - t0 < 20
    time.sleep(0.2)
    child = int(marker.read_text())
    assert not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]
    with pytest.raises(runs.CheckFailed, match="exited with 3"):
        runs.run([sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"], tmp_path / "bad.log", 30)


def test_run_ranks_gives_every_rank_its_environment_and_returns_their_last_lines(tmp_path):
    prog = "import json, os; print('noise'); print(json.dumps({k: os.environ[k] for k in " \
           "('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'MASTER_ADDR')}))"
    lines = runs.run_ranks([sys.executable, "-c", prog], 2, tmp_path, timeout_s=60)
    assert [json.loads(x) for x in lines] == [
        {"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r), "MASTER_ADDR": "127.0.0.1"} for r in (0, 1)]
    with pytest.raises(runs.CheckFailed, match="rank 1 exited with 1"):
        runs.run_ranks([sys.executable, "-c", "import os, sys; sys.exit(int(os.environ['RANK']))"], 2, tmp_path, 60)


def test_the_collectives_probe_agrees_with_its_hand_derived_values_over_gloo(tmp_path):
    """The probe the GPU check runs on CUDA, here on CPU tensors: 3 ranks contributing r + 1 sum to 6, the
    maximum of 10r + 3 is 23; the Bridge broadcasts, gathers objects of different sizes and reduces."""
    path = os.pathsep.join([str(ROOT / "scripts"), str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path, CUDA_VISIBLE_DEVICES="")
    lines = runs.run_ranks([sys.executable, "-m", "gpu_check.collectives_probe", "gloo"], 3, tmp_path, 120, env)
    for line in lines:
        assert json.loads(line) == {"device": "cpu", "default_group": "gloo", "default_group_ranks": 3,
                                    "backend_device": "cpu", "bridge": "gloo", "bridge_ranks": 3,
                                    "bridge_device": "cpu"}


def test_on_a_one_gpu_machine_main_runs_the_plan_prints_one_line_and_fails_when_a_check_fails(
        tmp_path, monkeypatch, capsys):
    """The whole flow with the machine and the checks faked: plan, assets, checks, summary line and file."""
    monkeypatch.setattr(entry, "machine", lambda: {"cuda": True, "gpus": 1, "gpu_names": ["fake"]})
    monkeypatch.setattr(entry.importlib.util, "find_spec", lambda name: None)  # no vllm
    monkeypatch.setattr(runs, "make_assets", lambda work: {"model": work / "model"})
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "")  # restored afterwards; main points it into the work folder

    def failing(ctx, timeout_s):
        raise runs.CheckFailed("resumed losses differ", {"resume_max_abs_diff": 0.3})
    for name in summary.CHECKS:
        monkeypatch.setattr(checks, name, lambda ctx, timeout_s: {"gpus": ctx.gpus})
    monkeypatch.setattr(checks, "sft_zero3_bf16_resume", failing)
    assert entry.main(["--work", str(tmp_path)]) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    out = json.loads(lines[0])
    assert out == json.loads((tmp_path / "summary.json").read_text())
    assert out["ok"] is False and out["failed"] == ["sft_zero3_bf16_resume"]
    assert out["passed"] == ["collectives", "grpo_colocated_hf", "engine_cpu_cuda", "engine_cuda_graphs",
                             "shared_prompts_cuda", "grpo_bridge_gloo", "deepspeed_no_jit"]
    assert out["results"]["collectives"]["figures"] == {"gpus": 1}
    assert {n["what"] for n in out["not_covered"]} == {"grpo_colocated_vllm", "NCCL across processes",
                                                       "sft_two_ranks_nccl", "grpo_bridge_nccl"}
    assert os.environ["TORCH_EXTENSIONS_DIR"] == str(tmp_path.resolve() / "torch_extensions")


def test_the_engine_check_on_the_cpu_twice_finds_the_same_samples(tmp_path):
    """engine_cpu_cuda's code path with both devices the CPU: every row equal, log-probs equal, both finish
    reasons met (the check compares rows that stop early and rows that run to the length)."""
    got = checks.engine_cpu_cuda(checks.Context(tmp_path, {}, 0), 60, devices=("cpu", "cpu"))
    assert got["rows"] == got["rows_equal"] == 16 and got["logprob_max_abs_diff"] == 0.0
    assert got["finish_reasons"] == ["length", "stop"], got


def test_the_cuda_graphs_check_on_the_cpu_runs_both_engines(tmp_path):
    """engine_cuda_graphs's code path on the CPU, where neither engine captures a graph: both sample every row
    alike and are timed."""
    got = checks.engine_cuda_graphs(checks.Context(tmp_path, {}, 0), 60, device="cpu")
    assert got["engines"] == ["launched", "graphs"] and got["cuda_graphs"] == [False, False], got
    assert got["rows"] == got["rows_equal"] == 16 and got["logprob_max_abs_diff"] == 0.0
    assert len(got["generate_s"]) == 2


def test_the_shared_prompts_check_on_the_cpu_compares_every_micro_batch(tmp_path):
    """shared_prompts_cuda's code path on the CPU: 16 samples in 4 micro-batches, logits and gradient within
    its tolerances of the padded batches'."""
    got = checks.shared_prompts_cuda(checks.Context(tmp_path, {}, 0), 60, device="cpu")
    assert got["samples"] == 16 and got["micro_batches"] == 4, got
    assert got["logit_max_abs_diff"] <= checks.SHARED_LOGIT_TOL and got["grad_max_rel_diff"] <= checks.SHARED_GRAD_TOL


def test_the_wheels_for_a_gpu_machine_are_pinned_within_pyproject_and_once_each():
    import re

    from packaging.requirements import Requirement
    text = (ROOT / "scripts" / "gpu_wheels.sh").read_text()
    pins = dict(re.findall(r"\b([A-Za-z][\w.-]*)==([\w.]+)", text))
    assert len(pins) == len(re.findall(r"==", text))  # one version of each
    pyproject = (ROOT / "pyproject.toml").read_text()
    for name in ("deepspeed", "datasets", "submitit"):
        req = Requirement(re.search(rf'"({name}[<>=!~,.\d ]*)"', pyproject).group(1))
        assert req.specifier and req.specifier.contains(pins[name]), (req, pins[name])
