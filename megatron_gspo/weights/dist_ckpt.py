"""Write and read Megatron-Core distributed checkpoints tensor by tensor.

Why not build the model and call ``dist_checkpointing.save(model.sharded_state_dict())``: that
holds the whole model in memory, and Megatron's writer then stages every tensor again before
writing (and starts writer processes). A conversion only needs to know *what* Megatron would
save, not to hold it. So:

* **Layout.** We build our ``GPTModel`` in the single-rank layout on the ``meta`` device (no
  memory) and take its ``sharded_state_dict()`` with factories applied: that is exactly the
  list of checkpoint keys, global shapes, chunk offsets and ``ShardedObject``\\ s that Megatron
  itself writes and expects, including the per-layer and per-expert axes and the gate/up split
  of ``linear_fc1``. Because a global shape does not depend on the parallel layout, a model
  built with any TP/PP/EP loads the result; Megatron's loader (torch DCP) reshards on read.
* **Writing.** The checkpoint is written with torch.distributed.checkpoint's own
  ``FileSystemWriter`` (one thread, so items are written in plan order and the serial loader
  asks for their data one at a time) and a save planner whose ``resolve_data`` produces each
  chunk on demand from a callback. Peak memory is about one full tensor plus one chunk. Next to
  it go the files Megatron's loader reads first: ``metadata.json`` (backend ``torch_dist``)
  and ``common.pt`` (no common state for a model).
* **Reading.** ``dist_checkpointing.load`` with the same layout entries, restricted to a group
  of tensors (one layer at a time), so a checkpoint saved by training in any layout converts
  back with memory of one layer.

Both directions need Megatron's parallel state in the single-rank layout; :func:`single_rank`
sets up a world of one when nothing is initialized.

The embedding and output layer are saved with the vocabulary rows of the layout that saved them
(Megatron pads the vocabulary to a multiple of TP): :func:`with_saved_vocab` reads them as
saved, and :func:`load_model_weights` loads a checkpoint into a model of any layout.
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factories
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from megatron_gspo.config import ModelConfig, ParallelConfig
from megatron_gspo.runtime.errors import InputError
from megatron_gspo.weights.shards import VOCAB_TENSORS

__all__ = [
    "CheckpointEntry",
    "checkpoint_layout",
    "load_model_weights",
    "read_tensors",
    "single_rank",
    "with_saved_vocab",
    "write_checkpoint",
]


# What Megatron's loader reads to pick its strategy, and the file with non-sharded state.
_BACKEND = ("torch_dist", 1)
COMMON_FILE = "common.pt"


@dataclass(frozen=True)
class CheckpointEntry:
    """One item Megatron saves for a full (single-rank) parameter."""

    # Full Megatron parameter name (what HFMapping speaks), or the module path of an object.
    name: str
    item: ShardedTensor | ShardedObject

    def region(self, full: torch.Tensor) -> torch.Tensor:
        """This chunk of the full parameter (a view), in the chunk's local shape.

        In the single-rank layout a chunk's offset inside the parameter is its global offset
        without the prepended (layer, expert) axes; only the gate/up halves of ``linear_fc1``
        are proper sub-ranges.
        """
        st = self.item
        assert isinstance(st, ShardedTensor)
        out = full
        offsets = st.global_offset[st.prepend_axis_num :]
        for dim, (off, size) in enumerate(zip(offsets, st.local_shape, strict=True)):
            if off or size != out.shape[dim]:
                out = out.narrow(dim, off, size)
        return out

    @property
    def param_shape(self) -> tuple[int, ...]:
        """The full parameter's shape: the global shape without the prepended axes."""
        st = self.item
        assert isinstance(st, ShardedTensor)
        return tuple(st.global_shape[st.prepend_axis_num :])


def single_rank() -> None:
    """Megatron parallel state for a world of one (TP=PP=EP=1), set up if absent.

    Goes through :func:`init_parallel` (which also switches on the CPU platform layer on a
    machine without CUDA). Refuses a process already initialized with another layout: the
    layout must be the single-rank one for chunk offsets to be parameter offsets.
    """
    if not parallel_state.model_parallel_is_initialized():
        from megatron_gspo.parallel import init_parallel

        init_parallel(ParallelConfig())
    sizes = (
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_world_size(),
        parallel_state.get_expert_model_parallel_world_size(),
        dist.get_world_size(),
    )
    if sizes != (1, 1, 1, 1):
        raise RuntimeError(
            f"checkpoint conversion runs on a single rank; this process has TP/PP/EP/world "
            f"sizes {sizes}"
        )


