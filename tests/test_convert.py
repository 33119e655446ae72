"""Conversion HF ⇄ Megatron is exact: logits parity with transformers, bit-identical round trips.

Megatron work runs in spawned ranks (the CPU platform layer is process-global); the pytest
process only builds the Hugging Face reference models and compares.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.support.hf_tiny import hf_logits, make_hf_dense, make_hf_moe, read_hf_dir, tokens
from tests.support.ranks import run_distributed

LOGIT_ATOL = 1e-4


def _causal_mask(t: int) -> torch.Tensor:
    return torch.triu(torch.ones(t, t, dtype=torch.bool), 1)[None, None]


def _convert_and_run(
    rank: int, world: int, work: str, toks: torch.Tensor, names=("moe", "dense")
) -> dict:
    """One rank: hf-to-megatron both models, Megatron logits, then megatron-to-hf back."""
    from megatron.core import dist_checkpointing

    from megatron_gspo.config import ParallelConfig
    from megatron_gspo.model import build_model
    from megatron_gspo.weights.convert import hf_to_megatron, megatron_to_hf

    out = {}
    for name in names:
        base = Path(work)
        cfg = hf_to_megatron(base / f"hf_{name}", base / f"mg_{name}", progress=False)
        model = build_model(cfg, ParallelConfig())
        dist_checkpointing.load(model.sharded_state_dict(), str(base / f"mg_{name}"))
        model.eval()
        pos = torch.arange(toks.shape[1])[None].expand_as(toks)
        with torch.no_grad():
            # Megatron returns [batch, seq, vocab] logits when post-processing without labels.
            out[name] = model(toks, pos, _causal_mask(toks.shape[1])).float()
        megatron_to_hf(base / f"mg_{name}", base / f"hf_back_{name}", progress=False)
    return out


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    work = tmp_path_factory.mktemp("convert")
    models = {"moe": make_hf_moe(work / "hf_moe"), "dense": make_hf_dense(work / "hf_dense")}
    return work, models


@pytest.fixture(scope="module")
def converted(hf_models) -> dict:
    work, _ = hf_models
    (result,) = run_distributed(_convert_and_run, 1, str(work), tokens())
    return result


@pytest.mark.parametrize("name", ["moe", "dense"])
def test_logits_match_transformers(hf_models, converted, name: str) -> None:
    _, models = hf_models
    toks = tokens()
    ref = hf_logits(models[name], toks)
    ours = converted[name]
    assert ours.shape == ref.shape
    diff = (ours - ref).abs().max().item()
    print(f"{name}: max |logit diff| = {diff:.3e} (logit scale {ref.abs().max().item():.2f})")
    assert diff <= LOGIT_ATOL, f"{name}: logits differ from transformers by {diff:.3e}"

    # Next-token log-probs, as the loss computes them, against transformers' log_softmax.
    from megatron_gspo.loss import token_logprobs

    nxt = toks[:, 1:, None]
    ref_lp = torch.log_softmax(ref[:, :-1], -1).gather(-1, nxt)[..., 0]
    our_lp = token_logprobs(ours[:, :-1], toks[:, 1:])
    lp_diff = (our_lp - ref_lp).abs().max().item()
    assert lp_diff <= LOGIT_ATOL, f"{name}: next-token log-probs differ by {lp_diff:.3e}"


def test_a_fractional_rope_theta_is_represented_exactly(tmp_path) -> None:
    """rope_theta 100.5 must not become 100 (that moved the logits by 3e-2)."""
    model = make_hf_moe(tmp_path / "hf_moe", rope_theta=100.5)
    (ours,) = run_distributed(_convert_and_run, 1, str(tmp_path), tokens(), ("moe",))
    diff = (ours["moe"] - hf_logits(model, tokens())).abs().max().item()
    assert diff <= LOGIT_ATOL, f"logits differ from transformers by {diff:.3e}"


def test_moe_routing_is_nontrivial(hf_models) -> None:
    """The parity above only checks the router if tokens pick different top-2 experts."""
    _, models = hf_models
    model = models["moe"]
    x = model.model.embed_tokens(tokens()).reshape(-1, 64)
    with torch.no_grad():
        logits = torch.nn.functional.linear(x, model.model.layers[0].mlp.gate.weight)
    choices = {tuple(sorted(r.tolist())) for r in logits.topk(2, -1).indices}
    assert len(choices) >= 3, f"only {len(choices)} distinct expert pairs routed"


@pytest.mark.parametrize("name", ["moe", "dense"])
def test_megatron_to_hf_is_bit_identical(hf_models, converted, name: str) -> None:
    work, models = hf_models
    orig = read_hf_dir(work / f"hf_{name}")
    back = read_hf_dir(work / f"hf_back_{name}")
    assert set(back) == set(orig)
    bad = [k for k in orig if not torch.equal(orig[k], back[k])]
    assert not bad, f"tensors changed by the round trip: {bad}"
    cfg = json.loads((work / f"hf_back_{name}" / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM" if name == "moe" else "Qwen3ForCausalLM"]


def test_exported_checkpoint_loads_in_transformers(hf_models, converted) -> None:
    from transformers import AutoModelForCausalLM

    work, models = hf_models
    reloaded = AutoModelForCausalLM.from_pretrained(
        work / "hf_back_moe", attn_implementation="eager"
    ).eval()
    toks = tokens()
    assert torch.equal(hf_logits(reloaded, toks), hf_logits(models["moe"], toks))


# -- round trip through parallel layouts -----------------------------------------------------

LAYOUTS = {
    "tp2": dict(tensor_model_parallel_size=2, sequence_parallel=True),
    "ep2": dict(expert_model_parallel_size=2),
    "pp2": dict(pipeline_model_parallel_size=2),
}


def _load_in_layout_and_gather(rank: int, world: int, ckpt: str, layout: dict) -> dict | None:
    from megatron.core import dist_checkpointing

    from megatron_gspo.config import ParallelConfig
    from megatron_gspo.model import build_model
    from megatron_gspo.parallel import init_parallel
    from megatron_gspo.weights import gather_full_state_dict
    from megatron_gspo.weights.convert import load_model_config

    parallel = ParallelConfig(**layout)
    init_parallel(parallel)
    model = build_model(load_model_config(ckpt), parallel)
    dist_checkpointing.load(model.sharded_state_dict(), ckpt)
    full = gather_full_state_dict(model)
    return full if rank == 0 else None


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_round_trip_through_parallel_layout(hf_models, converted, layout: str, tmp_path) -> None:
    from megatron_gspo.weights.convert import load_model_config
    from megatron_gspo.weights.hf import HFMapping
    from megatron_gspo.weights.safetensors_io import ShardedSafetensorsWriter

    work, _ = hf_models
    ckpt = work / "mg_moe"
    full = run_distributed(_load_in_layout_and_gather, 2, str(ckpt), LAYOUTS[layout])[0]

    cfg = load_model_config(ckpt)
    mapping = HFMapping(cfg)
    assert set(full) == set(mapping.by_megatron), "gathered names differ from the mapping's"
    plan = [(h, mapping.hf_shapes[h], torch.float32) for m in mapping.maps for h in m.hf]
    writer = ShardedSafetensorsWriter(tmp_path, plan, max_shard_size=1 << 20)
    for name, tensor in mapping.iter_hf((m.megatron, full[m.megatron]) for m in mapping.maps):
        writer.write(name, tensor)
    writer.close()

    orig = read_hf_dir(work / "hf_moe")
    back = read_hf_dir(tmp_path)
    assert set(back) == set(orig)
    bad = [k for k in orig if not torch.equal(orig[k], back[k])]
    assert not bad, f"{layout}: tensors changed by the round trip: {bad}"


def _policy_logits(rank: int, world: int, recipe_path: str, toks: torch.Tensor) -> torch.Tensor:
    from megatron_gspo.parallel import init_parallel
    from megatron_gspo.run.recipe import load_recipe
    from megatron_gspo.trainer.policy import Policy

    recipe = load_recipe(recipe_path)
    policy = Policy(recipe, init_parallel(recipe.parallel))
    policy.load_weights(recipe.run.init_from)
    policy.model.eval()
    pos = torch.arange(toks.shape[1])[None].expand_as(toks)
    with torch.no_grad():
        return policy.model(toks, pos, _causal_mask(toks.shape[1])).float()


def test_recipe_from_hf_starts_the_policy_at_the_hf_weights(hf_models, converted, tmp_path):
    """model: {from_hf} takes the shape from config.json; run.init_from loads the weights."""
    import yaml

    work, models = hf_models
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "model": {"from_hf": str(work / "hf_moe")},
                "run": {"init_from": str(work / "mg_moe")},
                "memory": {"use_distributed_optimizer": False},
            }
        )
    )
    (ours,) = run_distributed(_policy_logits, 1, str(recipe), tokens())
    diff = (ours - hf_logits(models["moe"], tokens())).abs().max().item()
    assert diff <= LOGIT_ATOL, f"policy logits differ from transformers by {diff:.3e}"
