"""``megatron-gspo plan`` against hand computations from the published architectures.

The expected figures are written out here from the model sizes, independently of plan.py's
code, so a wrong factor there (a TP split applied to a replicated norm, an optimizer state
sharded over the wrong group) shows up as a mismatch.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from megatron_gspo.config import MemoryConfig
from megatron_gspo.launch.plan import (
    GIB,
    PlanError,
    activation_bytes_per_token_layer,
    active_parameters,
    count_parameters,
    plan,
    plan_memory,
)
from megatron_gspo.run.recipe import load_recipe

REPO = Path(__file__).resolve().parents[1]
MOE = REPO / "recipes" / "qwen3-30b-a3b-gspo.yaml"
DENSE = REPO / "recipes" / "qwen3-8b-gspo.yaml"
MOONLIGHT = REPO / "recipes" / "moonlight-16b-a3b-gspo.yaml"
JUDGE = REPO / "recipes" / "qwen3-30b-a3b-judge.yaml"


def _row(p, prefix: str) -> float:
    return next(v for k, v in p.rows.items() if k.startswith(prefix))


def _close(got: float, want: float, what: str, rel: float = 0.10) -> None:
    assert abs(got - want) <= rel * want, f"{what}: plan says {got:.4g}, by hand {want:.4g}"


# Qwen3-30B-A3B by hand: 48 layers, h=2048, 32 heads x 128, 4 KV heads, 128 experts of 768.
H, L, V, E, F, HD = 2048, 48, 151936, 128, 768, 128
ATTN = H * 32 * HD + 2 * H * 4 * HD + 32 * HD * H  # q, k, v, output projection
NORMS = 2 * H + 2 * HD  # two RMSNorms per layer, q-norm and k-norm
ROUTER = E * H
EXPERTS = E * 3 * H * F  # gate, up, down per expert
EMBED = V * H  # and the same again for the untied output layer
MOE_TOTAL = 2 * EMBED + H + L * (ATTN + NORMS + ROUTER + EXPERTS)


def test_qwen3_30b_a3b_parameter_count_matches_the_architecture():
    counts = count_parameters(load_recipe(MOE).model)
    assert counts.total == MOE_TOTAL
    # The release is described as 30.5 B total.
    assert 30.4e9 < MOE_TOTAL < 30.6e9


def test_qwen3_8b_parameter_count_matches_the_architecture():
    h, layers = 4096, 36
    attn = h * 32 * 128 + 2 * h * 8 * 128 + 32 * 128 * h
    per_layer = attn + 3 * h * 12288 + 2 * h + 2 * 128
    by_hand = 2 * V * h + h + layers * per_layer
    assert count_parameters(load_recipe(DENSE).model).total == by_hand
    assert 8.1e9 < by_hand < 8.3e9  # "8.2 B"


def test_moonlight_16b_a3b_parameter_count_matches_the_architecture():
    """Multi-latent attention (no query latent), a dense first layer, 64 routed experts with
    their correction bias and 2 shared ones (one MLP of twice the width)."""
    h, layers, vocab, e, f, shared, dense_ffn, heads = 2048, 27, 163840, 64, 1408, 2816, 11264, 16
    attn = h * heads * (128 + 64) + h * (512 + 64) + 512 * heads * (128 + 128) + heads * 128 * h
    norms = 2 * h + 512  # input and pre-MLP norms, the key/value latent's norm
    dense = attn + norms + 3 * h * dense_ffn
    moe = attn + norms + e * h + e + 3 * h * shared + e * 3 * h * f
    by_hand = 2 * vocab * h + h + dense + (layers - 1) * moe
    model = load_recipe(MOONLIGHT).model
    assert count_parameters(model).total == by_hand
    assert 15.9e9 < by_hand < 16.0e9  # "16B"
    per_expert = 3 * h * f
    active = by_hand - (layers - 1) * (e - 6) * per_expert
    assert active_parameters(model) == active
    assert 2.8e9 < active < 3.0e9  # "A3B"


@pytest.mark.parametrize("nodes", [4, 8])
def test_30b_a3b_weights_and_optimizer_per_gpu_on_h200(nodes):
    # Layout TP4 EP8 ETP1 PP1: DP = 8n/4, expert-DP = 8n/8.
    world = 8 * nodes
    dp, edp = world // 4, world // 8
    dense = 2 * EMBED / 4 + L * (ATTN / 4 + NORMS + ROUTER) + H
    expert = L * EXPERTS / 8
    p = plan_memory(load_recipe(MOE), nodes=nodes, gpus_per_node=8, gpu="h200")
    assert (p.layout.dp, p.layout.expert_dp) == (dp, edp)
    _close(_row(p, "weights"), 2 * (dense + expert), "bf16 weights")
    _close(_row(p, "grads"), 4 * (dense + expert), "fp32 main grads")
    _close(_row(p, "optimizer"), 12 * (dense / dp + expert / edp), "master + Adam states")
    assert p.fits, p.table()


def test_an_asynchronous_saves_host_copy_is_counted_per_node_and_warned_of():
    """Megatron copies each GPU's weights and optimizer shard to host memory before an
    asynchronous save writes them: a node holds its 8 GPUs' copies at once."""
    p = plan_memory(load_recipe(MOE), nodes=4, gpus_per_node=8, gpu="h200")
    per_gpu = _row(p, "weights") + _row(p, "optimizer")
    _close(p.host_async, 8 * per_gpu, "host copy of an async save")
    assert "host, async save (per node)" in p.table()
    assert not any("asynchronous save" in n for n in p.notes), p.notes
    small = plan_memory(load_recipe(MOE), nodes=4, gpus_per_node=8, gpu="h200", node_ram_gib=128)
    assert any("asynchronous save" in n and "128 GiB" in n for n in small.notes), small.notes


