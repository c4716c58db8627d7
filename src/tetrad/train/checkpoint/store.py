"""Checkpoint folders on disk: names, atomic publishing, integrity, safe unpickling of metadata.

Nothing here knows about models or layouts beyond the manifest's model section; the protocol
(which states a folder can be in, and what resume does in each) is in the package docstring.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import os
import pickle
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from tetrad.config import ModelConfig
from tetrad.config.checkpoints import MANIFEST, complete

FORMAT = 1
LATEST = "latest"
PARTIAL = ".partial"  # a save in progress, or one that crashed: never loaded
SET_ASIDE = ".bad"  # a published checkpoint that failed its integrity check on resume
# Keys of [model] that decide tensor shapes; the others (dropout, ...) may change on resume.
SHAPE_KEYS = ("n_layers", "d_model", "n_heads", "n_kv_heads", "ffn_hidden", "vocab_size", "norm", "mlp", "pos",
              "tie_embeddings", "qkv_bias", "head_dim", "qk_norm", "sandwich_norm", "n_experts", "expert_ffn_hidden",
              "shared_expert_ffn_hidden", "shared_expert_gate", "dense_layers", "kv_lora_rank", "q_lora_rank",
              "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "mtp_layers")


def shape_keys(model_cfg) -> tuple[str, ...]:
    """SHAPE_KEYS, and seq_len where the model learns a position embedding (its rows)."""
    return SHAPE_KEYS + (("seq_len",) if model_cfg.pos == "learned" else ())


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded or saved; the message names the file and what to do."""


class NotShownEverywhere(CheckpointError):
    """A checkpoint rank 0 reads whole that some other rank's file system does not show yet (a
    shared file system catching up): not damage, so nothing is set aside for it."""


# ---------------------------------------------------------------------------------------- names
def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def read_latest(root: Path) -> tuple[str | None, str | None]:
    """(the name `ROOT/latest` holds, or None; a problem with the pointer to report, or None)."""
    pointer = Path(root) / LATEST
    if not pointer.exists():
        return None, None
    try:
        name = pointer.read_bytes().decode("ascii").strip()
    except (OSError, UnicodeDecodeError) as e:
        return None, f"{pointer} is unreadable ({type(e).__name__}); it is ignored and rewritten at the next save"
    if not name.startswith("step_") or not name.removeprefix("step_").isdigit():
        return None, f"{pointer} holds {name[:40]!r}, not a step_* name; it is ignored and rewritten at the next save"
    return name, None


def resolve(path: str | Path) -> Path:
    """A checkpoint folder, given it or a checkpoint root (then its newest published folder)."""
    path = Path(path)
    if (path / MANIFEST).exists():
        return path
    found = complete(path)
    if not found:
        raise CheckpointError(f"{path} is not a tetrad checkpoint: no {path / MANIFEST}"
                              + (" (an interrupted save?)" if path.name.endswith(PARTIAL) else ""))
    return found[0]


