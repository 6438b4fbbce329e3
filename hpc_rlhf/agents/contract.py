"""The environment file named by ``agent.agent_func_path``, in either of two forms (docs/agents.md).

OpenRLHF's form, which runs with only its import line changed
(``from hpc_rlhf.agents import AgentInstanceBase, MultiTurnAgentExecutor``)::

    class AgentInstance(AgentInstanceBase):
        async def reset(self, states): ...      # states: observation (the prompt text), label
                                                # -> {"observation": text}
        async def step(self, states): ...       # states: observation_text, action_text, label, sampling_params
                                                # -> {"rewards", "scores", "environment_feedback", "done",
                                                #     "sampling_params", "extra_logs"}

    class AgentExecutor(MultiTurnAgentExecutor):
        def __init__(self):
            super().__init__(AgentInstance)

``reset`` and ``step`` may be plain or ``async`` methods.  The simpler form for new code::

    class Environment:
        def reset(self, prompt: str, label: str | None) -> str: ...          # the first observation
        def step(self, action: str) -> tuple[str, float, bool]: ...          # (feedback, reward, done)

Both reach the same executor (agents/executor.py) through an :class:`~hpc_rlhf.agents.executor.Episode`.
"""
from __future__ import annotations

import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Callable

from .executor import EnvFailure, Episode, StepResult, parse_step_result


class AgentInstanceBase:
    """Base of an OpenRLHF-style environment instance: one per sample, made with no arguments."""

    def __init__(self, *args, **kwargs):
        pass

    async def reset(self, states: dict, **kwargs) -> dict:
        return {"observation": states["observation"]}

    async def step(self, states: dict, **kwargs) -> dict:
        raise NotImplementedError(f"{type(self).__name__}.step is not implemented")


class MultiTurnAgentExecutor:
    """OpenRLHF's executor class, kept for its contract: a user file subclasses it with its instance class."""

    def __init__(self, agent_instance_cls):
        if not (inspect.isclass(agent_instance_cls) and callable(getattr(agent_instance_cls, "step", None))):
            raise TypeError(f"MultiTurnAgentExecutor needs an environment class with reset and step, got "
                            f"{agent_instance_cls!r}")
        self.agent_instance_cls = agent_instance_cls


class AgentFileError(ValueError):
    """The agent file is missing, does not import, or defines neither form."""


async def _maybe_await(value):
    return await value if inspect.isawaitable(value) else value


class _Dict(Episode):
    """OpenRLHF's dict contract."""

    def __init__(self, instance):
        self.instance = instance
        self.blocking = not _is_async(instance)

    async def reset(self, prompt_text, label):
        out = await _maybe_await(self.instance.reset({"observation": prompt_text, "label": label}))
        if not isinstance(out, dict) or not isinstance(out.get("observation"), str):
            raise EnvFailure("malformed", f"reset must return {{'observation': str}}, got {out!r:.200}")
        return out["observation"]

    async def step(self, observation_text, action_text, label, params):
        return await _maybe_await(self.instance.step({"observation_text": observation_text, "action_text": action_text,
                                                      "label": label, "sampling_params": params}))


class _Simple(Episode):
    """``reset(prompt, label) -> str`` and ``step(action) -> (feedback, reward, done)``."""

    def __init__(self, env):
        self.env = env
        self.blocking = not _is_async(env)

    async def reset(self, prompt_text, label):
        out = await _maybe_await(self.env.reset(prompt_text, label))
        if not isinstance(out, str):
            raise EnvFailure("malformed", f"reset must return the observation text, got {type(out).__name__}")
        return out

    async def step(self, observation_text, action_text, label, params):
        out = await _maybe_await(self.env.step(action_text))
        if not (isinstance(out, tuple) and len(out) == 3):
            raise EnvFailure("malformed", f"step must return (feedback, reward, done), got {out!r:.200}")
        feedback, reward, done = out
        return parse_step_result({"environment_feedback": feedback, "rewards": reward, "done": done})


def load_agent(path: str) -> tuple[Callable[[], Episode], str]:
    """(a factory of fresh episodes, the form's name: "openrlhf" or "simple") for the agent file."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise AgentFileError(f"{path}: no such file")
    name = f"hpc_rlhf_agent_{abs(hash(str(file.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        raise AgentFileError(f"{path}: importing it failed: {type(e).__name__}: {e}") from e
    executor = getattr(module, "AgentExecutor", None)
    if inspect.isclass(executor) and issubclass(executor, MultiTurnAgentExecutor):
        try:
            cls = executor().agent_instance_cls
        except Exception as e:
            raise AgentFileError(f"{path}: AgentExecutor() failed: {type(e).__name__}: {e}") from e
    else:
        cls = getattr(module, "AgentInstance", None)
    if inspect.isclass(cls):
        return (lambda: _Dict(cls())), "openrlhf"
    env = getattr(module, "Environment", None)
    if inspect.isclass(env) and callable(getattr(env, "reset", None)) and callable(getattr(env, "step", None)):
        return (lambda: _Simple(env())), "simple"
    raise AgentFileError(f"{path} defines no environment: it needs class AgentExecutor("
                         f"MultiTurnAgentExecutor) (or class AgentInstance) with reset/step taking dicts, or class "
                         f"Environment with reset(prompt, label) -> str and step(action) -> (feedback, reward, "
                         f"done) (docs/agents.md)")


def _is_async(obj) -> bool:
    """Both reset and step are coroutine functions (else the episode runs in a worker thread)."""
    return all(inspect.iscoroutinefunction(getattr(obj, m, None)) for m in ("reset", "step"))


__all__ = ["AgentInstanceBase", "MultiTurnAgentExecutor", "AgentFileError", "load_agent", "StepResult"]
