"""Checkpoint conversion between Hugging Face (Qwen3, Qwen3-MoE, DeepSeek-V3) and Megatron-Core.

``hf-to-megatron`` streams safetensors tensors through :class:`HFMapping` into a Megatron
``torch_dist`` checkpoint (see :mod:`megatron_gspo.weights.dist_ckpt` for why it does not build
the model), plus ``model_config.yaml`` holding the recipe's ``model:`` section.
``megatron-to-hf`` loads a checkpoint one layer at a time and streams the HF tensors into
size-limited safetensors shards with an index and ``config.json``.

Both write into a hidden sibling directory and ``os.replace`` it onto the destination at the
end, so a destination that exists is complete; on failure the temporary directory is removed.
Everything that can be checked before writing (config, shard files, headers, every tensor's
name, shape and dtype, the parallel layout) is checked first.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import shutil
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path

import torch
import yaml

from megatron_gspo.config import ModelConfig, ParallelConfig
from megatron_gspo.model.hf_config import (
    HFConfigError,
    hf_config_from_model_config,
    load_hf_config,
    model_config_from_hf,
)
from megatron_gspo.runtime.errors import InputError, UserError
from megatron_gspo.weights.hf import HFMapping
from megatron_gspo.weights.safetensors_io import (
    HFCheckpointReader,
    SafetensorsError,
    ShardedSafetensorsWriter,
    parse_size,
)

__all__ = ["ConversionError", "hf_to_megatron", "main", "megatron_to_hf"]

log = logging.getLogger(__name__)

MODEL_CONFIG_FILE = "model_config.yaml"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


class ConversionError(InputError):
    """Input that cannot be converted; the message names the file, key or tensor."""


# -- shared plumbing -------------------------------------------------------------------------


@contextlib.contextmanager
def _atomic_dir(dst: Path) -> Iterator[Path]:
    """A temporary sibling of ``dst`` that becomes ``dst`` only if the block succeeds."""
    if dst.exists():
        raise ConversionError(f"{dst}: destination exists; remove it or choose another path")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.parent / f".{dst.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


class _Progress:
    """tqdm when installed, otherwise a counter logged every tenth of the way."""

    def __init__(self, total: int, desc: str, enabled: bool) -> None:
        self.total, self.desc, self.n = total, desc, 0
        self._bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=total, desc=desc, unit="tensor", file=sys.stderr)
            except ImportError:
                pass
        self._log = enabled and self._bar is None

    def update(self, n: int = 1) -> None:
        self.n += n
        if self._bar is not None:
            self._bar.update(n)
        elif self._log and (self.n == self.total or self.n % max(1, self.total // 10) == 0):
            log.info("%s: %d/%d tensors", self.desc, self.n, self.total)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _parallel(cfg: ModelConfig, tp: int, pp: int, ep: int) -> ParallelConfig:
    """Validate that the target layout divides the model (heads, groups, vocab, layers...)."""
    from megatron_gspo.model.provider import check_layout

    if ep > 1 and not cfg.is_moe:
        raise ConversionError(f"--ep {ep}: the model is dense (no experts to distribute)")
    parallel = ParallelConfig(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        sequence_parallel=tp > 1 and cfg.is_moe,
    )
    try:
        check_layout(cfg, parallel)
    except ValueError as e:
        raise ConversionError(f"layout TP={tp} PP={pp} EP={ep} does not fit the model: {e}") from e
    return parallel


def load_model_config(path: str | Path) -> ModelConfig:
    """A model config from our ``model_config.yaml`` or a recipe (its ``model:`` section)."""
    path = Path(path)
    if path.is_dir():
        path = path / MODEL_CONFIG_FILE
    if not path.is_file():
        raise ConversionError(
            f"{path}: model config not found (pass --model-config with a recipe or "
            f"{MODEL_CONFIG_FILE})"
        )
    data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict) or not isinstance(data.get("model"), dict):
        raise ConversionError(f"{path}: expected a 'model:' section")
    try:
        return ModelConfig(**data["model"])
    except ValueError as e:
        raise ConversionError(f"{path}: invalid model section: {e}") from e


# -- Hugging Face -> Megatron ----------------------------------------------------------------


def _check_hf_tensors(
    reader: HFCheckpointReader, mapping: HFMapping, src: Path, *, mtp_layers: int = 0
) -> None:
    """Every tensor the config implies is present with its shape and dtype; nothing extra
    (but the multi-token-prediction layers a DeepSeek-V3 checkpoint may carry, which are
    dropped with a notice)."""
    cfg = mapping.cfg
    dtype = _DTYPES[cfg.params_dtype]
    for name, shape in mapping.hf_shapes.items():
        if name not in reader:
            raise ConversionError(f"{src}: checkpoint has no tensor {name!r} (required by config)")
        got = reader.shape(name)
        if got != shape:
            raise ConversionError(
                f"{src}: tensor {name!r} has shape {got}, the config implies {shape}"
            )
        want = mapping.hf_dtype(name, dtype)
        if mapping.by_hf[name].fp32 and reader.dtype(name).is_floating_point:
            continue  # kept in fp32 by the model, whatever precision the file holds
        if reader.dtype(name) != want:
            raise ConversionError(
                f"{src}: tensor {name!r} is {reader.dtype(name)}, expected {want}"
            )
    known = set(mapping.hf_shapes)
    extra, mtp = [], []
    for name in reader.entries:
        if name in known or name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            continue
        if name == "lm_head.weight" and not cfg.untie_embeddings_and_output_weights:
            # Some tied checkpoints store the (identical) output layer as well.
            continue
        layer = _LAYER_INDEX.match(name)
        if mtp_layers and layer and cfg.num_layers <= int(layer[1]) < cfg.num_layers + mtp_layers:
            mtp.append(name)
            continue
        extra.append(name)
    if extra:
        raise ConversionError(
            f"{src}: {len(extra)} tensors the model has no place for, e.g. {extra[:3]}"
        )
    if mtp:
        log.warning(
            "%s: dropped the %d tensors of %d multi-token-prediction layer(s) "
            "(num_nextn_predict_layers): the policy trains the main model only",
            src,
            len(mtp),
            mtp_layers,
        )


def hf_to_megatron(
    src: str | Path,
    dst: str | Path,
    *,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    progress: bool = True,
) -> ModelConfig:
    """Convert a Hugging Face (Qwen3, Qwen3-MoE, DeepSeek-V3) safetensors checkpoint to ``dst``.

    ``tp``, ``pp`` and ``ep`` are the layout training will load it with; the checkpoint itself
    is layout-free, so they are only validated against the model.
    """
    from megatron_gspo.weights.dist_ckpt import checkpoint_layout, write_checkpoint
    from megatron_gspo.weights.shards import VOCAB_TENSORS, pad_rows

    src, dst = Path(src), Path(dst)
    try:
        cfg = model_config_from_hf(src)
        _parallel(cfg, tp, pp, ep)
        reader = HFCheckpointReader(src)
    except (HFConfigError, SafetensorsError) as e:
        raise ConversionError(str(e)) from e
    mapping = HFMapping(cfg)
    hf_cfg, _ = load_hf_config(src)
    _check_hf_tensors(
        reader, mapping, src, mtp_layers=int(hf_cfg.get("num_nextn_predict_layers") or 0)
    )

    with _atomic_dir(dst) as tmp:
        entries = checkpoint_layout(cfg)
        names = {e.name for e in entries if e.name in mapping.by_megatron}
        missing = set(mapping.by_megatron) - names
        if missing:
            raise RuntimeError(f"Megatron layout lacks tensors the mapping expects: {missing}")
        bar = _Progress(len(mapping.maps), "hf-to-megatron", progress)

        rows = {e.name: e.param_shape[0] for e in entries if e.name in VOCAB_TENSORS}

        def produce(name: str) -> torch.Tensor:
            m = mapping.by_megatron[name]
            try:
                tensor = mapping.to_megatron(m, (reader.get(h) for h in m.hf))
                if m.fp32:
                    tensor = tensor.float()
            except SafetensorsError as e:
                raise ConversionError(str(e)) from e
            bar.update()
            # Megatron's vocabulary padding of the single-rank layout (zeros: never read).
            return pad_rows(tensor, rows[name]) if name in rows else tensor

        try:
            write_checkpoint(tmp, entries, produce)
        finally:
            bar.close()
        (tmp / MODEL_CONFIG_FILE).write_text(
            yaml.safe_dump({"model": cfg.model_dump()}, sort_keys=False)
        )
    return cfg


# -- Megatron -> Hugging Face ----------------------------------------------------------------


def _copy_tokenizer(src: Path, dst: Path) -> None:
    if not src.is_dir():
        raise ConversionError(f"{src}: --tokenizer-from is not a directory")
    found = [f for f in _TOKENIZER_FILES if (src / f).is_file()]
    if not any(f.startswith("tokenizer") or f in ("vocab.json",) for f in found):
        raise ConversionError(
            f"{src}: no tokenizer files (looked for {', '.join(_TOKENIZER_FILES)})"
        )
    for f in found:
        shutil.copy2(src / f, dst / f)


def megatron_to_hf(
    src: str | Path,
    dst: str | Path,
    *,
    tokenizer_from: str | Path | None = None,
    model_config: str | Path | None = None,
    max_shard_size: int = 5 * 10**9,
    progress: bool = True,
) -> ModelConfig:
    """Convert a Megatron ``torch_dist`` checkpoint (saved in any layout) to HF safetensors.

    The model config comes from ``model_config.yaml`` in ``src`` (written by hf-to-megatron)
    or from ``model_config`` (a recipe or such a file) for checkpoints saved by training.
    """
    import json

    from megatron_gspo.weights.dist_ckpt import checkpoint_layout, read_tensors, with_saved_vocab
    from megatron_gspo.weights.shards import VOCAB_TENSORS

    src, dst = Path(src), Path(dst)
    if not (src / "metadata.json").is_file():
        raise ConversionError(f"{src}: not a Megatron distributed checkpoint (no metadata.json)")
    if (src / "manifest.json").is_file():  # a training checkpoint: check it before reading
        from megatron_gspo.weights.manifest import CheckpointError, verify_checkpoint

        try:
            verify_checkpoint(src)
        except CheckpointError as e:
            raise ConversionError(str(e)) from None
    cfg = load_model_config(model_config or src)
    mapping = HFMapping(cfg)
    dtype = _DTYPES[cfg.params_dtype]

    with _atomic_dir(dst) as tmp:
        if tokenizer_from is not None:
            _copy_tokenizer(Path(tokenizer_from), tmp)
        entries = with_saved_vocab(src, checkpoint_layout(cfg))
        groups: dict[int | None | str, list] = {}
        for e in entries:
            m = mapping.by_megatron.get(e.name)
            if m is None:
                continue  # ShardedObjects (extra state) and tied output copies
            # Embedding first, then layers in order, then final norm and output layer.
            key = "head" if m.layer is None and m.megatron != mapping.maps[0].megatron else m.layer
            groups.setdefault(key, []).append(e)
        plan = [
            (h, mapping.hf_shapes[h], mapping.hf_dtype(h, dtype))
            for m in mapping.maps
            for h in m.hf
        ]
        writer = ShardedSafetensorsWriter(tmp, plan, max_shard_size)
        bar = _Progress(len(plan), "megatron-to-hf", progress)
        try:
            for group in groups.values():
                fulls = read_tensors(src, group)
                for m in mapping.maps:
                    if m.megatron in fulls:
                        full = fulls.pop(m.megatron)
                        if m.megatron in VOCAB_TENSORS:
                            full = full[: cfg.vocab_size]
                        for name, tensor in mapping.to_hf(m.megatron, full):
                            writer.write(name, tensor)
                            bar.update()
            writer.close()
        except BaseException:
            writer.abort()
            raise
        finally:
            bar.close()
        (tmp / "config.json").write_text(json.dumps(hf_config_from_model_config(cfg), indent=2))
    return cfg


# -- command line ----------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="megatron-gspo convert",
        description=(
            "Convert checkpoints between Hugging Face (Qwen3, Qwen3-MoE, DeepSeek-V3) and "
            "Megatron-Core."
        ),
    )
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("hf-to-megatron", help="HF safetensors -> Megatron distributed checkpoint")
    a.add_argument("src", type=Path, help="HF model directory (config.json + safetensors)")
    a.add_argument("dst", type=Path, help="output directory (must not exist)")
    for flag, what in (("--tp", "tensor"), ("--pp", "pipeline"), ("--ep", "expert")):
        a.add_argument(flag, type=int, default=1, help=f"{what}-parallel size to validate for")
    b = sub.add_parser("megatron-to-hf", help="Megatron distributed checkpoint -> HF safetensors")
    b.add_argument("src", type=Path, help="Megatron checkpoint directory")
    b.add_argument("dst", type=Path, help="output directory (must not exist)")
    b.add_argument("--tokenizer-from", type=Path, help="directory to copy tokenizer files from")
    b.add_argument(
        "--model-config", type=Path, help=f"recipe or {MODEL_CONFIG_FILE} if src has none"
    )
    b.add_argument("--max-shard-size", default="5GB", help="e.g. 5GB, 500MB (default 5GB)")
    for q in (a, b):
        q.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``megatron-gspo convert`` and ``tools/convert.py``; returns the exit code."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        if args.command == "hf-to-megatron":
            hf_to_megatron(
                args.src,
                args.dst,
                tp=args.tp,
                pp=args.pp,
                ep=args.ep,
                progress=not args.no_progress,
            )
        else:
            megatron_to_hf(
                args.src,
                args.dst,
                tokenizer_from=args.tokenizer_from,
                model_config=args.model_config,
                max_shard_size=parse_size(args.max_shard_size),
                progress=not args.no_progress,
            )
    except UserError as e:  # the command line's boundary: one line, no traceback
        from megatron_gspo.runtime.errors import debug_enabled

        if debug_enabled():
            traceback.print_exception(e)
        print(f"Error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.dst}", file=sys.stderr)
    return 0
