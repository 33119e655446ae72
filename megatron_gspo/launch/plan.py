"""``megatron-gspo plan``: will this recipe's layout divide and fit on N nodes of a given GPU?

Two questions answered before a job queues for hours:

1. Does the layout divide? The world (nodes x GPUs) must factor as TP x PP x CP x DP, and the
   expert side as ETP x EP x PP x expert-DP (Megatron-Core's ``initialize_model_parallel`` builds
   the expert groups from the same ranks as (DP x CP x TP) / ETP per pipeline stage, so
   ETP x EP must divide TP x CP x DP); heads, query groups, FFN widths (and MLA's latent
   ranks) must divide by TP (experts' FFN by ETP), layers by PP, experts by EP. The vocabulary
   is padded to a multiple of TP as Megatron does, and counted so.
2. Does it fit? Per-GPU memory of the most loaded pipeline stage, by component. The
   assumptions are stated where each figure is computed and summarised in ``ASSUMPTIONS``.

Parameter counts are exact for the model ``megatron_gspo.model.provider`` builds; memory
figures for activations are estimates (see ``activation_bytes_per_token_layer``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import click

from megatron_gspo.config import Recipe
from megatron_gspo.model.counts import active_parameters, count_parameters
from megatron_gspo.runtime.errors import InputError

GIB = 1024**3

# Usable memory as nvidia-smi reports it (MiB): the H100 SXM "80 GB" and the H200 "141 GB".
GPU_MEMORY_MIB = {"h100": 81_559, "h200": 143_771}

# CUDA context, NCCL communicators and buffers, allocator fragmentation: measured runs of
# Megatron MoE training on Hopper leave roughly this much beyond what tensors account for.
RUNTIME_OVERHEAD_GIB = 5.0

ASSUMPTIONS = """\
assumptions:
  weights      model dtype (bf16 with precision.bf16, else params_dtype), full per GPU's shard
  grads        fp32 main-grad buffer (Megatron DDP, grad_reduce_in_fp32=True as in policy.py),
               one full copy per GPU: the distributed optimizer reduce-scatters in place
  optimizer    Adam: fp32 m and v, plus an fp32 master copy when weights are bf16; sharded over
               DP x CP (dense) and expert-DP (experts) with the distributed optimizer
  activations  per token and layer, bf16, flash attention (no s^2 scores), sequence parallel
               splits every tensor by TP, balanced routing (k expert copies per token);
               1F1B keeps PP micro-batches in flight on the first stage
  logits       bf16 [tokens, vocab/TP] kept for backward + one fp32 copy
  runtime      CUDA context, NCCL buffers, fragmentation: a flat 5 GiB
  rollout      a colocated vLLM's share: --rollout-gpu-fraction x GPU memory
  host         run.async_save: Megatron copies each GPU's weights and optimizer shard to host
               memory before writing them, so a node holds its GPUs' copies at once"""


class PlanError(InputError):
    """The layout does not divide, or does not fit; the message says which and by how much."""


# --------------------------------------------------------------------------------------------
# Parameter counts, exact for the GPTModel megatron_gspo.model.provider builds.


@dataclass(frozen=True)
class Layout:
    world: int
    tp: int
    pp: int
    cp: int
    ep: int
    etp: int
    dp: int
    expert_dp: int


