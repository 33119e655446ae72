"""The recipe's other sections and the recipe itself, with the rules between sections."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from megatron_gspo.config.base import _Section
from megatron_gspo.config.model import ModelConfig
from megatron_gspo.config.rollout import RolloutConfig


class ParallelConfig(_Section):
    """Megatron-Core's parallel layout. Data parallelism is what the world size leaves over."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None
    # Megatron requires sequence parallelism for MoE layers under tensor parallelism.
    sequence_parallel: bool = False
    seed: int = 1234

    @property
    def model_parallel_size(self) -> int:
        return (
            self.tensor_model_parallel_size
            * self.pipeline_model_parallel_size
            * self.context_parallel_size
        )


class PrecisionConfig(_Section):
    """Mixed precision. Log-probs and the loss are fp32 regardless of these settings."""

    bf16: bool = False
    # Transformer Engine FP8 recipe; needs the `gpu` extra and a GPU with FP8 support.
    fp8: Literal["hybrid", "e4m3"] | None = None


class MemoryConfig(_Section):
    """Megatron-Core's activation-memory knobs, passed through to its TransformerConfig."""

    recompute_granularity: Literal["full", "selective"] | None = None
    recompute_method: Literal["uniform", "block"] | None = None
    recompute_num_layers: int | None = None
    # With selective recompute: which submodules, e.g. ["core_attn", "moe_act", "layernorm"].
    recompute_modules: list[str] | None = None
    # Shard optimizer states (and fp32 master weights) over data-parallel ranks.
    use_distributed_optimizer: bool = True

    @model_validator(mode="after")
    def _check_recompute(self) -> MemoryConfig:
        if self.recompute_granularity == "full" and (
            self.recompute_method is None or self.recompute_num_layers is None
        ):
            raise ValueError(
                "recompute_granularity=full needs recompute_method and recompute_num_layers"
            )
        return self


class LossConfig(_Section):
    """The policy loss (see megatron_gspo.loss). Clip ranges default to each loss's own."""

    name: Literal["gspo", "gspo_token", "grpo"] = "gspo"
    eps_low: float | None = None
    eps_high: float | None = None
    max_log_ratio: float = 20.0
    advantage_scale: Literal["std", "none"] = "std"
    # Credit: "sequence" gives every token of an episode its group-normalised reward; "turn"
    # gives each model turn its own advantage (group-normalised return-to-go per turn, from
    # the environment's turn rewards), which GSPO-token and GRPO take per token. GSPO's
    # objective has one advantage per sequence, so it refuses "turn".
    advantage_level: Literal["sequence", "turn"] = "sequence"
    # KL penalty against a frozen reference policy (the initial weights), off as in the GSPO
    # paper: kl_coef * (1/N) sum_i mean_t k3, k3 = exp(ref - lp) - (ref - lp) - 1. The
    # reference is a second copy of the weights on every GPU (plan counts it) and is saved
    # with the checkpoints.
    kl_coef: float = 0.0

    @model_validator(mode="after")
    def _check_kl(self) -> LossConfig:
        if self.kl_coef < 0:
            raise ValueError(f"loss.kl_coef must be >= 0, got {self.kl_coef}")
        if self.advantage_level == "turn" and self.name == "gspo":
            raise ValueError(
                "loss.advantage_level: turn needs per-token advantages, which GSPO's objective "
                "does not have (one advantage per sequence); use loss.name: gspo_token (the "
                "sequence ratio and clip, each token weighted by its turn's advantage) or grpo"
            )
        return self


class OptimizerConfig(_Section):
    lr: float = 1e-6
    min_lr: float = 0.0
    warmup_steps: int = 0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0


class OffPolicyCorrection(_Section):
    """Importance weights pi_old / pi_behaviour between the recomputed old log-probs and the
    rollout engine's (see megatron_gspo.loss.off_policy): truncated (tis: min(w, tis_cap)) or
    masked (mis: units with w outside [mis_low, mis_high] leave the loss), per token or per
    sequence (w = exp of the mean token log-ratio)."""

    mode: Literal["none", "tis", "mis"] = "none"
    level: Literal["token", "sequence"] = "token"
    tis_cap: float = 2.0
    mis_low: float = 0.5
    mis_high: float = 2.0

    @model_validator(mode="after")
    def _check(self) -> OffPolicyCorrection:
        if self.tis_cap <= 0:
            raise ValueError(f"tis_cap must be > 0, got {self.tis_cap}")
        if not 0 <= self.mis_low < self.mis_high:
            raise ValueError(f"need 0 <= mis_low < mis_high, got {self.mis_low}, {self.mis_high}")
        return self


