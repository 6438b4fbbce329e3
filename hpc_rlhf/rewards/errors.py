"""The errors of the reward sources (no torch: the checks before a run raise them)."""


class RewardError(RuntimeError):
    """A reward source could not produce usable rewards (bad file, too many failed samples, ...)."""


class RewardFileError(RewardError):
    """A reward-function file is missing, cannot be imported, or defines no callable ``reward_func``."""
