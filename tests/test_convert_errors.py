"""Bad input is refused with an error naming the file/key/tensor, and leaves no output behind.

Every case here fails before any Megatron state is created, so it runs in the pytest process;
the last test checks that it stayed so.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from megatron_gspo.model.hf_config import (
    HFConfigError,
    hf_config_from_model_config,
    model_config_from_hf,
)
from megatron_gspo.weights.convert import ConversionError, _atomic_dir, hf_to_megatron, main
from megatron_gspo.weights.hf import HFMapping, split_fused_experts
from tests.support.hf_tiny import make_hf_moe


@pytest.fixture(scope="module")
def hf_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hf") / "moe"
    make_hf_moe(path)
    return path


@pytest.fixture(scope="module")
def hf_moe_sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hf") / "moe_sharded"
    make_hf_moe(path, save_kwargs={"max_shard_size": "100KB"})
    return path


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "src"
    shutil.copytree(src, dst)
    return dst


def _edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def _assert_refused(src: Path, tmp_path: Path, *match: str, **layout) -> None:
    dst = tmp_path / "out"
    with pytest.raises(ConversionError) as exc:
        hf_to_megatron(src, dst, progress=False, **layout)
    for m in match:
        assert m in str(exc.value), f"expected {m!r} in error: {exc.value}"
    assert not dst.exists(), "a refused conversion left its destination"
    assert not list(tmp_path.glob(".out*")), "a refused conversion left its temporary directory"


def test_truncated_safetensors_names_the_file(hf_moe, tmp_path) -> None:
    src = _copy(hf_moe, tmp_path)
    f = src / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    _assert_refused(src, tmp_path, str(f), "truncated")


def test_corrupt_header_names_the_file(hf_moe, tmp_path) -> None:
    src = _copy(hf_moe, tmp_path)
    f = src / "model.safetensors"
    f.write_bytes(b"\xff" * 8 + f.read_bytes()[8:])
    _assert_refused(src, tmp_path, str(f))


def test_missing_shard_names_the_file(hf_moe_sharded, tmp_path) -> None:
    src = _copy(hf_moe_sharded, tmp_path)
    shards = sorted(src.glob("model-*.safetensors"))
    assert len(shards) > 1, "fixture should be sharded"
    shards[1].unlink()
    _assert_refused(src, tmp_path, str(shards[1]), "missing")


@pytest.mark.parametrize(
    "changes, key",
    [
        ({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}, "model_type"),
        ({"architectures": ["Qwen3MoeForSequenceClassification"]}, "architectures"),
        ({"shared_expert_intermediate_size": 64}, "shared_expert_intermediate_size"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "yarn"),
    ],
)
def test_unsupported_config_names_file_and_key(hf_moe, tmp_path, changes, key) -> None:
    src = _copy(hf_moe, tmp_path)
    _edit_config(src, **changes)
    _assert_refused(src, tmp_path, str(src / "config.json"), key)


def test_shape_mismatch_names_tensor_and_shapes(hf_moe, tmp_path) -> None:
    src = _copy(hf_moe, tmp_path)
    _edit_config(src, moe_intermediate_size=16)
    _assert_refused(
        src, tmp_path, "model.layers.0.mlp.experts.0.gate_proj.weight", "(32, 64)", "(16, 64)"
    )


@pytest.mark.parametrize(
    "layout, key",
    [
        ({"tp": 3}, "num_attention_heads"),
        ({"ep": 3}, "num_experts"),
        ({"pp": 3}, "num_layers"),
    ],
)
def test_layout_that_does_not_divide_is_refused(hf_moe, tmp_path, layout, key) -> None:
    _assert_refused(hf_moe, tmp_path, key, **layout)


def test_cli_reports_error_and_exit_code(hf_moe, tmp_path, capsys) -> None:
    rc = main(["hf-to-megatron", str(hf_moe), str(tmp_path / "out"), "--tp", "3"])
    assert rc == 1
    assert "num_attention_heads" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_existing_destination_is_refused(hf_moe, tmp_path) -> None:
    (tmp_path / "out").mkdir()
    with pytest.raises(ConversionError, match="exists"):
        hf_to_megatron(hf_moe, tmp_path / "out", progress=False)


def test_failure_while_writing_removes_temporary_directory(tmp_path) -> None:
    with pytest.raises(RuntimeError), _atomic_dir(tmp_path / "out") as tmp:
        (tmp / "half-written").write_text("x")
        raise RuntimeError("disk full")
    assert list(tmp_path.iterdir()) == []


# -- config and mapping, without files -------------------------------------------------------


def test_config_round_trips_through_hf_dict(hf_moe) -> None:
    cfg = model_config_from_hf(hf_moe)
    assert cfg.num_experts == 4 and cfg.moe_router_topk == 2 and cfg.rotary_base == 10000.0
    assert model_config_from_hf(hf_config_from_model_config(cfg)) == cfg


def test_transformers_reads_our_config_json(hf_moe) -> None:
    from transformers import Qwen3MoeConfig

    cfg = model_config_from_hf(hf_moe)
    hf = Qwen3MoeConfig(**hf_config_from_model_config(cfg))
    assert hf.num_experts == 4 and hf.rope_parameters["rope_theta"] == 10000.0
    assert hf.tie_word_embeddings is False


def test_legacy_rope_theta_is_read() -> None:
    cfg = {
        "model_type": "qwen3",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 96,
        "vocab_size": 128,
        "rope_theta": 1e6,
        "rope_scaling": None,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
    }
    mc = model_config_from_hf(cfg)
    assert mc.rotary_base == 1e6 and mc.params_dtype == "bfloat16"
    assert not mc.untie_embeddings_and_output_weights
    with pytest.raises(HFConfigError, match="rope_theta"):
        model_config_from_hf({k: v for k, v in cfg.items() if k != "rope_theta"})


def test_qkv_mapping_inverts_and_groups_heads(hf_moe) -> None:
    mapping = HFMapping(model_config_from_hf(hf_moe))
    m = mapping.by_megatron["decoder.layers.0.self_attention.linear_qkv.weight"]
    q, k, v = (torch.randn(mapping.hf_shapes[h]) for h in m.hf)
    fused = mapping.to_megatron(m, [q, k, v])
    # Group 0 is [q heads 0-1, k head 0, v head 0], each head 16 rows.
    assert torch.equal(fused[:32], q[:32]) and torch.equal(fused[32:48], k[:16])
    assert torch.equal(fused[48:64], v[:16]) and torch.equal(fused[64:96], q[32:])
    back = dict(mapping.to_hf(m.megatron, fused))
    assert all(torch.equal(back[h], t) for h, t in zip(m.hf, (q, k, v), strict=True))


def test_fused_transformers5_experts_split_to_per_expert_names() -> None:
    gate_up = torch.randn(4, 64, 64)
    down = torch.randn(4, 64, 32)
    out = dict(split_fused_experts("model.layers.1.mlp.experts.gate_up_proj", gate_up))
    out.update(split_fused_experts("model.layers.1.mlp.experts.down_proj", down))
    assert torch.equal(out["model.layers.1.mlp.experts.2.gate_proj.weight"], gate_up[2, :32])
    assert torch.equal(out["model.layers.1.mlp.experts.2.up_proj.weight"], gate_up[2, 32:])
    assert torch.equal(out["model.layers.1.mlp.experts.3.down_proj.weight"], down[3])


def test_fused_expert_checkpoint_is_read_per_expert(hf_moe, tmp_path) -> None:
    """A safetensors file holding 5.x's in-memory fused expert tensors reads per expert."""
    from safetensors.torch import save_file
    from transformers import Qwen3MoeForCausalLM

    from megatron_gspo.weights.safetensors_io import HFCheckpointReader

    model = Qwen3MoeForCausalLM.from_pretrained(hf_moe)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    src = _copy(hf_moe, tmp_path)
    save_file(state, src / "model.safetensors")
    fused, ref = HFCheckpointReader(src), HFCheckpointReader(hf_moe)
    for name in HFMapping(model_config_from_hf(hf_moe)).hf_shapes:
        assert torch.equal(fused.get(name), ref.get(name)), name


def test_no_megatron_state_was_created_here() -> None:
    from megatron_gspo.parallel import cpu_platform_active

    assert not cpu_platform_active(), "a test in this file switched on the CPU platform layer"