class TrainConfig(_Section):
    """One RL step = one rollout batch, split into ``mini_batches`` optimizer steps."""

    mini_batches: int = 4
    # Packed micro-batches under a token budget, or padded ones of micro_batch_size sequences.
    packing: bool = True
    micro_batch_tokens: int = 4096
    micro_batch_size: int = 4
    # Where the importance ratio's denominator comes from: a forward pass of the pre-update
    # policy, or the rollout engine's own log-probs (cheaper; GSPO's sequence ratio tolerates
    # the small train/inference mismatch, which is logged either way).
    old_logprobs: Literal["recompute", "rollout"] = "recompute"
    # MoE routing replay: the training forward uses the experts of the pre-update policy
    # (old_policy, "R2": GSPO's paper needed it for its GRPO baseline) or those the rollout
    # engine routed each token to (rollout, "R3"; the old-policy recompute replays them too).
    # The router's gating weights are recomputed from its own logits on the replayed experts.
    # true / false are read as old_policy / none.
    routing_replay: Literal["none", "old_policy", "rollout"] = "none"
    # Off by default; with asynchronous rollouts (rollout.max_staleness >= 1) it corrects for
    # the weights versions between the sampler and the old policy.
    off_policy_correction: OffPolicyCorrection = OffPolicyCorrection()
    # Overlong filtering (DAPO): responses cut at rollout.max_new_tokens leave the loss and
    # the sequence count (their rewards still shape their group's advantages).
    overlong_filter: bool = False

    @field_validator("routing_replay", mode="before")
    @classmethod
    def _replay_from_bool(cls, value):
        if isinstance(value, bool):
            return "old_policy" if value else "none"
        return value


class DataConfig(_Section):
    """Prompts: a built-in synthetic task, or a JSONL file of prompt/answer records."""

    task: str | None = None
    # Passed to the synthetic task, e.g. {min_len: 2, max_len: 4}.
    task_options: dict = {}
    path: str | None = None
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    # A sentencepiece .model or a Hugging Face tokenizer.json; synthetic tasks bring their own.
    tokenizer: str | None = None
    shuffle: bool = True
    # A prompt whose tokens leave no room for rollout.max_new_tokens within
    # model.max_seq_length: skipped (and counted in prompts_skipped_overlong) or fatal (the
    # error names the record).
    overlong_prompts: Literal["skip", "fail"] = "skip"
    # A record that cannot be read (bad JSON or UTF-8, a missing or mistyped key): fatal, or
    # skipped and counted in bad_records_skipped. The error names the file, line or row, key.
    bad_records: Literal["skip", "fail"] = "fail"
    # Render prompts with data.tokenizer's chat template (a Hugging Face tokenizer directory),
    # as a user message after system_prompt; chat_template_kwargs reach the template.
    chat_template: bool = False
    system_prompt: str | None = None
    chat_template_kwargs: dict = {}

    @model_validator(mode="after")
    def _one_source(self) -> DataConfig:
        if self.chat_template and self.tokenizer is None:
            raise ValueError("data.chat_template needs data.tokenizer (a tokenizer directory)")
        if (self.task is None) == (self.path is None):
            raise ValueError("set exactly one of data.task (a synthetic task) or data.path (JSONL)")
        if self.path is not None and self.tokenizer is None:
            raise ValueError(
                "data.path needs data.tokenizer (a sentencepiece model or tokenizer.json)"
            )
        return self


class RewardFunctionConfig(_Section):
    # A registered name (exact_match, math, format, ...) or "package.module:function".
    name: str
    weight: float = 1.0
    kwargs: dict = {}


class OverlongPenalty(_Section):
    """DAPO's soft overlong punishment, added to the reward: 0 up to ``rollout.max_new_tokens
    - cache_tokens`` response tokens, then falling linearly to ``-max_penalty`` at the limit."""

    cache_tokens: int
    max_penalty: float = 1.0

    @model_validator(mode="after")
    def _check(self) -> OverlongPenalty:
        if self.cache_tokens < 1 or self.max_penalty < 0:
            raise ValueError("reward.overlong_penalty: need cache_tokens >= 1, max_penalty >= 0")
        return self


class RewardConfig(_Section):
    functions: list[RewardFunctionConfig] = [RewardFunctionConfig(name="exact_match")]
    overlong_penalty: OverlongPenalty | None = None
    # The deadline of one call (a reward function on one sample, an environment step): a worker
    # still busy past it is killed and replaced, and the call fails (counted).
    timeout_s: float = 30.0
    # What a failed score (the function raised, hung, or returned no finite number; an
    # environment that failed) means for the update: drop_group takes the sample's whole group
    # out of it (its advantages would be measured against a fabricated value); zero scores 0.
    on_error: Literal["drop_group", "zero"] = "drop_group"
    # A step where more than this fraction of samples failed stops the run, naming the
    # function and its first failure, rather than train on what is left.
    max_error_fraction: float = 0.25

    @model_validator(mode="after")
    def _check(self) -> RewardConfig:
        if not self.timeout_s > 0:
            raise ValueError(f"reward.timeout_s must be > 0 seconds, got {self.timeout_s}")
        if not 0 <= self.max_error_fraction <= 1:
            raise ValueError(
                f"reward.max_error_fraction must be in [0, 1], got {self.max_error_fraction}"
            )
        return self


