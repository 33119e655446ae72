"""Throughput and peak memory of checkpoint conversion on a synthetic Qwen3-MoE checkpoint.

    python benchmarks/convert.py [--size-gb 2] [--workdir DIR] [--keep]

Writes a random bf16 Hugging Face checkpoint of about ``--size-gb`` (shard by shard, one tensor
in memory at a time), then runs ``hf-to-megatron`` and ``megatron-to-hf`` each in a fresh child
process and reports seconds, MB/s and the child's peak RSS (the kernel's high-water mark
``VmHWM``, reset after the imports, so no sampling gaps; ``ru_maxrss`` would not do: Linux
carries it over ``exec`` from the parent). The target is

    peak RSS <= 3 x largest tensor + baseline

where the baseline is the peak RSS of a child that imports torch, Megatron-Core and the
converter and sets up the single-rank process group, measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MB = 1e6


def _synthetic_config(size_gb: float) -> dict:
    """Qwen3-MoE-like shapes; the embedding and lm_head are the largest tensors."""
    hidden, experts, moe_ffn = 1024, 64, 256
    vocab = 151_936 if size_gb >= 1.5 else max(8192, int(151_936 * size_gb / 1.5) // 128 * 128)
    per_layer = 2 * (
        experts * 3 * moe_ffn * hidden  # experts
        + 2 * 1024 * hidden  # q_proj, o_proj (16 heads x 64)
        + 2 * 256 * hidden  # k_proj, v_proj (4 groups x 64)
        + experts * hidden  # router
    )
    embed = 2 * vocab * hidden
    layers = max(1, round((size_gb * 1e9 - 2 * embed) / per_layer))
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": hidden,
        "intermediate_size": 3072,
        "moe_intermediate_size": moe_ffn,
        "num_hidden_layers": layers,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "num_experts": experts,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "rope_theta": 1_000_000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }


def _write_synthetic(path: Path, cfg: dict) -> tuple[int, int]:
    """Stream random tensors into shards; returns (total bytes, largest tensor bytes)."""
    import torch

    from megatron_gspo.model.hf_config import model_config_from_hf
    from megatron_gspo.weights.hf import HFMapping
    from megatron_gspo.weights.safetensors_io import ShardedSafetensorsWriter

    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    mapping = HFMapping(model_config_from_hf(cfg))
    plan = [(name, shape, torch.bfloat16) for name, shape in mapping.hf_shapes.items()]
    writer = ShardedSafetensorsWriter(path, plan, max_shard_size=500 * 10**6)
    g = torch.Generator().manual_seed(0)
    for name, shape, dtype in plan:
        writer.write(name, (torch.randn(shape, generator=g) * 0.02).to(dtype))
    writer.close()
    largest = max(2 * torch.Size(s).numel() for _, s, _ in plan)
    return writer.total_size, largest


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _child(argv: list[str]) -> None:
    """Run in a fresh interpreter: one conversion (or none, for the baseline), report RSS.

    Importing torch and Megatron briefly peaks above the steady state, which would hide the
    conversion's own peak; so after the imports and the process-group set-up the kernel's
    high-water mark is reset (``/proc/self/clear_refs``, Linux >= 4.0) and the baseline is the
    RSS at that point.
    """
    import megatron.core  # noqa: F401
    import torch  # noqa: F401

    from megatron_gspo.weights.convert import main
    from megatron_gspo.weights.dist_ckpt import single_rank

    single_rank()
    Path("/proc/self/clear_refs").write_text("5")
    baseline = _status_kb("VmRSS") * 1024
    rc = 0 if argv[0] == "baseline" else main([*argv, "--no-progress"])
    peak = _status_kb("VmHWM") * 1024
    print(json.dumps({"rc": rc, "peak_rss": peak, "baseline": baseline}))


def _run_child(args: list[str]) -> tuple[float, dict]:
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, __file__, "--child", *args], capture_output=True, text=True, check=False
    )
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"child {args[0]} failed with exit code {proc.returncode}")
    return seconds, json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--size-gb", type=float, default=2.0)
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--keep", action="store_true", help="keep the checkpoints")
    args = p.parse_args()

    work = args.workdir or Path(tempfile.mkdtemp(prefix="convert-bench-"))
    try:
        cfg = _synthetic_config(args.size_gb)
        t0 = time.perf_counter()
        total, largest = _write_synthetic(work / "hf", cfg)
        print(
            f"synthetic Qwen3-MoE: {cfg['num_hidden_layers']} layers, {cfg['num_experts']} "
            f"experts, vocab {cfg['vocab_size']}: {total / MB:.0f} MB bf16, largest tensor "
            f"{largest / MB:.0f} MB (written in {time.perf_counter() - t0:.1f} s)"
        )
        _, base = _run_child(["baseline"])
        baseline = base["baseline"]
        target = 3 * largest + baseline
        print(
            f"baseline RSS (torch + megatron + converter imported, process group up): "
            f"{baseline / MB:.0f} MB"
        )
        print(f"target peak RSS: 3 x largest + baseline = {target / MB:.0f} MB")
        runs = [
            ("hf-to-megatron", [str(work / "hf"), str(work / "megatron")]),
            ("megatron-to-hf", [str(work / "megatron"), str(work / "hf_back")]),
        ]
        for name, paths in runs:
            seconds, res = _run_child([name, *paths])
            peak = res["peak_rss"]
            over = peak - baseline
            verdict = "meets" if peak <= target else "MISSES"
            print(
                f"{name}: {seconds:.1f} s, {total / MB / seconds:.0f} MB/s, peak RSS "
                f"{peak / MB:.0f} MB = baseline + {over / largest:.2f} x largest tensor "
                f"({peak / target:.2f} x target: {verdict})"
            )
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"kept {work}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(sys.argv[2:])
    else:
        main()
