"""The actor -> rollout weight transfer over a gloo bridge: broadcast buckets, shared-memory slots when every
rank of the bridge is on one host, or shared weights when every rollout engine can also take them as its own.
Whatever the path, each rollout rank generates with exactly the leader's tensors."""
import pytest
import torch
from _dist import run_ranks

from hpc_rlhf.distributed.weight_sync.plan import ParamSpec, SyncItem, full_items, largest_bucket_bytes
from hpc_rlhf.distributed.weight_sync.shared import SharedWeights, shared_layout
from hpc_rlhf.distributed.weight_sync.slots import SharedSlots

BUCKET = 16 << 10  # bytes: several buckets, and one parameter (30000 floats, 120 KB) larger than a bucket


class _Engine:
    """Holds what it loads; with ``share``, takes the shared weights as its own and reads them at each
    finish_weight_update."""

    def __init__(self, share: bool):
        self.share = share
        self.loaded: dict[str, torch.Tensor] = {}
        self.own: dict[str, torch.Tensor] = {}

    def shareable(self, named):
        return self.share

    def share_weights(self, named):
        self.own = dict(named)

    def begin_weight_update(self):
        pass

    def load_weights(self, named):
        self.loaded.update((name, t.clone()) for name, t in named)  # the slot is rewritten after the load

    def finish_weight_update(self):
        self.loaded.update((name, t.clone()) for name, t in self.own.items())


def _sync(name: str, use_channel: bool, dtype: torch.dtype, sharing: set[int]):
    import torch.distributed as dist

    from hpc_rlhf.distributed.collectives import Bridge
    from hpc_rlhf.distributed.weight_sync import channel as ch
    from hpc_rlhf.distributed.weight_sync import shm
    rank = dist.get_rank()
    bridge = Bridge(name, [0, 1, 2], rank, dist.distributed_c10d._get_default_store(), 60)
    channel = ch.Channel() if use_channel else None
    torch.manual_seed(rank)  # each rank starts from other weights: only the leader's may arrive
    module = torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.Linear(30, 1000))
    items = full_items(module)
    engine, seen = _Engine(rank in sharing), []
    threads = torch.get_num_threads()
    for step in range(3):
        with torch.no_grad():
            for p in module.parameters():
                p.mul_(-1.5).add_(step)  # new weights every sync
        if rank == 0:
            sent = ch.send_weights(bridge, ch.actor_buckets(items, False, dtype, BUCKET, channel), True,
                                   channel=channel, slot_bytes=largest_bucket_bytes(items, dtype, BUCKET),
                                   specs=[it.spec for it in items], dtype=dtype)
            seen.append(({n: p.detach().to(dtype, copy=True) for n, p in module.named_parameters()}, sent.buckets))
        else:
            count = ch.receive_weights(bridge, engine, dtype, channel)
            seen.append((dict(engine.loaded), count))
    assert torch.get_num_threads() == threads  # the leader's copy with every CPU gave its threads back
    mode = None if channel is None else channel.transport.name
    left = sorted(p.name for p in shm.SHM_DIR.glob("hpc_rlhf-weights-*"))
    return seen, mode, left


# name: (a channel, the rank on another host, the ranks whose engines can take shared weights, dtype, the mode)
CASES = {
    "no channel: the broadcast": (False, None, {1, 2}, torch.float32, None),
    "one host, engines that keep their own weights: shared slots": (True, None, set(), torch.float32, "slots"),
    "the slots cast the fp32 actor's weights to bf16": (True, None, set(), torch.bfloat16, "slots"),
    "every engine takes the shared weights": (True, None, {1, 2}, torch.float32, "shared"),
    "the shared weights cast as they are written": (True, None, {1, 2}, torch.bfloat16, "shared"),
    "one engine that cannot take them: slots for all": (True, None, {1}, torch.float32, "slots"),
    "bf16 broadcast": (False, None, set(), torch.bfloat16, None),
    "a rollout rank on another host: every rank keeps the broadcast": (True, 2, {1, 2}, torch.float32, "broadcast"),
}


