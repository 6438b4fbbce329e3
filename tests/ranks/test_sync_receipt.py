"""The weight sync's receipt in `train rl` runs of three ranks (actor, critic+reward, rollout) over gloo: a tensor
flipped on the rollout side after a sync stops the run with one line naming it and its bucket; the same run
without the flip passes every receipt.

The ranks take a test hook from a ``sitecustomize`` module on their PYTHONPATH: buckets of 16 KiB instead of
64 MiB, so the tiny model's weights travel in 12 of them, and, with RECEIPT_TEST_FLIP set, the rollout engine
negates that tensor at the end of the run's third weight update (the sync after step 2)."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from rl_fixtures import finish_rl, make_assets, merged, start_rl

pytestmark = pytest.mark.slow  # two runs of about 40 s each

HOOK = '''
import os
if "RANK" in os.environ:  # a rank, not the launcher
    import torch
    from hpc_rlhf.generation.hf import HFEngine
    from hpc_rlhf.roles import sync
    sync.BUCKET_BYTES = 16 << 10
    flip = os.environ.get("RECEIPT_TEST_FLIP")
    finish = HFEngine.finish_weight_update

    def finish_weight_update(self):
        if flip and self.weight_version == 2:
            with torch.no_grad():
                dict(self.model.named_parameters())[flip].neg_()
        finish(self)
    HFEngine.finish_weight_update = finish_weight_update
'''
FLIPPED = "model.layers.1.self_attn.v_proj.weight"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def hooked(tmp_path, monkeypatch):
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(HOOK)
    # the hook imports hpc_rlhf before the rank puts its working directory on sys.path: this checkout's, named
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(hook), str(REPO), os.environ.get("PYTHONPATH", "")]))
    return merged(make_assets(tmp_path), placement={"colocate_critic_reward": True}, train={"max_steps": 3})


def test_a_flipped_tensor_stops_the_run_naming_it_and_its_bucket(hooked, tmp_path, monkeypatch):
    """The tiny model's 21 tensors in buckets of 16 KiB (fp32): embed_tokens (33,280 B) alone; layer 0's four
    attention products (4 x 4,096 B) fill bucket 1; gate, up and down (16,384 B each) take 2, 3 and 4; bucket 5
    holds layer 0's two norms (128 B each) and layer 1's q, k and v; then o, gate, up and down of layer 1 (6 to 9),
    the last three norms (10) and lm_head (11): layer 1's v_proj is in bucket 5 of 12."""
    monkeypatch.setenv("RECEIPT_TEST_FLIP", FLIPPED)
    proc = start_rl(hooked, tmp_path, "flipped")
    try:
        _, err = proc.communicate(timeout=400)
    finally:
        proc.kill()
    assert proc.returncode == 1, err[-3000:]
    lines = [line for line in err.splitlines() if "WeightSyncError" in line and "stops the job" in line]
    assert lines, err[-3000:]
    assert re.fullmatch(
        r"hpc-rlhf: .*stops the job: rank 2 \(roles rollout\) failed: WeightSyncError: the weight sync receipt: "
        r"rollout rank 0's log-probs of the probe differ from the actor's by [0-9.e+-]+ \(tolerance 0\.01\); its "
        + re.escape(FLIPPED) + r" \(bucket 5 of 12\) differs from the one sent", lines[-1]), lines[-1]
    rows = (tmp_path / "flipped" / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 1  # step 1 committed; step 2's sync failed its receipt


def test_without_the_flip_every_receipt_passes(hooked, tmp_path):
    rows = finish_rl(start_rl(hooked, tmp_path, "clean"), tmp_path, "clean")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["sync/receipt_max_abs_diff"] < 1e-5  # fp32: the same weights, other kernels
        assert r["time/sync_receipt_s"] > 0
