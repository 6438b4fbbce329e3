"""A rank's node environment (distributed/scratch.py): which caches go where in a SLURM job, what the user set is
kept, the offline flags, socket folders too long for Linux, and folders that cannot be used."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from sft_fixtures import sft_config

from hpc_rlhf.distributed import scratch
from hpc_rlhf.distributed.scratch import ScratchError, node_env, prepare, socket_problem

REPO = Path(__file__).resolve().parents[3]
FOLDERS = {"TRITON_CACHE_DIR": "triton", "TORCHINDUCTOR_CACHE_DIR": "inductor",
           "TORCH_EXTENSIONS_DIR": "torch_extensions", "VLLM_CACHE_ROOT": "vllm", "HF_DATASETS_CACHE": "hf_datasets"}
ONLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def under(root: str) -> dict[str, str]:
    return {name: f"{root}/{folder}" for name, folder in FOLDERS.items()}


def test_outside_a_slurm_job_nothing_is_set():
    assert node_env({}) == {}
    assert node_env({"TMPDIR": "/scratch/t", "SLURM_TMPDIR": "/local/x"}) == {}


@pytest.mark.parametrize("env, root", [
    ({"SLURM_JOB_ID": "77"}, "/tmp/hpc_rlhf-77"),
    ({"SLURM_JOB_ID": "77", "TMPDIR": "/scratch/t"}, "/scratch/t/hpc_rlhf-77"),
    ({"SLURM_JOB_ID": "77", "TMPDIR": "/scratch/t", "SLURM_TMPDIR": "/local/job77"}, "/local/job77/hpc_rlhf-77"),
    ({"SLURM_JOB_ID": "77", "TMPDIR": ""}, "/tmp/hpc_rlhf-77"),  # set but empty: not a folder
])
def test_in_a_slurm_job_every_cache_goes_under_the_jobs_scratch(env, root):
    assert node_env(env) == under(root) | ONLINE


def test_the_users_settings_are_kept():
    env = {"SLURM_JOB_ID": "9", "TRITON_CACHE_DIR": "/mine/triton", "HF_DATASETS_CACHE": "/mine/ds",
           "HF_HUB_OFFLINE": "0"}
    assert node_env(env) == {"TORCHINDUCTOR_CACHE_DIR": "/tmp/hpc_rlhf-9/inductor",
                             "TORCH_EXTENSIONS_DIR": "/tmp/hpc_rlhf-9/torch_extensions",
                             "VLLM_CACHE_ROOT": "/tmp/hpc_rlhf-9/vllm",
                             "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def test_each_switch_alone():
    env = {"SLURM_JOB_ID": "9"}
    assert node_env(env, caches=False) == ONLINE
    assert node_env(env, offline=False) == under("/tmp/hpc_rlhf-9")
    assert node_env(env, caches=False, offline=False) == {}


def test_the_hub_cache_and_xdg_cache_home_are_never_moved():
    got = node_env({"SLURM_JOB_ID": "9"})
    assert not {"HF_HOME", "HF_HUB_CACHE", "XDG_CACHE_HOME"} & set(got)


# vLLM: FOLDER + "/" + a uuid4 (36 characters) = len(FOLDER) + 37; multiprocessing: FOLDER + "/pymp-" + 8 +
# "/listener-" + 8 = len(FOLDER) + 32.  Linux: at most 107.
def folder(n: int) -> str:
    return "/" + "d" * (n - 1)  # a folder name of n characters


def test_socket_folders_that_fit():
    assert socket_problem({}) is None  # /tmp
    assert socket_problem({"TMPDIR": folder(70)}) is None  # 70 + 37 = 107
    assert socket_problem({"TMPDIR": folder(71), "VLLM_RPC_BASE_PATH": "/tmp"}) is None  # 71 + 32 = 103; 4 + 37


def test_a_temporary_folder_too_long_for_vllms_sockets_is_named():
    problem = socket_problem({"TMPDIR": folder(71)})
    assert problem == (f"TMPDIR={folder(71)} is too long: vLLM binds Unix-domain sockets at "
                       f"{folder(71)}/xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx (108 characters; Linux takes at most 107): "
                       f"set TMPDIR to a folder of at most 70 characters, e.g. /tmp")


def test_each_socket_folder_is_checked_with_its_variable():
    problem = socket_problem({"TMPDIR": "/tmp", "VLLM_RPC_BASE_PATH": folder(71)})
    assert problem.startswith(f"VLLM_RPC_BASE_PATH={folder(71)} is too long: vLLM ") and "(108 characters" in problem
    problem = socket_problem({"TMPDIR": folder(76), "VLLM_RPC_BASE_PATH": "/tmp"})  # 76 + 32 = 108
    assert problem.startswith(f"TMPDIR={folder(76)} is too long: Python's multiprocessing binds ")
    assert "(108 characters" in problem and "at most 75 characters" in problem
    assert socket_problem({"TMPDIR": folder(75), "VLLM_RPC_BASE_PATH": "/tmp"}) is None  # 107
    assert socket_problem({"TEMP": folder(71)}).startswith("TEMP=")  # tempfile's next choice


def test_the_multiprocessing_socket_name_is_as_long_as_counted(tmp_path):
    """The suffix counted for Python's multiprocessing is the one it makes (checked in a fresh interpreter)."""
    out = subprocess.run([sys.executable, "-c", "from multiprocessing.connection import arbitrary_address; "
                                                "print(arbitrary_address('AF_UNIX'))"],
                         env={**os.environ, "TMPDIR": str(tmp_path)}, capture_output=True, text=True, check=True)
    path = out.stdout.strip()
    assert path.startswith(f"{tmp_path}/pymp-")
    assert len(path) == len(str(tmp_path)) + len(scratch.SOCKETS[1][2])


