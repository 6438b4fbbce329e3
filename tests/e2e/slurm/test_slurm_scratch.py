"""In a real srun step, `hpc-rlhf train` points every cache of the rank at the job's scratch folder on its node and
sets the offline flags before the libraries load (distributed/scratch.py); the libraries report what they see."""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import yaml
from sft_fixtures import sft_config

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[3]
FOLDERS = {"TRITON_CACHE_DIR": "triton", "TORCHINDUCTOR_CACHE_DIR": "inductor",
           "TORCH_EXTENSIONS_DIR": "torch_extensions", "VLLM_CACHE_ROOT": "vllm", "HF_DATASETS_CACHE": "hf_datasets"}
OFFLINE = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")

# `hpc-rlhf train sft` as the CLI runs it (rendezvous from SLURM, config, checks, torch and DeepSpeed loaded), with
# the trainer replaced by a report of the environment and of where torch and datasets put their caches
REPORT = """
import json, os, sys
from hpc_rlhf import cli, commands

def report(name, cfg):
    import datasets.config, huggingface_hub.constants
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    from torch.utils.cpp_extension import _get_build_directory
    names = [*%r, *%r, "HF_HOME", "HF_HUB_CACHE", "XDG_CACHE_HOME"]
    print("REPORT " + json.dumps({
        "rank": os.environ["RANK"], "node": os.environ["SLURMD_NODENAME"],
        "env": {k: os.environ.get(k) for k in names},
        "inductor": cache_dir(), "extension": _get_build_directory("probe", False),
        "datasets": str(datasets.config.HF_DATASETS_CACHE), "datasets_offline": datasets.config.HF_HUB_OFFLINE,
        "hub_offline": huggingface_hub.constants.HF_HUB_OFFLINE, "hub_cache": huggingface_hub.constants.HF_HUB_CACHE}),
        flush=True)
    return {}

commands.run = report
sys.exit(cli.main(sys.argv[1:]))
""" % (tuple(FOLDERS), OFFLINE)


def test_every_cache_of_a_rank_points_under_the_jobs_scratch(slurm_cluster, tmp_path):
    config = sft_config(tmp_path, steps=1) | {"ckpt": {"save_path": str(tmp_path / "run"),
                                                        "ckpt_path": str(tmp_path / "ckpt")}}
    (tmp_path / "sft.yaml").write_text(yaml.safe_dump(config))
    (tmp_path / "report.py").write_text(REPORT)
    # nothing from the submitting shell: the ranks alone choose the folders and the flags
    unset = " ".join([*FOLDERS, *OFFLINE, "TMPDIR", "SLURM_TMPDIR", "TEMP", "TMP"])
    script = tmp_path / "job.sh"
    script.write_text(f"""#!/bin/bash
#SBATCH --nodes=2 --ntasks-per-node=1 --cpus-per-task=1 --time=00:05:00
unset {unset}
export PYTHONPATH={ROOT}
srun --kill-on-bad-exit=1 {sys.executable} {tmp_path / 'report.py'} train sft --config {tmp_path / 'sft.yaml'}
""")
    job = slurm_cluster.sbatch(script, "-o", str(tmp_path / "job.out"))
    scratch = Path(f"/tmp/hpc_rlhf-{job}")
    try:
        state = slurm_cluster.wait_done(job, timeout=240)
        out = (tmp_path / "job.out").read_text()
        assert state == "COMPLETED", out[-4000:]
        reports = sorted((json.loads(line[len("REPORT "):]) for line in out.splitlines()
                          if line.startswith("REPORT ")), key=lambda r: r["rank"])
        assert [r["rank"] for r in reports] == ["0", "1"], out[-4000:]
        assert len({r["node"] for r in reports}) == 2  # one rank on each of two nodes
        import huggingface_hub.constants
        for r in reports:
            assert r["env"] == {**{k: f"/tmp/hpc_rlhf-{job}/{v}" for k, v in FOLDERS.items()},
                                **dict.fromkeys(OFFLINE, "1"),
                                **{k: os.environ.get(k) for k in ("HF_HOME", "HF_HUB_CACHE", "XDG_CACHE_HOME")}}, r
            assert r["inductor"] == f"/tmp/hpc_rlhf-{job}/inductor"
            assert r["extension"] == f"/tmp/hpc_rlhf-{job}/torch_extensions/probe"
            assert r["datasets"] == f"/tmp/hpc_rlhf-{job}/hf_datasets"
            assert r["hub_offline"] is True and r["datasets_offline"] is True
            assert r["hub_cache"] == huggingface_hub.constants.HF_HUB_CACHE  # the user's models stay where they are
        assert oct(scratch.stat().st_mode & 0o777) == "0o700"
        assert sorted(p.name for p in scratch.iterdir()) == sorted(FOLDERS.values())
        assert f"node environment: TRITON_CACHE_DIR=/tmp/hpc_rlhf-{job}/triton " in out  # rank 0's log line
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
