"""Sharded checkpoints through torch.distributed.checkpoint (DCP), stored in the LOGICAL parameter space.

Every parameter, and its optimizer state, is saved as a DTensor over this rank's ("dp", "cp", "tp")
mesh whose global shape is the logical, unpadded tensor (`ParamSpec.full_shape`). DCP writes each
slice once (replicas are deduplicated) and on load reads whichever slices the new layout needs, so
a checkpoint written under one dp/tp/pp/cp layout loads under any other, or into one process.
Every rank writes its own shard; no rank gathers the model.

On disk (ROOT = checkpoint.dir, default RUN_DIR/checkpoints):

    ROOT/latest               the name of the newest complete checkpoint, replaced atomically
    ROOT/step_00000010/       DCP files (.metadata, *.distcp), config.toml and tetrad.json
    ROOT/step_00000012.partial/   a save in progress (or one that crashed): never loaded

A save writes into `.partial`, and only once every rank has finished does rank 0 write
`tetrad.json` (step, model shape, size and SHA-256 of every file), rename the folder and then
update `latest`; a crash anywhere before that leaves the previous checkpoint as `latest`.
Loading checks the file list, sizes and hashes, the model shape, and every tensor's shape before
reading, and never unpickles anything but DCP's own metadata classes (tensors load weights-only).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import math
import os
import pickle
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.tensor import DTensor, Replicate, Shard

from tetrad.model.sharding import ParamSpec, spec_of

FORMAT = 1
MANIFEST = "tetrad.json"
LATEST = "latest"
# Keys of [model] that decide tensor shapes; the others (dropout, ...) may change on resume.
SHAPE_KEYS = ("n_layers", "d_model", "n_heads", "n_kv_heads", "ffn_hidden", "vocab_size", "norm", "mlp", "pos",
              "tie_embeddings")
MESH_DIMS = ("dp", "cp", "tp")  # a parameter is replicated or split over these; pp stages hold different names


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded; the message names the file and what differs."""


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def latest_checkpoint(root: Path) -> Path | None:
    """The checkpoint `ROOT/latest` names, or None when there is none yet."""
    pointer = Path(root) / LATEST
    if not pointer.exists():
        return None
    path = Path(root) / pointer.read_text().strip()
    if not (path / MANIFEST).exists():
        raise CheckpointError(f"{pointer} names {path.name}, which is not a complete checkpoint "
                              f"(no {MANIFEST}); remove {pointer} or point it at a complete step_* folder")
    return path


def resolve(path: str | Path) -> Path:
    """A checkpoint folder, given it or a checkpoint root holding `latest`."""
    path = Path(path)
    if (path / MANIFEST).exists():
        return path
    found = latest_checkpoint(path) if path.is_dir() else None
    if found is None:
        raise CheckpointError(f"{path} is not a tetrad checkpoint: no {path / MANIFEST}"
                              + (" (an interrupted save?)" if path.name.endswith(".partial") else ""))
    return found


# ---------------------------------------------------------------------------------------- what is stored
def _mesh_of(topo):
    return topo.mesh[MESH_DIMS] if topo.mesh is not None else None


def _logical_local(t: torch.Tensor, spec: ParamSpec, index: int) -> torch.Tensor:
    """This rank's slice of the logical tensor: the local shard without its vocabulary padding."""
    if spec.shard_dim is None:
        return t
    size = t.shape[spec.shard_dim]
    keep = max(0, min(size, spec.full_shape[spec.shard_dim] - index * size))
    return t.narrow(spec.shard_dim, 0, keep)


def _as_logical(t: torch.Tensor, param: torch.Tensor, mesh) -> torch.Tensor:
    """`t` (shaped like the local parameter) as a DTensor of the logical tensor, or itself unsharded."""
    spec, index, parts = spec_of(param)
    local = _logical_local(t.detach(), spec, index)
    if mesh is None:
        if parts > 1:
            raise CheckpointError("a sharded parameter needs the process group's mesh to be saved")
        return local
    if parts > 1 and param.shape[spec.shard_dim] != math.ceil(spec.full_shape[spec.shard_dim] / parts):
        raise CheckpointError(f"shard of {tuple(param.shape)} does not follow torch.chunk's split of "
                              f"{spec.full_shape} into {parts}; DTensor offsets would be wrong")
    placements = [Shard(spec.shard_dim) if parts > 1 and dim == spec.group else Replicate() for dim in MESH_DIMS]
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(spec.full_shape),
                              stride=torch.empty(spec.full_shape, device="meta").stride())


