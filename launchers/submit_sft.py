"""Submit SFT to SLURM from Python (through submitit) and wait for its final metrics.

    python launchers/submit_sft.py CONFIG.yaml [key=value ...]

Resources, time limit and set-up lines come from the config's `slurm:` section (or key=value overrides
such as slurm.resources.gpus_per_task=1 launch.nproc=8).  The job is the one `hpc-rlhf plan sft` shows.
"""
import json
import sys

from hpc_rlhf.launch.submit import submit

if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    job = submit("sft", sys.argv[1], sys.argv[2:])
    print(f"submitted job {job.job_id}", flush=True)
    results = job.results()  # blocks; one dict of final metrics per rank (the job may be requeued meanwhile)
    print(json.dumps({"job_id": job.job_id, "ranks": len(results), "final": results[0]}))
