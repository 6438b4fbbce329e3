"""Reward sources and shaping.  Import the modules themselves (builtins.py and errors.py load no torch: the checks
before a run use them).

* ``function.RewardFunction``: a Python file's ``reward_func`` (batched, per-batch timeout, failure accounting).
* ``server.start_server`` / ``hpc-rlhf serve-reward``: serve a reward function over HTTP.
* ``client.RemoteReward``: score on one or more reward servers (concurrent batches, round robin, retries).
* ``model.RewardModelScorer``: a sequence-classification reward model.
* ``shaping``: combine sources, running normalisation, clipping, DAPO overlong and truncation penalties.

Every source returns a ``types.RewardBatch``; samples whose reward failed have ``valid`` False (reward NaN).
"""