def check_world(recipe: Recipe, world: int) -> Layout:
    """Factor ``world`` GPUs into the recipe's layout or raise naming what does not divide."""
    if world < 1:
        raise PlanError(f"world size (nodes x GPUs) {world}: need at least one GPU")
    p, m = recipe.parallel, recipe.model
    tp, pp, cp = (
        p.tensor_model_parallel_size,
        p.pipeline_model_parallel_size,
        p.context_parallel_size,
    )
    ep = p.expert_model_parallel_size
    etp = p.expert_tensor_parallel_size or tp
    errors: list[str] = []

    def need(value: int, by: int, what: str) -> None:
        if by < 1 or value % by:
            errors.append(f"{what}: {value} is not divisible by {by}")

    need(world, tp * pp * cp, f"world size (nodes x GPUs) vs TP{tp} x PP{pp} x CP{cp}")
    need(world, etp * ep * pp, f"world size vs ETP{etp} x EP{ep} x PP{pp}")
    need(m.num_attention_heads, tp, "model.num_attention_heads vs TP")
    need(m.num_query_groups, tp, "model.num_query_groups vs TP")
    if m.mla is not None:
        if m.mla.q_lora_rank is not None:
            need(m.mla.q_lora_rank, tp, "model.mla.q_lora_rank vs TP")
        need(m.mla.kv_lora_rank + m.mla.qk_rope_head_dim, tp, "MLA kv latent + RoPE dims vs TP")
    need(m.num_layers, pp, "model.num_layers vs PP")
    if m.is_moe:
        need(m.num_experts, ep, "model.num_experts vs EP")
        need(m.moe_ffn_hidden_size, etp, "model.moe_ffn_hidden_size vs ETP")
        if m.moe_shared_expert_intermediate_size:
            need(m.moe_shared_expert_intermediate_size, tp, "shared experts' width vs TP")
        if m.dense_layers:
            need(m.ffn_hidden_size, tp, "model.ffn_hidden_size (dense layers) vs TP")
        if tp > 1 and not p.sequence_parallel:
            errors.append("MoE with TP > 1 needs parallel.sequence_parallel: true (Megatron-Core)")
    else:
        need(m.ffn_hidden_size, tp, "model.ffn_hidden_size vs TP")
        if ep > 1:
            errors.append(f"EP{ep} on a dense model: set expert_model_parallel_size to 1")
    if errors:
        raise PlanError(f"layout does not divide on {world} GPUs:\n  " + "\n  ".join(errors))
    return Layout(
        world=world,
        tp=tp,
        pp=pp,
        cp=cp,
        ep=ep,
        etp=etp,
        dp=world // (tp * pp * cp),
        expert_dp=world // (etp * ep * pp),
    )


# --------------------------------------------------------------------------------------------
# Memory.


def activation_bytes_per_token_layer(recipe: Recipe, *, moe: bool | None = None) -> float:
    """Bytes one token leaves saved for backward in one layer (an MoE layer where ``moe``,
    else a dense one; by default the model's kind), before TP splitting.

    Our own accounting for this architecture, in the spirit of Korthikanti et al. (2022) but
    counted tensor by tensor for GQA, QK-norm, SwiGLU and top-k MoE with flash attention
    (which keeps no s x s scores), all in 2-byte activations:

    attention  2 x [2h (norm in, QKV in) + (a + 2g) d (q, k, v) + (a + g) d (q, k after norm
               and RoPE) + a d (attention out, projection in)]
    MLA        2 x [2h + 2 q_lora + 2 (kv_lora + r) (latents before and after their norms)
               + 3 a (nope + r) (q, k before RoPE and the RoPE'd q, k, together)
               + 2 a v (value, attention out)]
    MoE        2 x [2h (norm in, router in)] + 8 E (fp32 router logits and probabilities)
               + 2 k [h (dispatched input) + 2f (fc1 out) + f (SwiGLU out) + h (expert out)]
               + shared experts as a dense MLP of their width
    dense MLP  2 x [2h + 2f + f]

    Selective recompute removes what its modules would have saved: ``layernorm`` the two
    norm outputs (2 x 2h), ``moe_act``/``mlp`` the SwiGLU output (2 k f, or 2 f dense),
    ``moe``/``mlp`` the whole MLP except its input. ``core_attn`` saves nothing here because
    flash attention stores no scores anyway.
    """
    m, mem = recipe.model, recipe.memory
    moe = m.is_moe if moe is None else moe
    h, d = m.hidden_size, m.head_dim
    a, g = m.num_attention_heads, m.num_query_groups
    if m.mla is None:
        attn = 2 * (2 * h + (a + 2 * g) * d + (a + g) * d + a * d)
    else:
        x = m.mla
        latents = 2 * (x.q_lora_rank or 0) + 2 * (x.kv_lora_rank + x.qk_rope_head_dim)
        attn = 2 * (2 * h + latents + 3 * a * d + 2 * a * x.v_head_dim)
    if moe:
        k, f = m.moe_router_topk, m.moe_ffn_hidden_size
        act = 2 * k * f
        mlp = 2 * 2 * h + 8 * m.num_experts + 2 * k * (h + 2 * f + f + h)
        shared = m.moe_shared_expert_intermediate_size or 0
        act += 2 * shared
        mlp += 2 * 3 * shared
    else:
        k, f = 1, m.ffn_hidden_size
        act = 2 * f
        mlp = 2 * (2 * h + 3 * f)
    if mem.recompute_granularity == "selective":
        modules = set(mem.recompute_modules or ["core_attn"])
        if "layernorm" in modules:
            attn -= 2 * h
            mlp -= 2 * h
        if {"moe", "mlp"} & modules:
            mlp = 2 * h
        elif "moe_act" in modules:
            mlp -= act
    return float(attn + mlp)


