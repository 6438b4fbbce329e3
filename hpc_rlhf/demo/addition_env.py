"""The `multiturn` demo stage's environment: two tries at a sum (OpenRLHF's agent contract, docs/agents.md).

The prompt is ``a+b=``.  Each answer is checked against the true sum (the label): a right answer earns
``RIGHT`` and ends the episode; a wrong first answer earns ``WRONG`` and gets the feedback ``RETRY`` (" no ")
followed by the question again, and the model answers once more (``RIGHT`` or ``WRONG`` again).  Episode
totals: 1 for a right first answer, 0.5 for a wrong one fixed on the second try, -1 for two misses.  The
feedback says only that the answer was wrong, never the sum nor how far off it was.

The second try samples from the whole distribution (``RETRY_SAMPLING``: top_k off), whatever top_k the first
try had; a greedy eval (temperature 0) stays greedy on both tries.

``extra_logs`` (their means reach the metrics as ``agent/KEY``, ``eval/agent/KEY`` in the eval):
``first_try_correct``, ``wrong_first``, ``fixed`` (wrong first, right second) and ``final_correct``; the fix
rate is ``fixed / wrong_first``.
"""
from __future__ import annotations

from hpc_rlhf.agents import AgentInstanceBase, MultiTurnAgentExecutor

RIGHT, WRONG = 1.0, -0.5  # the reward of each answer
RETRY = " no "
RETRY_SAMPLING = {"top_k": 0}


def is_correct(action_text: str, label: str) -> bool:
    """The answer is the label, surrounding whitespace ignored."""
    return action_text.strip() == str(label).strip()


def judge(turn: int, correct: bool) -> tuple[float, bool, dict[str, float]]:
    """(reward, done, extra_logs) of the answer on ``turn`` (0: first try, 1: second try, which follows only a
    wrong first answer)."""
    reward, c = (RIGHT if correct else WRONG), float(correct)
    if turn == 0:
        return reward, correct, {"first_try_correct": c, "wrong_first": 1.0 - c, "fixed": 0.0, "final_correct": c}
    if turn == 1:
        return reward, True, {"first_try_correct": 0.0, "wrong_first": 1.0, "fixed": c, "final_correct": c}
    raise ValueError(f"turn {turn}: an episode has two tries at most (agent.max_turns=2)")


class AgentInstance(AgentInstanceBase):
    """One episode: the question is the prompt text (``a+b=``), the label the true sum."""

    def __init__(self, *args, **kwargs):
        super().__init__()
        self.question, self.turn, self.total = "", 0, 0.0

    async def reset(self, states: dict, **kwargs) -> dict:
        self.question, self.turn, self.total = states["observation"], 0, 0.0
        return {"observation": states["observation"]}

    async def step(self, states: dict, **kwargs) -> dict:
        reward, done, logs = judge(self.turn, is_correct(states["action_text"], states["label"]))
        self.turn += 1
        self.total += reward  # scores: what dynamic filtering compares, the episode's total so far
        return {"rewards": reward, "scores": self.total, "done": done,
                "environment_feedback": "" if done else RETRY + self.question,
                "sampling_params": None if done else dict(RETRY_SAMPLING), "extra_logs": logs}


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
