"""Rollout/trainer mismatch metrics and IS corrections against hand-derived numbers.

Log-probs are chosen so that the per-token ratios are exactly 4, 1, 0.25, 0.5, 1.5 (differences of log 4,
0, −log 4...); padding holds nan/inf to show it is never read.
"""
import dataclasses
import math

import pytest
import torch

from hpc_rlhf.algorithms.mismatch import is_weights, mismatch_metrics
from hpc_rlhf.algorithms.registry import IS_CORRECTIONS
from hpc_rlhf.config import ConfigError, load_config
from hpc_rlhf.config.base import allowed_values
from hpc_rlhf.config.rl import AlgoConfig, RLConfig

L4, L2, L15 = math.log(4.0), math.log(2.0), math.log(1.5)
NAN, INF = float("nan"), float("inf")


def pair(diffs: list[list[float | None]]):
    """(a, b, mask) with a − b = diffs on valid positions (None = padding, where a = 0 and b = nan/inf)."""
    R = max(len(r) for r in diffs)
    a = torch.zeros(len(diffs), R)
    b = torch.full((len(diffs), R), NAN)
    mask = torch.zeros(len(diffs), R)
    base = [-3.0, -1.0, -2.0, -0.5]
    for i, row in enumerate(diffs):
        for t, d in enumerate(row):
            if d is None:
                b[i, t] = INF if t % 2 else NAN
                continue
            b[i, t] = base[t]
            a[i, t] = base[t] + d
            mask[i, t] = 1.0
    return a, b, mask


def test_mismatch_metrics_by_hand():
    # d = log π_trainer − log π_engine: row 0 [log 4, 0, pad], row 1 [−log 4, −log 2, pad]; r = e^d = 4, 1, 1/4, 1/2
    trainer, engine, mask = pair([[L4, 0.0, None], [-L4, -L2, None]])
    m = mismatch_metrics(trainer, engine, mask)
    # k1 = mean(−d) = −(log 4 + 0 − log 4 − log 2)/4 = log 2 / 4
    assert m["mismatch/k1"].item() == pytest.approx(L2 / 4, abs=1e-6)
    # k3 terms r − 1 − log r: 3 − log 4, 0, −3/4 + log 4, −1/2 + log 2 → sum 7/4 + log 2, mean over 4 tokens
    assert m["mismatch/k3"].item() == pytest.approx((1.75 + L2) / 4, abs=1e-6)
    assert m["mismatch/max_abs_diff"].item() == pytest.approx(L4, abs=1e-6)
    assert all(v.dim() == 0 and not v.requires_grad for v in m.values())


def test_mismatch_metrics_equal_and_empty():
    trainer, engine, mask = pair([[0.0, 0.0], [0.0, None]])
    assert all(v.item() == 0.0 for v in mismatch_metrics(trainer, engine, mask).values())
    m = mismatch_metrics(trainer, engine, torch.zeros_like(mask))  # no valid token: zeros, not nan
    assert all(v.item() == 0.0 for v in m.values())


def test_tis_truncates_at_high_and_keeps_small_ratios():
    # ratios [4, 1, 1/4, pad], high = 2 → weights [2, 1, 1/4, 0]; low is unused
    old, engine, mask = pair([[L4, 0.0, -L4, None]])
    old.requires_grad_(True)
    w, m = is_weights("tis", old, engine, mask, low=0.5, high=2.0)
    torch.testing.assert_close(w, torch.tensor([[2.0, 1.0, 0.25, 0.0]]))
    assert not w.requires_grad
    assert m["is/clipped_frac"].item() == pytest.approx(1 / 3)          # the ratio 4, of 3 valid tokens
    assert m["is/weight_mean"].item() == pytest.approx(3.25 / 3)        # (2 + 1 + 0.25)/3
    w_low, _ = is_weights("tis", old, engine, mask, low=0.9, high=2.0)   # low changes nothing
    torch.testing.assert_close(w_low, w)


def test_icepop_masks_tokens_outside_bounds():
    # ratios [4, 1 | 1/4, 1.5, pad] in [0.5, 2]: 4 and 1/4 dropped, 1 and 1.5 kept as they are
    old, engine, mask = pair([[L4, 0.0, None], [-L4, L15, None]])
    w, m = is_weights("icepop", old, engine, mask, low=0.5, high=2.0)
    torch.testing.assert_close(w, torch.tensor([[0.0, 1.0, 0.0], [0.0, 1.5, 0.0]]))
    assert m["is/masked_frac"].item() == pytest.approx(0.5)             # 2 of 4 valid tokens
    assert m["is/weight_mean"].item() == pytest.approx(2.5 / 4)         # (0 + 1 + 0 + 1.5)/4


