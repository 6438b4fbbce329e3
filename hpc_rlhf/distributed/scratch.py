"""A rank's environment on a cluster node: per-job, node-local caches, the offline flags, and room for the Unix-domain
sockets the libraries make under the temporary folder.  Set before torch, Triton, transformers, datasets or vLLM load:
they read these variables as they load, or when they first compile.

In a SLURM job (``SLURM_JOB_ID`` set), each variable of ``CACHES`` that the environment does not set already points
into the job's scratch folder on this node, ``hpc_rlhf-JOBID`` under ``$SLURM_TMPDIR``, else ``$TMPDIR``, else
``/tmp``: compilers and the datasets cache write their many small files there, not on a shared home, and jobs do not
meet in one cache.  The folder is the job's own (mode 0700, refused when another user owns it).  Every rank of the
node makes it and the caches' folders (concurrent ranks: ``exist_ok``); each cache folder, the user's own included,
must take a file, and a cache of compiled code (``COMPILED``) must not be on a file system mounted noexec, from which
the libraries built there could not be loaded.  The offline flags (``OFFLINE``) are set to 1 where unset, for compute
nodes without internet.  The Hugging Face hub cache (``HF_HOME``, ``HF_HUB_CACHE``) holds the user's models and stays
where it is, and so does ``XDG_CACHE_HOME``, under which it lies by default.  Outside a SLURM job nothing is set: a
workstation's home is its own disk, and the caches there (the lean engine's few-row kernel takes about 40 s to
build) serve the next run.

vLLM binds ZeroMQ sockets at ``$VLLM_RPC_BASE_PATH/<uuid4>`` (default: the temporary folder), Python's
multiprocessing at ``TEMP/pymp-XXXXXXXX/listener-XXXXXXXX``.  A socket path takes at most 107 characters on Linux
(``sun_path`` is 108 bytes with its terminating NUL; ZeroMQ refuses a 108th), so a folder too long for them is
refused at start-up, naming the variable to shorten, rather than failing inside vLLM.

No torch here: ``commands.node_environment`` calls ``prepare`` before the rank loads anything heavy.
"""
from __future__ import annotations

import os
import tempfile

CACHES = {"TRITON_CACHE_DIR": "triton", "TORCHINDUCTOR_CACHE_DIR": "inductor",
          "TORCH_EXTENSIONS_DIR": "torch_extensions", "VLLM_CACHE_ROOT": "vllm", "HF_DATASETS_CACHE": "hf_datasets"}
COMPILED = ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "TORCH_EXTENSIONS_DIR", "VLLM_CACHE_ROOT")  # load .so files
OFFLINE = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")
SOCKET_PATH_MAX = 107
# (who binds them, the variable naming their folder (None: the temporary folder), the longest name made under it)
SOCKETS = (("vLLM", "VLLM_RPC_BASE_PATH", "/xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"),  # ipc://FOLDER/<uuid4>
           ("Python's multiprocessing", None, "/pymp-xxxxxxxx/listener-xxxxxxxx"))


class ScratchError(OSError):
    """A scratch or cache folder that cannot be written, or a socket folder whose paths would be too long."""


def temp_dir(env) -> tuple[str, str | None]:
    """(the temporary folder, the variable naming it): ``TMPDIR``, ``TEMP`` or ``TMP`` as Python's ``tempfile``
    reads them, else (/tmp, None)."""
    name = next((n for n in ("TMPDIR", "TEMP", "TMP") if env.get(n)), None)
    return (env[name], name) if name else ("/tmp", None)


def scratch_root(env) -> tuple[str, str | None] | None:
    """(this job's scratch folder on the node, the variable naming where it lies), or None outside a SLURM job."""
    job = env.get("SLURM_JOB_ID")
    if not job:
        return None
    name = next((n for n in ("SLURM_TMPDIR", "TMPDIR") if env.get(n)), None)
    return f"{env[name] if name else '/tmp'}/hpc_rlhf-{job}", name


def node_env(env, caches: bool = True, offline: bool = True) -> dict[str, str]:
    """The variables to add to ``env``: in a SLURM job, each of ``CACHES`` (with ``caches``) under the job's scratch
    folder and each of ``OFFLINE`` (with ``offline``) as 1, where ``env`` does not set it; else none."""
    root = scratch_root(env)
    if root is None:
        return {}
    out = {name: f"{root[0]}/{folder}" for name, folder in CACHES.items() if caches and name not in env}
    return out | {name: "1" for name in OFFLINE if offline and name not in env}


def socket_problem(env) -> str | None:
    """One line when a Unix-domain socket the libraries make under a folder ``env`` names would pass
    ``SOCKET_PATH_MAX`` characters; None when all fit."""
    temp = temp_dir(env)
    for who, variable, name in SOCKETS:
        folder, named_by = (env[variable], variable) if variable and env.get(variable) else temp
        length = len(os.fsencode(folder + name))
        if length > SOCKET_PATH_MAX:
            return (f"{named_by}={folder} is too long: {who} binds Unix-domain sockets at {folder}{name} "
                    f"({length} characters; Linux takes at most {SOCKET_PATH_MAX}): set {named_by} to a folder of "
                    f"at most {SOCKET_PATH_MAX - len(name)} characters, e.g. /tmp")
    return None


def _usable(path: str, variable: str, code: bool, mode: int = 0o777) -> None:
    """ScratchError naming ``path`` and the ``variable`` that decides it unless the folder exists, or can be made,
    and takes a file, and (``code``) its file system lets the libraries compiled into it be loaded (not noexec)."""
    try:
        os.makedirs(path, mode=mode, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path, prefix=".write-check-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ScratchError(f"{path} is not a writable folder ({e.strerror or e}): set {variable} to a folder this "
                           f"job can write") from None
    if code and os.statvfs(path).f_flag & os.ST_NOEXEC:
        raise ScratchError(f"{path} is on a file system mounted noexec, where the libraries compiled into it cannot "
                           f"be loaded: set {variable} to a folder on another one")


def prepare(caches: bool, offline: bool, env=None) -> dict[str, str]:
    """Check the socket folders, then add ``node_env`` to ``env`` (default ``os.environ``) after making the job's
    scratch folder and every cache folder, the user's own included, and checking each (``_usable``).  Returns the
    variables added.  ScratchError (one line naming the folder and the variable to change) otherwise."""
    env = os.environ if env is None else env
    if problem := socket_problem(env):
        raise ScratchError(problem)
    added = node_env(env, caches, offline)
    root = scratch_root(env)
    if caches and root is not None:
        folder, variable = root[0], root[1] or "TMPDIR"
        _usable(folder, variable, code=False, mode=0o700)
        if os.stat(folder).st_uid != os.getuid():
            raise ScratchError(f"{folder} belongs to another user, who could plant code in its compile caches: set "
                               f"{variable} to a folder of your own")
        for name in CACHES:
            if path := added.get(name, env.get(name)):
                _usable(path, name, code=name in COMPILED)
    env.update(added)
    return added
