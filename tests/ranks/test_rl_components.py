"""A reward function that returns a dict of named components per sample drives a GRPO-style run with
advantage_estimator=gdpo (one rank, every role on it, one step): each component is logged as reward/<name>, and
the advantages come from the components, not from their sum."""
from __future__ import annotations

from rl_fixtures import make_assets, merged, run_rl

# x = distinct characters of the response / 8 (varied even for a random model).  The components x, x^2 and
# -(x + x^2) sum to exactly 0 (multiples of 1/64): the scalar reward is 0 for every sample, so an estimator of the
# summed reward gives every sample advantage 0 and the actor no gradient.  GDPO z-scores each component in its
# group of two: for x1 > x2 the three give +, +, - (each +-1/sqrt2), a sum of +1/sqrt2: a gradient.
PARTS = '''
def reward_func(queries, prompts, labels):
    out = []
    for q, p in zip(queries, prompts):
        x = len(set(q[len(p):])) / 8
        out.append({"x": x, "x2": x * x, "neg": -(x + x * x)})
    return out
'''


def test_gdpo_trains_on_reward_components_and_logs_each(tmp_path):
    base = make_assets(tmp_path)
    (tmp_path / "parts.py").write_text(PARTS)
    cfg = merged(base, reward={"reward_func": str(tmp_path / "parts.py")}, placement={"colocate_all": True},
                 train={"max_steps": 1}, algo={"advantage_estimator": "gdpo"})
    [m] = run_rl(cfg, tmp_path, "gdpo")
    assert m["step"] == 1 and m["reward/invalid"] == 0
    assert m["reward/mean"] == 0 and m["reward/x"] > 0 and m["reward/x2"] > 0
    assert m["reward/neg"] == -(m["reward/x"] + m["reward/x2"])  # each component's mean over the step's samples
    assert m["actor/grad_norm"] > 0  # the advantages came from the components