def checkpoint_layout(cfg: ModelConfig) -> list[CheckpointEntry]:
    """What Megatron saves for ``cfg``, from a single-rank model on the meta device."""
    from megatron_gspo.model import build_model

    single_rank()
    with torch.device("meta"):
        model = build_model(cfg, ParallelConfig(), use_te=False)
    sharded = model.sharded_state_dict()
    apply_factories(sharded)
    entries = []
    for name, value in sharded.items():
        items = value if isinstance(value, list) else [value]
        for item in items:
            if not isinstance(item, ShardedTensor | ShardedObject):
                raise TypeError(f"unexpected sharded state dict entry {name!r}: {type(item)}")
            entries.append(CheckpointEntry(name, item))
    return entries


def _write_item(entry: CheckpointEntry) -> WriteItem:
    item = entry.item
    if isinstance(item, ShardedObject):
        return WriteItem(index=MetadataIndex(item.unique_key), type=WriteItemType.BYTE_IO)
    shape = (1,) * item.prepend_axis_num + tuple(item.local_shape)
    return WriteItem(
        index=MetadataIndex(item.key, torch.Size(item.global_offset)),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(
                offsets=torch.Size(item.global_offset), sizes=torch.Size(shape)
            ),
            properties=TensorProperties(dtype=item.dtype),
            size=torch.Size(item.global_shape),
        ),
    )


class _StreamingSavePlanner(DefaultSavePlanner):
    """A save plan made from checkpoint entries; each chunk's data is produced when written."""

    def __init__(
        self, entries: list[CheckpointEntry], produce: Callable[[str], torch.Tensor]
    ) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._entries = entries
        self._produce = produce
        self._by_index: dict[MetadataIndex, CheckpointEntry] = {}
        self._cached: tuple[str, torch.Tensor] | None = None

    def create_local_plan(self) -> SavePlan:
        items = []
        for entry in self._entries:
            wi = _write_item(entry)
            self._by_index[wi.index] = entry
            items.append(wi)
        self.plan = SavePlan(items)
        return self.plan

    def _full(self, name: str) -> torch.Tensor:
        # Consecutive chunks of one parameter (gate and up of linear_fc1) share one production.
        if self._cached is None or self._cached[0] != name:
            self._cached = None
            self._cached = (name, self._produce(name))
        return self._cached[1]

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        entry = self._by_index[write_item.index]
        if isinstance(entry.item, ShardedObject):
            # Megatron stores the list of the objects' data under their unique key.
            buf = io.BytesIO()
            torch.save([entry.item.data], buf)
            buf.seek(0)
            return buf
        # The checkpoint stores chunks with the prepended axes as leading 1-dims.
        chunk = entry.region(self._full(entry.name))
        chunk = chunk.reshape((1,) * entry.item.prepend_axis_num + tuple(chunk.shape))
        if chunk.dtype != entry.item.dtype:
            raise InputError(
                f"{entry.name}: tensor dtype {chunk.dtype} does not match the model's "
                f"{entry.item.dtype}"
            )
        return chunk.contiguous()


def write_checkpoint(
    directory: str | Path,
    entries: list[CheckpointEntry],
    produce: Callable[[str], torch.Tensor],
) -> None:
    """Write a Megatron ``torch_dist`` checkpoint into the (existing, empty) ``directory``.

    ``produce(name)`` returns the full tensor of a Megatron parameter; it is called about once
    per parameter, in model order.
    """
    directory = Path(directory)
    writer = dcp.FileSystemWriter(directory, single_file_per_rank=True, thread_count=1)
    dcp.save(
        {}, storage_writer=writer, planner=_StreamingSavePlanner(entries, produce), no_dist=True
    )
    torch.save({}, directory / COMMON_FILE)
    save_config(CheckpointingConfig(*_BACKEND), str(directory))