@dataclass
class MemoryPlan:
    recipe_name: str
    nodes: int
    gpus_per_node: int
    gpu: str
    layout: Layout
    params_total: int
    params_active: int
    params_per_gpu: int
    expert_params_per_gpu: int
    rows: dict[str, float] = field(default_factory=dict)  # bytes
    capacity: float = 0.0
    notes: list[str] = field(default_factory=list)
    host_async: float = 0.0  # host memory per node of an asynchronous save's copy of the state
    node_ram: float = 0.0

    @property
    def total(self) -> float:
        return sum(self.rows.values())

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity

    def table(self) -> str:
        lay = self.layout
        lines = [
            f"{self.recipe_name} on {self.nodes} x {self.gpus_per_node} {self.gpu.upper()} "
            f"({lay.world} GPUs)",
            f"  layout TP{lay.tp} PP{lay.pp} CP{lay.cp} DP{lay.dp}"
            + (
                f" | experts EP{lay.ep} ETP{lay.etp} expert-DP{lay.expert_dp}"
                if self.expert_params_per_gpu
                else " (dense)"
            ),
            f"  parameters {self.params_total / 1e9:.2f} B total, {self.params_active / 1e9:.2f} "
            f"B active; on the fullest GPU {self.params_per_gpu / 1e9:.3f} B "
            f"({self.expert_params_per_gpu / 1e9:.3f} B expert)",
            "",
            f"  {'component':<34}{'GiB/GPU':>10}",
            f"  {'-' * 44}",
        ]
        for name, b in self.rows.items():
            lines.append(f"  {name:<34}{b / GIB:>10.1f}")
        lines.append(f"  {'-' * 44}")
        lines.append(f"  {'total':<34}{self.total / GIB:>10.1f}")
        lines.append(f"  {self.gpu.upper() + ' memory':<34}{self.capacity / GIB:>10.1f}")
        head = (self.capacity - self.total) / GIB
        verdict = "fits" if self.fits else "DOES NOT FIT"
        lines.append(f"  {'headroom':<34}{head:>10.1f}   {verdict}")
        lines.append(
            f"  {'host, async save (per node)':<34}{self.host_async / GIB:>10.1f}   of "
            f"{self.node_ram / GIB:.0f} GiB RAM"
        )
        for n in self.notes:
            lines.append(f"  note: {n}")
        return "\n".join(lines)


