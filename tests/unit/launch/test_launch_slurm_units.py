"""SLURM launch pieces that need no cluster: host lists, rendezvous, signals, job script, plan, memory."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from hpc_rlhf.config import load_config
from hpc_rlhf.config.rl import RLConfig
from hpc_rlhf.config.sft import SFTConfig
from hpc_rlhf.launch import memory
from hpc_rlhf.launch.job import components, is_hetjob
from hpc_rlhf.distributed.preemption import NONE, STOP, STOP_AND_REQUEUE, StopRequest
from hpc_rlhf.launch.sbatch import render
from hpc_rlhf.models.shape import ModelShape, model_shape
from hpc_rlhf.distributed.rendezvous import expand_hostlist, in_slurm_step, rendezvous_port, slurm_rendezvous


def test_expand_hostlist():
    assert expand_hostlist("node1") == ["node1"]
    assert expand_hostlist("gpu[01-03,7],cpu5") == ["gpu01", "gpu02", "gpu03", "gpu7", "cpu5"]
    assert expand_hostlist("a[8-10]-ib") == ["a8-ib", "a9-ib", "a10-ib"]


# What the tasks of a 2+1 heterogeneous step saw on the local cluster (Slurm 22.05).
HET_TASK = {"SLURM_PROCID": "2", "SLURM_NTASKS": "3", "SLURM_LOCALID": "0", "SLURM_STEP_ID": "0",
            "SLURM_JOB_ID": "41", "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_STEP_NODELIST": "node[1-2]",
            "SLURM_JOB_NODELIST_HET_GROUP_0": "node1", "SLURM_JOB_NODELIST_HET_GROUP_1": "node2",
            "SLURM_CPUS_PER_TASK": "2"}


def test_rendezvous_from_a_het_step():
    got = slurm_rendezvous(HET_TASK)
    assert got == {"RANK": "2", "WORLD_SIZE": "3", "LOCAL_RANK": "0", "MASTER_ADDR": "node1",
                   "MASTER_PORT": str(rendezvous_port(41, 0, 0)), "OMP_NUM_THREADS": "2"}
    again = slurm_rendezvous(dict(HET_TASK, SLURM_RESTART_COUNT="1"))
    assert again["MASTER_PORT"] != got["MASTER_PORT"]  # a restarted job does not meet its old sockets
    assert 20000 <= int(again["MASTER_PORT"]) < 32768
    assert slurm_rendezvous(dict(HET_TASK, MASTER_PORT="1234"))["MASTER_PORT"] == "1234"


def test_rendezvous_ports_stay_below_the_ephemeral_range():
    # hand-derived: 20000 + (123456 * 7919) mod 12768 = 20000 + 977648064 mod 12768 = 22304; a requeue adds 131
    assert rendezvous_port(123456, 0, 0) == 22304 and rendezvous_port(123456, 0, 1) == 22435
    # job 2, step 0 got 35838 under the old span of 20000 and met a client socket there (EADDRINUSE)
    assert rendezvous_port(2, 0, 0) == 20000 + 15838 % 12768 == 23070
    ports = {rendezvous_port(job, step, restart) for job in range(0, 200_000, 997) for step in range(3)
             for restart in range(3)}
    assert min(ports) >= 20000 and max(ports) < 32768  # Linux's default ephemeral range starts at 32768


def test_the_batch_script_is_not_a_rank():
    batch = {k: v for k, v in HET_TASK.items() if k != "SLURM_STEP_ID"}
    assert not in_slurm_step(batch) and in_slurm_step(HET_TASK)


def test_signals_only_set_a_flag_and_requeue_signals_win():
    stop = StopRequest(["TERM", "USR1"], ["USR1"])
    try:
        assert stop.code() == NONE
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.code() == STOP
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.code() == STOP_AND_REQUEUE
        os.kill(os.getpid(), signal.SIGTERM)  # a later TERM does not take the requeue back
        assert stop.code() == STOP_AND_REQUEUE
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def _rl_cfg(*overrides):
    return load_config(RLConfig, None, ["pretrain=/nonexistent", "prompt_data=p.jsonl", "reward_func=r.py",
                                        "init_kl_coef=0.01", "colocate_actor_ref=true", *overrides])


def test_het_script_one_block_per_role_group():
    from hpc_rlhf.trainers.placement import plan_from_config
    cfg = _rl_cfg("slurm.roles.rollout.gpus_per_task=1", "slurm.setup=module load cuda/12.4")
    comps = components(cfg, plan_from_config(cfg))
    assert [(c.name, c.first_rank, c.ntasks) for c in comps] == [("actor+reference", 0, 1), ("reward", 1, 1),
                                                                ("rollout", 2, 1)]
    assert is_hetjob(comps, "auto")
    script = render(comps, cfg.slurm, ["python", "-m", "hpc_rlhf.cli", "train", "rl"], "/logs")
    assert script.count("#SBATCH hetjob") == 2
    assert "--gpus-per-task=1   # rollout" in script and "--requeue" in script and "--signal=USR1@300" in script
    assert "module load cuda/12.4" in script and "export HF_HUB_OFFLINE=1" in script
    srun = script[script.index("srun "):]
    assert srun.count("--het-group=") == 3 and "--kill-on-bad-exit=1" in srun
    # the same resources everywhere: one homogeneous allocation, global rank = plan rank
    same = components(_rl_cfg(), plan_from_config(_rl_cfg()))
    assert not is_hetjob(same, "auto")
    plain = render(same, cfg.slurm, ["python"], "/logs")
    assert "hetjob" not in plain and "#SBATCH --ntasks=3 --cpus-per-task=1" in plain


def test_the_script_runs_its_step_through_the_step_runner_with_spare_nodes_on_top():
    """3 ranks on 2 nodes plus 1 spare: the allocation asks for 3 nodes of 2 task slots each (a spare can take
    over a node's ranks) and --no-kill (it outlives a lost node); `hpc-rlhf steps` gets the ranks, the restart
    options and the step's srun with its log folder left open ({step_dir})."""
    cfg = load_config(SFTConfig, None, ["pretrain=/x", "dataset=d.jsonl", "nproc=3", "slurm.roles.actor.nodes=2",
                                        "slurm.spare_nodes=1", "launch.max_restarts=4", "slurm.on_node_loss=end"])
    script = render(components(cfg), cfg.slurm, ["python", "-m", "hpc_rlhf.cli", "train", "sft"], "/l",
                    max_restarts=cfg.launch.max_restarts)
    assert "#SBATCH --ntasks-per-node=2 --nodes=3 --cpus-per-task=1" in script and " --no-kill " in script
    assert (" -m hpc_rlhf.cli steps --log-dir /l --ntasks 3 --max-restarts 4 --spare-nodes 1 --on-node-loss end "
            "-- srun --kill-on-bad-exit=1") in script
    assert '--output="{step_dir}/rank-%t.log" "${CMD[@]}" || rc=$?\nexit "${rc:-0}"\n' in script


@pytest.mark.parametrize("overrides,message", [
    (["slurm.spare_nodes=1"], "slurm.roles.<role>.nodes"),
    (["slurm.spare_nodes=1", "slurm.roles.actor.nodes=1", "slurm.hetjob=always"], "homogeneous"),
])
def test_spare_nodes_need_a_homogeneous_job_with_its_node_count(overrides, message):
    from hpc_rlhf.config import ConfigError
    from hpc_rlhf.trainers.placement import plan_from_config
    cfg = _rl_cfg(*overrides)
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("<", "<")):
        render(components(cfg, plan_from_config(cfg)), cfg.slurm, ["python"], "/logs")