class EvalConfig(_Section):
    """Validation during training on held-out prompts, through the rollout engine."""

    # Every N steps (and at step 0 and the last step); 0: no validation.
    every: int = 0
    # A JSONL file (data's keys and tokenizer); None: a separately seeded sample of data.task.
    path: str | None = None
    num_prompts: int = 64
    # Sampled responses per prompt for eval_mean@k and eval_pass@k (besides the greedy one).
    k: int = 4
    temperature: float = 1.0
    # A sampled response "passes" when its reward reaches this.
    pass_threshold: float = 1.0
    # Keep the checkpoint of the step with the best greedy eval_reward_mean (checkpoints/best).
    keep_best: bool = False

    @model_validator(mode="after")
    def _check(self) -> EvalConfig:
        if self.every < 0 or self.num_prompts < 1 or self.k < 1:
            raise ValueError("eval: need every >= 0, num_prompts >= 1 and k >= 1")
        return self


class RunConfig(_Section):
    """The outer loop: how long, where to write, how often to save and report."""

    steps: int = Field(100, ge=1)
    # Relative paths are resolved against the working directory.
    output_dir: str = "runs/default"
    # Initial policy weights: a Megatron checkpoint written by `megatron-gspo convert
    # hf-to-megatron` (model weights only). Ignored when the run resumes from its own.
    init_from: str | None = None
    checkpoint_every: int = Field(10, ge=1)
    # 0: keep every checkpoint.
    keep_checkpoints: int = Field(2, ge=0)
    # Write checkpoints in the background (Megatron-Core's asynchronous save) while training
    # goes on; a checkpoint becomes `latest` a step or more later, once written and hashed
    # (docs/operations.md). Off until it has run on a GPU node.
    async_save: bool = False
    tensorboard: bool = True
    wandb_project: str | None = None
    # 0: no plots during the run.
    plot_every: int = Field(10, ge=0)


class Recipe(_Section):
    model: ModelConfig
    parallel: ParallelConfig = ParallelConfig()
    precision: PrecisionConfig = PrecisionConfig()
    rollout: RolloutConfig = RolloutConfig()
    memory: MemoryConfig = MemoryConfig()
    loss: LossConfig = LossConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    train: TrainConfig = TrainConfig()
    data: DataConfig | None = None
    reward: RewardConfig = RewardConfig()
    eval: EvalConfig = EvalConfig()
    run: RunConfig = RunConfig()

    @model_validator(mode="after")
    def _check_cross_sections(self) -> Recipe:
        if self.eval.every and self.eval.path is None and (self.data is None or not self.data.task):
            raise ValueError("eval.every needs eval.path (JSONL) or a synthetic data.task")
        penalty = self.reward.overlong_penalty
        if penalty is not None and penalty.cache_tokens > self.rollout.max_new_tokens:
            raise ValueError(
                f"reward.overlong_penalty.cache_tokens ({penalty.cache_tokens}) exceeds "
                f"rollout.max_new_tokens ({self.rollout.max_new_tokens})"
            )
        if self.loss.advantage_level == "turn" and self.rollout.multi_turn is None:
            raise ValueError(
                "loss.advantage_level: turn needs episodes of several turns "
                "(rollout.multi_turn); a single-turn rollout has one advantage per sequence"
            )
        if not self.reward.functions and self.rollout.multi_turn is None:
            raise ValueError(
                "reward.functions is empty and there is no environment (rollout.multi_turn) "
                "to give rewards: nothing would score the rollouts"
            )
        if self.eval.keep_best and not self.eval.every:
            raise ValueError("eval.keep_best needs eval.every > 0")
        if self.train.routing_replay != "none" and not self.model.is_moe:
            raise ValueError("train.routing_replay needs an MoE model (model.num_experts)")
        if self.rollout.return_routes and not self.model.is_moe:
            raise ValueError("rollout.return_routes needs an MoE model (model.num_experts)")
        if (
            self.train.off_policy_correction.mode != "none"
            and self.train.old_logprobs != "recompute"
        ):
            raise ValueError(
                "train.off_policy_correction weighs recomputed old log-probs against the "
                "rollout's, so it needs train.old_logprobs=recompute"
            )
        if self.train.routing_replay == "old_policy" and self.train.old_logprobs != "recompute":
            raise ValueError(
                "train.routing_replay: old_policy records the routing of the old-policy "
                "forward, so it needs train.old_logprobs=recompute"
            )
        return self

    @property
    def wants_rollout_routes(self) -> bool:
        """Whether the engine returns each token's experts with the samples."""
        return self.rollout.return_routes or self.train.routing_replay == "rollout"
