"""Model breadth: shapes users bring, checked against transformers as the reference.

- Qwen3-MoE with an odd vocabulary (padded to a multiple of TP, the padding never scored or
  sampled), a dense layer among the MoE ones (``mlp_only_layers``) and ``norm_topk_prob:
  false``;
- a tiny DeepSeek-V3: multi-latent attention, a dense first layer, a shared expert, sigmoid
  routing whose choice depends on the correction bias and on the expert groups, a routed
  scaling factor, and ``rms_norm_eps`` other than the latent norms' fixed 1e-6.

Both convert to Megatron and back bit for bit, and the forward-only path (``load_model``,
``full_vocab_logits``) gives transformers' logits at 1 rank, TP2 with sequence parallelism,
EP2 and PP2. The DeepSeek-V3 flavour trains in the RL loop, its bias moving by Megatron's rule
and resuming exactly.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from megatron_gspo.config import ParallelConfig
from megatron_gspo.model.hf_config import HFConfigError, model_config_from_hf
from tests.support.hf_tiny import hf_logits, make_hf_deepseek, make_hf_moe, read_hf_dir, tokens
from tests.support.ranks import run_distributed
from tests.support.runs import comparable, straight_and_resumed

LOGIT_ATOL = 1e-4
ODD_VOCAB = 127
MODELS = {
    "qwen3-moe": lambda path: make_hf_moe(
        path, vocab_size=ODD_VOCAB, mlp_only_layers=[1], norm_topk_prob=False
    ),
    "deepseek-v3": lambda path: make_hf_deepseek(path, rms_norm_eps=1e-5),
}


def _convert(rank, world, work: str, names):
    from megatron_gspo.weights.convert import hf_to_megatron, megatron_to_hf

    for name in names:
        base = Path(work)
        hf_to_megatron(base / f"hf_{name}", base / f"mg_{name}", progress=False)
        megatron_to_hf(base / f"mg_{name}", base / f"hf_back_{name}", progress=False)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    work = tmp_path_factory.mktemp("breadth")
    models = {name: make(work / f"hf_{name}") for name, make in MODELS.items()}
    run_distributed(_convert, 1, str(work), list(MODELS))
    return work, models


def _toks() -> torch.Tensor:
    return tokens() % ODD_VOCAB


def _logits(rank, world, ckpt: str, layout: dict, toks: torch.Tensor) -> torch.Tensor:
    from megatron_gspo.parallel import init_parallel
    from megatron_gspo.weights.convert import load_model_config
    from megatron_gspo.weights.forward import full_vocab_logits, load_model

    parallel = ParallelConfig(**layout)
    init_parallel(parallel)
    model = load_model(load_model_config(ckpt), parallel, ckpt)
    return full_vocab_logits(model, toks)


LAYOUTS = {
    "1": ({}, 1),
    "tp2-sp": ({"tensor_model_parallel_size": 2, "sequence_parallel": True}, 2),
    "ep2": ({"expert_model_parallel_size": 2}, 2),
    "pp2": ({"pipeline_model_parallel_size": 2}, 2),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", list(MODELS))
def test_logits_match_transformers_in_every_layout(converted, name, layout):
    work, models = converted
    parallel, world = LAYOUTS[layout]
    ref = hf_logits(models[name], _toks())
    for rank, ours in enumerate(
        run_distributed(_logits, world, str(work / f"mg_{name}"), parallel, _toks())
    ):
        assert ours.shape == ref.shape, f"rank {rank}: {tuple(ours.shape)}"
        diff = (ours - ref).abs().max().item()
        assert diff <= LOGIT_ATOL, f"{name} {layout} rank {rank}: logits differ by {diff:.2e}"


@pytest.mark.parametrize("name", list(MODELS))
def test_round_trip_is_bit_identical(converted, name):
    work, _ = converted
    orig, back = read_hf_dir(work / f"hf_{name}"), read_hf_dir(work / f"hf_back_{name}")
    assert set(back) == set(orig)
    bad = [
        k for k in orig if not (orig[k].dtype == back[k].dtype and torch.equal(orig[k], back[k]))
    ]
    assert not bad, f"tensors changed by the round trip: {bad}"
    cfg = model_config_from_hf(work / f"hf_back_{name}")
    assert cfg == model_config_from_hf(work / f"hf_{name}")


def test_the_configs_use_what_they_claim(converted):
    work, _ = converted
    qwen = model_config_from_hf(work / "hf_qwen3-moe")
    assert qwen.vocab_size == ODD_VOCAB and qwen.padded_vocab_size(2) == ODD_VOCAB + 1
    assert qwen.dense_layers == [1] and not qwen.moe_norm_topk_prob
    ds = model_config_from_hf(work / "hf_deepseek-v3")
    assert ds.mla is not None and ds.dense_layers == [0] and ds.moe_router_expert_bias
    assert (ds.moe_router_num_groups, ds.moe_router_group_topk) == (4, 2)
    assert ds.moe_shared_expert_intermediate_size == 32 and ds.norm_epsilon == 1e-5
    back = json.loads((work / "hf_back_deepseek-v3" / "config.json").read_text())
    # What vLLM reads to route as transformers does.
    assert back["scoring_func"] == "sigmoid" and back["topk_method"] == "noaux_tc"


def test_deepseek_routing_depends_on_the_bias_and_the_groups(converted):
    """Otherwise the parity above would not check them: transformers' output changes when
    the correction bias is zeroed or the group limit lifted."""
    _, models = converted
    model = models["deepseek-v3"]
    ref = hf_logits(model, _toks())
    gate = model.model.layers[1].mlp.gate
    bias = gate.e_score_correction_bias.clone()
    with torch.no_grad():
        gate.e_score_correction_bias.zero_()
    unbiased = hf_logits(model, _toks())
    with torch.no_grad():
        gate.e_score_correction_bias.copy_(bias)
    router = next(m for m in model.modules() if hasattr(m, "topk_group"))
    router.topk_group = router.num_group
    ungrouped = hf_logits(model, _toks())
    router.topk_group = 2
    assert (unbiased - ref).abs().max() > 1e-2, "the bias changes no route"
    assert (ungrouped - ref).abs().max() > 1e-2, "the groups change no route"


# ------------------------------------------------------------------------------------------
# Configs refused, multi-token-prediction layers dropped
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes, key",
    [
        # Megatron scores a group by its top topk/topk_group experts, transformers by its top 2.
        ({"topk_group": 1}, "topk_group"),
        ({"rope_interleave": False}, "rope_interleave"),
        ({"norm_topk_prob": False}, "norm_topk_prob"),
        ({"num_key_value_heads": 2}, "num_key_value_heads"),
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
        (
            {
                "rope_parameters": {
                    "rope_type": "yarn",
                    "rope_theta": 1e4,
                    "factor": 4.0,
                    "original_max_position_embeddings": 16,
                    "mscale": 0.7,
                }
            },
            "mscale",
        ),  # fmt: skip
    ],
)
def test_a_deepseek_config_the_model_cannot_represent_is_refused(converted, changes, key):
    work, _ = converted
    cfg = json.loads((work / "hf_deepseek-v3" / "config.json").read_text())
    cfg.update(changes)
    with pytest.raises(HFConfigError, match=key):
        model_config_from_hf(cfg)


def test_deepseek_yarn_is_read():
    rope = {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 40.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    }
    cfg = model_config_from_hf(
        {
            "model_type": "deepseek_v3",
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "vocab_size": 128,
            "intermediate_size": 96,
            "kv_lora_rank": 16,
            "q_lora_rank": None,
            "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8,
            "v_head_dim": 16,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "rope_parameters": rope,
        }
    )
    assert cfg.rope_scaling.factor == 40.0 and cfg.rope_scaling.mscale_all_dim == 1.0
    assert cfg.mla.q_lora_rank is None


def test_multi_token_prediction_layers_are_dropped_with_a_notice(converted, tmp_path):
    import shutil

    work, _ = converted
    src = tmp_path / "hf"
    shutil.copytree(work / "hf_deepseek-v3", src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    (src / "config.json").write_text(json.dumps(cfg))
    # A second shard holding an MTP layer's tensor (layer 2 of a 2-layer model), and the
    # index that lists both shards.
    save_file({"model.layers.2.eh_proj.weight": torch.zeros(64, 128)}, src / "mtp.safetensors")
    weight_map = {k: "model.safetensors" for k in read_hf_dir(work / "hf_deepseek-v3")}
    weight_map["model.layers.2.eh_proj.weight"] = "mtp.safetensors"
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (notices,) = run_distributed(_convert_one, 1, str(src), str(tmp_path / "mg"))
    assert any("1 multi-token-prediction layer" in n for n in notices), notices


def _convert_one(rank, world, src: str, dst: str) -> list[str]:
    """Convert; the conversion's log messages."""
    from megatron_gspo.weights.convert import hf_to_megatron

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("megatron_gspo.weights.convert").addHandler(handler)
    hf_to_megatron(src, dst, progress=False)
    return [r.getMessage() for r in records]


