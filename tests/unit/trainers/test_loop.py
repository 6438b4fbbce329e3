"""The outer loop every trainer shares (`trainers.loop.run_steps`) and its step boundary, without a model."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from hpc_rlhf.config.sections import LogConfig
from hpc_rlhf.distributed.preemption import NONE, STOP, RunStopped
from hpc_rlhf.logging.metrics import read_metrics
from hpc_rlhf.trainers.loop import StepBoundary, run_steps


class FakeStop:
    """A StopRequest whose vote is set by the test."""

    def __init__(self, vote: int = NONE):
        self.vote = vote

    def code(self) -> int:
        return self.vote


def _cfg(tmp_path, logging_steps: int, eval_steps: int):
    log = LogConfig(logging_steps=logging_steps, eval_steps=eval_steps, use_tensorboard=False, progress_bar="off")
    return SimpleNamespace(log=log, ckpt=SimpleNamespace(save_path=str(tmp_path)))


def _boundary(stop, saved: list, votes: list, save_steps: int = 2, barrier=lambda: None) -> StepBoundary:
    def agree(code):
        votes.append(code)
        return code
    return StepBoundary(stop, save_steps, saved.append, agree, barrier=barrier, leader=True)


def test_cadences_export_and_checkpoints(tmp_path):
    saved, votes, evals = [], [], []

    def evaluate(i):
        evals.append(i)
        return {"eval_loss": 10.0 + i}
    last = run_steps(_cfg(tmp_path, logging_steps=2, eval_steps=3), lambda i: {"loss": float(i)}, 0, 5,
                     _boundary(FakeStop(), saved, votes), is_main=True, desc="t", evaluate=evaluate,
                     export=lambda: {"reward_mean": 0.5})
    # eval after steps 3 and 5 (the last), rows every 2 steps and at the last, then the export's own row
    assert evals == [3, 5]  # evaluate(steps done)
    assert read_metrics(tmp_path / "metrics.jsonl") == [
        {"step": 2, "loss": 1.0}, {"step": 4, "loss": 3.0}, {"step": 5, "loss": 4.0, "eval_loss": 15.0},
        {"step": 5, "reward_mean": 0.5}]
    assert last == {"loss": 4.0, "eval_loss": 15.0, "reward_mean": 0.5}
    assert votes == [NONE] * 5 and saved == [2, 4]  # every save_steps, never after the last step


def test_resumed_run_starts_at_its_step_and_keeps_earlier_rows(tmp_path):
    cfg = _cfg(tmp_path, logging_steps=1, eval_steps=-1)
    with pytest.raises(RunStopped):
        run_steps(cfg, lambda i: {"loss": float(i)}, 0, 4, _boundary(FakeStop(STOP), [], []), is_main=True,
                  desc="t")
    done = []
    last = run_steps(cfg, lambda i: done.append(i) or {"loss": float(i)}, 1, 4, _boundary(FakeStop(), [], []),
                     is_main=True, desc="t")
    assert done == [1, 2, 3] and last == {"loss": 3.0}
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]


def test_stop_saves_closes_the_sinks_then_raises(tmp_path):
    saved, votes, order = [], [], []
    stop = FakeStop()

    def step(i):
        if i == 1:
            stop.vote = STOP  # a signal during the second step
        return {"loss": float(i)}
    boundary = _boundary(stop, saved, votes, save_steps=0, barrier=lambda: order.append("barrier"))
    with pytest.raises(RunStopped) as info:
        run_steps(_cfg(tmp_path, logging_steps=1, eval_steps=-1), step, 0, 5, boundary, is_main=True, desc="t",
                  export=lambda: order.append("export") or {})
    assert info.value.step == 2 and not info.value.requeue
    assert saved == [2] and votes == [NONE, STOP] and order == ["barrier"]  # no export after a stop
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]


def test_a_stop_agreed_after_the_last_step_ends_normally(tmp_path):
    saved, votes = [], []
    stop = FakeStop()

    def step(i):
        stop.vote = STOP if i == 2 else NONE  # a signal during the last step: nothing left to stop
        return {"loss": float(i)}
    last = run_steps(_cfg(tmp_path, logging_steps=1, eval_steps=-1), step, 0, 3, _boundary(stop, saved, votes),
                     is_main=True, desc="t", export=lambda: {"exported": 1.0})
    assert last == {"loss": 2.0, "exported": 1.0}
    assert votes == [NONE, NONE, STOP] and saved == [2]


def test_eval_at_start_and_eval_only(tmp_path):
    cfg = _cfg(tmp_path / "start", logging_steps=1, eval_steps=-1)
    evals = []
    last = run_steps(cfg, lambda i: {"loss": float(i)}, 0, 2, _boundary(FakeStop(), [], []), is_main=True, desc="t",
                     evaluate=lambda done: evals.append(done) or {"ev": float(done)}, eval_at_start=True)
    assert evals == [0, 2] and last == {"loss": 1.0, "ev": 2.0}
    assert read_metrics(tmp_path / "start" / "metrics.jsonl") == [
        {"step": 0, "ev": 0.0}, {"step": 1, "loss": 0.0}, {"step": 2, "loss": 1.0, "ev": 2.0}]
    steps, saved, exported = [], [], []
    last = run_steps(_cfg(tmp_path / "only", logging_steps=1, eval_steps=1), steps.append, 3, 5,
                     _boundary(FakeStop(), saved, []), is_main=True, desc="t", evaluate=lambda done: {"ev": 7.0},
                     export=lambda: exported.append(1) or {}, eval_only=True)
    assert last == {"ev": 7.0} and steps == [] and saved == [] and exported == []  # no step, no export
    assert read_metrics(tmp_path / "only" / "metrics.jsonl") == [{"step": 3, "ev": 7.0}]


def test_on_eval_stops_with_a_checkpoint_and_the_export(tmp_path):
    """on_eval sees every eval; True ends the run at that step: a checkpoint (even off the save cadence), no
    stop vote, the export's row at that step."""
    seen, saved, votes = [], [], []
    last = run_steps(_cfg(tmp_path, logging_steps=2, eval_steps=1), lambda i: {"loss": float(i)}, 0, 6,
                     _boundary(FakeStop(), saved, votes, save_steps=4), is_main=True, desc="t",
                     evaluate=lambda done: {"ev": float(done)}, export=lambda: {"exported": 1.0},
                     on_eval=lambda done, m: seen.append((done, m)) or m["ev"] >= 3)
    assert seen == [(1, {"ev": 1.0}), (2, {"ev": 2.0}), (3, {"ev": 3.0})]
    assert saved == [3] and votes == [NONE, NONE]  # steps 1 and 2 ended at the boundary; step 3 stopped
    assert last == {"loss": 2.0, "ev": 3.0, "exported": 1.0}
    assert read_metrics(tmp_path / "metrics.jsonl") == [
        {"step": 2, "loss": 1.0, "ev": 2.0}, {"step": 3, "loss": 2.0, "ev": 3.0}, {"step": 3, "exported": 1.0}]
    # a threshold reached at the start: no step at all, the export still runs
    steps = []
    last = run_steps(_cfg(tmp_path / "at_start", logging_steps=1, eval_steps=1), steps.append, 0, 3,
                     _boundary(FakeStop(), [], []), is_main=True, desc="t", evaluate=lambda done: {"ev": 5.0},
                     export=lambda: {"exported": 1.0}, eval_at_start=True, on_eval=lambda done, m: True)
    assert steps == [] and last == {"ev": 5.0, "exported": 1.0}
