"""Reward function of the demo's verifiable task: 1 when the response is exactly the label, else 0."""


def reward_func(queries, prompts, labels):
    rewards = [1.0 if q[len(p):].strip() == label else 0.0 for q, p, label in zip(queries, prompts, labels)]
    return {"rewards": rewards, "extra_logs": {"exact_match": rewards}}
