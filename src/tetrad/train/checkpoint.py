"""Sharded checkpoints through torch.distributed.checkpoint (DCP), stored in the LOGICAL parameter space.

Every key holds a logical tensor: `model.NAME` the unsharded, unpadded parameter
(`ParamSpec.full_shape`), `optim.NAME.KEY` its optimizer state of the same shape (AdamW's moments)
or a scalar (AdamW's step). A rank contributes the boxes of those tensors it holds: its tp shard
of a parameter, cut to the unpadded vocabulary, or under ZeRO only the slice of the flattened
parameter its dp x cp shard owns (a contiguous range, which is a few boxes). DCP writes each box
once (replicas are deduplicated) and on load reads whichever parts the new layout needs, so a
checkpoint written under one dp/tp/pp/cp/zero layout loads under any other, or into one
process. Every rank writes its own part; no rank gathers the model.

Also stored: `rng.rankR.KIND` (each rank's RNG state; a rank that did not exist when saved keeps
its seeded state), `extra.NAME.KEY` (the state of objects handed to save/load as `stateful`, e.g.
the loss scaler), `local.rankR.NAME.KEY` (state of objects handed as `local`, which only rank R
holds and which means something only in the same layout: gradient codecs' error feedback,
tp-shared dropout generators; restored when the [parallel] section is the saved one, a codec's
bucket by bucket where it holds the same parameters, else they start afresh), the resolved
config (config.toml) and the step (tetrad.json). The scheduler and the data position need
nothing more: the learning rate is a function of the step (optim.lr_at)
and each step's batch a function of (seed, step) (batches.Batches).

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
import torch.nn as nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper

from tetrad.model.sharding import spec_of
from tetrad.parallel.data import ShardedAdamW, zero_loaded, zero_pieces

FORMAT = 1
MANIFEST = "tetrad.json"
LATEST = "latest"
# Keys of [model] that decide tensor shapes; the others (dropout, ...) may change on resume.
SHAPE_KEYS = ("n_layers", "d_model", "n_heads", "n_kv_heads", "ffn_hidden", "vocab_size", "norm", "mlp", "pos",
              "tie_embeddings")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded; the message names the file and what differs."""


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def _step_of(path: Path) -> int:
    """The step a checkpoint folder holds, from its name (step_00000010 -> 10)."""
    return int(path.name.removeprefix("step_"))


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
@dataclasses.dataclass
class Piece:
    """Elements [start, end) of a local parameter, flattened: `values` holds them (the parameter
    itself, or the ZeRO shard's slice of it) and the optimizer keeps their state under `values`."""

    name: str
    param: nn.Parameter
    start: int
    end: int
    values: torch.Tensor


def pieces(params: dict[str, nn.Parameter], optimizer) -> list[Piece]:
    """What this rank holds and updates: whole local parameters, or under ZeRO its shard's slices."""
    if isinstance(optimizer, ShardedAdamW):
        names = {id(p): name for name, p in params.items()}
        return [Piece(names[id(p)], p, start, end, values) for p, start, end, values in zero_pieces(optimizer)]
    return [Piece(name, p, 0, p.numel(), p) for name, p in params.items()]


