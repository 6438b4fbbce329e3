"""The weight sync receipt's pieces, by hand: the probe, the gap between two sets of log-probs, the first tensor
that differs from the one sent, and the line that stops the run."""
import math

import pytest

from hpc_rlhf.roles.sync import (PROBE_PROMPT, PROBE_RESPONSE, WeightSyncError, first_difference, probe_gap,
                                 probe_tokens, receipt_failure)


def test_the_probe_is_the_same_everywhere_and_inside_the_vocabulary():
    prompt, response = probe_tokens(50)
    assert (len(prompt), len(response)) == (PROBE_PROMPT, PROBE_RESPONSE) == (12, 4)
    assert (prompt, response) == probe_tokens(50)
    assert all(0 <= t < 50 for t in prompt + response)


def test_probe_gap_is_the_largest_absolute_difference():
    # |-1.5 - -1| = 0.5, |-2 - -2| = 0, |-1 - -3| = 2
    assert probe_gap([-1.0, -2.0, -3.0], [-1.5, -2.0, -1.0]) == 2.0
    assert probe_gap([-1.0], [-1.0]) == 0.0
    assert probe_gap([-1.0, -2.0], [-1.0, math.nan]) == math.inf  # a nan never passes a tolerance
    with pytest.raises(WeightSyncError, match="gave 1 log-probs of the probe for 2 tokens"):
        probe_gap([-1.0, -2.0], [-1.0])


SENT = [("a", 0, 1.0), ("b", 0, 2.0), ("c", 1, 3.0), ("d", 2, -4.0)]


def test_first_difference_in_the_order_sent():
    assert first_difference(SENT, {"a": 1.0, "b": 2.0, "c": 3.0, "d": -4.0}) is None
    assert first_difference(SENT, {"a": 1.0, "b": 2.0, "c": 3.5, "d": 4.0}) == ("c", 1)
    # "a" is not held (a tied alias): passed over; "b" within 1e-9 relative (float64 sums in another order) matches
    assert first_difference(SENT, {"b": 2.0 * (1 + 1e-12), "c": 3.0, "d": -4.001}) == ("d", 2)


def test_the_line_that_stops_the_run():
    head = ("the weight sync receipt: rollout rank 1's log-probs of the probe differ from the actor's by 2.5 "
            "(tolerance 0.01); ")
    assert receipt_failure(1, 2.5, 0.01, SENT, {"a": 1.0, "b": 0.0, "c": 3.0}) == (
        head + "its b (bucket 0 of 3) differs from the one sent")
    assert receipt_failure(1, 2.5, 0.01, SENT, {"a": 1.0, "b": 2.0, "c": 3.0, "d": -4.0}) == (
        head + "each of the 4 tensors sent is held unchanged: the engine generates with other weights than the "
               "ones it holds")
    assert receipt_failure(1, 2.5, 0.01, SENT, None) == (
        head + "its engine keeps no checksums to name the tensor (vLLM: set log.check_weight_sync)")
