"""The typed recipe schema.

A recipe is one YAML file. Every section is a pydantic model that forbids unknown keys, so a
typo ("num_expert") is an error naming the key and the file instead of a silently ignored knob.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class MLAConfig(_Section):
    """Multi-latent attention (DeepSeek-V2/V3, Kimi K2, Moonlight): queries through a low-rank
    latent (``q_lora_rank``; None projects them directly), keys and values from one shared
    latent of ``kv_lora_rank``, each head's query/key split into a part without RoPE and a
    RoPE part shared by all heads."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # transformers builds the two latent RMSNorms with this epsilon whatever rms_norm_eps
    # says (vLLM takes rms_norm_eps: the two differ where it is not 1e-6).
    latent_norm_epsilon: float = 1e-6


class YarnScaling(_Section):
    """YaRN RoPE scaling (``rope_type: yarn`` in a Hugging Face config), as DeepSeek-V3 and
    Kimi K2 are released with; multi-latent attention only."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0


class ModelConfig(_Section):
    """A Qwen3-style decoder (GQA, QK-norm, RoPE, RMSNorm, SwiGLU, optional top-k MoE), or the
    DeepSeek-V3 family's (multi-latent attention, shared experts, first dense layers, sigmoid
    routing with an expert bias, group-limited routing)."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    # GQA's key/value heads; multi-latent attention has one per head.
    num_query_groups: int
    # The query/key head width (with multi-latent attention: qk_nope + qk_rope).
    head_dim: int
    # The tokenizer's vocabulary; the model's rows are padded up to a multiple of
    # make_vocab_size_divisible_by x TP (Megatron's rule), and padded ids are never sampled nor
    # scored. 1 pads only where TP does not divide the vocabulary. A run's checkpoint resumes
    # on another TP size where both pad to the same rows; run.init_from loads any padding.
    vocab_size: int
    make_vocab_size_divisible_by: int = 1
    max_seq_length: int = 2048
    # Dense MLP width: of a dense model, and of the dense layers of an MoE one.
    ffn_hidden_size: int | None = None
    num_experts: int | None = None
    moe_ffn_hidden_size: int | None = None
    # MoE models: the layers (0-based) whose MLP is dense (Qwen3-MoE's mlp_only_layers,
    # DeepSeek-V3's first_k_dense_replace).
    dense_layers: list[int] = []
    moe_router_topk: int = 2
    # Routing: "softmax" (Qwen3-MoE) or "sigmoid" (DeepSeek-V3) scores; whether the top-k
    # weights are renormalized to sum to 1 (Qwen3-MoE's norm_topk_prob; sigmoid routing
    # renormalizes for k > 1); a factor on the routed output (DeepSeek's
    # routed_scaling_factor).
    moe_router_score_function: Literal["softmax", "sigmoid"] = "softmax"
    moe_norm_topk_prob: bool = True
    moe_router_topk_scaling_factor: float | None = None
    # Aux-loss-free balancing (DeepSeek-V3's e_score_correction_bias): a per-expert bias added
    # to the scores for choosing experts only, moved by Megatron-Core after every optimizer
    # step towards balanced loads at this rate (0 keeps it fixed); saved with checkpoints.
    moe_router_expert_bias: bool = False
    moe_router_bias_update_rate: float = 1e-3
    # Group-limited routing: experts in num_groups groups, tokens routed within the group_topk
    # best groups.
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None
    # Shared experts' total width (DeepSeek: n_shared_experts x moe_intermediate_size).
    moe_shared_expert_intermediate_size: int | None = None
    moe_aux_loss_coeff: float = 1e-3
    # Megatron-Core's load-balancing loss: "aux_loss" per micro-batch and data-parallel rank
    # (its statistics over the TP x CP group), "seq_aux_loss" per sequence, "global_aux_loss"
    # with the expert counts over the data-parallel group too (README: which layouts equal
    # one rank with each).
    moe_aux_loss_type: Literal["aux_loss", "seq_aux_loss", "global_aux_loss"] = "aux_loss"
    mla: MLAConfig | None = None
    rotary_base: float = 1_000_000.0
    rope_scaling: YarnScaling | None = None
    norm_epsilon: float = 1e-6
    init_method_std: float = 0.02
    untie_embeddings_and_output_weights: bool = True
    params_dtype: Literal["float32", "bfloat16"] = "float32"

    @property
    def is_moe(self) -> bool:
        return bool(self.num_experts)

    @property
    def moe_layers(self) -> list[int]:
        """The (0-based) indices of the MoE layers."""
        if not self.is_moe:
            return []
        return [i for i in range(self.num_layers) if i not in self.dense_layers]

    def padded_vocab_size(self, tensor_parallel: int = 1) -> int:
        """The model's vocabulary rows under ``tensor_parallel`` (Megatron's padding rule)."""
        multiple = self.make_vocab_size_divisible_by * tensor_parallel
        return -(-self.vocab_size // multiple) * multiple

    @model_validator(mode="after")
    def _check_shapes(self) -> ModelConfig:
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_query_groups ({self.num_query_groups})"
            )
        if self.make_vocab_size_divisible_by < 1:
            raise ValueError("make_vocab_size_divisible_by must be >= 1")
        if self.is_moe:
            if self.moe_ffn_hidden_size is None:
                raise ValueError("moe_ffn_hidden_size is required when num_experts is set")
            if not 1 <= self.moe_router_topk <= self.num_experts:
                raise ValueError(
                    f"moe_router_topk ({self.moe_router_topk}) must be in [1, num_experts "
                    f"({self.num_experts})]"
                )
            if any(not 0 <= i < self.num_layers for i in self.dense_layers):
                raise ValueError(f"dense_layers {self.dense_layers} must be layer indices")
            if self.dense_layers and self.ffn_hidden_size is None:
                raise ValueError("dense_layers need ffn_hidden_size (the dense MLP's width)")
            self._check_router()
        elif self.ffn_hidden_size is None:
            raise ValueError("ffn_hidden_size is required for a dense model (no num_experts)")
        elif self.dense_layers:
            raise ValueError("dense_layers is for MoE models (every layer of this one is dense)")
        if self.mla is not None:
            want = self.mla.qk_nope_head_dim + self.mla.qk_rope_head_dim
            if self.head_dim != want or self.num_query_groups != self.num_attention_heads:
                raise ValueError(
                    "with multi-latent attention head_dim must be qk_nope_head_dim + "
                    f"qk_rope_head_dim ({want}) and num_query_groups num_attention_heads"
                )
        elif self.rope_scaling is not None:
            raise ValueError("rope_scaling (YaRN) is supported with multi-latent attention only")
        return self

    def _check_router(self) -> None:
        sigmoid = self.moe_router_score_function == "sigmoid"
        if self.moe_router_expert_bias and not sigmoid:
            raise ValueError("moe_router_expert_bias needs moe_router_score_function: sigmoid")
        if sigmoid and self.moe_norm_topk_prob != (self.moe_router_topk > 1):
            # Megatron's sigmoid routing always renormalizes k > 1 weights, never k = 1.
            raise ValueError(
                "sigmoid routing renormalizes the top-k weights exactly when "
                f"moe_router_topk > 1: moe_norm_topk_prob must be {self.moe_router_topk > 1}"
            )
        if not sigmoid and self.moe_router_topk == 1 and self.moe_norm_topk_prob:
            # Megatron scores top-1 softmax routing over all experts (it refuses otherwise).
            raise ValueError(
                "softmax routing with moe_router_topk 1 needs moe_norm_topk_prob false"
            )
        groups, group_topk = self.moe_router_num_groups, self.moe_router_group_topk
        if (groups is None) != (group_topk is None):
            raise ValueError("set both moe_router_num_groups and moe_router_group_topk, or none")
        if groups is not None and (self.num_experts % groups or not 1 <= group_topk <= groups):
            raise ValueError(
                f"group-limited routing needs num_experts ({self.num_experts}) divisible by "
                f"moe_router_num_groups ({groups}) and 1 <= moe_router_group_topk <= groups"
            )


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