# ---------------------------------------------------------------------------------------- publishing
def publish(tmp: Path, final: Path, cfg, step: int, files: dict, optimizer: bool, layout: dict,
            autotuned: dict | None = None) -> None:
    """Make the fully written folder `tmp` the checkpoint `final`: `config.toml`, then
    `tetrad.json` (its presence marks a complete folder), then the rename. A folder already at
    `final` (a save of this step that an earlier run published, or set-aside debris) is replaced,
    so publishing a step twice ends in the same state as once."""
    (tmp / "config.toml").write_text(cfg.to_toml())
    manifest = {"format": FORMAT, "step": step, "model": dataclasses.asdict(cfg.model), "layout": layout,
                "autotuned": autotuned or {}, "optimizer": optimizer, "files": files}
    with open(tmp / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    if final.exists():
        old = final.with_name(final.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        shutil.rmtree(old, ignore_errors=True)
    os.rename(tmp, final)
    _fsync_dir(final.parent)


def replace_text(path: Path, text: str) -> None:
    """Write `path` atomically: a reader sees the old content or the new, never a torn file."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(folder: Path) -> None:
    """Make renames in `folder` durable (a power cut after one must not bring the old name back)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------- integrity
def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def all_gather(obj, world: int) -> list:
    if world == 1:
        return [obj]
    out = [None] * world
    dist.all_gather_object(out, obj)  # small lists of our own strings, within the job
    return out


def _share_of(names: list[str], rank: int, world: int) -> list[str]:
    """The files this rank hashes: the work is split over ranks, so nobody reads the whole checkpoint."""
    return sorted(names)[rank::world]


def digest_share(folder: Path, rank: int, world: int) -> dict[str, dict]:
    """Size and SHA-256 of this rank's share of the files in `folder` (every rank's are written)."""
    names = [p.name for p in folder.iterdir() if p.is_file()]
    return {n: {"bytes": (folder / n).stat().st_size, "sha256": _sha256(folder / n)} for n in _share_of(names, rank, world)}


def digest_files(folder: Path, rank: int, world: int, mine: dict | None = None) -> dict[str, dict]:
    """Size and SHA-256 of every file in `folder`, each rank hashing its share (collective);
    `mine`: this rank's share, hashed already (a background write's thread did)."""
    mine = digest_share(folder, rank, world) if mine is None else mine
    return {k: v for part in all_gather(mine, world) for k, v in part.items()}


def read_manifest(path: Path) -> dict:
    """`tetrad.json`, checked for the keys this reader relies on; raise naming what is wrong."""
    manifest_path = path / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_bytes())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{manifest_path} cannot be read ({type(e).__name__}: {e}): the checkpoint is "
                              "incomplete or corrupt") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise CheckpointError(f"{manifest_path}: format {found!r}, this tetrad reads {FORMAT}")
    kinds = {"step": int, "model": dict, "files": dict, "optimizer": bool}
    bad = [k for k, kind in kinds.items() if not isinstance(manifest.get(k), kind)]
    files = manifest.get("files") if isinstance(manifest.get("files"), dict) else {}
    if bad or not all(isinstance(v, dict) and {"bytes", "sha256"} <= v.keys() for v in files.values()):
        raise CheckpointError(f"{manifest_path} lacks or garbles {', '.join(bad) or 'the entries of files'}: "
                              "the checkpoint is corrupt")
    return manifest


def verify(path: Path, rank: int = 0, world: int = 1) -> dict:
    """Read `tetrad.json` and check every file it lists (size, SHA-256); raise naming the bad
    files. Collective when world > 1: every rank hashes its share, and every rank raises if any
    rank cannot read the manifest (rank 0's reason, or the ranks whose file system does not
    show what rank 0's does)."""
    try:
        manifest, failure = read_manifest(path), None
    except CheckpointError as e:
        manifest, failure = None, str(e)
    problems = []
    for name in _share_of(list(manifest["files"]), rank, world) if manifest else []:
        want, file = manifest["files"][name], path / name
        if not file.exists():
            problems.append(f"{file}: missing")
        elif file.stat().st_size != want["bytes"]:
            problems.append(f"{file}: {file.stat().st_size} bytes, {want['bytes']} when written (truncated?)")
        elif _sha256(file) != want["sha256"]:
            problems.append(f"{file}: SHA-256 differs from the one recorded when written (corrupt)")
    gathered = all_gather((failure, problems), world)
    problems = sorted(p for _, part in gathered for p in part)
    unread = [r for r, (failed, _) in enumerate(gathered) if failed]
    if unread and unread[0] == 0:
        problems.insert(0, gathered[0][0])
    elif unread:
        lag = not problems
        problems.insert(0, f"ranks {unread} cannot read {path / MANIFEST}, which rank 0 reads (a shared file "
                           f"system not yet showing it on every node?): {gathered[unread[0]][0]}")
        if lag:
            raise NotShownEverywhere("checkpoint not shown on every node:\n  " + "\n  ".join(problems))
    if problems:
        raise CheckpointError("checkpoint failed its integrity check:\n  " + "\n  ".join(problems))
    return manifest


