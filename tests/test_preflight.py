"""`megatron-gspo preflight --size tiny` on a CPU: every part that needs no CUDA runs, the rest
say why they were skipped, and the table, the JSON and the last line agree."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.support.ranks import run_distributed

ROOT = Path(__file__).resolve().parents[1]
TINY_RECIPE = ROOT / "recipes" / "tiny-moe.yaml"
NUMBER = r"(\d+(\.\d+)?(e-?\d+)?|n/a)"
LAST_LINE = re.compile(
    rf"preflight: (?P<gpu>.+) step (?P<tps>{NUMBER}) tokens/s, MFU (?P<mfu>{NUMBER})%, "
    rf"logprobs time (?P<t>{NUMBER})x memory (?P<m>{NUMBER})x naive, "
    r"(fp8 (?P<fp8>\d+\.\d+)x bf16|fp8 unavailable: (?P<why>.+))"
)


def _preflight(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "megatron_gspo.cli", "preflight", "--size", "tiny", *args],
        capture_output=True,
        text=True,
        timeout=600,
    )


def _table(stdout: str) -> dict[tuple[str, str], str]:
    rows = {}
    for line in stdout.splitlines():
        if line.startswith("| ") and not line.startswith(("| part ", "| --- ")):
            part, field, value = line[2:-2].split(" | ", 2)
            rows[part, field] = value
    return rows


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("preflight") / "preflight.json"
    result = _preflight("--recipe", str(TINY_RECIPE), "--json", str(out))
    return result, json.loads(out.read_text()) if out.exists() else None


def test_tiny_preflight_passes_on_a_cpu_and_ends_with_the_summary_line(tiny_run):
    result, _ = tiny_run
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    last = result.stdout.strip().splitlines()[-1]
    match = LAST_LINE.fullmatch(last)
    assert match, f"last line not in the documented format: {last!r}"
    if not torch.cuda.is_available():
        assert match["gpu"] == "cpu" and match["why"], last
        assert "no CUDA GPU" in match["why"]
    for key in ("tps", "mfu", "t", "m"):
        assert match[key] != "n/a" and float(match[key]) > 0, f"{key} missing from {last!r}"


def test_tiny_preflight_runs_the_cpu_parts_and_says_why_it_skipped_the_rest(tiny_run):
    result, _ = tiny_run
    rows = _table(result.stdout)
    for part in ("environment", "recipe", "ceilings", "logprobs", "gspo step bf16"):
        assert rows[part, "status"] == "ok", (part, rows[part, "status"])
    assert rows["embedded engine", "status"] == "ok"
    assert int(rows["embedded engine", "batch"]) == 64
    assert rows["gspo step bf16", "slice"].count("128 experts top-8") == 1
    if torch.cuda.device_count() < 2:
        assert rows["nccl all-reduce", "status"].startswith("skipped: needs 2 or more CUDA GPUs")
    if not torch.cuda.is_available():
        assert rows["gspo step fp8", "status"].startswith("skipped: no CUDA GPU")


def test_json_holds_every_field_of_the_table(tiny_run):
    result, data = tiny_run
    assert data is not None, "--json wrote nothing"
    rows = _table(result.stdout)
    assert rows, "no table on stdout"
    for (part, field), shown in rows.items():
        assert field in data["parts"].get(part, {}), f"{part} / {field} is not in the JSON"
        value = data["parts"][part][field]
        if isinstance(value, float):
            assert math.isclose(value, float(shown), rel_tol=5e-3, abs_tol=1e-12), (part, field)
        else:
            assert str(value) == shown, (part, field, value, shown)
    assert sum(len(v) for v in data["parts"].values()) == len(rows)
    assert data["summary"] == result.stdout.strip().splitlines()[-1]


def test_a_recipe_needing_a_missing_extra_is_reported_with_the_extra(tmp_path):
    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("transformer_engine is installed here")
    data = yaml.safe_load(TINY_RECIPE.read_text())
    data["precision"] = {"bf16": True, "fp8": "hybrid"}
    recipe = tmp_path / "fp8.yaml"
    recipe.write_text(yaml.safe_dump(data))
    result = _preflight("--recipe", str(recipe))
    assert result.returncode == 3, result.stdout[-3000:] + result.stderr[-3000:]
    rows = _table(result.stdout)
    assert rows["recipe", "status"] == "missing"
    missing = rows["recipe", "missing"]
    assert "transformer_engine" in missing and "megatron-gspo[gpu]" in missing, missing
    assert LAST_LINE.fullmatch(result.stdout.strip().splitlines()[-1])


def test_a_part_that_raises_is_reported_failed_and_the_run_goes_on():
    from megatron_gspo.preflight.report import Report, Skip

    report = Report("tiny")
    with report.part("ok") as part:
        part.figures["x"] = 1.0
    with report.part("skipped"):
        raise Skip("not here")
    assert report.exit_code() == 0
    with report.part("broken") as part:
        part.figures["half"] = 2.0
        raise ZeroDivisionError("division by zero")
    assert [p.status for p in report.parts.values()] == ["ok", "skipped", "failed"]
    assert report.parts["broken"].reason == "ZeroDivisionError: division by zero"
    assert report.exit_code() == 1
    assert "fp8 unavailable: not run" in report.summary()


def _counted_forward_flops(rank: int, world: int, batch: int) -> tuple[float, float]:
    from torch.utils.flop_counter import FlopCounterMode

    from megatron_gspo.config import ParallelConfig
    from megatron_gspo.model import build_model
    from megatron_gspo.parallel import init_parallel
    from megatron_gspo.preflight.sizes import SIZES, forward_flops, slice_recipe

    recipe = slice_recipe(SIZES["tiny"], 2)
    init_parallel(ParallelConfig())
    model = build_model(recipe.model, ParallelConfig())
    tokens = torch.randint(0, recipe.model.vocab_size, (batch, 1))
    positions = torch.zeros(batch, 1, dtype=torch.long)
    mask = torch.zeros(batch, 1, 1, 1, dtype=torch.bool)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(tokens, positions, mask)
    # The count takes every parameter but the embedding as multiplied: norm weights too.
    norms = sum(p.numel() for name, p in model.named_parameters() if "norm" in name)
    return float(counter.get_total_flops() + 2 * norms * batch), forward_flops(
        recipe.model, [1] * batch
    )


def test_the_mfu_flop_count_is_what_the_slice_computes():
    """torch's FLOP counter on a real forward of the tiny slice (one-token sequences, so
    causal attention computes exactly its one query-key pair): top-8 experts of 128, the
    router, attention and the output layer, no embedding lookup."""
    counted, formula = run_distributed(_counted_forward_flops, 1, 6)[0]
    assert counted == formula, f"counted {counted:.6g} FLOPs, the formula {formula:.6g}"


def test_the_all_reduce_measurement_runs_its_ranks_and_reports_a_bandwidth():
    """The NCCL part's code on gloo and CPU tensors: the ranks start, agree, and report."""
    from megatron_gspo.preflight.env import allreduce_bus_gbps

    gbps = allreduce_bus_gbps(2, backend="gloo", nbytes=2**20, iters=3, timeout_s=120)
    assert math.isfinite(gbps) and gbps > 0


def test_micro_batches_move_every_tensor_to_the_model_device():
    from dataclasses import fields

    from megatron_gspo.trainer.packing import build_microbatch
    from tests.support.rl_fixtures import rollout_batch

    samples = rollout_batch()
    mb = build_microbatch(samples, list(range(4)), packing=True)
    moved = mb.to(torch.device("meta"))
    for f in fields(moved):
        value = getattr(moved, f.name)
        if isinstance(value, torch.Tensor):
            assert value.device.type == "meta", f"{f.name} stayed on {value.device}"
    assert moved.sample_indices == mb.sample_indices and moved.packed
