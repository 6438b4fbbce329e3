"""Preemption and time limits: signals only set a flag; trainers act on it at a step boundary.

A signal can arrive in any rank at any moment, in the middle of a collective.  The handler does
nothing but record it.  At the end of each step the trainer asks every rank (one small all-reduce
of ``StopRequest.code()``, maximum over ranks), so all roles see the same decision at the same step:
write a checkpoint, then (``stop_after_checkpoint``) the leader asks SLURM to requeue the job when
the signal was one of the requeue signals (the time-limit warning of ``sbatch --signal``), all ranks
wait for it, and every rank raises ``RunStopped``.  The requeue comes before any rank exits because
srun --kill-on-bad-exit ends the whole step as soon as one rank leaves with a non-zero code.  The
command table (``hpc_rlhf.commands.run``) turns ``RunStopped`` into exit code ``EXIT_STOPPED``.  SLURM requeues a
preempted job on its own after its SIGTERM.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess

log = logging.getLogger("hpc_rlhf.preemption")

EXIT_STOPPED = 3
NONE, STOP, STOP_AND_REQUEUE = 0, 1, 2


class RunStopped(Exception):
    """Raised on every rank after the checkpoint of the step at which the ranks agreed to stop."""

    def __init__(self, step: int, requeue: bool, leader: bool):
        super().__init__(f"stopped by a signal after step {step} (checkpoint written)"
                         + ("; requeue requested" if requeue else ""))
        self.step, self.requeue, self.leader = step, requeue, leader


class StopRequest:
    """The stop signals' handler (built in the main thread).  ``received``: the signal, once the handler has run.

    The handler runs in the main thread between two Python instructions, so not while that thread waits inside a
    collective (srun's SIGTERM to the survivors of a dead rank finds them there).  ``arrived()`` answers at once
    from any thread: the interpreter's C-level handler writes each signal's number into a wakeup pipe."""

    def __init__(self, stop_signals: list[str], requeue_signals: list[str]):
        self.requeue_signals = set(requeue_signals)
        self.received: str | None = None
        self._previous = {}
        self._numbers = {int(getattr(signal, f"SIG{name}")) for name in stop_signals}
        for name in stop_signals:
            sig = getattr(signal, f"SIG{name}")
            self._previous[sig] = signal.signal(sig, self._handle)
        self._seen, self._pipe, self._previous_fd = False, None, -1
        if self._numbers:
            r, w = os.pipe()
            os.set_blocking(r, False)
            os.set_blocking(w, False)
            self._previous_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
            self._pipe = (r, w)
            if self._previous_fd != -1:  # someone else's (an event loop's): leave it theirs, do without
                self.restore_wakeup()

    @classmethod
    def from_config(cls, slurm_cfg) -> "StopRequest":
        return cls(slurm_cfg.stop_signals, slurm_cfg.requeue_signals if slurm_cfg.requeue else [])

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name.removeprefix("SIG")
        if self.received is None or name in self.requeue_signals:
            self.received = name

    def code(self) -> int:
        """This rank's vote: NONE, STOP, or STOP_AND_REQUEUE (ranks agree on the maximum)."""
        if self.received is None:
            return NONE
        return STOP_AND_REQUEUE if self.received in self.requeue_signals else STOP

    def arrived(self) -> bool:
        """Whether a stop signal has arrived, its Python handler run or not (any thread may ask)."""
        if self.received is not None or self._seen:
            return True
        if self._pipe is not None:
            try:
                self._seen = any(b in self._numbers for b in os.read(self._pipe[0], 512))
            except (BlockingIOError, OSError):
                pass
        return self._seen

    def restore_wakeup(self) -> None:
        if self._pipe is not None:
            signal.set_wakeup_fd(self._previous_fd)
            os.close(self._pipe[1])
            os.close(self._pipe[0])
            self._pipe = None

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
        self.restore_wakeup()


class StepBoundary:
    """The end of every step, on every rank: agree on a stop (``agree``: maximum over all ranks),
    ``save(done)`` when stopping or every ``save_steps``, and when stopping raise RunStopped (after
    ``before_stop``, which closes the run's sinks, and the requeue)."""

    def __init__(self, stop: StopRequest, save_steps: int, save, agree, barrier, leader: bool):
        self.stop, self.save_steps, self.save = stop, save_steps, save
        self.agree, self.barrier, self.leader = agree, barrier, leader

    def __call__(self, done: int, total: int, before_stop=lambda: None) -> None:
        decision = int(self.agree(self.stop.code()))
        stopping = decision != NONE and done < total
        if done < total and (stopping or (self.save_steps > 0 and done % self.save_steps == 0)):
            self.save(done)
        if stopping:
            before_stop()
            stop_after_checkpoint(decision, done, self.leader, self.barrier)


def stop_after_checkpoint(decision: int, step: int, leader: bool, barrier) -> None:
    """Called on every rank once the checkpoint of ``step`` is committed; always raises RunStopped.

    The stop is logged here, before the requeue: ``scontrol requeue`` ends the job step (SIGTERM, then
    SIGKILL after SLURM's KillWait), which can come before the ranks have unwound to the entry point."""
    stopped = RunStopped(step, decision == STOP_AND_REQUEUE, leader)
    log.warning("%s", stopped)
    if stopped.requeue and leader:
        requeue_job()
    barrier()
    raise stopped


def requeue_job(job_id: str | None = None) -> bool:
    """``scontrol requeue`` this SLURM job; False (and a log line) when that is not possible."""
    job_id = job_id or os.environ.get("SLURM_JOB_ID")
    if not job_id:
        log.warning("a requeue was requested but this is not a SLURM job; not requeued")
        return False
    try:
        subprocess.run(["scontrol", "requeue", job_id], check=True, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.error("scontrol requeue %s failed: %s", job_id, str(detail).strip())
        return False
    log.warning("requeued SLURM job %s; it resumes from the checkpoint when it starts again", job_id)
    return True