def test_prepare_makes_the_folders_and_sets_the_variables(tmp_path):
    env = {"SLURM_JOB_ID": "5", "SLURM_TMPDIR": str(tmp_path), "HF_DATASETS_CACHE": str(tmp_path / "mine")}
    added = prepare(True, True, env)
    root = tmp_path / "hpc_rlhf-5"
    assert added == {k: v for k, v in under(str(root)).items() if k != "HF_DATASETS_CACHE"} | ONLINE
    assert env == {"SLURM_JOB_ID": "5", "SLURM_TMPDIR": str(tmp_path), "HF_DATASETS_CACHE": str(tmp_path / "mine"),
                   **added}
    assert oct(root.stat().st_mode & 0o777) == "0o700"
    assert sorted(p.name for p in root.iterdir()) == ["inductor", "torch_extensions", "triton", "vllm"]
    assert (tmp_path / "mine").is_dir()  # the user's own folder is made and checked too
    assert prepare(True, True, env) == {}  # a second rank of the node: everything set, folders there


def test_a_scratch_folder_that_cannot_be_made_is_one_line(tmp_path):
    (tmp_path / "file").write_text("")
    env = {"SLURM_JOB_ID": "5", "TMPDIR": str(tmp_path / "file")}
    with pytest.raises(ScratchError) as e:
        prepare(True, True, env)
    assert str(e.value) == (f"{tmp_path}/file/hpc_rlhf-5 is not a writable folder (Not a directory): set TMPDIR to "
                            f"a folder this job can write")
    assert env == {"SLURM_JOB_ID": "5", "TMPDIR": str(tmp_path / "file")}  # nothing set


def test_the_users_cache_folder_that_cannot_be_made_names_its_variable(tmp_path):
    (tmp_path / "file").write_text("")
    env = {"SLURM_JOB_ID": "5", "SLURM_TMPDIR": str(tmp_path), "TORCH_EXTENSIONS_DIR": str(tmp_path / "file/ext")}
    with pytest.raises(ScratchError, match=rf"^{tmp_path}/file/ext is not a writable folder \(Not a directory\): "
                                           rf"set TORCH_EXTENSIONS_DIR to a folder this job can write$"):
        prepare(True, True, env)


def test_a_cache_of_compiled_code_on_a_noexec_file_system_is_refused(tmp_path, monkeypatch):
    real = os.statvfs

    class NoExec:
        def __init__(self, path):
            self.f_flag = real(path).f_flag | os.ST_NOEXEC

    monkeypatch.setattr(scratch.os, "statvfs", NoExec)
    with pytest.raises(ScratchError, match=rf"^{tmp_path}/hpc_rlhf-5/triton is on a file system mounted noexec, "
                                           rf"where the libraries compiled into it cannot be loaded: set "
                                           rf"TRITON_CACHE_DIR to a folder on another one$"):
        prepare(True, True, {"SLURM_JOB_ID": "5", "SLURM_TMPDIR": str(tmp_path)})
    # the datasets cache holds no code: on its own it passes
    env = {"SLURM_JOB_ID": "5", "SLURM_TMPDIR": str(tmp_path), **{k: "" for k in scratch.COMPILED}}
    assert prepare(True, True, env) == {"HF_DATASETS_CACHE": f"{tmp_path}/hpc_rlhf-5/hf_datasets"} | ONLINE


def test_a_scratch_folder_of_another_user_is_refused(tmp_path, monkeypatch):
    (tmp_path / "hpc_rlhf-5").mkdir(mode=0o777)
    monkeypatch.setattr(scratch.os, "getuid", lambda: os.stat(tmp_path).st_uid + 1)
    with pytest.raises(ScratchError, match=rf"^{tmp_path}/hpc_rlhf-5 belongs to another user, who could plant code "
                                           rf"in its compile caches: set SLURM_TMPDIR to a folder of your own$"):
        prepare(True, True, {"SLURM_JOB_ID": "5", "SLURM_TMPDIR": str(tmp_path)})


def test_a_socket_folder_too_long_stops_before_anything_is_made(tmp_path):
    long = str(tmp_path) + "/" + "d" * (71 - len(str(tmp_path)) - 1)
    env = {"SLURM_JOB_ID": "5", "TMPDIR": long}
    with pytest.raises(ScratchError, match=r"^TMPDIR=.* is too long: vLLM binds"):
        prepare(True, True, env)
    assert not Path(long).exists()


def test_hpc_rlhf_train_stops_with_one_line_before_loading_torch(tmp_path):
    """The command line: the rank's environment is prepared before the checks and before torch loads; a scratch
    folder that cannot be made ends the run with one line and exit code 2."""
    config = sft_config(tmp_path, steps=1)
    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump(config))
    (tmp_path / "file").write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    code = ("import sys; from hpc_rlhf.cli import main; rc = main(sys.argv[1:]); "
            "print('torch loaded' if 'torch' in sys.modules else 'no torch'); sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code, "train", "sft", "--config", str(path)], cwd=REPO,
                          env={**env, "SLURM_JOB_ID": "5", "TMPDIR": str(tmp_path / "file")},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [f"hpc-rlhf: {tmp_path}/file/hpc_rlhf-5 is not a writable folder (Not a "
                                        f"directory): set TMPDIR to a folder this job can write"]
    assert proc.stdout.strip() == "no torch"
