"""Across the megatron-core range the project admits: what one end writes, the other reads.

Two interpreters take part: this one (Python 3.11 with megatron-core 0.16.1 in CI) and the
README's Python 3.12 environment with megatron-core 0.19 (``.venv312/``, which the README's
py312 command builds; CI builds it before this tier runs). The run written under 0.16.1 that
0.19 resumes is ``tests/fixtures/pre-layers-run`` (``tests/test_checkpoint.py``, which the 3.12
leg runs); here the other way round, and conversion under both.
"""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.support.hf_tiny import make_hf_deepseek, make_hf_moe, read_hf_dir
from tests.support.runs import ROOT, loop_recipe

VENV312 = ROOT / ".venv312" / "bin" / "python"


def _mcore(python: Path | str) -> str:
    code = "import importlib.metadata as m; print(m.version('megatron-core'))"
    return subprocess.run(
        [str(python), "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()


def _other_end() -> str:
    """The other interpreter, or a skip saying how to get it."""
    if not VENV312.exists():
        pytest.skip("no .venv312: the README's py312 command builds it (CI runs it first)")
    here, there = importlib.metadata.version("megatron-core"), _mcore(VENV312)
    if here == there:
        pytest.skip(f"both interpreters hold megatron-core {here}")
    return there


def _run(python, *args, timeout=900) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(python), "-m", "megatron_gspo", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=timeout,
    )


@pytest.mark.slow
def test_a_run_saved_under_the_newest_megatron_core_resumes_under_the_oldest(tmp_path):
    there = _other_end()
    run = tmp_path / "run"
    data = loop_recipe(run, rollout={"max_staleness": 1}, run={"plot_every": 0})
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(data))
    first = _run(VENV312, "train", recipe, "--steps", "2")
    assert first.returncode == 0, f"megatron-core {there}: {first.stderr[-3000:]}"
    second = _run(sys.executable, "train", recipe, "--steps", "3")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stderr and "at step 2" in second.stderr
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]


def _tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a converted Megatron checkpoint, read by this interpreter."""
    from megatron_gspo.weights.convert import megatron_to_hf

    back = checkpoint.parent / f"{checkpoint.name}-read-back"
    megatron_to_hf(checkpoint, back, progress=False)
    return read_hf_dir(back)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_conversion_writes_the_same_tensors_under_both_ends(tmp_path, family):
    """hf-to-megatron under each megatron-core, then each converted back by both: every
    tensor equal bit for bit, whichever version wrote or read it."""
    there = _other_end()
    hf = tmp_path / "hf"
    (make_hf_moe if family == "qwen3_moe" else make_hf_deepseek)(hf)
    source = read_hf_dir(hf)
    outputs = {}
    for name, python in (("here", sys.executable), ("there", VENV312)):
        mg = tmp_path / f"mg-{name}"
        proc = _run(python, "convert", "hf-to-megatron", hf, mg)
        assert proc.returncode == 0, f"{name}: {proc.stderr[-3000:]}"
        back = tmp_path / f"hf-{name}"
        proc = _run(python, "convert", "megatron-to-hf", mg, back)
        assert proc.returncode == 0, f"{name}: {proc.stderr[-3000:]}"
        outputs[name] = (mg, read_hf_dir(back))
    for name, (mg, back) in outputs.items():
        # Each end's round trip, and the other end's checkpoint read here.
        for tensors in (back, _tensors(mg)):
            assert tensors.keys() == source.keys(), name
            different = [k for k in source if not torch.equal(tensors[k], source[k])]
            assert not different, f"{name} (megatron-core {there}): {different[:5]}"