def read_tensors(
    directory: str | Path, entries: Iterable[CheckpointEntry], dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """Full tensors of the parameters named by ``entries`` (Megatron's loader, any saved layout).

    Pass the entries of a few parameters at a time (a layer) to bound memory.
    """
    sharded: dict[str, ShardedTensor] = {}
    fulls: dict[str, torch.Tensor] = {}
    for n, entry in enumerate(entries):
        st = entry.item
        if not isinstance(st, ShardedTensor):
            continue
        if entry.name not in fulls:
            fulls[entry.name] = torch.empty(entry.param_shape, dtype=dtype or st.dtype)
        # The loader copies into the given tensors in place: each chunk is a view of the full.
        # The prepended axes become real leading 1-dims: Megatron's path for prepended axes
        # (torch's legacy ShardedTensor) assumes a rank holds the whole grid of a tensor, which
        # a one-layer subset on a single rank is not; plain N-D chunks go through DCP as is.
        p = st.prepend_axis_num
        view = entry.region(fulls[entry.name])
        sharded[f"{entry.name}#{n}"] = dataclasses.replace(
            st,
            data=view.reshape((1,) * p + tuple(view.shape)),
            local_shape=(1,) * p + tuple(st.local_shape),
            prepend_axis_num=0,
            replica_id=0,
        )
    # A subset of the tensors does not cover each global tensor: skip the coverage check.
    dist_checkpointing.load(sharded, str(directory), validate_access_integrity=False)
    return fulls


def _saved_shapes(directory: str | Path) -> dict[str, tuple[int, ...]]:
    meta = dist_checkpointing.load_tensors_metadata(str(directory))
    return {k: tuple(v.global_shape) for k, v in meta.items() if isinstance(v, ShardedTensor)}


def with_saved_vocab(
    directory: str | Path, entries: list[CheckpointEntry]
) -> list[CheckpointEntry]:
    """``entries`` (of the single-rank layout) with the vocabulary rows the checkpoint in
    ``directory`` was saved with."""
    saved = _saved_shapes(directory)
    out = []
    for e in entries:
        st = e.item
        if e.name in VOCAB_TENSORS and isinstance(st, ShardedTensor) and st.key in saved:
            shape = saved[st.key]
            if shape != tuple(st.global_shape):
                e = dataclasses.replace(
                    e, item=dataclasses.replace(st, global_shape=shape, local_shape=shape)
                )
        out.append(e)
    return out


def load_model_weights(model: torch.nn.Module, directory: str | Path) -> None:
    """Load a checkpoint's model weights (saved in any layout) into this rank's ``model``.

    Megatron's loader reshards everything but a vocabulary padded to another size; then the
    vocabulary tensors are read whole (by every rank, since the loader is collective), cut to
    the tokenizer's rows and sliced into this rank's shard.
    """
    saved = _saved_shapes(directory)
    # Decided alike on every rank (stages without a vocabulary tensor included).
    repad = any(saved[k][0] != model.vocab_size for k in VOCAB_TENSORS if k in saved)
    sharded = model.sharded_state_dict()
    vocab = {}
    if repad:
        vocab = {
            key: sharded.pop(key)
            for key, st in list(sharded.items())
            if isinstance(st, ShardedTensor) and st.key in VOCAB_TENSORS
        }
    state = dist_checkpointing.load(sharded, str(directory))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if set(missing) - set(vocab) or unexpected:
        raise KeyError(f"{directory}: missing {missing}, unexpected {unexpected}")
    if repad:
        _load_vocab(model, directory, saved, vocab)


def _load_vocab(model, directory, saved, vocab: dict[str, ShardedTensor]) -> None:
    from megatron_gspo.weights.shards import shard_infos, slice_full, weight_tensors

    wholes = {
        k: torch.empty(saved[k], dtype=model.config.params_dtype)
        for k in VOCAB_TENSORS
        if k in saved
    }
    request = {k: ShardedTensor.from_rank_offsets(k, t, replica_id=0) for k, t in wholes.items()}
    dist_checkpointing.load(request, str(directory), validate_access_integrity=False)
    infos, weights = shard_infos(model), weight_tensors(model)
    with torch.no_grad():
        for key, st in vocab.items():
            whole = wholes[st.key][: model.vocab_size_unpadded]
            weights[key].copy_(slice_full(whole, infos[key]))
