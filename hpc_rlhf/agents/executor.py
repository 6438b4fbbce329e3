"""Executors: what the generate phase calls to turn prompts into token trajectories.

An executor gets :class:`Request` s (a prompt's token ids and text, its label, the sample's seed) and an engine,
and returns one :class:`Trajectory` per request.  :class:`SingleTurnExecutor` is one ``engine.generate`` call
(the single-turn path); :class:`MultiTurnExecutor` alternates generation and environment steps.

Token in, token out: a trajectory's context is a token list that only grows.  The action tokens are the
engine's sampled ids (with its log-probs); the environment's feedback is tokenized on its own and appended; no
earlier turn is ever decoded and tokenized again.  ``action_mask`` is 1 exactly on sampled tokens: feedback,
template tokens the framework inserts and an end-of-turn token it appends have 0 (and log-prob 0.0).
"""
from __future__ import annotations

import abc
import asyncio
import dataclasses
import logging
import math
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from ..generation.engine import FINISH_LENGTH, FINISH_STOP, sample_seed, SamplingParams
from .feedback import FeedbackFormat

log = logging.getLogger("hpc_rlhf.agents")

TURN_SALT = -7  # turn t > 0 of a sample with seed s samples with sample_seed(s, TURN_SALT, t, 0)


class AgentError(RuntimeError):
    """Too many trajectories failed in the environment (agent.max_failure_fraction)."""


@dataclass
class Request:
    prompt_ids: list[int]
    prompt_text: str
    label: str | None
    seed: int


@dataclass
class Trajectory:
    """One sample: the prompt's ids, then everything after it (actions and feedback) in ``response_ids``.

    ``action_mask[i]`` is 1 where ``response_ids[i]`` was sampled by the engine; ``logprobs[i]`` is the engine's
    log-prob of it there (0.0 elsewhere).  ``turn_ends[k]`` is the index in ``response_ids`` of turn k's last
    action token and ``turn_rewards[k]`` the environment's reward for turn k.  ``reward`` is their sum (None
    without an environment), ``score`` the environment's last ``scores`` (for dynamic filtering; default the
    reward).  ``error`` names why the environment failed (the trajectory is then invalid), else None.
    ``finish_reason`` is "length" when a limit cut the trajectory (a turn's max new tokens, the context
    budget, max_turns), else "stop".
    """

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    action_mask: list[int] | None = None  # None: every response token is an action (single turn)
    turn_ends: list[int] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    reward: float | None = None
    score: float | None = None
    error: str | None = None
    extra_logs: dict[str, float] = field(default_factory=dict)

    @property
    def turns(self) -> int:
        return max(len(self.turn_ends), 1)


class Executor(abc.ABC):
    """Turns requests into trajectories with ``engine`` (any :class:`~hpc_rlhf.generation.engine.RolloutEngine`)."""

    @abc.abstractmethod
    def run(self, engine, requests: list[Request], params: SamplingParams) -> list[Trajectory]:
        """One trajectory per request, in order."""


class SingleTurnExecutor(Executor):
    """One generation per request: the response is the completion, every token an action."""

    def run(self, engine, requests, params):
        if not requests:
            return []
        outs = engine.generate([r.prompt_ids for r in requests], params, [r.seed for r in requests])
        return [Trajectory(list(r.prompt_ids), list(o.token_ids), list(o.logprobs), o.finish_reason)
                for r, o in zip(requests, outs)]


@dataclass
class AgentLimits:
    max_turns: int                 # generations per trajectory at most
    max_context_len: int           # prompt + every action and feedback token, at most
    step_timeout_s: float          # one reset or step call, at most
    max_failure_fraction: float    # of one call's trajectories failing in the environment, before AgentError


@dataclass
class StepResult:
    reward: float
    done: bool
    feedback: str
    score: float | None = None
    sampling_params: Any = None
    extra_logs: dict[str, float] = field(default_factory=dict)


class EnvFailure(Exception):
    """The environment raised, returned a malformed result or ran out of time; ``kind`` groups the messages."""

    def __init__(self, kind: str, message: str):
        super().__init__(f"{kind}: {message}")
        self.kind = kind


class Episode(abc.ABC):
    """One environment instance, driven by :class:`MultiTurnExecutor` (agents/contract.py adapts user classes).
    ``blocking``: its methods call plain (not async) user code, so the executor runs each call in a worker
    thread, where the event loop can give up on it at the timeout."""

    blocking: bool = False

    @abc.abstractmethod
    async def reset(self, prompt_text: str, label: str | None) -> str:
        """The first observation's text (the prompt text itself keeps the prompt's token ids)."""

    @abc.abstractmethod
    async def step(self, observation_text: str, action_text: str, label: str | None,
                   params: SamplingParams) -> StepResult:
        """The environment's answer to one action."""


@dataclass
class _State:
    request: Request
    episode: Episode | None
    context: list[int]
    observation: str
    params: SamplingParams
    traj: Trajectory
    done: bool = False
    last_action: list[int] = field(default_factory=list)


