"""The `multiturn` demo stage's environment: two tries at a sum (OpenRLHF's agent contract, docs/agents.md).

The prompt is ``a+b=``.  Each answer is checked against the true sum: a right answer earns ``RIGHT`` and ends
the episode; a wrong first answer earns ``WRONG`` and gets the feedback `` too small `` or `` too big `` (just
what a checker comparing the two numbers knows; `` wrong `` when the answer is no number) followed by the
question again, and the model answers a second time (``RIGHT`` or ``WRONG`` again).  An episode's total is 1
for a right first answer, 0.5 for a wrong one fixed on the second try, -1 for two wrong answers.

``extra_logs`` (their means reach the metrics as ``agent/KEY``, ``eval/agent/KEY`` in the eval):
``first_try_correct``, ``wrong_first``, ``fixed`` (wrong first, right second) and ``final_correct``; the fix
rate is ``fixed / wrong_first``.
"""
from __future__ import annotations

from hpc_rlhf.agents import AgentInstanceBase, MultiTurnAgentExecutor

RIGHT, WRONG = 1.0, -0.5  # the reward of each answer


def parse_answer(action_text: str) -> int | None:
    """The answer as a number (surrounding whitespace ignored), or None when it is not a plain number."""
    text = action_text.strip()
    return int(text) if text.isdigit() else None


def feedback(answer: int | None, total: int) -> str:
    """What the environment says about a wrong answer, before the question is asked again."""
    if answer is None:
        return " wrong "
    return " too small " if answer < total else " too big "


def judge(turn: int, correct: bool) -> tuple[float, bool, dict[str, float]]:
    """(reward, done, extra_logs) of the answer on ``turn`` (0: first try, 1: second try, which follows only a
    wrong first answer)."""
    reward = RIGHT if correct else WRONG
    if turn == 0:
        c = float(correct)
        return reward, correct, {"first_try_correct": c, "wrong_first": 1.0 - c, "fixed": 0.0, "final_correct": c}
    if turn == 1:
        c = float(correct)
        return reward, True, {"first_try_correct": 0.0, "wrong_first": 1.0, "fixed": c, "final_correct": c}
    raise ValueError(f"turn {turn}: an episode has two tries at most (agent.max_turns=2)")


class AgentInstance(AgentInstanceBase):
    """One episode: the question is the prompt text (``a+b=``), the label the true sum."""

    def __init__(self, *args, **kwargs):
        super().__init__()
        self.question, self.turn = "", 0

    async def reset(self, states: dict, **kwargs) -> dict:
        self.question, self.turn = states["observation"], 0
        return {"observation": states["observation"]}

    async def step(self, states: dict, **kwargs) -> dict:
        total = int(states["label"])
        answer = parse_answer(states["action_text"])
        reward, done, logs = judge(self.turn, answer == total)
        self.turn += 1
        return {"rewards": reward, "scores": reward, "done": done,
                "environment_feedback": "" if done else feedback(answer, total) + self.question,
                "sampling_params": states.get("sampling_params"), "extra_logs": logs}


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
