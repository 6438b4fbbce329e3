"""The OpenMP wait policy of a rank (distributed/openmp.py): the rule, and that libgomp gets it."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_rlhf.distributed.openmp import ACTIVE, policy_for, rank_threads, usable_cpus, user_chose, wait_policy

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("threads, sharing, cpus, expected", [
    (2, 1, 2, ACTIVE),   # the benchmark's rank: 2 threads on 2 cores
    (4, 2, 8, ACTIVE),   # two ranks of 4 threads on 8 cores: each thread has its core
    (2, 2, 4, ACTIVE),   # exactly full
    (2, 2, 2, None),     # two ranks of 2 threads on 2 cores: spinning would take the other rank's core
    (3, 3, 8, None),     # 9 threads on 8 cores
    (1, 1, 2, None),     # one thread: no worker to wait
    (1, 2, 2, None),     # the launcher's split of 2 cores between 2 ranks
    (8, 1, 4, None),     # more threads than cores
])
def test_wait_policy(threads, sharing, cpus, expected):
    assert wait_policy(threads, sharing, cpus) == expected


@pytest.mark.parametrize("args", [(0, 1, 2), (2, 0, 2), (2, 1, 0)])
def test_wait_policy_rejects_counts_below_one(args):
    with pytest.raises(ValueError, match="must be >= 1"):
        wait_policy(*args)


def test_rank_threads_reads_the_launchers_variables():
    assert rank_threads({}, 4) == (4, 1)  # torch's default: a thread a CPU; alone
    assert rank_threads({"OMP_NUM_THREADS": "2", "LOCAL_WORLD_SIZE": "3"}, 8) == (2, 3)
    assert rank_threads({"OMP_NUM_THREADS": ""}, 6) == (6, 1)
    with pytest.raises(ValueError, match=r"OMP_NUM_THREADS='4,2' is not a whole number"):
        rank_threads({"OMP_NUM_THREADS": "4,2"}, 8)


def test_policy_for_leaves_the_users_choices_alone():
    assert policy_for({"OMP_NUM_THREADS": "2"}, 2) == ACTIVE
    assert policy_for({"OMP_NUM_THREADS": "2", "LOCAL_WORLD_SIZE": "2"}, 2) is None
    assert policy_for({"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"}, 2) is None
    assert policy_for({"OMP_NUM_THREADS": "2", "GOMP_SPINCOUNT": "300000"}, 2) is None
    assert policy_for({"OMP_NUM_THREADS": "2,1"}, 4) is None  # libgomp's nested form: not a count to judge
    assert policy_for({"OMP_NUM_THREADS": "0"}, 4) is None


def _libgomp_policy(code: str, **env) -> tuple[str, str]:
    """(the OMP_WAIT_POLICY libgomp reports as it loads, the child's stdout) for ``python -c code``."""
    chosen = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "LOCAL_WORLD_SIZE", "OMP_NUM_THREADS")
    base = {k: v for k, v in os.environ.items() if k not in chosen}
    out = subprocess.run([sys.executable, "-c", code], env={**base, "OMP_DISPLAY_ENV": "true", **env},
                         capture_output=True, text=True, timeout=120, cwd=REPO, check=True)
    found = re.findall(r"OMP_WAIT_POLICY = '(\w+)'", out.stderr)
    assert len(found) == 1, out.stderr[-2000:]
    return found[0], out.stdout.strip()


@pytest.fixture(scope="module")
def libgomp_default() -> str:
    """The policy libgomp reports when nobody sets one (one thread: the rule leaves it alone)."""
    return _libgomp_policy("import torch", OMP_NUM_THREADS="1")[0]


@pytest.fixture(scope="module")
def train_rank(tmp_path_factory) -> str:
    """`hpc-rlhf train sft` on one rank up to its run, which prints the OMP_WAIT_POLICY a process it started would
    see: the config checks have passed and torch is loaded then (the policy is chosen as it loads)."""
    root = tmp_path_factory.mktemp("omp")
    (root / "m").mkdir()
    (root / "m" / "tokenizer.json").write_text("{}")  # the config checks look for the tokenizer's files only
    (root / "d.jsonl").write_text('{"input": "1", "output": "2"}\n')
    args = ["train", "sft", f"pretrain={root / 'm'}", f"dataset={root / 'd.jsonl'}", f"ckpt_path={root / 'ckpt'}"]
    return ("import os; from hpc_rlhf import cli, commands; "
            "commands.run = lambda name, cfg: print(os.environ.get('OMP_WAIT_POLICY')); "
            f"cli.main({args!r})")


def test_the_cli_loads_openmp_with_the_rule_and_children_do_not_inherit_it(libgomp_default, train_rank):
    CHILD_ENV = train_rank
    expected = ACTIVE if wait_policy(2, 1, usable_cpus()) else libgomp_default
    policy, child_sees = _libgomp_policy(CHILD_ENV, OMP_NUM_THREADS="2")
    assert policy == expected
    assert child_sees == "None"  # processes the rank starts choose for themselves
    # the ranks of the local launcher share the machine: two of 2 threads never fit on what they share with
    # each other unless there are 4 CPUs
    policy, _ = _libgomp_policy(CHILD_ENV, OMP_NUM_THREADS="2", LOCAL_WORLD_SIZE="2")
    assert policy == (ACTIVE if wait_policy(2, 2, usable_cpus()) else libgomp_default)


def test_other_commands_keep_libgomps_default(libgomp_default, tmp_path):
    code = f"from hpc_rlhf import cli; cli.main(['tiny-model', {str(tmp_path / 'm')!r}, '--hidden-size', '8'])"
    assert _libgomp_policy(code, OMP_NUM_THREADS="2")[0] == libgomp_default


def test_user_chose():
    assert not user_chose({"OMP_NUM_THREADS": "2"})
    assert user_chose({"OMP_WAIT_POLICY": "passive"})
    assert user_chose({"GOMP_SPINCOUNT": "300000"})


def test_a_users_wait_policy_stands(libgomp_default, train_rank):
    CHILD_ENV = train_rank
    policy, child_sees = _libgomp_policy(CHILD_ENV, OMP_NUM_THREADS="2", OMP_WAIT_POLICY="PASSIVE")
    assert (policy, child_sees) == ("PASSIVE", "PASSIVE")
    # libgomp's own default kept by its spin count: the policy libgomp reports unset is the one it reports here
    policy, child_sees = _libgomp_policy(CHILD_ENV, OMP_NUM_THREADS="2", GOMP_SPINCOUNT="300000")
    assert (policy, child_sees) == (libgomp_default, "None")