def optimizer_state(optimizer, params: dict[str, torch.nn.Parameter]) -> dict[str, dict[str, torch.Tensor]]:
    """name -> {state key -> tensor}: tensors shaped like the local parameter, or scalars (Adam's step).

    A sharded optimizer (ZeRO) provides the same through `logical_state(params)` and
    `load_logical_state(params, state)`, so the stored form does not depend on its sharding.
    """
    if hasattr(optimizer, "logical_state"):
        return optimizer.logical_state(params)
    return {name: dict(optimizer.state[p]) for name, p in params.items() if p in optimizer.state}


def load_optimizer_state(optimizer, params, state: dict[str, dict[str, torch.Tensor]]) -> None:
    if hasattr(optimizer, "load_logical_state"):
        optimizer.load_logical_state(params, state)
        return
    for name, p in params.items():
        optimizer.state[p] = state[name]


def _rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    out = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        out["cuda"] = torch.cuda.get_rng_state(device)
    return out


def _state_dict(params, optimizer, topo, with_optimizer: bool) -> dict[str, torch.Tensor]:
    """The flat DCP state: model.NAME, optim.NAME.KEY (logical), rng.rankR.KIND (per rank)."""
    mesh = _mesh_of(topo)
    state = {f"model.{name}": _as_logical(p, p, mesh) for name, p in params.items()}
    if with_optimizer:
        for name, entries in optimizer_state(optimizer, params).items():
            for key, value in entries.items():
                is_like_param = value.shape == params[name].shape
                state[f"optim.{name}.{key}"] = _as_logical(value, params[name], mesh) if is_like_param else value
        for kind, value in _rng_state(topo.device).items():
            state[f"rng.rank{topo.rank}.{kind}"] = value
    return state


# ---------------------------------------------------------------------------------------- integrity
def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _all_gather(obj, world: int) -> list:
    if world == 1:
        return [obj]
    out = [None] * world
    dist.all_gather_object(out, obj)  # small lists of our own strings, within the job
    return out


def _share_of(names: list[str], rank: int, world: int) -> list[str]:
    """The files this rank hashes: the work is split over ranks, so nobody reads the whole checkpoint."""
    return sorted(names)[rank::world]


def digest_files(folder: Path, rank: int, world: int) -> dict[str, dict]:
    names = [p.name for p in folder.iterdir() if p.is_file()]
    mine = {n: {"bytes": (folder / n).stat().st_size, "sha256": _sha256(folder / n)}
            for n in _share_of(names, rank, world)}
    return {k: v for part in _all_gather(mine, world) for k, v in part.items()}


def verify(path: Path, rank: int = 0, world: int = 1) -> dict:
    """Read `tetrad.json` and check every file it lists (size, SHA-256); raise naming the bad files."""
    manifest_path = path / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{manifest_path} cannot be read ({e}): the checkpoint is incomplete or corrupt") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{manifest_path}: format {manifest.get('format')!r}, this tetrad reads {FORMAT}")
    problems = []
    for name in _share_of(list(manifest["files"]), rank, world):
        want, file = manifest["files"][name], path / name
        if not file.exists():
            problems.append(f"{file}: missing")
        elif file.stat().st_size != want["bytes"]:
            problems.append(f"{file}: {file.stat().st_size} bytes, {want['bytes']} when written (truncated?)")
        elif _sha256(file) != want["sha256"]:
            problems.append(f"{file}: SHA-256 differs from the one recorded when written (corrupt)")
    problems = sorted(p for part in _all_gather(problems, world) for p in part)
    if problems:
        raise CheckpointError("checkpoint failed its integrity check:\n  " + "\n  ".join(problems))
    return manifest