def test_script_is_valid_bash():
    cfg = load_config(SFTConfig, None, ["pretrain=/x", "dataset=d.jsonl", "nproc=4", "slurm.hetjob=never"])
    script = render(components(cfg), cfg.slurm, ["python", "-m", "hpc_rlhf.cli", "train", "sft", "a b"], "/l")
    assert "CMD=(python -m hpc_rlhf.cli train sft 'a b')" in script
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0


def test_memory_counts_by_hand():
    from hpc_rlhf.generation.specs import LEAN, TRANSFORMERS, VLLM
    shape = ModelShape(params=1000, hidden=8, layers=2, kv_heads=2, head_dim=4, vocab=10, intermediate=32)
    # activations per token and layer: b * (11 h + 3 kv + 4 i) = b * (88 + 24 + 128) = 240 b
    assert memory.activation_bytes(shape, 2) == 480
    assert memory.activation_bytes(ModelShape(1000, 8, 2, 2, 4, gated=False), 4) == 4 * (88 + 24 + 2 * 32)
    # bf16 weights 2 B/param; ZeRO-2 over 4 ranks shards gradients (2000/4) and AdamW
    # (8 B moments + 4 B fp32 master = 12000 B, /4); activations 480 B * (2*16 tokens) * 2 layers
    assert memory.trained(shape, "bf16", 2, 4, False, False, 2, 16, False) == {
        "weights": 2000, "gradients": 500, "optimizer": 3000, "activations": 480 * 32 * 2}
    # fp32, ZeRO-3: weights sharded too; 4-byte activations; no master copy; logits of 6 positions per
    # sequence: 3 float32 copies of [1 x 6, 10 vocab]
    assert memory.trained(shape, "fp32", 3, 2, False, False, 1, 10, False, logit_positions=6) == {
        "weights": 2000, "gradients": 2000, "optimizer": 4000, "activations": 960 * 10 * 2, "logits": 3 * 4 * 6 * 10}
    # gradient checkpointing: each layer's input (4 B * 8 hidden per token and layer) plus one full layer
    assert memory.trained(shape, "fp32", 0, 1, True, False, 1, 10, True)["activations"] == 4 * 8 * 10 * 2 + 960 * 10
    # the engines' memory models; the rollout's cache: 2 (k and v) * layers * kv_heads * head_dim * 2 B * sequences
    # * length
    assert TRANSFORMERS.memory(shape, "bf16", 3, 5) == {"weights": 2000, "kv cache": 2 * 2 * 2 * 4 * 2 * 3 * 5}
    # the lean decoder's packed copy: all weights but the untied input embedding (10 x 8), or all when tied
    assert LEAN.memory(shape, "fp32", 3, 5) == {"weights": 4000, "packed weights": (1000 - 80) * 4,
                                                "kv cache": 2 * 2 * 2 * 4 * 4 * 3 * 5}
    tied = ModelShape(1000, 8, 2, 2, 4, vocab=10, tied=True)
    assert LEAN.memory(tied, "fp32", 3, 5)["packed weights"] == 4000
    # vLLM on a CPU: the cache it reserves (rollout.vllm.cpu_kv_cache_gib), on a GPU that of the sequences
    assert VLLM.memory(shape, "fp32", 3, 5, cpu_kv_cache_gib=2) == {"weights": 4000, "kv cache (preallocated)": 2 << 30}
    assert VLLM.memory(shape, "fp32", 3, 5, on_cpu=False) == TRANSFORMERS.memory(shape, "fp32", 3, 5)
    # the weight sync's two shared slots: each the bucket (here 100 B), or the model when smaller (1000 params
    # * 2 B), or the embedding (10 x 8 x 4 B = 320 B) when larger than the bucket
    assert memory.weight_slots(shape, "fp32", 100) == 2 * 320
    assert memory.weight_slots(shape, "bf16", 200) == 2 * 200
    assert memory.weight_slots(shape, "bf16", 10 ** 6) == 2 * 2000
    # a rank: lasting parts of all its roles + the largest phase of one role + the runtime; CPU parts left out
    actor = {"weights": 10, "optimizer (CPU)": 1000, "activations": 50, "logits": 20}
    rollout = {"weights": 10, "packed weights": 10, "kv cache": 60}
    assert memory.rank_total([actor, rollout]) == 30 + 70 + memory.RUNTIME_BYTES
    assert memory.rank_total([rollout]) == 20 + 60 + memory.RUNTIME_BYTES
    assert memory.rank_total([{}]) == memory.RUNTIME_BYTES