def plan_memory(
    recipe: Recipe,
    *,
    nodes: int,
    gpus_per_node: int,
    gpu: str,
    rollout_gpu_fraction: float = 0.0,
    recipe_name: str = "recipe",
    node_ram_gib: float = 2048.0,
) -> MemoryPlan:
    """Per-GPU memory of the fullest pipeline stage; raises PlanError if the layout does not
    divide. Whether it fits is ``MemoryPlan.fits`` (the command turns it into an exit code)."""
    if gpu not in GPU_MEMORY_MIB:
        raise PlanError(f"unknown GPU {gpu!r} (known: {', '.join(GPU_MEMORY_MIB)})")
    if not 0.0 <= rollout_gpu_fraction < 1.0:
        raise PlanError(f"rollout GPU fraction must be in [0, 1), got {rollout_gpu_fraction}")
    m, lay = recipe.model, check_world(recipe, nodes * gpus_per_node)
    c = count_parameters(m)
    per_stage = m.num_layers // lay.pp
    # Megatron's vocabulary rows under this TP (padding included), split over TP.
    vocab_rows = m.padded_vocab_size(lay.tp) * m.hidden_size // lay.tp

    def stage(s: int) -> tuple[int, int, list[int]]:
        """(dense, expert) parameters per GPU of pipeline stage ``s``, and its layers."""
        layers = list(range(s * per_stage, (s + 1) * per_stage))
        dense = sum(
            c.layers[i].attention // lay.tp + c.layers[i].replicated + c.layers[i].mlp // lay.tp
            for i in layers
        )
        if s == 0:
            dense += vocab_rows
        if s == lay.pp - 1:
            dense += c.final_norm + (vocab_rows if c.output or lay.pp > 1 else 0)
        expert = sum(c.layers[i].experts for i in layers) // (lay.ep * lay.etp)
        return dense, expert, layers

    # The fullest stage: the first holds the embedding, the last the output layer (or, with
    # PP > 1, a tied copy), each V x h.
    dense, expert, layers = max((stage(s) for s in range(lay.pp)), key=lambda t: t[0] + t[1])

    bf16 = recipe.precision.bf16 or m.params_dtype == "bfloat16"
    w_bytes = 2 if bf16 else 4
    # Adam m and v in fp32, plus an fp32 master copy of bf16 weights.
    opt_bytes = 8 + (4 if bf16 else 0)
    if recipe.memory.use_distributed_optimizer:
        opt = opt_bytes * (dense / (lay.dp * lay.cp) + expert / lay.expert_dp)
    else:
        opt = opt_bytes * (dense + expert)

    # Activations: tokens of one micro-batch on this GPU, times layers, times micro-batches
    # in flight (1F1B keeps up to PP of them on the first stage).
    tokens = recipe.train.micro_batch_tokens / lay.cp
    kinds = [i in m.moe_layers for i in layers]
    acts_per_layer = [
        activation_bytes_per_token_layer(recipe, moe=moe) * tokens / lay.tp for moe in kinds
    ]
    per_layer = max(acts_per_layer)
    n_layers = len(layers)
    mem = recipe.memory
    if mem.recompute_granularity == "full":
        # Only each recompute chunk's input is kept (2h per token), plus one chunk's
        # activations live while it is recomputed in backward.
        n = mem.recompute_num_layers or 1
        chunk_input = 2 * m.hidden_size * tokens / lay.tp
        if mem.recompute_method == "uniform":
            stored = math.ceil(n_layers / n) * chunk_input + min(n, n_layers) * per_layer
        else:  # block: the first n layers of the stage are recomputed, the rest are kept
            n = min(n, n_layers)
            stored = n * chunk_input + sum(acts_per_layer[n:]) + (per_layer if n else 0)
        acts = stored * lay.pp
    else:
        acts = sum(acts_per_layer) * lay.pp
    logits = 6 * tokens * m.padded_vocab_size(lay.tp) / lay.tp

    capacity = GPU_MEMORY_MIB[gpu] * 1024**2
    rows = {
        f"weights ({'bf16' if bf16 else 'fp32'})": w_bytes * (dense + expert),
        "grads (fp32 main grads)": 4.0 * (dense + expert),
        "optimizer (fp32 master + Adam m, v)" if bf16 else "optimizer (Adam m, v)": opt,
        f"activations ({mem.recompute_granularity or 'no'} recompute)": acts,
        "logits (bf16 + fp32)": logits,
        "runtime (CUDA, NCCL, fragmentation)": RUNTIME_OVERHEAD_GIB * GIB,
    }
    if recipe.loss.kl_coef > 0:
        # A frozen copy of the initial weights: no grads, no optimizer state.
        rows["reference policy (loss.kl_coef)"] = w_bytes * (dense + expert)
    if rollout_gpu_fraction:
        rows[f"colocated rollout ({rollout_gpu_fraction:.0%})"] = rollout_gpu_fraction * capacity
    plan = MemoryPlan(
        recipe_name=recipe_name,
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        gpu=gpu,
        layout=lay,
        params_total=c.total,
        params_active=active_parameters(m),
        params_per_gpu=dense + expert,
        expert_params_per_gpu=expert,
        rows=rows,
        capacity=capacity,
        host_async=gpus_per_node * (w_bytes * (dense + expert) + opt),  # weights, optimizer
        node_ram=node_ram_gib * GIB,
    )
    if plan.host_async > 0.8 * plan.node_ram:
        plan.notes.append(
            f"an asynchronous save (run.async_save) copies {plan.host_async / GIB:.0f} GiB to "
            f"each node's host memory, over 80% of its {node_ram_gib:.0f} GiB: keep it off"
        )
    if lay.cp > 1:
        plan.notes.append(
            f"CP{lay.cp}: activations count 1/{lay.cp} of each micro-batch's tokens (every "
            f"sequence padded to a multiple of {2 * lay.cp}); attention through Transformer "
            "Engine's context-parallel kernels (the gpu extra)"
        )
    seqs = recipe.rollout.prompts_per_step * recipe.rollout.group_size
    per_mini = seqs // recipe.train.mini_batches
    if per_mini < lay.dp:
        plan.notes.append(
            f"a mini-batch has {per_mini} sequences for DP{lay.dp}: some data-parallel ranks "
            "get none; raise rollout.prompts_per_step or lower train.mini_batches"
        )
    return plan