def check_model(manifest: dict, model_cfg, path: Path) -> None:
    """Refuse a checkpoint written for another model shape, naming every key that differs."""
    here = dataclasses.asdict(model_cfg)
    diffs = [f"model.{k} = {manifest['model'].get(k)!r} in the checkpoint, {here[k]!r} here"
             for k in SHAPE_KEYS if manifest["model"].get(k) != here[k]]
    if diffs:
        raise CheckpointError(f"{path / MANIFEST} was written for a different model:\n  " + "\n  ".join(diffs))


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's `.metadata` is a pickle; admit only the classes DCP writes there and torch's plain values."""

    ALLOWED = {("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "StorageMeta", "MetadataIndex", "ChunkStorageMetadata", "TensorProperties",
        "TensorStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")} | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch.serialization", "_get_layout"),
        ("torch", "Size"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("collections", "OrderedDict")}

    def find_class(self, module: str, name: str):
        is_dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) not in self.ALLOWED and not is_dtype:
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")
        return super().find_class(module, name)


class SafeReader(FileSystemReader):
    """A FileSystemReader whose metadata is read by the restricted unpickler above."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        path = Path(self._get_metadata_path(kwargs.get("rank")))
        try:
            metadata = _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
        except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ValueError) as e:
            raise CheckpointError(f"{path} cannot be read: {e}") from None
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def check_shapes(metadata: Metadata, state: dict[str, torch.Tensor], path: Path) -> None:
    problems = []
    for key, value in state.items():
        stored = metadata.state_dict_metadata.get(key)
        if stored is None:
            problems.append(f"{key}: not in the checkpoint")
        elif not isinstance(stored, TensorStorageMetadata) or tuple(stored.size) != tuple(value.shape):
            size = tuple(stored.size) if isinstance(stored, TensorStorageMetadata) else "not a tensor"
            problems.append(f"{key}: {size} in the checkpoint, {tuple(value.shape)} here")
    if problems:
        raise CheckpointError(f"{path / '.metadata'} does not match this model:\n  " + "\n  ".join(problems[:20]))


