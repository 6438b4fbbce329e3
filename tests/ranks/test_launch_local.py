"""The local launcher: a rank that dies takes the job down quickly, and every rank and the launcher name it;
the ranks die with the launcher."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml


@pytest.mark.slow  # the default suite stays under 12 minutes (moved in issue 16)
def test_killed_rank_stops_the_job(tmp_path):
    from hpc_rlhf.models.tiny import build_tiny_model
    model = build_tiny_model(tmp_path / "m", hidden_size=32, num_layers=2, max_position_embeddings=64)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"input": f"{i}+1=", "output": str(i + 1)}) + "\n" for i in range(64)))
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({
        "model": {"pretrain": str(model), "param_dtype": "fp32"},
        "data": {"dataset": [str(data)], "max_len": 32},
        "train": {"train_batch_size": 4, "micro_train_batch_size": 2, "max_epochs": 1000, "zero_stage": 1},
        "ckpt": {"save_path": str(tmp_path / "out"), "ckpt_path": str(tmp_path / "ck")},
        "log": {"logging_steps": 1, "progress_bar": "off"}}))
    launcher = subprocess.Popen([sys.executable, "-m", "hpc_rlhf.cli", "train", "sft", "--config", str(cfg),
                                 "launch.nproc=2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        metrics = tmp_path / "out" / "metrics.jsonl"
        deadline = time.time() + 120
        while not (metrics.is_file() and metrics.read_text().strip()):
            assert launcher.poll() is None, launcher.communicate()[1][-3000:]
            assert time.time() < deadline, "training did not start"
            time.sleep(0.2)
        ranks = {int(p.environ()["RANK"]): p for p in psutil.Process(launcher.pid).children()}
        assert sorted(ranks) == [0, 1]
        t_kill = time.time()
        os.kill(ranks[1].pid, signal.SIGKILL)
        _, err = launcher.communicate(timeout=60)
        elapsed = time.time() - t_kill
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 128 + signal.SIGKILL, launcher.returncode
    assert "hpc-rlhf launcher: rank 1 was killed by SIGKILL" in err
    print(f"launcher exited {elapsed:.1f} s after the kill")
    assert elapsed < 30, elapsed
    assert not ranks[0].is_running() or ranks[0].status() == psutil.STATUS_ZOMBIE


# ---- the launcher with tiny role jobs (tests/support/roles_job.py): a few seconds each -----------------------------
ROLES_JOB = Path(__file__).resolve().parents[1] / "support" / "roles_job.py"
REPO = Path(__file__).resolve().parents[2]


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))


def _start_launcher(markers: Path, scenario: str, nproc: int = 3) -> subprocess.Popen:
    """``run_ranks`` of roles_job.py in a launcher process of its own; its stderr holds every rank's too."""
    code = ("import sys\nfrom hpc_rlhf.launch.local import run_ranks\n"
            f"sys.exit(run_ranks([sys.executable, {str(ROLES_JOB)!r}, {scenario!r}, {str(markers)!r}], {nproc}, "
            "grace_s=5, settle_s=2, describe=lambda r: 'roles ' + ('actor', 'reward', 'rollout')[r]))")
    return subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True, env=_env())


def _rank_pids(launcher: subprocess.Popen, markers: Path, nproc: int) -> dict[int, int]:
    """The ranks' pids, once every rank has joined (or, when idle, started)."""
    deadline = time.time() + 90
    while not all((markers / f"rank-{r}").is_file() and (markers / f"rank-{r}").read_text() for r in range(nproc)):
        assert launcher.poll() is None, launcher.communicate()[1][-3000:]
        assert time.time() < deadline, "the ranks did not start"
        time.sleep(0.1)
    return {r: int((markers / f"rank-{r}").read_text()) for r in range(nproc)}


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _clean_up(launcher: subprocess.Popen, pids) -> None:
    for pid in pids:
        if _alive(pid):
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)
    if launcher.poll() is None:
        launcher.kill()
    launcher.communicate()


def _clean_log(err: str) -> None:
    """No C++ stack frames, no guessing."""
    assert "frame #" not in err and "most likely died" not in err, err[-3000:]


def _recorded_end(markers: Path) -> dict:
    """The end row rank 0 wrote into the attempt record (hpc_rlhf/logging/attempts.py)."""
    rows = [json.loads(x) for x in (markers / "run" / "attempts.jsonl").read_text().splitlines()]
    assert [r["event"] for r in rows] == ["start", "end"], rows
    return rows[-1]


