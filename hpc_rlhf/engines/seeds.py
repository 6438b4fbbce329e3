"""Per-sample seeds: every sample of every step can be regenerated on its own."""
from __future__ import annotations

import hashlib

_MASK63 = (1 << 63) - 1


def sample_seed(base_seed: int, step: int, prompt_index: int, sample_index: int) -> int:
    """A 63-bit seed for one sample: blake2b of the four numbers (each as 16 signed little-endian bytes).

    The result depends only on the four numbers (not on the process, the platform or the Python hash
    seed), so a sample can be reproduced without replaying the samples before it.
    """
    data = b"".join(int(x).to_bytes(16, "little", signed=True)
                    for x in (base_seed, step, prompt_index, sample_index))
    digest = hashlib.blake2b(data, digest_size=8, person=b"hpc_rlhf.seed").digest()
    return int.from_bytes(digest, "little") & _MASK63
