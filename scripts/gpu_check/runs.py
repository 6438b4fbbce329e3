"""Processes with a time limit, the tiny assets every check trains on, and reading a run's metrics."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import yaml


class CheckFailed(Exception):
    """A check's verdict: ``str(e)`` says what went wrong, ``figures`` what was measured up to then."""

    def __init__(self, message: str, figures: dict | None = None):
        super().__init__(message)
        self.figures = figures or {}


def tail(path: Path, chars: int = 1500) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""


def run(argv: list[str], log: Path, timeout_s: float, env: dict | None = None) -> None:
    """``argv`` with stdout and stderr into ``log``; its whole process group (a launcher's ranks too) is
    killed when it outlives ``timeout_s``.  Raises CheckFailed on a non-zero exit or the time limit."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            code = proc.wait(timeout=max(1.0, timeout_s))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise CheckFailed(f"{log.stem} ran past {timeout_s:.0f} s (log {log}):\n{tail(log)}") from None
    if code != 0:
        raise CheckFailed(f"{log.stem} exited with {code} (log {log}):\n{tail(log)}")


def cli(args: list[str], log: Path, timeout_s: float) -> None:
    """``hpc-rlhf ARGS`` (``python -m hpc_rlhf.cli``, the repository on PYTHONPATH) with a free MASTER_PORT: a
    lone rank hosts its rendezvous store there, and a neighbour may hold the default 29500 (the local launcher
    picks its ranks' port itself)."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    run([sys.executable, "-m", "hpc_rlhf.cli", *args], log, timeout_s, env)


def train(trainer: str, config: dict, path: Path, log: Path, timeout_s: float) -> list[dict]:
    """``hpc-rlhf train TRAINER --config PATH`` (``config`` written there first); its metrics.jsonl rows."""
    path.write_text(yaml.safe_dump(config))
    cli(["train", trainer, "--config", str(path)], log, timeout_s)
    return metrics(Path(config["ckpt"]["save_path"]))


def metrics(save_path: Path) -> list[dict]:
    return [json.loads(x) for x in (save_path / "metrics.jsonl").read_text().splitlines() if x.strip()]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(argv: list[str], n: int, logs: Path, timeout_s: float, env: dict | None = None) -> list[str]:
    """``argv`` as ``n`` ranks (RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT set like the
    local launcher does); every rank's last line of stdout.  Raises CheckFailed when a rank fails."""
    port, procs = free_port(), []
    logs.mkdir(parents=True, exist_ok=True)
    for rank in range(n):
        rank_env = dict(env or os.environ, RANK=str(rank), WORLD_SIZE=str(n), LOCAL_RANK=str(rank),
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        out = open(logs / f"rank{rank}.log", "w")
        procs.append((subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=rank_env,
                                       start_new_session=True), out))
    deadline = time.time() + timeout_s
    try:
        for rank, (proc, _) in enumerate(procs):
            code = proc.wait(timeout=max(1.0, deadline - time.time()))
            if code != 0:
                raise CheckFailed(f"rank {rank} exited with {code}:\n{tail(logs / f'rank{rank}.log')}")
    except subprocess.TimeoutExpired:
        raise CheckFailed(f"the ranks ran past {timeout_s:.0f} s:\n{tail(logs / 'rank0.log')}") from None
    finally:
        for proc, out in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            out.close()
    return [(logs / f"rank{r}.log").read_text().strip().splitlines()[-1] for r in range(n)]


REWARD = '''
def reward_func(queries, prompts, labels):
    # more distinct characters in the response, more reward: a spread even for a random model
    return [len(set(q[len(p):])) / 6.0 for q, p in zip(queries, prompts)]
'''


def make_assets(root: Path, timeout_s: float = 120) -> dict[str, Path]:
    """A tiny llama (head dimension 32, which every vLLM attention backend takes), SFT rows, prompts with
    labels and a reward function; built once, shared by the checks."""
    paths = {"model": root / "model", "sft_data": root / "train.jsonl", "prompts": root / "prompts.jsonl",
             "reward": root / "reward.py"}
    if not (paths["model"] / "config.json").exists():
        cli(["tiny-model", str(paths["model"]), "--hidden-size", "64", "--heads", "2", "--layers", "2",
             "--max-position", "128", "--seed", "0"], root / "logs" / "tiny_model.log", timeout_s)
    paths["sft_data"].write_text("".join(
        json.dumps({"input": f"{10 + 3 * i}+{40 + 7 * i % 50}=", "output": str(50 + 3 * i + 7 * i % 50)}) + "\n"
        for i in range(32)))
    paths["prompts"].write_text("".join(json.dumps({"input": f"{i}+{i % 7}=", "label": str(i + i % 7)}) + "\n"
                                        for i in range(40)))
    paths["reward"].write_text(REWARD)
    return paths
