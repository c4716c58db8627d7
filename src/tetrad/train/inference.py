"""The model `tetrad generate` samples: on a device, in a dtype, whole or split over tensor-parallel
ranks; and the two collectives tensor-parallel decoding adds to the model's own.

The model is built on the meta device (no memory) in its dtype, then given memory on the device,
and each parameter is filled with this rank's shard of one logical tensor at a time, read from the
checkpoint or HF folder and converted on the copy: the host holds one tensor at a time, never
an fp32 model. A tp rank reads only its rows or columns of each tensor (`stored_weights`: the
slice an HF folder's safetensors file holds, or the chunks of a tetrad checkpoint that overlap it;
DCP reads a stored chunk whole, so a checkpoint saved at tp 1 is read whole and narrowed). Under
tp each rank holds its heads (their share of the KV cache too), its slice of the MLP and
of the vocabulary: its logits are its slice, gathered whole on every rank (`full_logits`); every
rank then draws from the same logits, and takes tp rank 0's token (`agreed_token`), so that all
feed the same one, however their draws might differ (a kernel that rounds otherwise on one GPU).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from tetrad.config import ModelConfig
from tetrad.dist.topology import Topology
from tetrad.model.llama import Transformer
from tetrad.model.sharding import set_spec, spec_of
from tetrad.train.checkpoint import CheckpointError, SafeReader
from tetrad.train.checkpoint.store import one_process
from tetrad.train.convert import checkpoint_folder
from tetrad.train.hf_architectures import fused_rows, hf_name, model_config_from_hf
from tetrad.train.init_from import HF_CONFIG, hf_config, is_hf_folder

Box = tuple[slice, ...]  # one slice per dimension of a logical tensor


def inference_model(model_cfg: ModelConfig, weights: Callable[[str], torch.Tensor], topo: Topology,
                    dtype: torch.dtype = torch.float32) -> Transformer:
    """This rank's model (topo's tp shard) in `dtype` on topo.device, its parameters read one by
    one through `weights(name)`: the logical tensor (on the CPU, in any dtype), or a handle to it
    (`stored_weights`') with its `shape`, of which `handle[box]` reads that part alone."""
    with torch.device("meta"):
        model = Transformer(model_cfg, topo)
    specs = {name: spec_of(p) for name, p in model.named_parameters()}
    model.to(dtype)
    model.to_empty(device=topo.device)  # makes new Parameter objects: re-attach their specs
    with torch.no_grad():
        for name, p in model.named_parameters():
            set_spec(p, *specs[name])
            p.copy_(_local_part(name, p, weights(name)))
    return model.eval()


def _local_part(name: str, param: torch.Tensor, stored) -> torch.Tensor:
    """This rank's shard of `stored` (a logical tensor or a handle), reading that part alone; the
    vocabulary's padding rows zero."""
    spec, index, _ = spec_of(param)
    if tuple(stored.shape) != tuple(spec.full_shape):
        raise ValueError(f"the starting weights' {name} is {tuple(stored.shape)}, the model's {spec.full_shape}")
    box = [slice(0, size) for size in spec.full_shape]
    if spec.shard_dim is None:
        return stored[tuple(box)]
    dim, local = spec.shard_dim, param.shape[spec.shard_dim]
    start = min(index * local, spec.full_shape[dim])
    box[dim] = slice(start, min(start + local, spec.full_shape[dim]))
    part = stored[tuple(box)]
    if part.shape[dim] < local:  # the padded vocabulary's last rows
        pad = list(part.shape)
        pad[dim] = local - part.shape[dim]
        part = torch.cat([part, part.new_zeros(pad)], dim=dim)
    return part


def stored_weights(path: Path) -> Callable[[str], SafetensorsPart | CheckpointPart]:
    """name -> a handle to that parameter's logical tensor in a tetrad checkpoint or an HF folder
    at `path` (init_from.initial_weights' tensors, read by the part a rank keeps)."""
    if not is_hf_folder(path):
        found = checkpoint_folder(path)
        stored = SafeReader(found).read_metadata().state_dict_metadata

        def in_checkpoint(name: str) -> CheckpointPart:
            if f"model.{name}" not in stored:
                raise CheckpointError(f"{found} has no model.{name}")
            meta = stored[f"model.{name}"]
            return CheckpointPart(found, f"model.{name}", tuple(meta.size), meta.properties.dtype)
        return in_checkpoint
    hf = hf_config(path)
    model_type = hf.get("model_type", "")
    rows = fused_rows(ModelConfig(**model_config_from_hf(hf, path / HF_CONFIG)), model_type)
    files = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            files.update({key: (file, tuple(f.get_slice(key).get_shape())) for key in f.keys()})

    def in_folder(name: str) -> SafetensorsPart:
        key, start, stop = rows.get(name, (hf_name(name, model_type), 0, None))  # a fused one's part: its rows
        if key not in files:
            raise CheckpointError(f"{path} has no {key}, which model.{name} needs")
        file, shape = files[key]
        return SafetensorsPart(file, key, start, (shape[0] if stop is None else stop) - start, shape[1:])
    return in_folder


@dataclass(frozen=True)
class SafetensorsPart:
    """Rows [start, start + rows) of tensor `key` of a safetensors file (a fused tensor's part, or
    all of it), read by the box indexed (safetensors reads that slice alone)."""
    file: Path
    key: str
    start: int
    rows: int
    rest: tuple[int, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.rows, *self.rest)

    def __getitem__(self, box: Box) -> torch.Tensor:
        first = slice(self.start + box[0].start, self.start + box[0].stop)
        with safe_open(self.file, "pt") as f:
            return f.get_slice(self.key)[(first, *box[1:])]


@dataclass(frozen=True)
class CheckpointPart:
    """Tensor `key` of the tetrad checkpoint (DCP) at `folder`, read by the box indexed: DCP reads
    the stored chunks that overlap it, each whole (a torch.save record), and copies their overlap."""
    folder: Path
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    def __getitem__(self, box: Box) -> torch.Tensor:
        offsets, sizes = [b.start for b in box], [b.stop - b.start for b in box]
        part = torch.empty(sizes, dtype=self.dtype)
        with one_process():
            dcp.load({self.key: part}, storage_reader=SafeReader(self.folder),
                     planner=_BoxPlanner(self.key, ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))),
                     no_dist=True)
        return part