def test_ranks_die_with_the_launcher(tmp_path):
    launcher = _start_launcher(tmp_path, "idle", nproc=2)
    pids = {}
    try:
        pids = _rank_pids(launcher, tmp_path, 2)
        launcher.kill()
        launcher.wait()
        deadline = time.time() + 5
        while any(_alive(p) for p in pids.values()) and time.time() < deadline:
            time.sleep(0.1)
        assert not [r for r, p in pids.items() if _alive(p)], "ranks outlived their launcher"
    finally:
        _clean_up(launcher, pids.values())


def test_own_error_is_reported_at_once_and_named_by_every_rank(tmp_path):
    launcher = _start_launcher(tmp_path, "raise")
    pids = {}
    try:
        pids = _rank_pids(launcher, tmp_path, 3)
        _, err = launcher.communicate(timeout=60)
        ended = time.time()
    finally:
        _clean_up(launcher, pids.values())
    took = ended - float((tmp_path / "raised").read_text())
    print(f"the job ended {took:.1f} s after rank 1 raised")
    assert launcher.returncode == 1, err[-3000:]
    verdict = "rank 1 (roles reward) failed: ValueError: bad row 7"
    assert f"hpc-rlhf launcher: {verdict}; stopping the other ranks" in err, err[-3000:]
    for r, roles in ((0, "actor"), (2, "rollout")):
        assert f"hpc-rlhf: rank {r} (roles {roles}) stops the job: {verdict}" in err, err[-3000:]
    assert "ValueError: bad row 7" in err  # rank 1's own traceback
    assert _recorded_end(tmp_path) == {"time": pytest.approx(ended, abs=10), "event": "end", "reason": "error",
                                       "error": verdict}  # rank 0's watchdog wrote the verdict before it ended
    _clean_log(err)
    assert took < 5, took  # the watchdog's dead_rank_timeout_s (2 s) + 5 s before


def test_own_error_of_a_lone_rank_waits_for_nothing(tmp_path):
    proc = subprocess.run([sys.executable, str(ROLES_JOB), "raise", str(tmp_path)], capture_output=True, text=True,
                          timeout=120, env={k: v for k, v in _env().items() if k not in ("RANK", "MASTER_PORT")})
    took = time.time() - float((tmp_path / "raised").read_text())
    assert proc.returncode == 1 and "ValueError: bad row 7" in proc.stderr, proc.stderr[-3000:]
    print(f"the rank exited {took:.1f} s after it raised")
    assert took < 2, took  # dead_rank_timeout_s (2 s) + 5 s before


def test_killed_rank_is_named_by_the_launcher_and_every_rank(tmp_path):
    rank = 0  # it hosts the store under srun: the launcher's store outlives it
    launcher = _start_launcher(tmp_path, "barriers")
    pids = {}
    try:
        pids = _rank_pids(launcher, tmp_path, 3)
        os.kill(pids[rank], signal.SIGKILL)
        _, err = launcher.communicate(timeout=60)
    finally:
        _clean_up(launcher, pids.values())
    assert launcher.returncode == 128 + signal.SIGKILL, (launcher.returncode, err[-3000:])
    roles = ("actor", "reward", "rollout")
    verdict = f"rank {rank} (roles {roles[rank]}) was killed by SIGKILL"
    assert f"hpc-rlhf launcher: {verdict}; stopping the other ranks" in err, err[-3000:]
    for r in {0, 1, 2} - {rank}:
        assert f"hpc-rlhf: rank {r} (roles {roles[r]}) stops the job: {verdict}" in err, err[-3000:]
    _clean_log(err)


def test_stopped_rank_is_named_by_the_launcher_and_every_rank(tmp_path):
    launcher = _start_launcher(tmp_path, "barriers")
    pids = {}
    try:
        pids = _rank_pids(launcher, tmp_path, 3)
        os.kill(pids[1], signal.SIGSTOP)
        _, err = launcher.communicate(timeout=60)
        assert not any(_alive(p) for p in pids.values()), "the launcher left a rank behind"
    finally:
        _clean_up(launcher, pids.values())
    assert launcher.returncode == 1, (launcher.returncode, err[-3000:])
    verdict = "no heartbeat from rank 1 (roles reward, host "
    assert f"hpc-rlhf launcher: {verdict}" in err, err[-3000:]
    assert _recorded_end(tmp_path)["error"].startswith(verdict)
    for r, roles in ((0, "actor"), (2, "rollout")):
        assert f"hpc-rlhf: rank {r} (roles {roles}) stops the job: {verdict}" in err, err[-3000:]
    _clean_log(err)