def test_8b_weights_and_optimizer_per_gpu_on_one_h100_node():
    h, layers = 4096, 36
    attn = h * 32 * 128 + 2 * h * 8 * 128 + 32 * 128 * h
    sharded = 2 * V * h + layers * (attn + 3 * h * 12288)  # split by TP2
    replicated = layers * (2 * h + 2 * 128) + h
    per_gpu = sharded / 2 + replicated
    p = plan_memory(load_recipe(DENSE), nodes=1, gpus_per_node=8, gpu="h100")
    assert p.layout.dp == 4
    _close(_row(p, "weights"), 2 * per_gpu, "bf16 weights")
    _close(_row(p, "optimizer"), 12 * per_gpu / 4, "master + Adam states")
    assert p.fits, p.table()


def test_recompute_lowers_the_activation_estimate():
    r = load_recipe(MOE)
    none = activation_bytes_per_token_layer(r.model_copy(update={"memory": MemoryConfig()}))
    selective = activation_bytes_per_token_layer(r)
    assert selective < none
    full = r.memory.model_copy(
        update=dict(
            recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
        )
    )
    p_full = plan_memory(
        r.model_copy(update={"memory": full}), nodes=4, gpus_per_node=8, gpu="h100"
    )
    p_sel = plan_memory(r, nodes=4, gpus_per_node=8, gpu="h100")
    assert _row(p_full, "activations") < _row(p_sel, "activations")


def test_layout_that_does_not_divide_is_rejected_naming_the_factor():
    r = load_recipe(MOE)
    with pytest.raises(PlanError, match=r"world size .* TP4"):
        plan_memory(r, nodes=1, gpus_per_node=6, gpu="h200")
    bad = r.model_copy(
        update={"parallel": r.parallel.model_copy(update={"expert_model_parallel_size": 5})}
    )
    with pytest.raises(PlanError, match="num_experts vs EP"):
        plan_memory(bad, nodes=5, gpus_per_node=8, gpu="h200")
    result = CliRunner().invoke(plan, [str(MOE), "--nodes", "1", "--gpus-per-node", "6"])
    assert result.exit_code == 1 and "does not divide" in result.output


