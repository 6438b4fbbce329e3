"""A calculator tool for math word problems, as an environment file (``agent.agent_func_path``).

The model may call the calculator inside its answer: ``<calc>37*12</calc>``.  The environment evaluates every
call of the turn with a small arithmetic evaluator (numbers, ``+ - * / **`` and parentheses; never ``eval``)
and replies ``<result>444</result>`` (or ``<error>...</error>`` for an expression it cannot evaluate); that
turn's reward is 0 and the episode goes on.  A turn without a call is the final answer: it is checked against
the label with the math verifier (hpc_rlhf/rewards/math_verify.py), reward 1 or 0, and the episode ends.
A turn whose calls would pass ``MAX_CALLS`` for the episode ends it with reward 0.

Written to OpenRLHF's contract (``AgentInstance`` with async ``reset``/``step`` taking and returning dicts,
``AgentExecutor(MultiTurnAgentExecutor)``); extra_logs per trajectory: ``tool_calls`` (calls made) and
``correct`` (1 for a verified final answer).
"""
from __future__ import annotations

import ast
import math
import operator
import re
from fractions import Fraction

from hpc_rlhf.agents import AgentInstanceBase, MultiTurnAgentExecutor
from hpc_rlhf.rewards.math_verify import verify

MAX_CALLS = 4            # calculator calls per episode
MAX_EXPR_CHARS = 200     # longer expressions are refused
MAX_ABS = Fraction(10) ** 30  # a value (or intermediate value) beyond this is refused
MAX_EXPONENT = 64        # |exponent| of ** at most (an integer)
DECIMALS = 10            # a result that is no integer is shown rounded to this many decimals

# Appended to the user's message of a ChatML prompt (before any other prompt: put in front of it).
TOOL_HINT = ("Use the calculator: reply with only <calc>EXPRESSION</calc> (e.g. <calc>9+6</calc>); you will then "
             "get <result>VALUE</result>. After that, give the final number.")

_CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
_OPEN = "<calc>"
_USER = "<|im_start|>user\n"
_END = "<|im_end|>"
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_SYMBOL = {ast.FloorDiv: "//", ast.Mod: "%", ast.MatMult: "@", ast.BitAnd: "&", ast.BitOr: "|", ast.BitXor: "^",
           ast.LShift: "<<", ast.RShift: ">>", ast.Invert: "~", ast.Not: "not"}


class CalcError(ValueError):
    """An expression the calculator refuses; the message is shown to the model."""


def evaluate(expression: str) -> Fraction:
    """The exact value of an arithmetic expression: numbers (integers, decimals), ``+ - * / **`` with Python's
    precedence, unary signs and parentheses.  Anything else (names, calls, attributes, other operators, a
    non-integer or too large exponent, a value beyond 10**30, division by zero) raises :class:`CalcError`."""
    text = expression.strip()
    if not text:
        raise CalcError("empty expression")
    if len(text) > MAX_EXPR_CHARS:
        raise CalcError(f"expression longer than {MAX_EXPR_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        raise CalcError(f"not an arithmetic expression: {text}") from None
    return _value(tree.body)


def _value(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant):
        if type(node.value) not in (int, float):  # bool, str, complex, bytes, None
            raise CalcError(f"not a number: {node.value!r}")
        if isinstance(node.value, float) and not math.isfinite(node.value):  # e.g. 1e999
            raise CalcError("number too large (beyond 10**30)")
        # a decimal literal is read as written (0.1 is exactly 1/10): repr gives its shortest decimal form
        return _bounded(Fraction(repr(node.value)) if isinstance(node.value, float) else Fraction(node.value))
    if isinstance(node, ast.UnaryOp):
        if type(node.op) not in _UNARY:
            raise CalcError(f"operator {_SYMBOL.get(type(node.op), type(node.op).__name__)} is not supported")
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp):
        op = type(node.op)
        if op not in _BINARY:
            raise CalcError(f"operator {_SYMBOL.get(op, op.__name__)} is not supported")
        left, right = _value(node.left), _value(node.right)
        if op is ast.Div and right == 0:
            raise CalcError("division by zero")
        if op is ast.Pow:
            if right.denominator != 1:
                raise CalcError("the exponent must be an integer")
            if abs(right) > MAX_EXPONENT:
                raise CalcError(f"exponent larger than {MAX_EXPONENT}")
            if left == 0 and right < 0:
                raise CalcError("division by zero")
        return _bounded(_BINARY[op](left, right))
    if isinstance(node, ast.Name):
        raise CalcError(f"names are not allowed: {node.id}")
    if isinstance(node, ast.Call):
        raise CalcError("function calls are not allowed")
    if isinstance(node, ast.Attribute):
        raise CalcError(f"attributes are not allowed: .{node.attr}")
    raise CalcError(f"only numbers, + - * / ** and parentheses are allowed, not {type(node).__name__}")