class VLLMConfig(_Section):
    """A vLLM OpenAI-compatible service used as the rollout engine."""

    # Base URLs (http://host:port) of the servers; prompts are spread over them. The
    # MEGATRON_GSPO_VLLM_URLS environment variable (comma-separated) overrides this, which is
    # how the Slurm launcher hands over the addresses of the servers it started.
    urls: list[str] = []
    # The served model name; defaults to what the server reports at /v1/models.
    model: str | None = None
    request_timeout_s: float = 600.0
    max_retries: int = 3
    # How the trainer's weights reach the servers after each step: in memory over a process
    # group of the trainer's rank 0 and every server worker (gloo on CPU, NCCL on GPU), or as
    # a Hugging Face checkpoint written to sync_dir and reloaded by the servers.
    weight_sync: Literal["collective", "disk"] = "collective"
    # Collective: tensors are sent in flat buckets of at most this size.
    bucket_mb: float = 512.0
    # Collective: how long forming the group or one sync may take before it fails.
    sync_timeout_s: float = 600.0
    # Collective: the address the servers reach the trainer's rank 0 at (default: MASTER_ADDR,
    # else this host's name).
    sync_host: str | None = None
    # Disk: a directory that the trainer and the servers both see.
    sync_dir: str | None = None
    # Multi-turn episodes in flight on one server at a time (each advances on its own,
    # megatron_gspo.episodes.concurrent).
    max_inflight: int = 256

    @model_validator(mode="after")
    def _check_sync(self) -> VLLMConfig:
        if self.weight_sync == "disk" and self.sync_dir is None:
            raise ValueError("rollout.vllm.weight_sync=disk needs rollout.vllm.sync_dir")
        if self.bucket_mb <= 0:
            raise ValueError(f"rollout.vllm.bucket_mb must be > 0, got {self.bucket_mb}")
        if self.max_inflight < 1:
            raise ValueError(f"rollout.vllm.max_inflight must be >= 1, got {self.max_inflight}")
        return self


