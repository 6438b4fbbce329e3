"""Actor -> rollout weight sync: gathered, flattened into buckets, converted on the sender, then carried by one
transport chosen once per ``weights`` bridge.

- ``plan``: what is sent: each tensor's name and full shape (``ParamSpec``), a LoRA actor's merged layers
  (``lora_items``), and the buckets (``plan_buckets``: at most ``BUCKET_BYTES`` each, every actor
  rank walking the same plan).
- ``transport``: the ``Transport`` interface.
- ``channel``: the transport's choice at a bridge's first sync (``Channel``), the buckets as every actor rank walks
  them (``actor_buckets``: gathered per bucket under ZeRO-3, packed where the transport sends them from) and the
  two sides of a sync (``send_weights``, ``receive_weights``), which drive the chosen transport without knowing
  which it is.
- ``broadcast``: one broadcast per bucket from the actor leader (index 0 of the bridge) over NCCL or gloo.
- ``slots``: two shared-memory slots under /dev/shm (a gloo bridge on one host; engines that keep their own weights,
  such as vLLM): the leader packs bucket k into slot k % 2 while the rollout ranks load bucket k - 1.
- ``shared``: the rollout engines' weights live in one shared-memory file (a gloo bridge on one host, engines that
  can take shared tensors as their parameters): a sync is the leader's one copy.
- ``shm``: what the two shared-memory transports share: the files' place, the offer and its answer.

Import the modules themselves; this package module holds only the bucket size, which `hpc-rlhf plan` reads
without loading torch.
"""
BUCKET_BYTES = 64 << 20  # the sync's bucket: one broadcast (or one shared slot) each