class MultiTurnExecutor(Executor):
    """Drives one environment per request: generate (all live trajectories in one engine call per distinct
    sampling setting), step every environment concurrently, append the feedback, until each is done or cut.

    ``make_episode()`` makes a fresh environment; ``decode(ids)`` is the action text the environment reads;
    ``feedback`` turns the environment's feedback text into the tokens appended (agents/feedback.py) and
    tokenizes an observation that reset rewrote.
    """

    def __init__(self, make_episode: Callable[[], Episode], decode: Callable[[list[int]], str],
                 feedback: FeedbackFormat, limits: AgentLimits):
        self.make_episode, self.decode = make_episode, decode
        self.feedback, self.limits = feedback, limits
        self._logged: set[str] = set()  # failure kinds already logged (each once per run)

    def run(self, engine, requests, params):
        if not requests:
            return []
        pool = ThreadPoolExecutor(max_workers=min(32, len(requests)), thread_name_prefix="hpc_rlhf-env")
        try:
            out = asyncio.run(self._run(engine, requests, params, pool))
        finally:
            pool.shutdown(wait=False, cancel_futures=True)  # a sync call that timed out is not waited for
        failed = [t for t in out if t.error is not None]
        if failed and len(failed) > self.limits.max_failure_fraction * len(out):
            kinds = Counter(t.error.split(":", 1)[0] for t in failed)
            raise AgentError(f"{len(failed)} of {len(out)} trajectories failed in the environment (more than "
                             f"agent.max_failure_fraction={self.limits.max_failure_fraction}): "
                             f"{', '.join(f'{k} x{n}' for k, n in kinds.most_common())}; first: {failed[0].error}")
        return out

    # ---- one call ------------------------------------------------------------------------------------------
    async def _run(self, engine, requests, params, pool) -> list[Trajectory]:
        states = [_State(r, None, list(r.prompt_ids), r.prompt_text, params,
                         Trajectory(list(r.prompt_ids), [], [], FINISH_STOP, action_mask=[]))
                  for r in requests]
        await asyncio.gather(*(self._reset(s, pool) for s in states))
        for turn in range(self.limits.max_turns):
            live = [s for s in states if not s.done]
            if not live:
                break
            self._generate(engine, live, turn)
            await asyncio.gather(*(self._step(s, pool, turn == self.limits.max_turns - 1) for s in live))
        return [s.traj for s in states]

    async def _call(self, episode: Episode, method: str, pool, *args):
        """``episode.method(*args)`` within step_timeout_s (in a worker thread when the episode is blocking)."""
        fn = getattr(episode, method)
        if episode.blocking:
            call = asyncio.get_running_loop().run_in_executor(pool, lambda: asyncio.run(fn(*args)))
        else:
            call = fn(*args)
        try:
            return await asyncio.wait_for(call, self.limits.step_timeout_s)
        except asyncio.TimeoutError:
            raise EnvFailure("timeout", f"{method} took more than agent.step_timeout_s="
                                        f"{self.limits.step_timeout_s} s") from None

    def _fail(self, s: _State, err: Exception) -> None:
        kind = err.kind if isinstance(err, EnvFailure) else f"raised {type(err).__name__}"
        msg = str(err) if isinstance(err, EnvFailure) else f"{kind}: {err}"
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning("environment failure (%s; the sample is invalid, logged once per kind): %s", kind, msg)
        s.traj.error, s.done = msg, True

    async def _reset(self, s: _State, pool) -> None:
        try:
            s.episode = self.make_episode()
            obs = await self._call(s.episode, "reset", pool, s.request.prompt_text, s.request.label)
        except Exception as e:  # noqa: BLE001 - any failure of user code makes this sample invalid
            return self._fail(s, e)
        if obs != s.request.prompt_text:  # the environment rewrote the prompt: its text, tokenized on its own
            s.context = self.feedback.encode(obs)  # the tokenizer alone, no special tokens added
            if not s.context:  # the engine needs a token to start from
                return self._fail(s, EnvFailure("malformed", "reset returned an empty observation"))
            s.traj.prompt_ids = list(s.context)
            s.observation = obs
        if len(s.context) >= self.limits.max_context_len:
            s.traj.finish_reason, s.done = FINISH_LENGTH, True

    def _generate(self, engine, live: list[_State], turn: int) -> None:
        """One engine call per distinct sampling setting; each row's new tokens capped by its context budget."""
        calls: dict[str, list[tuple[_State, SamplingParams]]] = {}
        for s in live:
            budget = self.limits.max_context_len - len(s.context)
            p = dataclasses.replace(s.params, max_new_tokens=min(s.params.max_new_tokens, budget))
            calls.setdefault(repr(p), []).append((s, p))
        for rows in calls.values():
            seeds = [s.request.seed if turn == 0 else sample_seed(s.request.seed, TURN_SALT, turn, 0)
                     for s, _ in rows]
            outs = engine.generate([s.context for s, _ in rows], rows[0][1], seeds)
            for (s, _), o in zip(rows, outs):
                t = s.traj
                t.response_ids += o.token_ids
                t.action_mask += [1] * len(o.token_ids)
                t.logprobs += list(o.logprobs)
                t.turn_ends.append(len(t.response_ids) - 1)
                t.finish_reason = o.finish_reason
                s.context += o.token_ids
                s.last_action = list(o.token_ids)

    async def _step(self, s: _State, pool, last_turn: bool) -> None:
        t = s.traj
        action_text = self.decode(s.last_action)
        try:
            res = parse_step_result(await self._call(s.episode, "step", pool, s.observation, action_text,
                                                     s.request.label, s.params))
            params = s.params if res.sampling_params is None else merge_params(s.params, res.sampling_params)
        except Exception as e:  # noqa: BLE001
            return self._fail(s, e)
        t.turn_rewards.append(res.reward)
        t.reward = sum(t.turn_rewards)
        t.score = res.score if res.score is not None else t.reward
        t.extra_logs = res.extra_logs
        s.observation += action_text
        s.params = params
        if res.done:
            s.done = True
            return
        # max_turns reached with the environment still going (no feedback: it would carry no loss and read as
        # part of the answer), or no room for feedback and another action
        if last_turn or len(s.context) >= self.limits.max_context_len:
            t.finish_reason, s.done = FINISH_LENGTH, True
            return
        ids = self.feedback.tokens(res.feedback, s.last_action)
        if len(s.context) + len(ids) >= self.limits.max_context_len:
            t.finish_reason, s.done = FINISH_LENGTH, True
            return
        s.context += ids
        t.response_ids += ids
        t.action_mask += [0] * len(ids)
        t.logprobs += [0.0] * len(ids)
        s.observation += res.feedback
        t.finish_reason = FINISH_STOP


