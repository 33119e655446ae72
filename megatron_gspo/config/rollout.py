"""The rollout section: the engine, sampling, episodes, the vLLM service."""

from __future__ import annotations

from typing import Literal

from pydantic import model_validator

from megatron_gspo.config.base import _Section


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
    # Collective: the address the servers reach the trainer's rank 0 at (default: the loopback
    # when every server is on this host, else MASTER_ADDR, else this host's name).
    sync_host: str | None = None
    # Disk: a directory that the trainer and the servers both see.
    sync_dir: str | None = None
    # Multi-turn episodes in flight on one server at a time (each advances on its own,
    # megatron_gspo.episodes.concurrent).
    max_inflight: int = 256
    # The fleet (docs/operations.md): a server that answers no probe for this long is dead,
    # and the requests it held go to the others; it serves again once a sync has brought it
    # to the trainer's version. Well under request_timeout_s, above a loaded server's
    # slowest /health answer.
    health_timeout_s: float = 30.0
    # Fewer serving servers than this: the run checkpoints and exits 75, for Slurm to requeue
    # it; above it training never stops for a server.
    min_servers: int = 1
    # Sequences (a request's samples) in flight on one server at most, like vLLM's own
    # --max-num-seqs: beyond it requests wait in the trainer for the first server to free.
    # Below it a server's share follows its measured pace (rollout/vllm/fleet.py).
    max_seqs_per_server: int = 256

    @model_validator(mode="after")
    def _check_sync(self) -> VLLMConfig:
        if self.weight_sync == "disk" and self.sync_dir is None:
            raise ValueError("rollout.vllm.weight_sync=disk needs rollout.vllm.sync_dir")
        if self.bucket_mb <= 0:
            raise ValueError(f"rollout.vllm.bucket_mb must be > 0, got {self.bucket_mb}")
        if self.max_inflight < 1:
            raise ValueError(f"rollout.vllm.max_inflight must be >= 1, got {self.max_inflight}")
        if not self.health_timeout_s > 0:
            raise ValueError(
                f"rollout.vllm.health_timeout_s must be > 0, got {self.health_timeout_s}"
            )
        if self.min_servers < 1:
            raise ValueError(f"rollout.vllm.min_servers must be >= 1, got {self.min_servers}")
        if self.max_seqs_per_server < 1:
            raise ValueError(
                f"rollout.vllm.max_seqs_per_server must be >= 1, got {self.max_seqs_per_server}"
            )
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


class InFlightUpdates(_Section):
    """Weight syncs that do not wait for the generation in flight (docs/async.md)."""

    # keep: requests are frozen during the sync and go on with the new weights over the KV
    # cache the old ones computed. resubmit: they are aborted, and each is sent again as
    # prompt + tokens so far with the budget left, its prefix read by the new weights.
    mode: Literal["keep", "resubmit"]
    # null: a step trains on one whole batch, sampled together. N >= rollout.prompts_per_step:
    # N groups are generated at once and each step trains on the first prompts_per_step of
    # them to finish (the stalest first); a group still running is carried to later steps
    # while its oldest token is within max_staleness, and dropped (rollout_groups_dropped)
    # beyond it. Short episodes finish first: see docs/async.md on the length bias.
    groups_in_flight: int | None = None


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
    # max_staleness >= 1 with the vLLM engine: sync the weights as soon as a step is trained,
    # while generation goes on (each token records the version that sampled it); None: each
    # sync waits until the generation in flight has finished on the weights it started with.
    in_flight_updates: InFlightUpdates | None = None
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
    # Stop the run (an error naming the figure) when rollout_sampler_kl, the engine's
    # log-probs against the trainer's on the same weights and tokens (mean k3 per token),
    # stays above max_rollout_kl for max_rollout_kl_steps consecutive steps: the engine
    # computes another model than the trainer. null: never. docs/operations.md ("A sampler
    # that disagrees") says how the default was chosen.
    max_rollout_kl: float | None = 0.05
    max_rollout_kl_steps: int = 3
    # max_staleness >= 1: after each weight sync the engine and the trainer both score this
    # many of the step's sequences with the new weights (rollout_sampler_kl); 0: no probe.
    sampler_probe: int = 8

    @model_validator(mode="after")
    def _check_staleness(self) -> RolloutConfig:
        if self.max_staleness < 0:
            raise ValueError(f"rollout.max_staleness must be >= 0, got {self.max_staleness}")
        if self.max_rollout_kl is not None and not self.max_rollout_kl > 0:
            raise ValueError(
                f"rollout.max_rollout_kl must be > 0 (or null: no limit), got {self.max_rollout_kl}"
            )
        if self.sampler_probe < 0:
            raise ValueError(f"rollout.sampler_probe must be >= 0, got {self.sampler_probe}")
        if self.max_rollout_kl_steps < 1:
            raise ValueError(
                f"rollout.max_rollout_kl_steps must be >= 1, got {self.max_rollout_kl_steps}"
            )
        if self.in_flight_updates is not None and (self.max_staleness < 1 or self.engine != "vllm"):
            raise ValueError(
                "rollout.in_flight_updates needs rollout.max_staleness >= 1 and rollout.engine: "
                f"vllm (got max_staleness {self.max_staleness}, engine {self.engine!r}): the "
                "embedded engine cannot change its weights under a request in flight"
            )
        groups = None if self.in_flight_updates is None else self.in_flight_updates.groups_in_flight
        if groups is not None and groups < self.prompts_per_step:
            raise ValueError(
                "rollout.in_flight_updates.groups_in_flight must be >= rollout.prompts_per_step "
                f"({self.prompts_per_step}): a step trains on that many groups; got {groups}"
            )
        if self.dynamic_sampling is not None and self.max_staleness:
            raise ValueError(
                "rollout.dynamic_sampling samples more prompts within a step, which the "
                "asynchronous pipeline (rollout.max_staleness >= 1) cannot; use one of them"
            )
        return self
