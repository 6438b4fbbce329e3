"""`hpc-rlhf status RUN_DIR` (hpc_rlhf/launch/status.py) and the attempt record it reads
(hpc_rlhf/logging/attempts.py, written by trainers/lifecycle.py and trainers/loop.py).

The first tests build run folders by hand (fast); the real runs follow: an SFT run stopped by SIGTERM at a step
boundary and resumed to the end (default suite), an RL run whose rollout rank is killed, and a SLURM job that
is requeued by its time-limit signal (slow)."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from hpc_rlhf import cli
from hpc_rlhf.checkpoint.manifest import write_manifest
from hpc_rlhf.distributed.preemption import RunStopped, StopRequest
from hpc_rlhf.launch import status as st
from hpc_rlhf.logging import attempts
from hpc_rlhf.trainers.lifecycle import recorded

T0 = 1_700_000_000.0  # the hand-built runs start here (seconds since the epoch)


def write_record(run: Path, *rows: dict) -> None:
    run.mkdir(parents=True, exist_ok=True)
    with open(run / attempts.ATTEMPTS, "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def start_row(t: float, ckpt: Path, **kw) -> dict:
    return {"time": t, "event": "start", "job_id": None, "restart": None, "host": "elsewhere", "pid": 4242,
            "pid_start": 1, "world_size": 2, "ckpt_path": str(ckpt), **kw}


def write_metrics(run: Path, steps, mtime: float, **extra) -> None:
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0 / s, **extra}) + "\n"
                                               for s in steps))
    os.utime(run / "metrics.jsonl", (mtime, mtime))


def commit(ckpt: Path, step: int, t: float) -> Path:
    folder = ckpt / f"global_step{step}"
    folder.mkdir(parents=True)
    (folder / "trainer.json").write_text(json.dumps({"step": step}))
    (folder / "rng_rank0.pt").write_bytes(b"x" * 100)
    write_manifest(folder)
    (folder / "COMMITTED").write_text(f"{step}\n")
    os.utime(folder / "COMMITTED", (t, t))
    return folder


def no_squeue(job_id):
    raise AssertionError("squeue asked about a run without a job id")


def test_finished_run_after_a_stop_and_a_resume(tmp_path):
    run, ckpt = tmp_path / "run", tmp_path / "ckpt"
    write_record(run, start_row(T0, ckpt),
                 {"time": T0 + 10, "event": "steps", "start_step": 0, "total_steps": 10, "trainer": "sft"},
                 {"time": T0 + 30, "event": "end", "reason": "stopped", "step": 4, "signal": "TERM",
                  "requeue": False},
                 start_row(T0 + 100, ckpt, pid=4343),
                 {"time": T0 + 105, "event": "steps", "start_step": 4, "total_steps": 10, "trainer": "sft"},
                 {"time": T0 + 117, "event": "end", "reason": "finished"})
    write_metrics(run, range(1, 11), T0 + 116)
    commit(ckpt, 2, T0 + 20)
    commit(ckpt, 4, T0 + 29)
    s = st.run_status(run, squeue=no_squeue, now=T0 + 200, hostname="here")
    assert s["state"] == "finished" and s["running"] is False and s["trainer"] == "sft"
    assert (s["last_step"], s["total_steps"], s["remaining_steps"]) == (10, 10, 0)
    # attempt 2 did steps 4..10 between its loop start (T0+105) and its end (T0+117): 12 s / 6 steps
    assert s["time_per_step_s"] == pytest.approx(2.0)
    assert s["eta_s"] is None and s["remaining_compute_s"] == 0
    ck = s["checkpoint"]
    assert ck["committed_steps"] == [2, 4] and ck["newest"]["step"] == 4 and ck["newest"]["damage"] is None
    assert ck["newest"]["committed_at"] == T0 + 29 and ck["newest_intact_step"] == 4
    a1, a2 = s["attempts"]
    assert (a1["start_step"], a1["end_step"], a2["start_step"], a2["end_step"]) == (0, 4, 4, 10)
    assert a1["exit"] == "stopped by SIGTERM after step 4 (checkpoint written)"
    assert a2["exit"] == "finished"
    text = st.render(s)
    assert "state       finished  (running: no; the last attempt recorded its end)" in text
    assert "step 10 of 10 (100%)" in text and "2 s/step (wall clock of attempt 2: steps 4-10 in 12s)" in text
    assert "global_step4 committed at" in text and "manifest intact; 2 kept in" in text
    assert "no SLURM job recorded" in text


def test_a_local_run_is_running_while_its_recorded_process_lives(tmp_path):
    run, ckpt = tmp_path / "run", tmp_path / "ckpt"
    me = {"pid": os.getpid(), "pid_start": attempts.process_start_ticks(os.getpid()), "host": "here"}
    write_record(run, start_row(T0, ckpt, **me),
                 {"time": T0 + 10, "event": "steps", "start_step": 0, "total_steps": 100, "trainer": "rl"})
    write_metrics(run, range(1, 26), T0 + 60)
    s = st.run_status(run, squeue=no_squeue, now=T0 + 70, hostname="here")
    assert s["state"] == "running" and s["running"] is True
    assert s["running_how"] == f"process {os.getpid()} on this host runs"
    # 25 steps from the loop start (T0+10) to the last row (T0+60): 2 s/step; 75 steps left from T0+60
    assert s["time_per_step_s"] == pytest.approx(2.0)
    assert s["eta_s"] == pytest.approx(60 + 150 - 70)
    assert s["attempts"][0]["exit"] == "running" and s["checkpoint"]["newest"] is None
    text = st.render(s)
    assert "RUNNING" in text and "step 25 of 100 (25%)" in text and "ETA 2m20s" in text
    assert "steps 0->25" in text and f"none committed in {ckpt} (no such folder)" in text

    # the same pid with another start time is another process (pids are reused): the run died
    write_record(run, start_row(T0 + 80, ckpt, **dict(me, pid_start=me["pid_start"] + 1)))
    s = st.run_status(run, squeue=no_squeue, now=T0 + 90, hostname="here")
    assert s["state"] == "died" and s["running"] is False
    assert s["time_per_step_s"] == pytest.approx(2.0)  # the last row (T0+60) came before attempt 2 (T0+80)
    assert s["attempts"][0]["exit"].startswith("ended without a record (killed")
    # started on another host and no SLURM job: nothing to ask
    s = st.run_status(run, squeue=no_squeue, now=T0 + 90, hostname="another")
    assert s["state"] == "unknown" and s["running"] is None
    assert s["running_how"] == f"no SLURM job id, and the process (pid {os.getpid()} on here) is not on this host"
    assert f"(running: cannot tell; {s['running_how']})" in st.render(s)


def test_slurm_attempts_rank_log_errors_and_the_queue(tmp_path):
    run, ckpt, logs = tmp_path / "run", tmp_path / "ckpt", tmp_path / "logs"
    job = {"job_id": "77", "log_dir": str(logs), "host": "node1"}
    write_record(run, start_row(T0, ckpt, restart=0, **job),
                 {"time": T0 + 5, "event": "steps", "start_step": 0, "total_steps": 8, "trainer": "rl"},
                 {"time": T0 + 25, "event": "end", "reason": "stopped", "step": 4, "signal": "USR1", "requeue": True},
                 start_row(T0 + 60, ckpt, restart=1, **job),
                 {"time": T0 + 65, "event": "steps", "start_step": 4, "total_steps": 8, "trainer": "rl"})
    write_metrics(run, range(1, 7), T0 + 75)
    for restart, text in ((0, "12:00:01 [rank 0] INFO x: fine\n"),
                          (1, "Traceback (most recent call last):\n  File x\nRuntimeError: CUDA out of memory\n"),
                          (2, "12:00:09 [rank 1] ERROR hpc_rlhf.data: prompts.jsonl row 3: no 'input'\n")):
        (logs / "77" / f"attempt-{restart}").mkdir(parents=True)
        (logs / "77" / f"attempt-{restart}" / "rank-0.log").write_text(text)
        t = T0 + 60 * restart + 1
        os.utime(logs / "77" / f"attempt-{restart}" / "rank-0.log", (t, t))
    (logs / "77.out").write_text("hpc-rlhf: job 77 attempt 0 on node1, rank logs in x\n"
                                 "hpc-rlhf: the ranks stopped on a signal after writing a checkpoint\n"
                                 "hpc-rlhf: job 77 attempt 1 on node1, rank logs in x\n"
                                 "srun: error: node1: task 0: Out Of Memory\n"
                                 "hpc-rlhf: job 77 attempt 2 on node2, rank logs in x\n")
    asked = []

    def squeue(state):
        def ask(job_id):
            asked.append(job_id)
            return state, "test"
        return ask
    s = st.run_status(run, squeue=squeue("RUNNING"), now=T0 + 200, hostname="here")
    assert asked == ["77"] and s["state"] == "running" and s["job_id"] == "77"
    # attempt 3 (restart 2) left rank logs but no start row: it died before its trainer started
    a = s["attempts"]
    assert [(x["restart"], x["recorded"]) for x in a] == [(0, True), (1, True), (2, False)]
    assert a[0]["exit"] == "stopped by SIGUSR1 after step 4 (checkpoint written); rank 0 requeued the job"
    assert a[0]["log_error"] is None  # neither an INFO line nor the batch script's notes are errors
    assert a[1]["log_errors"] == [{"file": str(logs / "77" / "attempt-1" / "rank-0.log"),
                                   "line": "RuntimeError: CUDA out of memory"},
                                  {"file": str(logs / "77.out"), "line": "srun: error: node1: task 0: Out Of Memory"}]
    assert a[1]["exit"].startswith("ended without a record") and "Out Of Memory" in a[1]["exit"]
    assert s["log_errors"] == a[2]["log_errors"]
    text = st.render(s)
    assert "SLURM job 77: RUNNING (squeue)" in text and "job 77 restart 1 on node1" in text
    assert "log error   rank-0.log: 12:00:09 [rank 1] ERROR" in text
    # 2 steps left at 5 s/step from the last row (T0+75): due at T0+85, long past at T0+200
    assert s["eta_s"] == 0 and "2 steps left: at this speed they would be done by now" in text
    # while the job runs, an attempt without start row is one whose trainer has not started yet
    assert a[2]["exit"] == "starting (no start recorded yet)"

    assert st.run_status(run, squeue=squeue("PENDING"), now=T0 + 200)["state"] == "queued"
    gone = st.run_status(run, squeue=squeue("GONE"), now=T0 + 200)
    assert gone["state"] == "failed" and gone["attempts"][2]["exit"] == (
        "died before its start was recorded: 12:00:09 [rank 1] ERROR hpc_rlhf.data: prompts.jsonl row 3: no 'input'")
    unknown = st.run_status(run, squeue=lambda j: (None, "squeue is not installed here"), now=T0 + 200)
    assert unknown["running"] is None
    assert unknown["running_how"] == "SLURM job 77: squeue is not installed here"
    assert "(running: cannot tell; SLURM job 77: squeue is not installed here)" in st.render(unknown)


def test_a_damaged_newest_checkpoint_and_an_unfinished_save(tmp_path):
    ckpt = tmp_path / "ckpt"
    commit(ckpt, 3, T0)
    newest = commit(ckpt, 6, T0 + 10)
    (newest / "trainer.json").write_text(json.dumps({"step": 7}))  # same size, other content
    (ckpt / ".tmp-global_step9").mkdir()
    c = st.checkpoint_status(ckpt)
    assert c["newest"]["step"] == 6 and c["newest_intact_step"] == 3 and c["unfinished"] == [".tmp-global_step9"]
    assert c["newest"]["damage"] == f"{newest / 'trainer.json'}: sha256 differs from the one recorded at commit " \
                                    "(same size, other content)"
    run = tmp_path / "run"
    write_record(run, start_row(T0, ckpt), {"time": T0 + 1, "event": "end", "reason": "error",
                                            "error": "ValueError: bad"})
    s = st.run_status(run, squeue=no_squeue, now=T0 + 20)
    assert s["state"] == "failed" and s["last_step"] == 6 and s["attempts"][0]["exit"] == "error: ValueError: bad"
    text = st.render(s)
    assert "DAMAGED:" in text and "newest intact: global_step3" in text and "uncommitted: .tmp-global_step9" in text
    assert "progress    step 6 of ?\n" in text and "speed       no step timed yet" in text


def test_a_run_without_attempt_record(tmp_path):
    """A run of an older version: steps and the step time metric from metrics.jsonl, the checkpoint from the
    exported config; job, attempts and state unknown."""
    run, ckpt = tmp_path / "run", tmp_path / "ckpt"
    run.mkdir()
    write_metrics(run, [2, 4, 6], T0, step_time_s=0.5)
    (run / "hpc_rlhf_config.yaml").write_text(yaml.safe_dump({"ckpt": {"ckpt_path": str(ckpt)}}))
    commit(ckpt, 4, T0)
    s = st.run_status(run, squeue=no_squeue, now=T0 + 5)
    assert (s["state"], s["running"], s["attempts"], s["last_step"], s["total_steps"]) == ("unknown", None, [], 6,
                                                                                          None)
    assert s["checkpoint"]["newest"]["step"] == 4
    assert (s["time_per_step_s"], s["time_per_step_from"]) == (0.5, "mean step_time_s of the last 3 logged rows")
    assert s["notes"] == ["no attempts.jsonl: a run of an older version; job, attempts and state are unknown"]
    text = st.render(s)
    assert "progress    step 6 of ?" in text and "attempts    none recorded" in text


@pytest.mark.parametrize("line, is_error", [
    ("12:00:01 [rank 0] ERROR hpc_rlhf.x: boom", True),
    ("12:00:01 [rank 3] CRITICAL hpc_rlhf.x: boom", True),
    ("12:00:01 [rank 0] WARNING hpc_rlhf.x: error rate high", False),
    ("ValueError: bad value", True),
    ("torch.distributed.DistBackendError: NCCL error", True),
    ("KeyboardInterrupt", True),
    ("UserWarning: deprecated", False),
    ("Traceback (most recent call last):", False),
    ("hpc-rlhf: rank 0 (roles actor) stops the job: no heartbeat from rank 2", True),
    ("hpc-rlhf: the step failed (exit 1); the ranks that saw a peer die name it in x", True),
    ("hpc-rlhf: job 12 attempt 0 on node1, rank logs in x", False),
    ("hpc-rlhf: the ranks stopped on a signal after writing a checkpoint", False),
    ("hpc-rlhf launcher: rank 1 was killed by SIGKILL; stopping the other ranks", True),
    ("slurmstepd: error: *** JOB 12 ON node1 CANCELLED AT 2024-01-01T00:00:00 DUE TO TIME LIMIT ***", True),
    ("srun: error: node1: task 2: Killed", True),
    ("[sft] step 3/6 loss=4.4 eta=3s", False),
])
def test_error_lines(line, is_error):
    assert st.is_error_line(line) is is_error


def test_batch_output_split_by_attempt():
    text = "sbatch noise\nhpc-rlhf: job 5 attempt 0 on n1, x\na\nhpc-rlhf: job 5 attempt 2 on n1, x\nb\n"
    assert st.batch_output_by_attempt(text) == {0: "sbatch noise\nhpc-rlhf: job 5 attempt 0 on n1, x\na",
                                                2: "hpc-rlhf: job 5 attempt 2 on n1, x\nb"}


def test_squeue_answers(monkeypatch):
    monkeypatch.setattr(st.shutil, "which", lambda name: "/usr/bin/squeue")

    def answer(rc, out="", err=""):
        return lambda cmd, **kw: subprocess.CompletedProcess(cmd, rc, out, err)
    assert st.squeue_state("5", answer(0, "RUNNING\n")) == ("RUNNING", "squeue: RUNNING")
    assert st.squeue_state("5", answer(0, "PENDING\nRUNNING\n"))[0] == "RUNNING"  # a het job's components
    assert st.squeue_state("5", answer(0, "")) == ("GONE", "squeue: not in the queue")
    assert st.squeue_state("5", answer(1, err="slurm_load_jobs error: Invalid job id specified\n"))[0] == "GONE"
    assert st.squeue_state("5", answer(1, err="slurm_load_jobs error: Unable to contact slurm controller\n")) == \
        (None, "squeue failed: slurm_load_jobs error: Unable to contact slurm controller")
    monkeypatch.setattr(st.shutil, "which", lambda name: None)
    assert st.squeue_state("5", answer(0, "RUNNING\n")) == (None, "squeue is not installed here")


def test_run_dir_is_found_from_its_neighbours(tmp_path):
    run, ckpt = tmp_path / "exp" / "model", tmp_path / "exp" / "ckpt"
    run.mkdir(parents=True)
    write_metrics(run, [1], T0)
    commit(ckpt, 1, T0)
    (ckpt / "global_step1" / "config.yaml").write_text(yaml.safe_dump({"ckpt": {"save_path": str(run)}}))
    assert st.find_run_dir(run) == run
    assert st.find_run_dir(ckpt) == run  # the checkpoints' config names the save_path
    assert st.find_run_dir(tmp_path / "exp") == run  # the one run inside
    (tmp_path / "exp" / "other").mkdir()
    write_record(tmp_path / "exp" / "other", start_row(T0, ckpt))
    with pytest.raises(st.StatusError, match="holds several runs; name one: .*model, .*other"):
        st.find_run_dir(tmp_path / "exp")
    with pytest.raises(st.StatusError, match="no attempts.jsonl or metrics.jsonl here"):
        st.find_run_dir(ckpt / "global_step1")
    with pytest.raises(st.StatusError, match="no such folder"):
        st.find_run_dir(tmp_path / "nothing")


def test_the_command_prints_text_and_json_and_rejects_a_folder_without_a_run(tmp_path, capsys):
    run, ckpt = tmp_path / "run", tmp_path / "ckpt"
    write_record(run, start_row(T0, ckpt), {"time": T0 + 1, "event": "end", "reason": "finished"})
    assert cli.main(["status", str(run)]) == 0
    assert capsys.readouterr().out.startswith(f"run         {run}\nstate       finished")
    assert cli.main(["status", str(run), "--json", "--ckpt-path", str(tmp_path / "elsewhere")]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["state"] == "finished" and got["checkpoint"]["path"] == str(tmp_path / "elsewhere")
    (tmp_path / "empty").mkdir()
    assert cli.main(["status", str(tmp_path / "empty")]) == 2
    assert capsys.readouterr().err.startswith(f"hpc-rlhf status: {tmp_path / 'empty'}: no attempts.jsonl")


# -- the writer side: trainers/lifecycle.py:recorded -------------------------------------------------------------

def _cfg(tmp_path):
    return SimpleNamespace(ckpt=SimpleNamespace(save_path=str(tmp_path / "run"), ckpt_path=str(tmp_path / "ck")),
                           slurm=SimpleNamespace(log_dir="logs"))


def _rows(tmp_path):
    return [json.loads(x) for x in (tmp_path / "run" / attempts.ATTEMPTS).read_text().splitlines()]


def test_the_lifecycle_records_start_and_each_way_of_ending(tmp_path, monkeypatch):
    for key in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "SLURMD_NODENAME"):
        monkeypatch.delenv(key, raising=False)
    cfg, stop = _cfg(tmp_path), StopRequest([], [])
    with recorded(cfg, stop, main=True):
        pass
    stop.received = "USR1"
    with pytest.raises(RunStopped), recorded(cfg, stop, main=True):
        raise RunStopped(7, requeue=True, leader=True)
    with pytest.raises(ZeroDivisionError), recorded(cfg, stop, main=True):
        raise ZeroDivisionError("division by zero")
    with pytest.raises(KeyError), recorded(cfg, stop, main=False):  # only the main rank writes
        raise KeyError("x")
    rows = _rows(tmp_path)
    assert [(r["event"], r.get("reason")) for r in rows] == [("start", None), ("end", "finished"), ("start", None),
                                                             ("end", "stopped"), ("start", None), ("end", "error")]
    start = rows[0]
    assert start["job_id"] is None and start["restart"] is None and "log_dir" not in start
    assert (start["pid"], start["host"], start["ckpt_path"]) == (os.getpid(), socket.gethostname(),
                                                                   str(tmp_path / "ck"))
    assert start["pid_start"] == attempts.process_start_ticks(os.getpid())
    assert {k: rows[3][k] for k in ("step", "signal", "requeue")} == {"step": 7, "signal": "USR1", "requeue": True}
    assert rows[5]["error"] == "ZeroDivisionError: division by zero"

    monkeypatch.setenv("SLURM_JOB_ID", "91")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    monkeypatch.setenv("SLURMD_NODENAME", "node7")
    monkeypatch.chdir(tmp_path)
    with recorded(cfg, stop, main=True):
        pass
    start = _rows(tmp_path)[-2]
    assert (start["job_id"], start["restart"], start["host"], start["log_dir"]) == ("91", 2, "node7",
                                                                                    str(tmp_path / "logs"))


def test_a_failed_write_of_the_record_does_not_stop_the_run(tmp_path, caplog):
    (tmp_path / "file").write_text("")
    attempts.append(tmp_path / "file" / "run", "start")  # a file where the folder should be
    assert "could not append to the attempt record" in caplog.text


# -- real runs ----------------------------------------------------------------------------------------------------

def _status(run: Path, *extra: str, env=None) -> dict:
    proc = subprocess.run([sys.executable, "-m", "hpc_rlhf.cli", "status", str(run), "--json", *extra],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)



def _status_then_sigterm(proc, run, first_row_s: float, poll_s: float, exit_s: float):
    """Once ``run``'s first metrics row is written: its status (the run live), then SIGTERM to ``proc`` and
    its exit.  (status while running, proc's stderr)."""
    try:
        deadline = time.time() + first_row_s
        while not ((run / "metrics.jsonl").is_file() and (run / "metrics.jsonl").read_text().strip()):
            assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
            time.sleep(poll_s)
        live = st.run_status(run)
        os.kill(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=exit_s)
    finally:
        proc.kill()
    return live, err

@pytest.mark.slow  # two real runs (~40 s): the default suite stays under 12 minutes
def test_sft_run_stopped_by_sigterm_and_resumed(tmp_path):
    """A real `train sft` (one rank): while it runs, status finds its process; SIGTERM stops it at a step
    boundary after a checkpoint (the record says so); the rerun resumes and finishes."""
    from sft_fixtures import sft_config, with_paths
    # enough steps that the run cannot end between its first metrics row and the SIGTERM (4 steps did, on a
    # quiet machine: exit 0); a stop comes at the next step boundary, so the test waits no longer for it
    steps = 200
    config = sft_config(tmp_path, steps)
    config["launch"]["nproc"] = 1
    config["train"]["zero_stage"] = 0
    path = with_paths(config, tmp_path, "run")
    run = tmp_path / "run"
    cli_cmd = [sys.executable, "-m", "hpc_rlhf.cli", "train", "sft", "--config", str(path)]
    env = dict(os.environ, OMP_NUM_THREADS="1")  # two OpenMP threads on a busy 2-core machine: steps 40x slower
    proc = subprocess.Popen(cli_cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    live, err = _status_then_sigterm(proc, run, first_row_s=120, poll_s=0.05, exit_s=120)
    assert proc.returncode == 3, err[-3000:]
    assert live["running"] is True and live["running_how"] == f"process {proc.pid} on this host runs"
    assert live["total_steps"] == steps and live["trainer"] == "sft"

    stopped = st.run_status(run)
    [a] = stopped["attempts"]
    step = a["end_step"]
    assert stopped["state"] == "stopped" and stopped["running"] is False and 1 <= step < steps
    assert a["exit"] == f"stopped by SIGTERM after step {step} (checkpoint written)"
    assert stopped["checkpoint"]["newest"]["step"] == step and stopped["checkpoint"]["newest"]["damage"] is None
    assert stopped["last_step"] == step and stopped["remaining_steps"] == steps - step

    subprocess.run(cli_cmd, check=True, capture_output=True, timeout=300, env=env)
    done = st.run_status(run)
    assert done["state"] == "finished" and done["last_step"] == steps
    assert [(x["start_step"], x["end_step"], x["exit"]) for x in done["attempts"]] == [
        (0, step, a["exit"]), (step, steps, "finished")]
    assert done["time_per_step_s"] > 0 and done["time_per_step_from"].startswith("wall clock of attempt 2")
    print("\n" + st.render(done))


@pytest.mark.slow  # 120-130 s on the busy 2-core test machine: three ranks, twice
def test_rl_run_on_three_ranks_stopped_and_resumed(tmp_path):
    """`train rl` under the local launcher: SIGTERM to the launcher reaches every rank; rank 0 records the stop
    with the step the ranks agreed on, the rerun records its resume and its end, and status reads the RL loop's
    step time."""
    from rl_fixtures import finish_rl, make_assets, merged, start_rl
    cfg = merged(make_assets(tmp_path), algo={"advantage_estimator": "group_norm"}, train={"max_steps": 6},
                 placement={"colocate_critic_reward": True},
                 log={"check_weight_sync": False, "use_tensorboard": False})
    run = tmp_path / "rl"
    proc = start_rl(cfg, tmp_path, "rl")
    live, err = _status_then_sigterm(proc, run, first_row_s=240, poll_s=0.1, exit_s=180)
    assert proc.returncode == 3, err[-3000:]
    assert live["state"] == "running" and live["trainer"] == "rl" and live["total_steps"] == 6
    stopped = st.run_status(run)
    [a] = stopped["attempts"]
    step = a["end_step"]
    assert stopped["state"] == "stopped" and a["world_size"] == 3 and 1 <= step < 6  # actor, reward, rollout
    assert a["exit"] == f"stopped by SIGTERM after step {step} (checkpoint written)"
    assert stopped["checkpoint"]["newest"]["step"] == step

    finish_rl(start_rl(cfg, tmp_path, "rl"), tmp_path, "rl")
    done = st.run_status(run)
    assert done["state"] == "finished" and done["last_step"] == 6
    assert [(x["start_step"], x["end_step"], x["exit"]) for x in done["attempts"]] == [
        (0, step, a["exit"]), (step, 6, "finished")]
    print("\n" + st.render(done))


def _wait_rows(run: Path, n: int, timeout: float = 240) -> None:
    deadline = time.time() + timeout
    while not ((run / "metrics.jsonl").is_file() and len((run / "metrics.jsonl").read_text().splitlines()) >= n):
        assert time.time() < deadline, f"fewer than {n} metrics rows in {run} after {timeout} s"
        time.sleep(0.2)


@pytest.mark.slurm
@pytest.mark.slow  # 50-85 s: a job, its time-limit signal, the requeue (SLURM waits ~12 s) and the rerun
def test_slurm_job_requeued_by_its_time_limit_signal(slurm_env, tmp_path):
    """An sbatch job of `hpc-rlhf plan --script-only`: status asks squeue while it runs; USR1 (the time-limit
    warning) stops it at a step boundary and rank 0 requeues it; the record holds both attempts of the job
    with their restart counts and where their rank logs are."""
    from sft_fixtures import sft_config, with_paths
    steps = 60  # enough that the signal comes long before the end (a step takes 0.05 to 0.5 s here)
    config = sft_config(tmp_path, steps)
    config["launch"]["nproc"] = 1
    config["train"]["zero_stage"] = 0
    path = with_paths(config, tmp_path, "run")
    run, logs = tmp_path / "run", tmp_path / "logs"
    logs.mkdir()
    script = subprocess.run([sys.executable, "-m", "hpc_rlhf.cli", "plan", "sft", "--config", str(path),
                             "--script-only", f"slurm.python={sys.executable}", f"slurm.log_dir={logs}"],
                            check=True, capture_output=True, text=True, timeout=120).stdout
    (tmp_path / "job.sbatch").write_text(script)
    job = slurm_env.sbatch(tmp_path / "job.sbatch")

    _wait_rows(run, 2)
    live = st.run_status(run)
    assert live["state"] == "running" and live["job_id"] == job, live
    assert live["running_how"] == f"SLURM job {job}: RUNNING (squeue)"
    print("\n" + st.render(live))
    slurm_env.run(["scancel", "--signal=USR1", job])
    assert slurm_env.wait_done(job, timeout=300) == "COMPLETED", (logs / f"{job}.out").read_text()

    done = st.run_status(run)
    first, second = done["attempts"]
    assert done["state"] == "finished" and done["last_step"] == steps and done["job_id"] == job
    assert (first["job_id"], first["restart"], second["job_id"], second["restart"]) == (job, 0, job, 1)
    assert first["log_dir"] == str(logs) and first["host"].startswith("node")
    step = first["end_step"]
    assert first["exit"] == f"stopped by SIGUSR1 after step {step} (checkpoint written); rank 0 requeued the job"
    assert (second["start_step"], second["end_step"], second["exit"]) == (step, steps, "finished")
    assert done["running"] is False and done["queue_state"] in st.FINAL_STATES
    assert done["log_errors"] == second["log_errors"]  # the newest attempt's (the requeue's lines are attempt 1's)
    text = subprocess.run([sys.executable, "-m", "hpc_rlhf.cli", "status", str(run)], check=True,
                          capture_output=True, text=True, timeout=120).stdout
    assert f"job         SLURM job {job}" in text and f"job {job} restart 1 on node" in text
    print("\n" + text)