def test_plan_exits_nonzero_when_it_does_not_fit():
    # One H100 node: expert-DP 1 leaves every expert's fp32 states on its GPU.
    result = CliRunner().invoke(plan, [str(MOE), "--nodes", "1", "--gpu", "h100"])
    assert result.exit_code == 1, result.output
    assert "DOES NOT FIT" in result.output and "GiB per GPU" in result.output


def test_colocated_rollout_share_is_counted():
    r = load_recipe(DENSE)
    alone = plan_memory(r, nodes=1, gpus_per_node=8, gpu="h200")
    shared = plan_memory(r, nodes=1, gpus_per_node=8, gpu="h200", rollout_gpu_fraction=0.4)
    _close(shared.total - alone.total, 0.4 * alone.capacity, "colocated rollout", rel=1e-9)


def test_plan_table_for_the_shipped_recipes():
    shipped = [
        (MOE, ["--nodes", "4", "--gpu", "h200"]),
        (DENSE, ["--nodes", "1"]),
        (MOONLIGHT, ["--nodes", "2", "--gpu", "h200"]),
    ]
    for recipe, args in shipped:
        result = CliRunner().invoke(plan, [str(recipe), *args])
        assert result.exit_code == 0, result.output
        assert "total" in result.output and "assumptions:" in result.output
    tiny = plan_memory(
        load_recipe(REPO / "recipes" / "tiny-moe.yaml"), nodes=1, gpus_per_node=1, gpu="h100"
    )
    assert tiny.fits and tiny.total / GIB < 10


def test_plan_counts_the_serving_nodes_and_wants_a_server_for_a_served_reward():
    args = [str(JUDGE), "--nodes", "4", "--gpu", "h200", "--no-assumptions"]
    result = CliRunner().invoke(plan, [*args, "--rollout-nodes", "2", "--reward-nodes", "1"])
    assert result.exit_code == 0, result.output
    assert result.output.startswith(
        "job: 4 trainer + 2 rollout + 1 reward = 7 nodes "
        "(NODES=7 TRAINER_NODES=4 ROLLOUT_NODES=2 REWARD_NODES=1)\n"
    ), result.output
    # The judge names no url: without reward nodes nothing would serve it.
    result = CliRunner().invoke(plan, args)
    assert result.exit_code == 1 and "reward 'judge' has no kwargs.url" in result.output
    # Reward nodes for a recipe whose rewards are all local: nothing to serve.
    result = CliRunner().invoke(plan, [str(MOE), *args[1:], "--reward-nodes", "1"])
    assert result.exit_code == 1 and "no served reward" in result.output
    result = CliRunner().invoke(plan, [str(MOE), *args[1:], "--rollout-nodes", "2"])
    assert result.exit_code == 0 and "4 trainer + 2 rollout = 6 nodes" in result.output


@pytest.mark.parametrize("recipe", [MOE, DENSE, MOONLIGHT, JUDGE], ids=lambda p: p.name)
def test_shipped_gpu_recipes_validate(recipe):
    from megatron_gspo.cli import main

    assert CliRunner().invoke(main, ["validate", "--no-extras-check", str(recipe)]).exit_code == 0
    # Without the flag: valid but not runnable here, since the data and the checkpoint the
    # recipe names are not on this machine (a trainer that samples from vLLM servers needs no
    # vllm itself, so that is not what is missing).
    result = CliRunner().invoke(main, ["validate", str(recipe)])
    assert result.exit_code == 3, result.output
    data = "freeform" if recipe == JUDGE else "math"
    assert f"data.path: file data/{data}-train.jsonl not found" in result.output
    assert "vllm" not in result.output.split("not runnable")[1]