def test_seq_mask_tis_masks_whole_sequences_by_geometric_mean():
    # A: [4, 4, 4]          geometric mean 4     > 2   → dropped (3 tokens)
    # B: [4, 1/4, pad]      geometric mean 1           → kept, weights min(w, 2) = [2, 1/4]
    #                       (its arithmetic mean 2.125 would drop it)
    # C: [1/4, pad, pad]    geometric mean 1/4   < 1/2 → dropped (1 token)
    # D: [1.5, 1.5, 1.5]    geometric mean 1.5         → kept, weights [1.5, 1.5, 1.5]
    #                       (the product 3.375, a sum instead of a mean of logs, would drop it)
    old, engine, mask = pair([[L4, L4, L4], [L4, -L4, None], [-L4, None, None], [L15, L15, L15]])
    w, m = is_weights("seq_mask_tis", old, engine, mask, low=0.5, high=2.0)
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.0, 0.0], [2.0, 0.25, 0.0], [0.0, 0.0, 0.0],
                                                [1.5, 1.5, 1.5]]))
    assert m["is/masked_frac"].item() == pytest.approx(4 / 9)           # A's 3 + C's 1 of 9 valid tokens
    assert m["is/clipped_frac"].item() == pytest.approx(1 / 9)          # B's ratio 4 (A's are dropped, not clipped)
    assert m["is/seq_masked_frac"].item() == pytest.approx(2 / 4)
    assert m["is/weight_mean"].item() == pytest.approx(6.75 / 9)        # (2 + 0.25 + 3 · 1.5)/9
    # per token, icepop would drop B's ratio-4 token; the sequence criterion keeps it (truncated)
    w_ice, _ = is_weights("icepop", old, engine, mask, low=0.5, high=2.0)
    assert w_ice[1, 0].item() == 0.0 and w[1, 0].item() == 2.0


def test_registry_bounds_and_config_choices():
    assert IS_CORRECTIONS.names() == ["icepop", "seq_mask_tis", "tis"]
    field = {f.name: f for f in dataclasses.fields(AlgoConfig)}["is_correction"]
    assert set(allowed_values(field)) == {"none", *IS_CORRECTIONS.names()}
    old, engine, mask = pair([[0.0]])
    for name in IS_CORRECTIONS:
        for low, high in ((1.0, 1.0), (-0.1, 2.0), (2.0, 0.5)):
            with pytest.raises(ValueError, match="0 <= low < high"):
                is_weights(name, old, engine, mask, low=low, high=high)
    with pytest.raises(KeyError, match="unknown is_correction 'tls'"):
        is_weights("tls", old, engine, mask, low=0.5, high=2.0)


def test_config_options_and_checks():
    base = ["pretrain=m", "prompt_data=p.jsonl", "reward_func=r.py"]
    cfg = load_config(RLConfig, None, base)
    assert (cfg.algo.is_correction, cfg.algo.is_bounds.is_low, cfg.algo.is_bounds.is_high) == ("none", 0.5, 2.0)
    cfg = load_config(RLConfig, None, base + ["algo.is_correction=icepop", "is_low=0", "is_high=5"])
    assert (cfg.algo.is_correction, cfg.algo.is_bounds.is_low, cfg.algo.is_bounds.is_high) == ("icepop", 0.0, 5.0)
    with pytest.raises(ConfigError, match="algo.is_correction: 'ice' is not allowed"):
        load_config(RLConfig, None, base + ["is_correction=ice"])
    with pytest.raises(ConfigError, match="algo.is_bounds.is_low: -0.1 is out of range; it must be >= 0"):
        load_config(RLConfig, None, base + ["is_low=-0.1"])
    for bad in (["is_low=2", "is_high=2"], ["is_high=0.4"]):
        with pytest.raises(ConfigError, match="algo.is_bounds.is_low and is_high need 0 <= is_low < is_high"):
            load_config(RLConfig, None, base + ["is_correction=tis"] + bad)
    with pytest.raises(ConfigError, match=r"^algo.is_bounds.is_high is set but algo.is_correction is 'none': it "
                                          r"applies to is_correction icepop, seq_mask_tis, tis$"):
        load_config(RLConfig, None, base + ["is_high=3"])