# ---------------------------------------------------------------------------------------- save / load
class Checkpointer:
    """Saves and restores (model, optimizer, RNG, step) of one rank; every method is collective."""

    def __init__(self, cfg, topo, root: Path):
        self.cfg, self.topo, self.root = cfg, topo, Path(root)
        self.world = dist.get_world_size() if topo.distributed else 1

    @classmethod
    def for_run(cls, cfg, topo, run_dir: Path) -> "Checkpointer":
        return cls(cfg, topo, Path(cfg.checkpoint.dir or Path(run_dir) / "checkpoints"))

    def resume(self, params: dict[str, torch.nn.Parameter], optimizer, metrics: Path) -> int:
        """Apply `checkpoint.resume`; return the step to continue from (0: a fresh start). Rank 0
        drops the metrics lines of steps after it, so a resumed run reads as never interrupted."""
        resume = self.cfg.checkpoint.resume
        path = None if resume == "never" else latest_checkpoint(self.root) if resume == "auto" else resolve(resume)
        if path is None:
            return 0
        step = self.load(path, params, optimizer)
        if self.topo.rank == 0 and metrics.exists():
            kept = [line for line in metrics.read_text().splitlines() if line and json.loads(line)["step"] <= step]
            _replace_text(metrics, "".join(line + "\n" for line in kept))
        return step

    def maybe_save(self, step: int, params: dict[str, torch.nn.Parameter], optimizer) -> None:
        """Save every `checkpoint.every` steps, and at the last step (every = 0: never)."""
        every = self.cfg.checkpoint.every
        if every and (step % every == 0 or step == self.cfg.train.steps):
            self.save(step, params, optimizer)

    def _barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def save(self, step: int, params: dict[str, torch.nn.Parameter], optimizer) -> Path:
        """Write checkpoint `step`; it becomes visible, and `latest`, only once every rank is done."""
        final = step_dir(self.root, step)
        if (final / MANIFEST).exists():  # a resumed run reaching a step it already saved: same content
            return final
        tmp = final.with_name(final.name + ".partial")
        if self.topo.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # left by a save that crashed
            tmp.mkdir(parents=True)
        self._barrier()
        dcp.save(_state_dict(params, optimizer, self.topo, True), storage_writer=FileSystemWriter(tmp),
                 no_dist=not self.topo.distributed)
        files = digest_files(tmp, self.topo.rank, self.world)
        if self.topo.rank == 0:
            publish(tmp, final, self.cfg, step, files, optimizer=True, layout=dataclasses.asdict(self.topo.layout))
            _replace_text(self.root / LATEST, final.name + "\n")
            self._prune()
        self._barrier()
        return final

    def _prune(self) -> None:
        """Keep the newest `checkpoint.keep` complete checkpoints; drop crashed partial saves."""
        complete = sorted(p for p in self.root.glob("step_*") if (p / MANIFEST).exists())
        for old in complete[:-self.cfg.checkpoint.keep] + list(self.root.glob("step_*.partial")):
            shutil.rmtree(old, ignore_errors=True)

    def load(self, path: Path, params: dict[str, torch.nn.Parameter], optimizer) -> int:
        """Restore from `path` (written under any layout) and return its step. A weights-only
        checkpoint (from `tetrad convert`) restores the parameters; the optimizer then starts fresh."""
        path = resolve(path)
        manifest = verify(path, self.topo.rank, self.world)
        check_model(manifest, self.cfg.model, path)
        reader = SafeReader(path)
        metadata = reader.read_metadata()
        bases, state = self._templates(params, metadata)
        check_shapes(metadata, state, path)
        dcp.load(state, storage_reader=reader, no_dist=not self.topo.distributed)
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(bases[f"model.{name}"])
        restored: dict[str, dict[str, torch.Tensor]] = {}
        for key, value in bases.items():
            if key.startswith("optim."):
                name, entry = key[len("optim."):].rsplit(".", 1)
                restored.setdefault(name, {})[entry] = value
        if restored:
            load_optimizer_state(optimizer, params, restored)
        for kind, value in bases.items():
            if kind == f"rng.rank{self.topo.rank}.cpu":
                torch.set_rng_state(value)
            elif kind == f"rng.rank{self.topo.rank}.cuda":
                torch.cuda.set_rng_state(value, self.topo.device)
        self._barrier()
        return manifest["step"]

    def _templates(self, params, metadata: Metadata) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(key -> local tensor to restore, key -> what DCP loads into it): the model, and whatever
        optimizer state and this rank's RNG state the checkpoint holds, for this rank's parameters."""
        mesh = _mesh_of(self.topo)
        bases, state = {}, {}
        for name, p in params.items():
            bases[f"model.{name}"] = torch.zeros_like(p.detach())
        for key, meta in metadata.state_dict_metadata.items():
            if not isinstance(meta, TensorStorageMetadata):
                continue
            if key.startswith("optim."):
                name = key[len("optim."):].rsplit(".", 1)[0]
                if name in params and tuple(meta.size) == spec_of(params[name])[0].full_shape:
                    bases[key] = torch.zeros_like(params[name].detach(), dtype=meta.properties.dtype)
                elif name in params:
                    bases[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
            elif key.startswith(f"rng.rank{self.topo.rank}."):
                bases[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, base in bases.items():
            name = key[len("model."):] if key.startswith("model.") else key[len("optim."):].rsplit(".", 1)[0]
            is_like_param = name in params and base.shape == params[name].shape
            state[key] = _as_logical(base, params[name], mesh) if is_like_param else base
        return bases, state


def publish(tmp: Path, final: Path, cfg, step: int, files: dict, optimizer: bool, layout: dict) -> None:
    """Make the fully written folder `tmp` the checkpoint `final`: `config.toml`, then
    `tetrad.json` (its presence marks a complete checkpoint), then the rename."""
    (tmp / "config.toml").write_text(cfg.to_toml())
    manifest = {"format": FORMAT, "step": step, "model": dataclasses.asdict(cfg.model), "layout": layout,
                "optimizer": optimizer, "files": files}
    with open(tmp / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, final)


def _replace_text(path: Path, text: str) -> None:
    """Write `path` atomically: a reader sees the old content or the new, never a torn file."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
