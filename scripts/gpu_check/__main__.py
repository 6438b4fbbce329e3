"""``python -m gpu_check [--work DIR] [--budget-s S] [--only NAME,...]`` (scripts/gpu_check.sh sets it up):
the checks this machine's GPU count allows, then one JSON line on stdout; exit code 1 when one failed.
Progress goes to stderr, each run's log to WORK/logs."""
from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

from . import summary
from .summary import FAILED, PASSED, Result, not_covered

TIMEOUT_S = {"collectives": 120, "sft_zero3_bf16_resume": 300, "grpo_colocated_hf": 240, "engine_cpu_cuda": 90,
             "engine_cuda_graphs": 60,
             "shared_prompts_cuda": 60,
             "grpo_colocated_vllm": 420,
             "sft_two_ranks_nccl": 180, "grpo_bridge_nccl": 240, "grpo_bridge_gloo": 240, "deepspeed_no_jit": 10}
MIN_START_S = 30  # a check with less time left than this is not started


def versions() -> dict:
    out = {}
    for name in ("transformers", "deepspeed", "datasets", "peft", "accelerate", "submitit", "vllm"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def machine() -> dict:
    import torch
    cuda = torch.cuda.is_available()
    gpus = torch.cuda.device_count() if cuda else 0
    info = {"cuda": cuda, "gpus": gpus, "gpu_names": [torch.cuda.get_device_name(i) for i in range(gpus)],
            "torch": torch.__version__, "torch_cuda": torch.version.cuda, "python": platform.python_version(),
            "versions": versions()}
    if cuda:
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return info


def run_checks(names: list[str], ctx, budget_s: float, t0: float) -> list[Result]:
    from . import checks
    from .runs import CheckFailed
    results = []
    for name in names:
        left = budget_s - (time.time() - t0)
        if left < MIN_START_S:
            results.append(not_covered(name, f"the time budget of {budget_s:.0f} s was spent"))
            continue
        print(f"gpu_check: {name} ({summary.CHECKS[name]})", file=sys.stderr, flush=True)
        start = time.time()
        try:
            result = Result(name, PASSED, figures=getattr(checks, name)(ctx, min(TIMEOUT_S[name], left)))
        except CheckFailed as e:
            result = Result(name, FAILED, figures=e.figures, reason=str(e))
        except Exception as e:  # noqa: BLE001 - a broken check is a failed check, and the others still run
            result = Result(name, FAILED, reason=f"{type(e).__name__}: {e}")
        result.seconds = round(time.time() - start, 1)
        print(f"gpu_check: {name} {result.status} in {result.seconds} s", file=sys.stderr, flush=True)
        results.append(result)
    return results


def run_on_gpus(info: dict, work: Path, budget_s: float, only: list[str] | None, t0: float) -> list[Result]:
    from .checks import Context
    from .runs import CheckFailed, make_assets
    names, left_out = summary.plan(info["gpus"], importlib.util.find_spec("vllm") is not None)
    if only:
        left_out += [not_covered(n, "left out by --only") for n in names if n not in only]
        names = [n for n in names if n in only]
    os.environ["TORCH_EXTENSIONS_DIR"] = str(work / "torch_extensions")  # fresh: shows what DeepSpeed compiles
    try:
        assets = make_assets(work)
    except CheckFailed as e:
        return [Result("assets", FAILED, reason=str(e)), *(not_covered(n, "the assets failed") for n in names)]
    return run_checks(names, Context(work, assets, info["gpus"]), budget_s, t0) + left_out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu_check", description=__doc__)
    p.add_argument("--work", help="folder for the runs and their logs (default: a new temporary folder)")
    p.add_argument("--budget-s", type=float, default=570, help="time for all checks together")
    p.add_argument("--only", help="comma-separated check names to run (default: all the machine allows)")
    args = p.parse_args(argv)
    only = args.only.split(",") if args.only else None
    unknown = sorted(set(only or []) - set(summary.CHECKS))
    if unknown:
        p.error(f"--only: unknown check {', '.join(unknown)}; the checks are {', '.join(summary.CHECKS)}")
    t0 = time.time()
    try:
        info = machine()
    except ImportError as e:  # no torch in this interpreter: nothing can be decided
        result = summary.assemble({"cuda": None}, [Result("torch", FAILED, reason=f"{e} ({sys.executable})")], 0.0)
        print(json.dumps(result), flush=True)
        return summary.exit_code(result)
    if not info["cuda"]:
        result = summary.without_cuda(info, "torch.cuda.is_available() is false: no CUDA device, nothing ran")
    else:
        work = Path(args.work or tempfile.mkdtemp(prefix="hpc_rlhf_gpu_check_")).resolve()
        work.mkdir(parents=True, exist_ok=True)
        result = summary.assemble(dict(info, work=str(work)), run_on_gpus(info, work, args.budget_s, only, t0),
                                  time.time() - t0)
        (work / "summary.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result), flush=True)
    return summary.exit_code(result)


if __name__ == "__main__":
    sys.exit(main())