def _flat_boxes(shape: tuple[int, ...], start: int, end: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Elements [start, end) of a row-major tensor of `shape` as (offsets, sizes) boxes, each of
    them contiguous in memory (leading ones, then a run, then whole trailing dimensions)."""
    if start >= end:
        return []
    if len(shape) <= 1:
        return [((start,), (end - start,))] if shape else [((), ())]
    inner = math.prod(shape[1:])
    first, last = start // inner, (end - 1) // inner
    if first == last:
        return [((first, *o), (1, *s)) for o, s in _flat_boxes(shape[1:], start - first * inner, end - first * inner)]
    head = (first + 1) * inner if start % inner else start  # a partial first row, then whole rows
    whole_end = end // inner
    out = _flat_boxes(shape, start, head) if head > start else []
    if whole_end > head // inner:
        out.append(((head // inner, *[0] * (len(shape) - 1)), (whole_end - head // inner, *shape[1:])))
    return out + _flat_boxes(shape, whole_end * inner, end)


def _chunks(piece: Piece, flat: torch.Tensor) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """(offsets in the logical tensor, view of `flat`) for every box of `piece`, whose elements
    `flat` holds: a tp shard's boxes move to its place, vocabulary padding is cut off."""
    spec, index, _ = spec_of(piece.param)
    shape = tuple(piece.param.shape)
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    out = []
    for offsets, sizes in _flat_boxes(shape, piece.start, piece.end):
        at = sum(o * s for o, s in zip(offsets, strides)) - piece.start
        box = flat[at:at + math.prod(sizes)].view(sizes)
        offsets = list(offsets)
        if spec.shard_dim is not None:
            dim = spec.shard_dim
            offsets[dim] += index * shape[dim]
            keep = min(sizes[dim], spec.full_shape[dim] - offsets[dim])
            if keep <= 0:
                continue
            box = box.narrow(dim, 0, keep)
        out.append((tuple(offsets), box))
    return out


def _logical(chunks: list[tuple[tuple[int, ...], torch.Tensor]], full_shape: tuple[int, ...], mesh) -> torch.Tensor:
    """The logical tensor of which this rank holds `chunks`, as DCP saves and loads it: a DTensor
    of the chunks (any boxes; DCP reads and writes them by offset), or the tensor in one process."""
    if mesh is None:
        (offsets, tensor), = chunks
        if tuple(tensor.shape) != tuple(full_shape):
            raise CheckpointError(f"one process holds {tuple(tensor.shape)} of a {full_shape} tensor")
        return tensor
    wrapper = LocalShardsWrapper([t for _, t in chunks], [o for o, _ in chunks])
    stride = [math.prod(full_shape[d + 1:]) for d in range(len(full_shape))]
    return DTensor.from_local(wrapper, mesh, [Replicate()] * mesh.ndim, run_check=False,
                              shape=torch.Size(full_shape), stride=tuple(stride))


def _rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    out = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        out["cuda"] = torch.cuda.get_rng_state(device)
    return out


def _check_optimizer_covered(optimizer, mine: list[Piece]) -> None:
    """Refuse to save an optimizer whose state is keyed by tensors we do not know (it would be lost)."""
    known = {id(p.values) for p in mine}
    if any(id(key) not in known for key in optimizer.state):
        raise CheckpointError(f"{type(optimizer).__name__} keeps state for tensors that are not parameters or "
                              "ZeRO shard slices of them; teach checkpoint.pieces() where its state lives")


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


def check_shapes(metadata: Metadata, expected: dict[str, tuple[int, ...]], path: Path) -> None:
    """Refuse before reading anything when a tensor is missing or its logical shape differs."""
    problems = []
    for key, shape in expected.items():
        stored = metadata.state_dict_metadata.get(key)
        if stored is None:
            problems.append(f"{key}: not in the checkpoint")
        elif not isinstance(stored, TensorStorageMetadata) or tuple(stored.size) != tuple(shape):
            size = tuple(stored.size) if isinstance(stored, TensorStorageMetadata) else "not a tensor"
            problems.append(f"{key}: {size} in the checkpoint, {tuple(shape)} here")
    if problems:
        raise CheckpointError(f"{path / '.metadata'} does not match this model:\n  " + "\n  ".join(problems[:20]))


def optimizer_entries(metadata: Metadata) -> dict[str, dict[str, TensorStorageMetadata]]:
    """Parameter name -> {optimizer state key -> its stored metadata}."""
    out: dict[str, dict[str, TensorStorageMetadata]] = {}
    for key, meta in metadata.state_dict_metadata.items():
        if key.startswith("optim.") and isinstance(meta, TensorStorageMetadata):
            name, entry = key[len("optim."):].rsplit(".", 1)
            out.setdefault(name, {})[entry] = meta
    return out


# ---------------------------------------------------------------------------------------- save / load
class Checkpointer:
    """Saves and restores the model, optimizer, RNG and step of one rank; every method is collective.

    `stateful` (save, load, resume, maybe_save) maps a name to an object with `state_dict()` and
    `load_state_dict()` whose values are tensors or numbers, e.g. {"scaler": the loss scaler}: it
    is saved as replicated tensors `extra.NAME.KEY` and restored when the checkpoint has it.
    """

    def __init__(self, cfg, topo, root: Path):
        self.cfg, self.topo, self.root = cfg, topo, Path(root)
        self.world = dist.get_world_size() if topo.distributed else 1
        self.resumed_from: Path | None = None  # the checkpoint `resume` loaded

    @classmethod
    def for_run(cls, cfg, topo, run_dir: Path) -> "Checkpointer":
        return cls(cfg, topo, Path(cfg.checkpoint.dir or Path(run_dir) / "checkpoints"))

    def resume(self, params: dict[str, nn.Parameter], optimizer, metrics: Path, stateful: dict | None = None,
               local: dict | None = None) -> int:
        """Apply `checkpoint.resume`; return the step to continue from (0: a fresh start). Rank 0
        drops the metrics lines of steps after it, so a resumed run reads as never interrupted."""
        resume = self.cfg.checkpoint.resume
        latest = latest_checkpoint(self.root)
        path = None if resume == "never" else latest if resume == "auto" else resolve(resume)
        step = 0 if path is None else _step_of(path)
        if latest is not None and latest != path and _step_of(latest) > step:
            # This run would save steps that an earlier run saved differently, beside them.
            raise CheckpointError(f"{self.root} already holds {latest.name} from an earlier run, later than the step "
                                  f"{step} this run starts from (checkpoint.resume={resume!r}); use a new "
                                  f"checkpoint.dir (or run.dir), or checkpoint.resume='auto' to continue it")
        if path is None:
            return 0
        step = self.load(path, params, optimizer, stateful, local)
        self.resumed_from = path
        if self.topo.rank == 0 and metrics.exists():
            kept = [line for line in metrics.read_text().splitlines() if line and json.loads(line)["step"] <= step]
            _replace_text(metrics, "".join(line + "\n" for line in kept))
        return step

    def maybe_save(self, step: int, params: dict[str, nn.Parameter], optimizer, stateful: dict | None = None,
                   local: dict | None = None) -> None:
        """Save every `checkpoint.every` steps, and at the last step (every = 0: never)."""
        every = self.cfg.checkpoint.every
        if every and (step % every == 0 or step == self.cfg.train.steps):
            self.save(step, params, optimizer, stateful, local)

    def _barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def save(self, step: int, params: dict[str, nn.Parameter], optimizer, stateful: dict | None = None,
             local: dict | None = None) -> Path:
        """Write checkpoint `step`; it becomes visible, and `latest`, only once every rank is done."""
        final = step_dir(self.root, step)
        tmp = final.with_name(final.name + ".partial")
        if self.topo.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # left by a save that crashed
            tmp.mkdir(parents=True)
        self._barrier()
        dcp.save(self._saved_state(params, optimizer, stateful or {}, local or {}), storage_writer=FileSystemWriter(tmp),
                 no_dist=not self.topo.distributed)
        files = digest_files(tmp, self.topo.rank, self.world)
        if self.topo.rank == 0:
            publish(tmp, final, self.cfg, step, files, optimizer=True, layout=self._layout())
            _replace_text(self.root / LATEST, final.name + "\n")
            self._prune()
        self._barrier()
        return final

    def _layout(self) -> dict:
        """What rank-local state depends on: the whole [parallel] section (layout, schedule,
        virtual stages, sequence parallelism, ZeRO stage, codec, buckets)."""
        return dataclasses.asdict(self.cfg.parallel)

    def _saved_state(self, params, optimizer, stateful: dict, local: dict) -> dict[str, torch.Tensor]:
        """The flat DCP state of this rank: its boxes of the model and optimizer state, its RNG
        state, the `stateful` objects' values and its `local` objects' values."""
        mine = pieces(params, optimizer)
        _check_optimizer_covered(optimizer, mine)
        mesh, state = self.topo.mesh, {}
        for piece in mine:
            full = spec_of(piece.param)[0].full_shape
            chunks = _chunks(piece, piece.values.detach().reshape(-1))
            if not chunks:  # this rank's slice lies in the vocabulary padding
                continue
            state[f"model.{piece.name}"] = _logical(chunks, full, mesh)
            for entry, value in optimizer.state.get(piece.values, {}).items():
                key = f"optim.{piece.name}.{entry}"
                if value.ndim == 0:
                    state[key] = value
                elif value.numel() == piece.end - piece.start:
                    state[key] = _logical(_chunks(piece, value.reshape(-1)), full, mesh)
                else:
                    raise CheckpointError(f"{key}: optimizer state of shape {tuple(value.shape)} is neither a "
                                          f"scalar nor one value per element of {tuple(piece.values.shape)}")
        for kind, value in _rng_state(self.topo.device).items():
            state[f"rng.rank{self.topo.rank}.{kind}"] = value
        for name, obj in stateful.items():
            for key, value in obj.state_dict().items():
                state[f"extra.{name}.{key}"] = _as_tensor(value)
        for name, obj in local.items():
            for key, value in obj.state_dict().items():
                state[f"local.rank{self.topo.rank}.{name}.{key}"] = value
        return state

    def _prune(self) -> None:
        """Keep the newest `checkpoint.keep` complete checkpoints; drop crashed partial saves."""
        complete = sorted(p for p in self.root.glob("step_*") if (p / MANIFEST).exists())
        for old in complete[:-self.cfg.checkpoint.keep] + list(self.root.glob("step_*.partial")):
            shutil.rmtree(old, ignore_errors=True)

    def load(self, path: Path, params: dict[str, nn.Parameter], optimizer, stateful: dict | None = None,
             local: dict | None = None) -> int:
        """Restore from `path` (written under any layout) and return its step. A weights-only
        checkpoint (from `tetrad convert`) restores the parameters; the optimizer then starts fresh."""
        path = resolve(path)
        manifest = verify(path, self.topo.rank, self.world)
        check_model(manifest, self.cfg.model, path)
        reader = SafeReader(path)
        metadata = reader.read_metadata()
        stored = metadata.state_dict_metadata
        entries = optimizer_entries(metadata) if manifest["optimizer"] else {}
        expected = {}
        for name, p in params.items():
            full = spec_of(p)[0].full_shape
            expected[f"model.{name}"] = full
            for entry, meta in entries.get(name, {}).items():
                expected[f"optim.{name}.{entry}"] = () if len(meta.size) == 0 else full
        check_shapes(metadata, expected, path)

        # Read into zeroed scratch buffers (vocabulary padding stays zero), so that a failure
        # leaves the live state untouched.
        mesh, state, buffers = self.topo.mesh, {}, {}
        mine = pieces(params, optimizer)
        for piece in mine:
            full = spec_of(piece.param)[0].full_shape
            wanted = [(f"model.{piece.name}", piece.values.dtype)]
            wanted += [(f"optim.{piece.name}.{e}", m.properties.dtype) for e, m in entries.get(piece.name, {}).items()]
            for key, dtype in wanted:
                if expected[key] == ():
                    buffers[key] = state[key] = torch.zeros((), dtype=dtype)
                    continue
                buffers[key] = torch.zeros(piece.end - piece.start, dtype=dtype, device=piece.values.device)
                chunks = _chunks(piece, buffers[key])
                if chunks:
                    state[key] = _logical(chunks, full, mesh)
        mine_local = f"local.rank{self.topo.rank}."
        same_layout = manifest.get("layout") == json.loads(json.dumps(self._layout()))  # as stored: lists, not tuples
        for key, meta in stored.items():
            if (key.startswith((f"rng.rank{self.topo.rank}.", "extra."))
                    or (same_layout and key.startswith(mine_local))):
                state[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
        dcp.load(state, storage_reader=reader, no_dist=not self.topo.distributed)

        with torch.no_grad():
            for piece in mine:
                piece.values.view(-1).copy_(buffers[f"model.{piece.name}"])
                restored = {entry: buffers[f"optim.{piece.name}.{entry}"] for entry in entries.get(piece.name, {})}
                if restored:
                    optimizer.state[piece.values] = {
                        e: t if t.ndim == 0 else t.view_as(piece.values) for e, t in restored.items()}
        if isinstance(optimizer, ShardedAdamW):
            zero_loaded(optimizer)
        self._restore_rng(state)
        for name, obj in (stateful or {}).items():
            current = obj.state_dict()
            saved = {k: _like(v, state[f"extra.{name}.{k}"]) for k, v in current.items() if f"extra.{name}.{k}" in state}
            if saved:
                obj.load_state_dict({**current, **saved})
        for name, obj in (local or {}).items():
            prefix = f"{mine_local}{name}."
            obj.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})
        self._barrier()
        return manifest["step"]

    def _restore_rng(self, state: dict[str, torch.Tensor]) -> None:
        prefix = f"rng.rank{self.topo.rank}."
        if prefix + "cpu" in state:
            torch.set_rng_state(state[prefix + "cpu"])
        if prefix + "cuda" in state and self.topo.device.type == "cuda":
            torch.cuda.set_rng_state(state[prefix + "cuda"], self.topo.device)


def _as_tensor(value) -> torch.Tensor:
    """A `stateful` value as a tensor (numbers as 0-d tensors, floats in float64: exact)."""
    if torch.is_tensor(value):
        return value.detach().clone()
    return torch.tensor(value, dtype=torch.float64 if isinstance(value, float) else None)


def _like(old, loaded: torch.Tensor):
    """`loaded` in the type `old` had (a number back as a number)."""
    return loaded if torch.is_tensor(old) else type(old)(loaded.item())


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
    _fsync_dir(final.parent)


def _replace_text(path: Path, text: str) -> None:
    """Write `path` atomically: a reader sees the old content or the new, never a torn file."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(folder: Path) -> None:
    """Make a rename in `folder` durable (a power cut after it must not bring the old name back)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