class DynamicSampling(_Section):
    max_rounds: int = 3

    @model_validator(mode="after")
    def _check(self) -> DynamicSampling:
        if self.max_rounds < 1:
            raise ValueError("rollout.dynamic_sampling.max_rounds must be >= 1")
        return self


class MultiTurnConfig(_Section):
    """Episodes of several model turns with an environment answering each
    (megatron_gspo.episodes)."""

    # A built-in environment (relay_digits) or "package.module:attr" (a class or factory,
    # called with env_kwargs in each environment worker).
    env: str
    env_kwargs: dict = {}
    # Model turns per episode at most; the token budget is model.max_seq_length.
    max_turns: int = 4
    # The chat role an observation is rendered as (data.chat_template): "user", or "tool" for
    # tool results.
    observation_role: Literal["user", "tool"] = "user"
    # A model turn cut at rollout.max_new_tokens (no stop token) ends its episode: a chat
    # transcript cannot go on from a half-written message. Tasks that tolerate one (the tiny
    # ones) may go on.
    end_on_cut_turn: bool = True
    # Environment worker processes (default: the CPU count, at most 8).
    workers: int | None = None

    @model_validator(mode="after")
    def _check(self) -> MultiTurnConfig:
        if self.max_turns < 1:
            raise ValueError(f"rollout.multi_turn.max_turns must be >= 1, got {self.max_turns}")
        if self.workers is not None and self.workers < 1:
            raise ValueError(f"rollout.multi_turn.workers must be >= 1, got {self.workers}")
        return self


class RolloutConfig(_Section):
    """How responses are sampled: the embedded engine or a vLLM service."""

    engine: Literal["local", "vllm"] = "local"
    prompts_per_step: int = 16
    group_size: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    # Defaults to the tokenizer's end-of-sequence id.
    stop_token_ids: list[int] | None = None
    seed: int = 0
    # 0: sample each batch after the previous update (on-policy). K >= 1: sample the next
    # batches while the trainer trains on the current one, from weights at most K updates
    # older than the policy that trains on them.
    max_staleness: int = 0
    # engine=local: sample in a generation worker process holding a single-rank snapshot of
    # the weights instead of in the trainer's ranks: generation runs once rather than on every
    # data-parallel rank, and works with any trainer layout (sequence and pipeline parallelism
    # included). Implied by max_staleness >= 1.
    local_worker: bool = False
    # MoE: the engine returns the experts it routed every token to (per MoE layer), which gives
    # the rollout_routing_disagreement metric; train.routing_replay: rollout turns it on. vLLM
    # servers then run with --enable-return-routed-experts.
    return_routes: bool = False
    # DAPO's dynamic sampling: groups whose rewards are all equal are dropped and more prompts
    # are sampled, up to max_rounds generations per step in all, until prompts_per_step groups
    # with a signal are found.
    dynamic_sampling: DynamicSampling | None = None
    # Episodes with environment turns; None: one model turn per prompt.
    multi_turn: MultiTurnConfig | None = None
    vllm: VLLMConfig = VLLMConfig()
    # Stop the run (an error naming the figure) when rollout_kl_k3, the sampler's log-probs
    # against the trainer's old policy (mean k3 per token), stays above max_rollout_kl for
    # max_rollout_kl_steps consecutive steps: the engine samples another distribution than the
    # trainer scores. null: never. README ("A sampler that disagrees") says how the default
    # was chosen.
    max_rollout_kl: float | None = 0.05
    max_rollout_kl_steps: int = 3

    @model_validator(mode="after")
    def _check_staleness(self) -> RolloutConfig:
        if self.max_staleness < 0:
            raise ValueError(f"rollout.max_staleness must be >= 0, got {self.max_staleness}")
        if self.max_rollout_kl is not None and not self.max_rollout_kl > 0:
            raise ValueError(
                f"rollout.max_rollout_kl must be > 0 (or null: no limit), got {self.max_rollout_kl}"
            )
        if self.max_rollout_kl_steps < 1:
            raise ValueError(
                f"rollout.max_rollout_kl_steps must be >= 1, got {self.max_rollout_kl_steps}"
            )
        if self.dynamic_sampling is not None and self.max_staleness:
            raise ValueError(
                "rollout.dynamic_sampling samples more prompts within a step, which the "
                "asynchronous pipeline (rollout.max_staleness >= 1) cannot; use one of them"
            )
        return self


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
