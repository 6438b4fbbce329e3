"""Config of `hpc-rlhf train rl`: one loop for PPO, REINFORCE++, RLOO, GRPO and the rest."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..algorithms.registry import COMPONENT_ESTIMATORS
from .algo import AlgoConfig
from .base import ConfigError, field
from .sections import (CheckpointConfig, EngineOptions, LaunchConfig, LogConfig, ModelConfig, OptimizerConfig,
                       VllmOptions)
from .slurm import SlurmConfig


@dataclass(kw_only=True)
class PromptFormat:
    """How prompt rows become prompts: shared by `train rl` and `hpc-rlhf eval`."""
    prompt_split: str = field("train", help="split read from sources that have several")
    input_key: str = field("input", help="column holding the prompt (a messages list with apply_chat_template)")
    label_key: str | None = field("label", help="column passed to reward functions as the label (null: none)")
    input_template: str | None = field(None, help="format string with one {} for the prompt")
    apply_chat_template: bool = field(False, help="render prompts with the tokenizer's chat template and a "
                                                  "generation prompt")
    prompt_max_len: int = field(1024, ge=1, help="prompts longer than this (tokens) are bad rows")
    bad_rows: Literal["skip", "error"] = field("skip", help="skip (and report) or stop on a bad row")


@dataclass(kw_only=True)
class PromptDataConfig(PromptFormat):
    prompt_data: list[str] = field(path="data", help="prompt data sources (same formats as SFT datasets)")
    prompt_data_probs: list[float] | None = field(None, ge=0, help="mixing probabilities, one per source")
    eval_prompt_data: list[str] | None = field(None, path="data", help="held-out prompts: sampled as the eval.* "
                                                                       "options say, scored by the reward sources, "
                                                                       "pass@k and the rest logged every eval_steps "
                                                                       "and at the end (docs/eval.md)")
    max_eval_prompts: int | None = field(None, ge=1, help="cap on eval prompts")
    max_samples: int | None = field(None, ge=1, help="cap on prompts")
    shuffle_prompts: bool = field(True, help="draw each epoch's prompts in a seeded random order (false: in the "
                                             "order of the sources, every epoch the same)")

    def validate(self) -> None:
        if not self.prompt_data:
            raise ConfigError("data.prompt_data is empty: name at least one prompt source")
        if self.prompt_data_probs is not None and len(self.prompt_data_probs) != len(self.prompt_data):
            raise ConfigError(f"data.prompt_data_probs has {len(self.prompt_data_probs)} values for "
                              f"{len(self.prompt_data)} sources")


@dataclass
class RolloutVllmOptions(VllmOptions):
    sleep: bool = field(True, aliases=("vllm_sleep",), help="on GPU: free the KV cache and weights while the actor "
                                                             "trains (colocated ranks); vLLM has no sleep mode on CPU")


@dataclass
class RolloutConfig(EngineOptions):
    vllm: RolloutVllmOptions = field(default_factory=RolloutVllmOptions, help="engine vllm")
    n_samples_per_prompt: int = field(1, ge=1, help="responses sampled per prompt (the group size)")
    rollout_batch_size: int = field(8, ge=1, help="prompts per RL step, over all ranks")
    generate_max_len: int = field(256, ge=1, help="new tokens per response at most")
    min_new_tokens: int = field(0, ge=0, help="no stop token is sampled before this many new tokens (their "
                                              "probability is set to 0, as transformers' min_new_tokens and vLLM's "
                                              "min_tokens do)")
    temperature: float = field(1.0, ge=0, help="sampling temperature (0: greedy)")
    top_p: float = field(1.0, gt=0, le=1, help="nucleus sampling mass")
    top_k: int = field(0, ge=0, help="sample from the k most likely tokens (0: all)")
    max_batch_size: int = field(64, ge=1, help="sequences per generation batch on one rank")
    dynamic_filtering: bool = field(False, help="drop groups whose rewards are all equal (all right or all "
                                                "wrong) and replace them with fresh prompts")
    dynamic_filtering_max_rounds: int = field(4, ge=1, help="generation rounds per step at most when filtering")

    def validate(self) -> None:
        if self.min_new_tokens > self.generate_max_len:
            raise ConfigError(f"rollout.min_new_tokens={self.min_new_tokens} exceeds rollout.generate_max_len="
                              f"{self.generate_max_len}")
        if self.dynamic_filtering and self.n_samples_per_prompt < 2:
            raise ConfigError("rollout.dynamic_filtering needs n_samples_per_prompt >= 2 (a group to compare)")


@dataclass
class RewardConfig:
    reward_pretrain: str | None = field(None, path="model",
                                        help="reward model folder (AutoModelForSequenceClassification)")
    reward_func: str | None = field(None, path="reward",
                                    help="Python file defining reward_func(queries, prompts, labels), or a "
                                         "built-in: builtin:math (the math-answer verifier, docs/rl.md)")
    remote_rm_url: list[str] | None = field(None, help="reward server URLs (hpc-rlhf serve-reward); batches are "
                                                       "spread over them")
    remote_rm_token_env: str | None = field(None, help="environment variable holding the reward servers' "
                                                       "bearer token")
    reward_weights: list[float] | None = field(None, unbounded=True, help="weights of the sources, in the order model, "
                                                                          "function, remote, environment (agent."
                                                                          "agent_func_path) (default 1 each)")
    reward_timeout_s: float = field(60.0, gt=0, help="time limit per reward batch")
    reward_batch_size: int = field(64, ge=1, help="samples per reward call")
    normalize_reward: bool = field(False, help="divide rewards by a running std (and subtract the running mean)")
    reward_clip_range: list[float] | None = field(None, unbounded=True, help="clip rewards to [low, high]")
    overlong_buffer_len: int | None = field(None, ge=1, help="DAPO soft overlong penalty: length of the buffer "
                                                             "before generate_max_len")
    overlong_penalty_factor: float = field(1.0, ge=0, help="DAPO overlong penalty at full overlength")
    truncated_reward: float | None = field(None, unbounded=True, help="reward given to responses cut by "
                                                                      "generate_max_len (null: keep their score)")

    def validate(self) -> None:
        if self.reward_clip_range is not None and len(self.reward_clip_range) != 2:
            raise ConfigError("reward.reward_clip_range needs two values: low,high")


def require_reward_source(reward: RewardConfig, agent: "AgentConfig") -> None:
    if not (reward.reward_pretrain or reward.reward_func or reward.remote_rm_url or agent.agent_func_path):
        raise ConfigError("no reward source: set reward.reward_pretrain, reward.reward_func, reward.remote_rm_url "
                          "or an environment (agent.agent_func_path)")


@dataclass
class AgentConfig:
    """Multi-turn rollouts: an environment steps after every generation (docs/agents.md)."""
    agent_func_path: str | None = field(None, path="agent", help="Python file defining the environment (OpenRLHF's "
                                                                "AgentExecutor/AgentInstance, or a class Environment "
                                                                "with reset(prompt, label) and step(action)); null: "
                                                                "single-turn generation")
    max_turns: int = field(4, ge=1, help="generations per trajectory at most (rollout.generate_max_len new tokens "
                                         "each)")
    max_context_len: int = field(2048, ge=2, help="prompt + every action and feedback token of a trajectory at "
                                                 "most (a trajectory reaching it is cut and flagged truncated)")
    step_timeout_s: float = field(60.0, gt=0, help="one reset or step call of the environment at most; past it "
                                                   "the sample is invalid")
    max_failure_fraction: float = field(0.5, ge=0, le=1, help="the run stops when more than this fraction of a "
                                                              "generate call's trajectories fail in the environment "
                                                              "(raised, malformed result, timeout)")
    feedback_template: Literal["auto", "raw", "user_turn"] = field(
        "auto", help="feedback tokens: raw = the environment's text as written; user_turn = wrapped as a user "
                     "message of the chat template followed by the generation prompt; auto = user_turn for the "
                     "simple Environment form with a chat-template tokenizer, else raw")


@dataclass
class EvalSamplingConfig:
    """How the eval prompts are sampled and judged: `train rl` and `hpc-rlhf eval` share it (docs/eval.md)."""
    eval_n_samples_per_prompt: int = field(1, ge=1, help="samples per eval prompt (n of pass@k and avg@n)")
    eval_temperature: float = field(0.0, ge=0, help="eval sampling temperature (0: greedy)")
    eval_top_p: float = field(1.0, gt=0, le=1, help="eval nucleus sampling mass")
    eval_max_new_tokens: int | None = field(None, ge=1, help="new tokens per eval response at most (null: "
                                                             "rollout.generate_max_len)")
    eval_batch_size: int | None = field(None, ge=1, help="eval prompts per generate call on one rollout rank "
                                                         "(each with its n samples; null: the rank's whole share)")
    correct_threshold: float = field(1.0, unbounded=True, help="a sample is correct when its reward is >= this "
                                                               "(verifier rewards: 1 right, 0 wrong)")
    save_samples: bool = field(False, help="write every eval sample (prompt id, sample index, prompt, response, "
                                           "label, reward, correct, prediction) to save_path/eval_samples/"
                                           "step_<N>.jsonl (hpc-rlhf eval: output_path)")

    def validate(self) -> None:
        if self.eval_n_samples_per_prompt > 1 and self.eval_temperature == 0:
            raise ConfigError(f"eval.eval_n_samples_per_prompt={self.eval_n_samples_per_prompt} with "
                              f"eval_temperature 0 draws {self.eval_n_samples_per_prompt} identical greedy "
                              f"samples: set eval_temperature > 0 (e.g. 0.6 or 1.0)")


@dataclass
class EvalConfig(EvalSamplingConfig):
    eval_at_start: bool = field(False, help="evaluate before the first step (a row at the start step)")
    eval_only: bool = field(False, help="evaluate the policy (the resumed checkpoint's, else the pretrained "
                                        "model) once, write save_path/eval_metrics.json and exit: no training")
    best_metric: str | None = field(None, help="keep the model with the best value of this eval metric (e.g. "
                                               "eval/pass@1) in save_path/best (with best.json: metric, value, "
                                               "step), apart from the checkpoint rotation")
    best_mode: Literal["max", "min"] = field("max", help="whether a higher (max) or lower (min) best_metric is "
                                                         "better")
    early_stop_threshold: float | None = field(None, unbounded=True,
                                               help="stop once best_metric reaches this value (>= with max, <= "
                                                    "with min) at an eval: checkpoint, final export, exit")

    def validate(self) -> None:
        super().validate()
        if self.best_metric is not None and not self.best_metric.startswith("eval"):
            raise ConfigError(f"eval.best_metric={self.best_metric!r} is not an eval metric: name one of the "
                              f"eval keys, e.g. eval/pass@1 or eval/avg@n (docs/eval.md)")
        if self.early_stop_threshold is not None and self.best_metric is None:
            raise ConfigError("eval.early_stop_threshold needs eval.best_metric: the metric it watches")


@dataclass
class RLTrainConfig(OptimizerConfig):
    num_episodes: int = field(1, ge=1, help="passes over the prompt data")
    max_steps: int | None = field(None, ge=1, help="stop after this many RL steps")
    train_batch_size: int = field(8, ge=1, help="samples per optimizer step, over all actor ranks")
    micro_train_batch_size: int = field(4, ge=1, help="samples per forward/backward on one rank")
    micro_batch_overhead_tokens: int = field(
        0, ge=0, help="0: micro-batches of micro_train_batch_size samples, longest first; N > 0: at most that many, "
                      "cut where padding costs more than N positions per extra micro-batch (less padding, the same "
                      "gradient; 64 suits SmolLM2-135M on a CPU: docs/performance.md)")
    max_epochs: int = field(1, ge=1, help="optimisation passes over each step's samples")
    share_prompts: bool = field(
        True, help="the actor and the critic (per optimizer step) and the reference run each distinct prompt "
                   "once, and its samples' responses attend to its keys and values: the same log-probs, values and "
                   "gradient, a prompt's positions once instead of once per sample (docs/performance.md); actor and "
                   "critic only where a step holds at most micro_train_batch_size distinct prompts (their pass "
                   "lives until the optimizer step's last backward); where the model cannot (layers other than full "
                   "attention, gradient checkpointing, ZeRO-3) every sample runs its prompt, as with false")
    share_prompts_min_positions: int = field(
        128, ge=0, help="share_prompts only where it saves at least this many prompt positions (every sample's "
                        "prompt less each distinct prompt once): the prompt pass is a pass of its own, which costs "
                        "more than it saves below that (a 3.3M toy on a CPU: 8 samples of a 7-token prompt, 49 "
                        "positions, trained slower shared, of a 25-token one about as fast, longer ones faster: "
                        "docs/performance.md); 0: wherever a prompt repeats")
    actor_learning_rate: float = field(1e-6, gt=0, help="actor peak learning rate")
    critic_learning_rate: float = field(9e-6, gt=0, help="critic peak learning rate")
    freezing_actor_steps: int = field(0, ge=0, help="critic warm-up: RL steps during which only the critic trains")
    async_train: bool = field(False, help="the rollout ranks generate the next step's samples while this step "
                                          "trains (one step off-policy; needs the rollout on ranks of its own; "
                                          "docs/rl.md)")


@dataclass
class PlacementConfig:
    actor_num_ranks: int = field(1, ge=1, help="ranks running the actor (DeepSpeed data parallel)")
    critic_num_ranks: int = field(1, ge=1, help="ranks running the critic (when the estimator needs one)")
    ref_num_ranks: int = field(1, ge=1, help="ranks running the reference model (when init_kl_coef > 0), or the "
                                             "teacher (advantage_estimator opd)")
    reward_num_ranks: int = field(1, ge=1, help="ranks scoring rewards")
    rollout_num_ranks: int = field(1, ge=1, help="ranks generating")
    colocate_actor_ref: bool = field(False, help="reference (or teacher) on the actor's ranks")
    colocate_critic_reward: bool = field(False, help="reward model on the critic's ranks")
    colocate_actor_reward: bool = field(False, help="reward role on the actor's ranks (a reward function or "
                                                    "remote reward needs no rank of its own)")
    colocate_all: bool = field(False, help="every role on the actor's ranks (small runs)")
    collective_timeout_s: float = field(1800.0, gt=0, help="time limit of any collective")
    dead_rank_timeout_s: float = field(20.0, gt=0, help="a rank silent this long is dead: every rank exits")

    def validate(self) -> None:
        if self.colocate_actor_reward and self.colocate_critic_reward:
            raise ConfigError("placement.colocate_actor_reward and placement.colocate_critic_reward both put the "
                              "reward role somewhere: set only one")


@dataclass
class PlanConfig:
    """What `hpc-rlhf plan` checks the placement against and estimates its step time for (docs/hpc.md#planning-a-
    large-run); the run itself reads none of it."""
    gpu: Literal["none", "a800-80g", "a100-80g", "h100-80g", "h200-141g"] = field(
        "none", help="the GPU model of the job's nodes (hpc_rlhf/config/gpus.py: memory, bf16 peak, HBM, NVLink and "
                     "network bandwidth from the data sheets): `plan` says whether each role fits its GPUs, `plan "
                     "--estimate` prints seconds per phase; none: no GPU check")
    gpus_per_node: int = field(8, ge=1, help="GPUs per node: a role on a node's GPUs or fewer talks over NVLink, "
                                             "a larger one, and the bridge of a job of several nodes, over the "
                                             "network")
    network_gb_per_s: float | None = field(None, gt=0, help="network bandwidth per GPU between nodes, GB/s one way "
                                                            "(null: the GPU's DGX system: 25 for A100/A800, 50 for "
                                                            "H100/H200)")
    prompt_len: int | None = field(None, ge=1, help="mean prompt tokens of the estimate (null: data.prompt_max_len)")
    response_len: int | None = field(None, ge=1, help="mean response tokens of the estimate (null: "
                                                      "rollout.generate_max_len)")


@dataclass
class RLModelConfig(ModelConfig):
    teacher_pretrain: str | None = field(None, path="tokenizer", same_tokenizer_as="model.pretrain",
                                         help="the teacher of on-policy distillation (advantage_estimator opd): HF "
                                              "model folder run frozen in the reference role; its tokenizer must "
                                              "be the actor's (folders are compared before any rank starts)")


@dataclass
class RLConfig:
    model: RLModelConfig = field(help="the actor (policy) model, and the teacher of on-policy distillation")
    data: PromptDataConfig = field(help="prompts")
    reward: RewardConfig = field(help="reward sources and shaping")
    critic_pretrain: str | None = field(None, path="model", help="critic initialisation (default: reward_pretrain, "
                                                                 "else the actor's pretrain)")
    ref_pretrain: str | None = field(None, path="model", help="reference model (default: the actor's pretrain)")
    rollout: RolloutConfig = field(default_factory=RolloutConfig, help="generation")
    algo: AlgoConfig = field(default_factory=AlgoConfig, help="advantages and losses")
    train: RLTrainConfig = field(default_factory=RLTrainConfig, help="optimisation")
    placement: PlacementConfig = field(default_factory=PlacementConfig, help="roles and ranks")
    ckpt: CheckpointConfig = field(default_factory=CheckpointConfig, help="saving and resuming")
    log: LogConfig = field(default_factory=LogConfig, help="metrics and evaluation")
    eval: EvalConfig = field(default_factory=EvalConfig, help="evaluation on data.eval_prompt_data: sampling, "
                                                              "pass@k, best model, early stop (docs/eval.md)")
    agent: AgentConfig = field(default_factory=AgentConfig, help="multi-turn environments and tool use "
                                                                 "(docs/agents.md)")
    launch: LaunchConfig = field(default_factory=LaunchConfig, help="backend; launch.nproc stays 1 (the rank "
                                                                    "count comes from the placement)")
    slurm: SlurmConfig = field(default_factory=SlurmConfig, help="SLURM job: resources per role, preemption, "
                                                               "requeue")
    plan: PlanConfig = field(default_factory=PlanConfig, help="GPU model and workload of `hpc-rlhf plan`'s memory "
                                                              "check and step-time estimate")

    def sequence_len(self) -> int:
        """Tokens of one sample at most: prompt + response, or the multi-turn context budget."""
        if self.agent.agent_func_path:
            return self.agent.max_context_len
        return self.data.prompt_max_len + self.rollout.generate_max_len

    def reference_pretrain(self) -> str:
        """The model the reference role runs: the teacher, else ref_pretrain, else the actor's initial model."""
        return self.model.teacher_pretrain or self.ref_pretrain or self.model.pretrain

    def max_action_tokens(self) -> int:
        """Sampled tokens of one sample at most (Dr. GRPO's constant divisor)."""
        g = self.rollout.generate_max_len
        return min(g * self.agent.max_turns, self.agent.max_context_len) if self.agent.agent_func_path else g

    def validate(self) -> None:
        require_reward_source(self.reward, self.agent)
        self._check_teacher()
        m = self.rollout.vllm.max_model_len
        if self.agent.agent_func_path and self.rollout.engine == "vllm" and m is not None \
                and m < self.agent.max_context_len:
            raise ConfigError(f"rollout.vllm.max_model_len={m} is below agent.max_context_len="
                              f"{self.agent.max_context_len}: a trajectory's context must fit the vLLM engine; "
                              f"raise rollout.vllm.max_model_len or lower max_context_len")
        n = self.rollout.n_samples_per_prompt
        if (self.rollout.rollout_batch_size * n) % self.train.train_batch_size:
            raise ConfigError(f"rollout_batch_size x n_samples_per_prompt = {self.rollout.rollout_batch_size * n} "
                              f"samples per step must be a multiple of train.train_batch_size "
                              f"({self.train.train_batch_size})")
        if self.model.load_in_4bit:
            raise ConfigError("model.load_in_4bit is not supported by `train rl`: the weight sync merges LoRA into "
                              "full-precision base weights; use lora_rank > 0 on a bf16/fp32 base")
        t = self.rollout.temperature
        for key in ("is_correction", "token_mask"):
            if getattr(self.algo, key) != "none" and t not in (0.0, 1.0):
                # the engine's log-probs are at temperature 1, the trainer's at rollout.temperature
                raise ConfigError(f"algo.{key}={getattr(self.algo, key)!r} needs rollout.temperature 1 (or 0): "
                                  f"the rollout engine's log-probs are at temperature 1 and the trainer's at {t}")
        if self.train.async_train and self.placement.colocate_all:
            raise ConfigError("train.async_train needs the rollout on ranks of its own, so that generation runs "
                              "while the actor trains: set placement.colocate_all to false")
        e = self.eval
        wants = [k for k in ("eval_at_start", "eval_only", "best_metric") if getattr(e, k) not in (False, None)]
        if wants and not self.data.eval_prompt_data:
            raise ConfigError(f"eval.{wants[0]} needs eval prompts: set data.eval_prompt_data")
        self._check_component_estimator()
        if self.launch.nproc != 1:
            raise ConfigError("launch.nproc does not apply to `train rl`: its rank count follows from the placement "
                              "(placement.*_num_ranks and the colocate_* options)")

    def _check_component_estimator(self) -> None:
        """An estimator that normalises each reward component (gdpo) never sees the shaped scalar reward, the KL
        penalty in the reward or the sources' weights: refuse what it would ignore."""
        est = self.algo.advantage_estimator
        if est not in COMPONENT_ESTIMATORS:
            return
        r = self.reward
        shaping = {"reward.normalize_reward": r.normalize_reward, "reward.reward_clip_range": r.reward_clip_range,
                   "reward.overlong_buffer_len": r.overlong_buffer_len, "reward.truncated_reward": r.truncated_reward,
                   "reward.reward_weights": r.reward_weights}
        for name, value in shaping.items():
            if value is not None and value is not False:
                raise ConfigError(f"{name} is set but algo.advantage_estimator {est} normalises each reward component "
                                  f"with the same weight, not the shaped reward: return a penalty as a component of "
                                  f"the reward function (docs/rl.md#reward-components)")
        if self.algo.kl.init_kl_coef > 0 and self.algo.kl.use_kl_loss is False:
            raise ConfigError(f"algo.kl.use_kl_loss is false but algo.advantage_estimator {est} normalises the reward "
                              f"components, which hold no KL penalty: keep the KL in the loss")
    def _check_teacher(self) -> None:
        """A teacher exactly when the estimator needs one, in the reference role alone; a task reward to centre
        on its group needs groups."""
        a, teacher = self.algo, self.model.teacher_pretrain
        if a.needs_teacher() and not teacher:
            raise ConfigError(f"algo.advantage_estimator {a.advantage_estimator!r} needs a teacher: set "
                              f"model.teacher_pretrain")
        if teacher and not a.needs_teacher():
            raise ConfigError(f"model.teacher_pretrain is set but algo.advantage_estimator is "
                              f"{a.advantage_estimator!r}, which reads no teacher (opd does)")
        if teacher and self.ref_pretrain:
            raise ConfigError("ref_pretrain and model.teacher_pretrain are both set: with a teacher the reference "
                              "role runs the teacher; leave ref_pretrain unset")
        n = self.rollout.n_samples_per_prompt
        if a.needs_teacher() and a.opd.task_reward_weight > 0 and n < 2:
            raise ConfigError(f"algo.opd.task_reward_weight={a.opd.task_reward_weight} centres each reward on its "
                              f"group: it needs rollout.n_samples_per_prompt >= 2, got {n}")