def _number(value, what: str) -> float:
    try:
        x = float(value.item() if hasattr(value, "item") else value)
    except (TypeError, ValueError, RuntimeError):
        raise EnvFailure("malformed", f"{what} must be a number (or a one-element tensor), got {value!r}") from None
    if not math.isfinite(x):
        raise EnvFailure("malformed", f"{what} must be finite, got {x}")
    return x


def parse_step_result(res) -> StepResult:
    """OpenRLHF's step dict (``rewards``, ``done``, ``environment_feedback``; optional ``scores``,
    ``sampling_params``, ``extra_logs``), checked; an :class:`EnvFailure` ("malformed") names what is wrong."""
    if isinstance(res, StepResult):  # the simple form's adapter has checked it already
        return res
    if not isinstance(res, dict):
        raise EnvFailure("malformed", f"step must return a dict, got {type(res).__name__}")
    missing = [k for k in ("rewards", "done") if k not in res]
    if missing:
        raise EnvFailure("malformed", f"step's dict lacks {', '.join(missing)} (it has {', '.join(sorted(res))})")
    done = res["done"]
    try:
        done = bool(done.item() if hasattr(done, "item") else done)
    except (RuntimeError, ValueError):  # a tensor or array of several elements
        raise EnvFailure("malformed", f"done must be a bool (or a one-element tensor), got {done!r:.200}") from None
    feedback = res.get("environment_feedback", "")
    if feedback is None:
        feedback = ""
    if done:  # the final feedback is never appended, so its type does not matter
        feedback = feedback if isinstance(feedback, str) else ""
    elif "environment_feedback" not in res:
        raise EnvFailure("malformed", "step's dict lacks environment_feedback while done is false")
    elif not isinstance(feedback, str):
        raise EnvFailure("malformed", f"environment_feedback must be a str, got {type(feedback).__name__}")
    score = res.get("scores")
    extra = {}
    for k, v in (res.get("extra_logs") or {}).items():
        try:
            extra[str(k)] = _number(v, f"extra_logs[{k!r}]")
        except EnvFailure:
            continue  # a non-numeric log value is not a failure of the sample; it is just not logged
    return StepResult(reward=_number(res["rewards"], "rewards"), done=done, feedback=feedback,
                      score=None if score is None else _number(score, "scores"),
                      sampling_params=res.get("sampling_params"), extra_logs=extra)


_PARAM_NAMES = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                "max_new_tokens": "max_new_tokens", "max_tokens": "max_new_tokens"}


def merge_params(params: SamplingParams, new) -> SamplingParams:
    """The environment's next sampling settings: our SamplingParams, a dict, or an object with vLLM's attribute
    names (temperature, top_p, top_k, max_tokens); unnamed settings and the stop tokens stay."""
    if isinstance(new, SamplingParams):
        return dataclasses.replace(new, stop_token_ids=new.stop_token_ids or params.stop_token_ids)
    items = new.items() if isinstance(new, dict) else ((k, getattr(new, k, None)) for k in _PARAM_NAMES)
    changes = {_PARAM_NAMES[k]: v for k, v in items if k in _PARAM_NAMES and v is not None}
    try:
        if changes.get("top_k", 0) < 0:  # vLLM's "off" is -1, ours 0
            changes["top_k"] = 0
        return dataclasses.replace(params, **changes)
    except (TypeError, ValueError) as e:
        raise EnvFailure("malformed", f"sampling_params: {e}") from None
