"""The GPU check of hpc_rlhf (`bash scripts/gpu_check.sh`): runs on a CUDA machine what its GPU count allows
and prints one JSON summary.  Built on the stable surfaces only: the `hpc-rlhf` commands, their YAML configs
and outputs (metrics.jsonl, checkpoints, the HF export) and ``hpc_rlhf.distributed.collectives``.

- ``summary``: the plan for a GPU count and the summary's assembly (pure, tested without CUDA);
- ``runs``: processes with a time limit, the tiny assets, metrics;
- ``checks``: one function per check, each returning its key figures or raising ``CheckFailed``;
- ``collectives_probe``: the program each rank of the collectives check runs.
"""
