"""Submit GRPO as a heterogeneous SLURM job from Python: each role group gets its own resources.

    python launchers/submit_grpo.py CONFIG.yaml [key=value ...]

The roles are placed as the config's `placement:` says; here the reference joins the actor's ranks and
the rollout ranks ask for their own GPUs.  submitit has no heterogeneous jobs (its issue 1741):
hpc_rlhf.launch.submit renders the hetjob script itself and lets submitit track the job.
"""
import json
import sys

from hpc_rlhf.launch.submit import submit

ROLE_RESOURCES = [
    "placement.colocate_actor_ref=true",
    "slurm.hetjob=always",                    # one component per role group even with equal resources
    "slurm.roles.rollout.cpus_per_task=2",    # e.g. slurm.roles.rollout.gpus_per_task=2 on a GPU cluster
]

if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    job = submit("rl", sys.argv[1], [*ROLE_RESOURCES, *sys.argv[2:]])
    print(f"submitted job {job.job_id}", flush=True)
    results = job.results()  # one dict per rank: every rank ends with the same step metrics
    print(json.dumps({"job_id": job.job_id, "ranks": len(results), "reward_mean": results[0].get("reward/mean")}))
