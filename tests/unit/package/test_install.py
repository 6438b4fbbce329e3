"""The environment the set-up script promises: pinned torch, DeepSpeed's CPU op prebuilt."""
import importlib.metadata as md
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def test_torch_matches_the_constraints_pin():
    pins = dict(line.split("==") for line in (ROOT / "constraints.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    assert md.version("torch").split("+")[0] == pins["torch"]


def test_deepspeed_cpu_comm_op_is_prebuilt(monkeypatch):
    """Built into the installed package by scripts/setup_env.sh, so no run compiles it (~35-55 s): DeepSpeed's
    loader takes the prebuilt module (it compiles only where its install record says the op is not built)."""
    import deepspeed
    from deepspeed.ops.op_builder.builder import OpBuilder
    from deepspeed.ops.op_builder.cpu.comm import ShareMemCommBuilder

    def no_compile(self, verbose=True):
        raise AssertionError(f"DeepSpeed would compile {self.name} at run time: it is not prebuilt")
    monkeypatch.setattr(OpBuilder, "jit_load", no_compile)
    monkeypatch.setattr(OpBuilder, "_loaded_ops", {})  # no module loaded earlier in this process answers for it
    op = ShareMemCommBuilder().load()
    assert Path(op.__file__).parent == Path(deepspeed.__file__).parent / "ops" / "comm"
    assert Path(op.__file__).name.startswith("deepspeed_shm_comm_op") and callable(op.initialize)


def test_console_script_is_installed():
    eps = [e for e in md.entry_points(group="console_scripts") if e.name == "hpc-rlhf"]
    assert eps and eps[0].value == "hpc_rlhf.cli:main"


@pytest.mark.slow
def test_few_row_kernel_is_built_on_first_use_only(tmp_path):
    # Not at install (scripts/setup_env.sh builds nothing of it) nor when the package or the lean decoder is imported:
    # the lean engine builds it (~40 s) the first time it decodes in fp32 on an x86 CPU; its source ships with the
    # package.  A fresh extension cache shows when it is built.
    import subprocess
    import sys

    code = ("import os, sys; from hpc_rlhf.generation.lean import decoder, few_rows; "
            "print(sorted(os.listdir(os.environ['TORCH_EXTENSIONS_DIR']))); "
            "print(few_rows.SOURCE.is_file(), few_rows.kernel() is not None, "
            "any(p.endswith('.so') for _, _, f in os.walk(os.environ['TORCH_EXTENSIONS_DIR']) for p in f))")
    env = {**__import__("os").environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600, check=True)
    assert out.stdout.splitlines() == ["[]", "True True True"], out.stderr[-2000:]
    assert "few_rows" not in (ROOT / "scripts" / "setup_env.sh").read_text()


def test_loading_the_few_row_kernel_again_does_not_rebuild_it():
    # A new process of this environment finds the build as it is (ninja runs nothing: its log gains no line); the
    # build's name carries this PyTorch's version and folder, so another environment sharing the cache builds
    # its own instead of rebuilding this one in turn (each rebuild ~40 s).
    import hashlib
    import subprocess
    import sys

    import torch
    from torch.utils.cpp_extension import _get_build_directory

    from hpc_rlhf.generation.lean import few_rows
    folder = hashlib.sha256(str(Path(torch.__file__).resolve().parent).encode()).hexdigest()[:10]
    assert few_rows.NAME.endswith(folder) and torch.__version__.split("+")[0].replace(".", "_") in few_rows.NAME
    log = Path(_get_build_directory(few_rows.NAME, verbose=False)) / ".ninja_log"
    run = [sys.executable, "-m", "hpc_rlhf.generation.lean.few_rows"]
    subprocess.run(run, check=True, capture_output=True, timeout=600)  # builds it where no test has yet
    before = log.read_text()
    subprocess.run(run, check=True, capture_output=True, timeout=300)
    assert log.read_text() == before