def test_plan_command_prints_placement_memory_and_script(tmp_path):
    from hpc_rlhf.models.tiny import build_tiny_model
    model = build_tiny_model(tmp_path / "m", hidden_size=32, num_layers=2, max_position_embeddings=64)
    proc = subprocess.run([sys.executable, "-m", "hpc_rlhf.cli", "plan", "rl", f"pretrain={model}",
                           "prompt_data=p.jsonl", "reward_func=r.py", "init_kl_coef=0.01",
                           "rollout_num_ranks=2", "slurm.roles.rollout.gpus_per_task=1",
                           f"slurm.log_dir={tmp_path / 'logs'}"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "5 ranks, heterogeneous job" in out
    assert "actor      ranks 0-0 (1 tasks)  1 CPU per task" in out
    assert "rollout    ranks 3-4 (2 tasks)  1 GPU + 1 CPU per task" in out
    assert out.startswith("hpc-rlhf plan:")  # nothing else on stdout (a script can capture it)
    for role in ("actor", "reference", "reward", "rollout"):
        assert f"\n  {role:<10}" in out.split("memory per rank")[1]
    assert "#!/bin/bash" in out and f"--output={tmp_path / 'logs'}/%j.out" in out
    assert not (tmp_path / "logs").exists()  # plan submits and creates nothing
    assert "weight-sync slots" not in out  # a GPU job's weights go by NCCL broadcast
    # no vLLM in this environment: the lean engine on the rollout ranks' GPUs
    assert "\nrollout engine: lean (rollout.engine=auto: vLLM is not installed, and the lean engine runs llama " \
           "models)\n" in out


def test_plan_counts_the_weight_sync_memory_between_cpu_components(tmp_path):
    """Actor and rollout on CPU ranks of their own: to the transformers engine, the actor holds the shared weights
    (the rollout's are its weights); to vLLM, both sides hold the two shared-memory slots; every role on one
    rank: no weights bridge, neither."""
    from hpc_rlhf.config.rl import RLConfig
    from hpc_rlhf.distributed.weight_sync import BUCKET_BYTES
    from hpc_rlhf.launch.plan import role_memory
    from hpc_rlhf.models.tiny import build_tiny_model
    from hpc_rlhf.trainers.placement import plan_from_config
    model = build_tiny_model(tmp_path / "m", hidden_size=32, num_layers=2, max_position_embeddings=64)
    args = [f"pretrain={model}", "prompt_data=p.jsonl", "reward_func=r.py", "param_dtype=fp32"]
    shape = model_shape(str(model))
    slots = 2 * max(min(BUCKET_BYTES, shape.params * 4), shape.vocab * shape.hidden * 4)
    split = load_config(RLConfig, None, args + ["async_train=true", "colocate_actor_reward=true"])
    parts = role_memory(split, plan_from_config(split))
    assert parts["actor"]["weight-sync shared weights"] == shape.params * 4
    assert "weight-sync slots" not in parts["actor"] and set(parts["rollout"]) == {"weights", "packed weights",
                                                                                 "kv cache"}
    vllm = load_config(RLConfig, None, args + ["async_train=true", "colocate_actor_reward=true", "engine=vllm"])
    parts = role_memory(vllm, plan_from_config(vllm))
    assert parts["actor"]["weight-sync slots"] == parts["rollout"]["weight-sync slots"] == slots
    assert "weight-sync shared weights" not in parts["actor"]
    together = load_config(RLConfig, None, args + ["colocate_all=true"])
    assert not {"weight-sync slots", "weight-sync shared weights"} & {
        k for v in role_memory(together, plan_from_config(together)).values() for k in v}


def test_plan_of_on_policy_kd_counts_the_students_engine_and_the_teacher_on_the_rank(tmp_path):
    """train kd with objective.lmbda > 0 loads the student, the teacher and an engine of its own with the student's
    weights on every rank: the per-rank total holds all three (lasting weights, the largest phase)."""
    from hpc_rlhf.commands import load_config as load_command
    from hpc_rlhf.launch.plan import rank_memory, role_memory
    from hpc_rlhf.models.tiny import build_tiny_model
    model = build_tiny_model(tmp_path / "m", hidden_size=32, num_layers=2, max_position_embeddings=64)
    args = [f"pretrain={model}", f"teacher_pretrain={model}", "dataset=d.jsonl", "kd_coef=0.5", "param_dtype=fp32",
            "max_len=64", "train_batch_size=8", "micro_train_batch_size=2"]
    on_policy = load_command("train kd", None, args + ["lmbda=0.5", "rollout.engine=hf", "rollout.max_batch_size=4"])
    parts = role_memory(on_policy, None)
    shape = model_shape(str(model))
    kv = 2 * shape.layers * shape.kv_heads * shape.head_dim * 4 * 4 * 64  # 4 rows of 64 tokens, fp32
    assert parts["student engine"] == {"weights": shape.params * 4, "kv cache": kv}
    assert parts["teacher"] == {"weights": shape.params * 4}
    [(_, total)] = rank_memory(on_policy, None, parts)
    assert total == memory.rank_total(list(parts.values()))
    assert total > memory.rank_total([parts["actor"]]) + 2 * shape.params * 4 - 1  # teacher and engine weights
    offline = load_command("train kd", None, args)
    assert "student engine" not in role_memory(offline, None)


@pytest.mark.parametrize("bad", ["slurm.stop_signals=TERM,KILL", "slurm.requeue_signals=USR2"])
def test_bad_signal_config_names_the_key(bad):
    from hpc_rlhf.config import ConfigError
    with pytest.raises(ConfigError, match="slurm"):
        load_config(SFTConfig, None, ["pretrain=/x", "dataset=d.jsonl", "slurm.stop_signals=TERM,USR1", bad])