# ------------------------------------------------------------------------------------------
# Vocabulary padding in the loss; the expert bias's token count
# ------------------------------------------------------------------------------------------


def _padded_logprobs(rank, world, logits, targets, vocab):
    import torch.distributed as dist

    from megatron_gspo.loss import token_logprobs

    group = dist.new_group(list(range(world))) if world > 1 else None
    local = logits.chunk(world, dim=-1)[rank].clone().requires_grad_()
    lp, ent = token_logprobs(local, targets, tp_group=group, return_entropy=True, vocab_size=vocab)
    (lp.sum() + ent.sum()).backward()
    return lp.detach(), ent.detach(), local.grad


@pytest.mark.parametrize("world", [1, 2])
def test_padded_vocabulary_ids_take_no_probability_entropy_or_gradient(world):
    """Rank 1 of TP2 holds only padding here (5 real ids of 8)."""
    g = torch.Generator().manual_seed(0)
    vocab, padded = 5, 8
    logits = torch.randn(6, padded, generator=g, dtype=torch.float64) * 3
    logits[:, vocab:] = 50.0  # would dominate the softmax if it were counted
    targets = torch.randint(0, vocab, (6,), generator=g)
    real = logits[:, :vocab].clone().requires_grad_()
    ref_lp = torch.log_softmax(real, -1).gather(-1, targets[:, None])[:, 0]
    p = torch.softmax(real, -1)
    ref_ent = -(p * torch.log_softmax(real, -1)).sum(-1)
    (ref_lp.sum() + ref_ent.sum()).backward()
    results = run_distributed(_padded_logprobs, world, logits, targets, vocab)
    grad = torch.cat([r[2] for r in results], dim=-1)
    for lp, ent, _ in results:
        torch.testing.assert_close(lp, ref_lp.detach())
        torch.testing.assert_close(ent, ref_ent.detach())
    torch.testing.assert_close(grad[:, :vocab], real.grad)
    assert torch.equal(grad[:, vocab:], torch.zeros(6, padded - vocab, dtype=torch.float64))


