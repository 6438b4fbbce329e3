"""Agent execution: the generate phase's executors, single-turn and multi-turn (docs/agents.md).

An environment file imports its base classes from here: ``from hpc_rlhf.agents import AgentInstanceBase,
MultiTurnAgentExecutor`` (OpenRLHF's names).
"""
from __future__ import annotations

from .contract import AgentFileError, AgentInstanceBase, MultiTurnAgentExecutor, load_agent
from .executor import (AgentError, AgentLimits, Executor, MultiTurnExecutor, Request, SingleTurnExecutor,
                       Trajectory)
from .feedback import FeedbackFormat

__all__ = ["AgentError", "AgentFileError", "AgentInstanceBase", "AgentLimits", "Executor", "MultiTurnAgentExecutor",
           "MultiTurnExecutor", "Request", "SingleTurnExecutor", "Trajectory", "make_executor"]


def make_executor(agent, tokenizer, stop_token_ids: list[int]) -> Executor:
    """The executor for the ``agent`` config section: single-turn without an environment file."""
    if not agent.agent_func_path:
        return SingleTurnExecutor()
    make_episode, form = load_agent(agent.agent_func_path)
    style = agent.feedback_template
    if style == "auto":
        style = "user_turn" if form == "simple" and getattr(tokenizer, "chat_template", None) else "raw"
    feedback = FeedbackFormat(tokenizer, style, stop_token_ids)
    limits = AgentLimits(agent.max_turns, agent.max_context_len, agent.step_timeout_s, agent.max_failure_fraction)
    return MultiTurnExecutor(make_episode, lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                             feedback, limits)