def saved_model(manifest: dict) -> dict:
    """The manifest's [model] keys, those it predates at their defaults (head_dim derived as it
    was then): a checkpoint from before a key existed is a model without that feature."""
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    return dataclasses.asdict(ModelConfig(**{k: v for k, v in manifest["model"].items() if k in known}))


# Keys of [model] that leave the shapes alone but change what the model computes from the same
# weights: a resume with another value is allowed (context extension changes rope_theta), and said.
BEHAVIOUR_KEYS = ("sliding_window", "rope_theta", "rope_scaling", "partial_rotary_factor", "norm_eps", "layer_types",
                  "rope_local_base_freq", "query_pre_attn_scalar", "scale_embeddings", "experts_per_token",
                  "normalize_expert_weights", "router_score", "expert_weight_scale", "expert_groups",
                  "expert_groups_per_token", "expert_group_score_top")


def behaviour_changes(manifest: dict, model_cfg) -> list[str]:
    """How this run's model computes differently from the checkpoint's, key by key (none: alike)."""
    here, saved = dataclasses.asdict(model_cfg), saved_model(manifest)
    return [f"model.{k} = {saved[k]!r} in the checkpoint, {here[k]!r} here" for k in BEHAVIOUR_KEYS if saved[k] != here[k]]


def check_model(manifest: dict, model_cfg, path: Path) -> None:
    """Refuse a checkpoint written for another model shape, naming every key that differs."""
    here, saved = dataclasses.asdict(model_cfg), saved_model(manifest)
    width, saved_width = as_built(here), as_built(saved)
    diffs = [f"model.{k} = {saved[k]!r} in the checkpoint, {here[k]!r} here"
             for k in shape_keys(model_cfg) if saved_width[k] != width[k]]
    if diffs:
        raise CheckpointError(f"{path / MANIFEST} was written for a different model:\n  " + "\n  ".join(diffs)
                              + "\nset those keys back to the checkpoint's, or train this model in a new run.dir "
                              "(or checkpoint.dir)")


def as_built(model: dict) -> dict:
    """`model` with expert_ffn_hidden as the width it gives (0 means ffn_hidden; a dense model has
    no experts), so a checkpoint written with 0 resumes with that width named, and back;
    dense_layers as a set of layers (the order it is listed in builds the same model); and latent
    attention's widths 0 without it (kv_lora_rank 0: unused)."""
    width = (model.get("expert_ffn_hidden") or model.get("ffn_hidden")) if model.get("n_experts") else 0
    latent = {} if model.get("kv_lora_rank") else dict.fromkeys(
        ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"), 0)
    return {**model, "expert_ffn_hidden": width, "dense_layers": sorted(model.get("dense_layers") or []), **latent}


# ---------------------------------------------------------------------------------------- metadata
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
        except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ValueError, IndexError) as e:
            raise CheckpointError(f"{path} cannot be read: {e}") from None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path} holds a {type(metadata).__name__}, not DCP metadata")
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


@contextlib.contextmanager
def one_process():
    """DCP on one process by design: its warning that it assumes so is noise here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def read_extras(path: Path, name: str) -> dict[str, torch.Tensor]:
    """The saved values of the replicated `stateful` object `name` (its `extra.NAME.KEY` entries),
    read on one process without the rest of the checkpoint at `path` ({} when it holds none): what
    the process that starts the ranks needs of a resume, such as the data's place. A damaged file
    is a CheckpointError (a resume verifies the checkpoint, and says what it does about it)."""
    reader = SafeReader(path)
    prefix = f"extra.{name}."
    state = {key: torch.empty(meta.size, dtype=meta.properties.dtype)
             for key, meta in reader.read_metadata().state_dict_metadata.items() if key.startswith(prefix)}
    if state:
        try:
            with one_process():
                dcp.load(state, storage_reader=reader, no_dist=True)
        except CheckpointException:
            raise CheckpointError(f"{path}: {', '.join(state)} cannot be read") from None
    return {key[len(prefix):]: value for key, value in state.items()}