# --------------------------------------------------------------------------------------------
# The command.


@click.command()
@click.argument("recipe", type=click.Path(dir_okay=False))
@click.option("--nodes", type=click.IntRange(min=1), required=True, help="Trainer nodes.")
@click.option("--gpus-per-node", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--gpu", type=click.Choice(sorted(GPU_MEMORY_MIB)), default="h100", show_default=True)
@click.option(
    "--rollout-gpu-fraction",
    type=float,
    default=0.0,
    show_default=True,
    help="Share of each GPU a colocated vLLM reserves (its --gpu-memory-utilization).",
)
@click.option(
    "--rollout-nodes",
    type=click.IntRange(min=0),
    default=0,
    help="vLLM nodes besides the trainer ones.",
)
@click.option(
    "--reward-nodes", type=click.IntRange(min=0), default=0, help="Judge or reward model nodes."
)
@click.option(
    "--node-ram-gib",
    type=float,
    default=2048.0,
    show_default=True,
    help="Host memory of a trainer node (an asynchronous save's copy must fit).",
)
@click.option("--assumptions/--no-assumptions", default=True, show_default=True)
def plan(
    recipe: str,
    nodes: int,
    gpus_per_node: int,
    gpu: str,
    rollout_gpu_fraction: float,
    rollout_nodes: int,
    reward_nodes: int,
    node_ram_gib: float,
    assumptions: bool,
) -> None:
    """Check that RECIPE's layout divides NODES x GPUS and estimate memory per GPU; count the
    job's nodes with the serving ones (--rollout-nodes, --reward-nodes).

    Exits 1 when the layout does not divide, the estimate exceeds the GPU's memory, or a
    served reward has no server."""
    from megatron_gspo.launch.errors import LaunchError
    from megatron_gspo.launch.roles import job_nodes
    from megatron_gspo.run.recipe import RecipeError, load_recipe

    try:
        r = load_recipe(recipe)
        p = plan_memory(
            r,
            nodes=nodes,
            gpus_per_node=gpus_per_node,
            gpu=gpu,
            rollout_gpu_fraction=rollout_gpu_fraction,
            recipe_name=recipe,
            node_ram_gib=node_ram_gib,
        )
        job = job_nodes(r, trainer=nodes, rollout=rollout_nodes, reward=reward_nodes)
    except (RecipeError, PlanError, LaunchError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(job)
    click.echo(p.table())
    if assumptions:
        click.echo(ASSUMPTIONS)
    if not p.fits:
        raise click.ClickException(
            f"{recipe}: needs {p.total / GIB:.1f} GiB per GPU, {gpu.upper()} has "
            f"{p.capacity / GIB:.1f} GiB; add nodes (more DP shards the optimizer), raise "
            "EP/TP/PP, enable recompute or lower train.micro_batch_tokens"
        )
