"""The collectives module's bridges when a bridge has one rank: no process group, values as a gather would give."""
import os

import torch
import torch.distributed as dist

from hpc_rlhf.distributed.collectives import MAX, Bridge


def _gloo_threads() -> set[str]:
    """Ids of this process's threads that gloo started (named gloo_tcp_loop and pt_gloo_runloop)."""
    out = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if "gloo" in f.read():
                    out.add(tid)
        except FileNotFoundError:  # the thread ended meanwhile
            continue
    return out


def test_a_bridge_of_one_rank_builds_no_group_and_returns_copies():
    before = _gloo_threads()
    bridge = Bridge("solo", [5], 5, dist.HashStore(), 10)
    assert bridge.pg is None and bridge.size == 1 and bridge.index == 0
    t = torch.tensor([1.0, -2.0, 3.5])
    assert bridge.broadcast(t) is t and t.tolist() == [1.0, -2.0, 3.5]
    assert bridge.all_reduce(t) is t and t.tolist() == [1.0, -2.0, 3.5]  # a sum over one rank
    assert bridge.all_reduce(torch.tensor([4]), MAX).item() == 4
    assert bridge.max(7) == 7
    bridge.barrier()
    big = {"ids": list(range(50_000)), "scores": torch.arange(70_000, dtype=torch.float32)}  # > 32768 bytes
    (got,) = bridge.all_gather_object(big)
    assert got is not big and got["ids"] is not big["ids"]  # a copy, as every other rank's part is
    assert got["ids"] == big["ids"] and torch.equal(got["scores"], big["scores"])
    got["ids"].append(-1)
    assert big["ids"][-1] == 49_999
    assert bridge.broadcast_object("done", 0) == "done"
    assert _gloo_threads() <= before  # no gloo thread was started for it