def _every_case():
    """Every case on the same three ranks, one after the other (one spawn instead of one per case)."""
    import torch.distributed as dist

    from hpc_rlhf.distributed.weight_sync import shm
    host = shm.host
    out = {}
    for k, (name, (use_channel, other_host_rank, sharing, dtype, _)) in enumerate(CASES.items()):
        shm.host = (lambda: "another-node") if dist.get_rank() == other_host_rank else host
        out[name] = _sync(f"weights{k}", use_channel, dtype, sharing)  # a bridge of its own name each
    return out


@pytest.fixture(scope="module")
def synced():
    return run_ranks(_every_case, 3)


@pytest.mark.parametrize("case", list(CASES))
def test_every_rollout_rank_loads_the_leaders_tensors(synced, case):
    ranks = [r[case] for r in synced]
    leader = ranks[0][0]
    assert all(r[1] == CASES[case][-1] for r in ranks)
    for seen, _, _ in ranks[1:]:
        for (want, buckets), (got, count) in zip(leader, seen):
            assert count == buckets > 2
            assert got.keys() == want.keys()
            for name in want:
                torch.testing.assert_close(got[name], want[name], rtol=0, atol=0)
    assert not ranks[0][2]  # the file's name is gone once every rank mapped it


def test_slots_are_page_aligned_and_alternate(tmp_path):
    slots = SharedSlots(tmp_path / "s", 5000, create=True)
    assert slots.slot_bytes == 8192 and slots.buffer.numel() == 16384
    a, b = slots.view(0, 10, torch.float32), slots.view(1, 10, torch.bfloat16)
    a.fill_(1.0)
    b.fill_(2.0)
    assert a.data_ptr() - slots.buffer.data_ptr() == 0 and b.data_ptr() - slots.buffer.data_ptr() == 8192
    assert slots.view(2, 10, torch.float32).sum().item() == 10.0  # bucket 2 reuses slot 0
    again = SharedSlots(tmp_path / "s", 5000, create=False)  # another mapping of the same file sees the writes
    assert again.view(1, 10, torch.bfloat16).sum().item() == 20.0


def test_largest_bucket_bytes():
    def item(n):
        return SyncItem(ParamSpec(f"p{n}", (n,)), (), lambda: None)
    # buckets of at most 100 bytes in fp32: [10, 10] (80 B), [30] (120 B: larger than a bucket alone), [5]
    assert largest_bucket_bytes([item(10), item(10), item(30), item(5)], torch.float32, 100) == 120
    assert largest_bucket_bytes([item(10), item(10), item(5)], torch.bfloat16, 100) == 50
    assert largest_bucket_bytes([], torch.float32, 100) == 0


def test_shared_layout_by_hand(tmp_path):
    specs = [ParamSpec("a", (3, 5)), ParamSpec("b", (17,)), ParamSpec("c", ())]
    # fp32: a 60 B -> 64, b 68 B -> 128 from 64, c 4 B -> 64 from 192
    assert shared_layout(specs, torch.float32) == ({"a": (0, (3, 5)), "b": (64, (17,)), "c": (192, ())}, 256)
    # bf16: 30, 34 and 2 bytes, each on its own 64-byte boundary
    assert shared_layout(specs, torch.bfloat16) == ({"a": (0, (3, 5)), "b": (64, (17,)), "c": (128, ())}, 192)
    layout, nbytes = shared_layout(specs, torch.float32)
    w = SharedWeights(tmp_path / "w", layout, nbytes, torch.float32, create=True)
    assert w.buffer.numel() == 256 and [n for n, _ in w.named()] == ["a", "b", "c"]
    assert w.view("b").shape == (17,) and w.view("b").data_ptr() - w.buffer.data_ptr() == 64
    with pytest.raises(KeyError, match="'d' has no place in the shared weights"):
        w.view("d")
