"""The environment the set-up script promises: pinned torch, DeepSpeed's CPU op prebuilt."""
import importlib.metadata as md
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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


def test_few_row_kernel_is_prebuilt():
    # Built into PyTorch's extension cache by scripts/setup_env.sh, so the first generation does not compile it;
    # its source ships with the package.
    from torch.utils.cpp_extension import _get_build_directory

    from hpc_rlhf.generation.lean import few_rows
    assert few_rows.SOURCE.is_file()
    assert (Path(_get_build_directory(few_rows.NAME, verbose=False)) / f"{few_rows.NAME}.so").is_file()
    assert few_rows.kernel() is not None


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
    before = log.read_text()
    subprocess.run([sys.executable, "-m", "hpc_rlhf.generation.lean.few_rows"], check=True, capture_output=True,
                   timeout=300)
    assert log.read_text() == before
