"""A reward function that returns a dict of named components per sample drives a GRPO-style run with
advantage_estimator=gdpo (one rank, every role on it, one step): each component is logged as reward/<name>."""
from __future__ import annotations

import pytest

from rl_fixtures import make_assets, merged, run_rl

PARTS = '''
def reward_func(queries, prompts, labels):
    # "length": distinct characters of the response (varied even for a random model); "digits": its digits
    out = []
    for q, p in zip(queries, prompts):
        response = q[len(p):]
        out.append({"length": len(set(response)) / 6.0, "digits": float(sum(c.isdigit() for c in response))})
    return out
'''


def test_gdpo_trains_on_reward_components_and_logs_each(tmp_path):
    base = make_assets(tmp_path)
    (tmp_path / "parts.py").write_text(PARTS)
    cfg = merged(base, reward={"reward_func": str(tmp_path / "parts.py")}, placement={"colocate_all": True},
                 train={"max_steps": 1}, algo={"advantage_estimator": "gdpo"})
    rows = run_rl(cfg, tmp_path, "gdpo")
    [m] = rows
    assert m["step"] == 1
    # the reward is the sum of its components, so the step's mean reward is the sum of their means
    assert m["reward/length"] > 0 and m["reward/digits"] >= 0
    assert m["reward/mean"] == pytest.approx(m["reward/length"] + m["reward/digits"], rel=1e-6)
    assert m["reward/invalid"] == 0 and m["actor/grad_norm"] > 0  # advantages not all 0