class _BoxPlanner(DefaultLoadPlanner):
    """Loads one box (`chunk`: offsets and sizes in the logical tensor) of tensor `key` into the
    state's tensor of the box's shape, where the default planner loads the whole tensor."""

    def __init__(self, key: str, chunk: ChunkStorageMetadata):
        super().__init__()
        self.key, self.chunk = key, chunk

    def create_local_plan(self) -> LoadPlan:
        stored = self.metadata.state_dict_metadata[self.key]
        return LoadPlan(create_read_items_for_chunk_list(self.key, stored, [self.chunk]))

    def lookup_tensor(self, index) -> torch.Tensor:
        return self.state_dict[index.fqn]  # the box itself, not a shard of it found by offset


def full_logits(model: Transformer, local: torch.Tensor) -> torch.Tensor:
    """The logits [vocab_size] of the whole vocabulary, fp32, from this rank's slice of the padded
    vocabulary (the model's output); gathered over tp, so the same on every rank."""
    local, topo = local.float(), model.topo
    if topo.tp_size == 1:
        return local[:model.cfg.vocab_size]
    gathered = local.new_empty(topo.tp_size * local.shape[0])
    topo.comm.all_gather(gathered, local.contiguous(), "tp")
    return gathered[:model.cfg.vocab_size]


def agreed_token(token: int, topo: Topology) -> int:
    """Tensor-parallel rank 0's `token`, on every rank of its tp group."""
    if topo.tp_size == 1:
        return token
    sent = torch.tensor([token], device=topo.device)
    topo.comm.broadcast(sent, 0, "tp")
    return int(sent)


def agreed_line(line: str | None, topo: Topology) -> str:
    """Tensor-parallel rank 0's `line` (a conversation's next user message, read there alone: the
    other ranks pass None), on every rank of its tp group: its length, then its UTF-8 bytes."""
    if topo.tp_size == 1:
        return line
    data = line.encode() if topo.tp_rank == 0 else b""
    size = torch.tensor([len(data)], device=topo.device)
    topo.comm.broadcast(size, 0, "tp")
    if not int(size):
        return ""
    sent = torch.tensor(list(data), dtype=torch.uint8, device=topo.device) if topo.tp_rank == 0 else \
        torch.empty(int(size), dtype=torch.uint8, device=topo.device)
    topo.comm.broadcast(sent, 0, "tp")
    return bytes(sent.cpu().tolist()).decode()