def _expert_counts(rank, world):
    from megatron_gspo.model import build_model
    from megatron_gspo.parallel import init_parallel
    from megatron_gspo.run.recipe import load_recipe

    model_cfg = load_recipe(
        Path(__file__).resolve().parents[1] / "recipes/tiny-deepseek.yaml"
    ).model
    init_parallel(ParallelConfig())
    model = build_model(model_cfg, ParallelConfig())
    tokens = torch.randint(0, model_cfg.vocab_size, (2, 12))
    padding = torch.zeros(2, 12, dtype=torch.bool)
    padding[0, 9:] = True
    padding[1, 5:] = True
    mask = torch.ones(12, 12, dtype=torch.bool).triu(1)[None, None]
    model(tokens, torch.arange(12)[None].expand(2, 12), mask, padding_mask=padding)
    routers = [m for m in model.modules() if hasattr(m, "local_tokens_per_expert")]
    return [float(r.local_tokens_per_expert.sum()) for r in routers], int((~padding).sum())


def test_the_expert_bias_counts_real_tokens_only():
    counts, real = run_distributed(_expert_counts, 1)[0]
    topk = 4  # recipes/tiny-deepseek.yaml
    assert counts and all(c == real * topk for c in counts), (counts, real * topk)


# ------------------------------------------------------------------------------------------
# The DeepSeek-V3 flavour in the RL loop
# ------------------------------------------------------------------------------------------


def _deepseek_loop(output_dir: Path) -> dict:
    import yaml

    data = yaml.safe_load(
        (Path(__file__).resolve().parents[1] / "recipes" / "tiny-deepseek.yaml").read_text()
    )
    data["rollout"].update(prompts_per_step=8, group_size=4)
    data["run"].update(output_dir=str(output_dir), checkpoint_every=2, plot_every=0)
    data["run"]["tensorboard"] = False
    return data


def _expert_bias(rank, world, data: dict, step: int) -> dict:
    from megatron_gspo.config import Recipe
    from megatron_gspo.parallel import init_parallel
    from megatron_gspo.run.checkpoint import Checkpointer
    from megatron_gspo.trainer.policy import Policy

    recipe = Recipe.model_validate(data)
    policy = Policy(recipe, init_parallel(recipe.parallel))
    Checkpointer(Path(recipe.run.output_dir) / "checkpoints", policy).load(step)
    return {n: b.clone() for n, b in policy.model.named_buffers() if n.endswith("expert_bias")}


@pytest.mark.slow
def test_the_deepseek_flavour_trains_and_its_expert_bias_resumes_exactly(tmp_path):

    straight, split = _deepseek_loop(tmp_path / "a"), _deepseek_loop(tmp_path / "b")
    a, b = straight_and_resumed(straight, split)
    assert [comparable(m) for m in a] == [comparable(m) for m in b], "resume differs"
    for key in ("routing_flip_rate", "expert_load_max_over_mean", "entropy", "clip_fraction"):
        assert all(key in m for m in a), key
    bias = run_distributed(_expert_bias, 1, straight, 4)[0]
    assert len(bias) == 2, "one bias per MoE layer (the first layer is dense)"
    # Megatron moves each expert's bias by +-rate per optimizer step (2 per RL step here).
    for name, b in bias.items():
        assert b.abs().max() > 0 and b.abs().max() <= 8 * 1e-3 + 1e-9, (name, b)
