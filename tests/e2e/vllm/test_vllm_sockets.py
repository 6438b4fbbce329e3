"""The Unix-domain socket path vLLM makes under VLLM_RPC_BASE_PATH is as long as the start-up check counts it
(hpc_rlhf/distributed/scratch.py).  Runs in .venv-vllm (`bash scripts/test_vllm.sh`)."""
from hpc_rlhf.distributed.scratch import SOCKETS


def test_vllm_socket_path_is_as_long_as_counted(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", str(tmp_path))
    from vllm.utils.network_utils import get_open_zmq_ipc_path
    who, variable, name = SOCKETS[0]
    assert (who, variable) == ("vLLM", "VLLM_RPC_BASE_PATH")
    path = get_open_zmq_ipc_path().removeprefix("ipc://")
    assert path.startswith(f"{tmp_path}/")
    assert len(path) == len(str(tmp_path)) + len(name)