def _bounded(value: Fraction) -> Fraction:
    if abs(value) > MAX_ABS:
        raise CalcError("number too large (beyond 10**30)")
    return value


def format_number(value: Fraction) -> str:
    """An integer as is ("444", "-3"); else a decimal rounded to DECIMALS places, trailing zeros dropped
    ("2.5", "0.3333333333")."""
    if value.denominator == 1:
        return str(value.numerator)
    scaled = round(value * 10 ** DECIMALS)  # Fraction rounds half to even, exactly
    sign = "-" if scaled < 0 else ""
    whole, frac = divmod(abs(scaled), 10 ** DECIMALS)
    digits = f"{frac:0{DECIMALS}d}".rstrip("0")
    return f"{sign}{whole}.{digits}" if digits else f"{sign}{whole}"


def calculator_reply(expression: str) -> str:
    """The feedback for one call: ``<result>VALUE</result>`` or ``<error>WHY</error>``."""
    try:
        return f"<result>{format_number(evaluate(expression))}</result>"
    except CalcError as e:
        return f"<error>{e}</error>"


def with_hint(prompt: str) -> str:
    """The prompt with TOOL_HINT: at the end of the last user message of a ChatML prompt, else in front."""
    start = prompt.rfind(_USER)
    end = prompt.find(_END, start + len(_USER)) if start >= 0 else -1
    if end < 0:
        return f"{TOOL_HINT}\n\n{prompt}"
    return f"{prompt[:end]}\n{TOOL_HINT}{prompt[end:]}"


class AgentInstance(AgentInstanceBase):
    """One episode: the calculator's state (calls made) for one sample."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = 0

    async def reset(self, states: dict, **kwargs) -> dict:
        self.calls = 0
        return {"observation": with_hint(states["observation"])}

    async def step(self, states: dict, **kwargs) -> dict:
        action = states["action_text"]
        label = states["label"]
        calls = _CALL.findall(action)
        if not calls and _OPEN in action:  # an opened call the model did not close
            calls = [None]
        if calls and self.calls + len(calls) > MAX_CALLS:
            self.calls += len(calls)
            return self._result(states, 0.0, True, "")
        if calls:
            self.calls += len(calls)
            replies = [calculator_reply(c) if c is not None else "<error>unclosed <calc>: write "
                       "<calc>expression</calc></error>" for c in calls]
            return self._result(states, 0.0, False, "".join(replies))
        if label is None or not str(label).strip():
            raise ValueError("calculator env: this sample has no label (data.label_key) to check the answer with")
        score, _ = verify(action, str(label))
        return self._result(states, score, True, "", correct=score)

    def _result(self, states: dict, reward: float, done: bool, feedback: str, correct: float = 0.0) -> dict:
        return {"rewards": reward, "scores": reward, "environment_feedback": feedback, "done": done,
                "sampling_params": states.get("sampling_params"),
                "extra_logs": {"tool_calls": float(self.calls), "correct": correct}}


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
