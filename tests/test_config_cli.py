"""Recipe validation, the CLI, and the GPU extras staying optional."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_gspo.config import ParallelConfig, PrecisionConfig
from megatron_gspo.run.recipe import RecipeError, load_recipe
from tests.support.tiny import TINY_MOE

ROOT = Path(__file__).resolve().parents[1]
TINY_RECIPE = ROOT / "recipes" / "tiny-moe.yaml"


def _write(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "megatron_gspo.cli", *args], capture_output=True, text=True
    )


def test_shipped_tiny_recipe_loads():
    recipe = load_recipe(TINY_RECIPE)
    assert recipe.model.is_moe and recipe.model.num_experts == 4


def test_unknown_key_is_named_with_its_file(tmp_path):
    data = yaml.safe_load(TINY_RECIPE.read_text())
    data["model"]["num_expert"] = 4
    path = _write(tmp_path, data)
    with pytest.raises(RecipeError) as e:
        load_recipe(path)
    assert str(path) in str(e.value) and "model.num_expert: unknown key" in str(e.value)


def test_wrong_type_is_named_with_its_key(tmp_path):
    data = yaml.safe_load(TINY_RECIPE.read_text())
    data["parallel"]["tensor_model_parallel_size"] = "two"
    with pytest.raises(RecipeError, match=r"parallel\.tensor_model_parallel_size"):
        load_recipe(_write(tmp_path, data))


def test_missing_recipe_file_is_named(tmp_path):
    with pytest.raises(RecipeError, match="nope.yaml: recipe file not found"):
        load_recipe(tmp_path / "nope.yaml")


def test_layout_that_does_not_divide_the_model_is_refused():
    from megatron_gspo.model import check_layout

    with pytest.raises(ValueError, match="num_experts=4 is not divisible by .*=3"):
        check_layout(TINY_MOE, ParallelConfig(expert_model_parallel_size=3))
    with pytest.raises(ValueError, match="sequence_parallel must be true"):
        check_layout(TINY_MOE, ParallelConfig(tensor_model_parallel_size=2))


def test_cli_help_and_import_need_no_gpu_extras():
    code = (
        "import sys, megatron_gspo, megatron_gspo.cli, megatron_gspo.model, "
        "megatron_gspo.parallel, megatron_gspo.weights\n"
        "bad = [m for m in ('transformer_engine', 'apex', 'vllm') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    result = _cli("--help")
    assert result.returncode == 0 and "validate" in result.stdout


@pytest.mark.parametrize(
    "section,value,extra_module",
    [("precision", {"fp8": "hybrid"}, "transformer_engine")],
)
def test_recipe_needing_a_missing_extra_fails_naming_the_extra(
    tmp_path, section, value, extra_module
):
    if extra_module in sys.modules or _importable(extra_module):
        pytest.skip(f"{extra_module} is installed here")
    data = yaml.safe_load(TINY_RECIPE.read_text())
    data[section] = value
    result = _cli("validate", str(_write(tmp_path, data)))
    assert result.returncode != 0
    assert "megatron-gspo[gpu]" in result.stderr and extra_module in result.stderr


def test_fp8_model_config_without_transformer_engine_names_the_extra():
    from megatron_gspo.model import transformer_config
    from megatron_gspo.runtime.extras import MissingExtraError

    if _importable("transformer_engine"):
        pytest.skip("transformer_engine is installed here")
    with pytest.raises(MissingExtraError, match=r"megatron-gspo\[gpu\]"):
        transformer_config(TINY_MOE, ParallelConfig(), PrecisionConfig(fp8="e4m3"), use_te=False)


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


@pytest.mark.parametrize("path", sorted((ROOT / "recipes").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_recipe_is_valid(path):
    load_recipe(path)
