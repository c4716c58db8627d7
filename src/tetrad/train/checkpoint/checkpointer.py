"""The Checkpointer: saves and restores one rank's model, optimizer, RNG and step (every method
is collective). What is stored, and the publish protocol, are in the package docstring."""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable
from types import SimpleNamespace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from tetrad import device as devices
from tetrad.config import ParallelConfig
from tetrad.config.checkpoints import complete
from tetrad.config.sections import zero_shard
from tetrad.dist import autotune
from tetrad.model.sharding import spec_of
from tetrad.parallel.data import ShardedAdamW, zero_loaded
from tetrad.train.checkpoint import recovery
from tetrad.train.checkpoint.background import BackgroundWrites, cause
from tetrad.train.checkpoint.logical import Piece, check_optimizer_covered, chunks, logical, mesh_on, pieces
from tetrad.train.checkpoint.store import (LATEST, PARTIAL, CheckpointError, SafeReader, behaviour_changes,
                                           check_model, check_shapes, digest_files, optimizer_entries,
                                           publish, replace_text, resolve, step_dir, verify)


# [parallel] keys no rank-local state depends on: a resume that changes only these (a longer
# timeout after a collective timed out, other communicator settings) restores that state.
NOT_LAYOUT = ("collective_timeout_s", "startup_timeout_s", "comm_options")


class Checkpointer:
    """Saves and restores the model, optimizer, RNG and step of one rank; every method is collective.

    `stateful` (save, load, resume, maybe_save) maps a name to an object with `state_dict()` and
    `load_state_dict()` whose values are tensors or numbers, e.g. {"scaler": the loss scaler}: it
    is saved as replicated tensors `extra.NAME.KEY` and restored when the checkpoint has it.
    `local` maps a name to such an object whose state only this rank holds (package docstring).
    """

    def __init__(self, cfg, topo, root: Path):
        self.cfg, self.topo, self.root = cfg, topo, Path(root)
        self.world = dist.get_world_size() if topo.distributed else 1
        self.resumed_from: Path | None = None  # the checkpoint `resume` loaded
        self.behaviour_changes: list[str] = []  # ... and how this run's model computes otherwise (store.py)
        self._chosen: tuple[Path | None, dict | None] | None = None  # what `choose` chose
        self._autotuned: dict = {}  # what "auto" in [parallel] resolved to (resolve_auto): in each manifest
        self._meshes = {} if topo.mesh is None else {topo.mesh.device_type: topo.mesh}
        self.background = BackgroundWrites(topo.rank, self.world, topo.distributed) if cfg.checkpoint.async_save \
            else None

    @classmethod
    def for_run(cls, cfg, topo, run_dir: Path) -> "Checkpointer":
        return cls(cfg, topo, Path(cfg.checkpoint.dir or Path(run_dir) / "checkpoints"))

    def resume(self, params: dict[str, nn.Parameter], optimizer, metrics: Path, stateful: dict | None = None,
               local: dict | None = None) -> int:
        """Apply `checkpoint.resume`; return the step to continue from (0: a fresh start). Rank 0
        drops the metrics lines of steps after it, so a resumed run reads as never interrupted;
        a fresh start refuses to erase an earlier run's metrics."""
        rank = self.topo.rank
        path, manifest = self.choose()
        if path is None:
            if rank == 0:
                recovery.refuse_overwriting_history(metrics, recovery.first_publish_by(self.cfg, metrics.parent))
            self._barrier()
            return 0
        step = self._load_verified(path, manifest, params, optimizer, stateful or {}, local or {})
        self.resumed_from, self.behaviour_changes = path, behaviour_changes(manifest, self.cfg.model)
        if rank == 0:
            recovery.cut_history(metrics, step)
        return step

    def choose(self) -> tuple[Path | None, dict | None]:
        """The checkpoint `resume` loads and its manifest, (None, None) for a fresh start; chosen
        once, by every rank alike (collective: recovery.py)."""
        if self._chosen is None:
            resume, rank = self.cfg.checkpoint.resume, self.topo.rank
            if resume == "auto":
                self._chosen = recovery.newest_good(self.root, self.cfg.model, rank, self.world)
            elif resume == "never":
                recovery.refuse_later(self.root, 0, "checkpoint.resume='never'")
                self._chosen = None, None
            else:
                self._chosen = recovery.explicit(resume, self.root, self.cfg.model, rank, self.world)
        return self._chosen

    def resolve_auto(self, measure: Callable[[], ParallelConfig]) -> ParallelConfig:
        """The [parallel] section with "auto" resolved (collective). A resume from a checkpoint of
        this layout takes what its run resolved: the same buckets, so codecs' per-bucket state
        and the order of the sums continue bitwise. Otherwise `measure()` (dist/autotune.py).
        Rank 0 decides for all (a rank measuring alone would hang). Saved with each checkpoint."""
        auto = [k for k in autotune.AUTO_KEYS if getattr(self.cfg.parallel, k) == "auto"]
        if not auto:
            return self.cfg.parallel
        path, manifest = self.choose()
        saved = None
        if self.topo.rank == 0 and path is not None and self._same_layout(manifest):
            saved = manifest.get("autotuned")  # absent before this was recorded: measured again
        saved = recovery.broadcast(saved if saved and set(saved) == set(auto) else None, self.world)
        parallel = measure() if saved is None else autotune.reuse(self.cfg.parallel, saved, path.name, self.topo.rank)
        self._autotuned = {k: getattr(parallel, k) for k in auto}
        return parallel

    def maybe_save(self, step: int, params: dict[str, nn.Parameter], optimizer, stateful: dict | None = None,
                   local: dict | None = None) -> None:
        """Save every `checkpoint.every` steps, and at the last step (every = 0: never); with
        `checkpoint.async_save` in the background, and publish a write that every rank finished."""
        if self.background is not None:
            self._publish_written(wait=False)
        every = self.cfg.checkpoint.every
        if every and (step % every == 0 or step == self.cfg.train.steps):
            self.save(step, params, optimizer, stateful, local, background=self.background is not None)

    def finish(self) -> None:
        """Publish the checkpoint being written in the background, once it is written (at a run's end)."""
        if self.background is not None:
            self._publish_written(wait=True)

    def ensure_saved(self, step: int, *state) -> Path:
        """Checkpoint `step`, published: the one `maybe_save` made of it, or a new one."""
        self.finish()
        path = step_dir(self.root, step)
        return path if path.is_dir() else self.save(step, *state)  # every rank has passed the publish barrier

    def _barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def save(self, step: int, params: dict[str, nn.Parameter], optimizer, stateful: dict | None = None,
             local: dict | None = None, background: bool = False) -> Path:
        """Write checkpoint `step`; it becomes visible, and `latest`, only once every rank is done
        (`background`: written by a thread, published by a later `maybe_save` or `finish`). A
        failure (full disk, no permission) leaves the previous checkpoints as they were."""
        if self.background is not None:
            self._publish_written(wait=True)  # one write at a time
        final = step_dir(self.root, step)
        tmp = final.with_name(final.name + PARTIAL)
        try:
            if self.topo.rank == 0:
                _clear(tmp)  # left by a save that crashed
                tmp.mkdir(parents=True)
            self._barrier()
            state = self._saved_state(params, optimizer, stateful or {}, local or {}, copy=background)
            if background:
                self.background.start(step, tmp, state)
                return final
            dcp.save(state, storage_writer=FileSystemWriter(tmp), no_dist=not self.topo.distributed)
            self._publish(step, tmp, final)
        except (OSError, CheckpointException) as e:
            raise self._failed(step, tmp, cause(e)) from None
        self._barrier()
        return final

    def _publish_written(self, wait: bool) -> None:
        """Publish the background write once every rank's is done (`wait`: wait for that)."""
        write, failure = self.background.done(wait)
        if write is None:
            return
        final = step_dir(self.root, write.step)
        try:
            if failure is not None:
                raise self._failed(write.step, write.tmp, failure)
            self._publish(write.step, write.tmp, final, write.future.result())
        except (OSError, CheckpointException) as e:
            raise self._failed(write.step, write.tmp, cause(e)) from None
        self._barrier()

    def _publish(self, step: int, tmp: Path, final: Path, hashed: dict | None = None) -> None:
        """Every rank's files in `tmp` are written: hash them (`hashed`: this rank's share, done
        already), and make `tmp` checkpoint `final`."""
        files = digest_files(tmp, self.topo.rank, self.world, hashed)
        if self.topo.rank == 0:
            publish(tmp, final, self.cfg, step, files, optimizer=True, layout=self._layout(), autotuned=self._autotuned)
            replace_text(self.root / LATEST, final.name + "\n")
            self._prune()

    def _failed(self, step: int, tmp: Path, reason: str) -> CheckpointError:
        kept = [p.name for p in complete(self.root)]
        return CheckpointError(f"saving step {step} to {tmp} failed ({reason}); the earlier checkpoints "
                               f"{kept or '(none)'} are untouched. Free space or fix the permissions of "
                               f"{self.root}, or set checkpoint.dir elsewhere")

    def _mesh_for(self, tensor: torch.Tensor):
        """The mesh to wrap `tensor` on: the topology's, or the same ranks on the tensor's own
        device (logical.mesh_on); None in one process."""
        if not self._meshes:
            return None
        kind = tensor.device.type
        if kind not in self._meshes:
            self._meshes[kind] = mesh_on(self.topo.mesh, kind)
        return self._meshes[kind]

    def _layout(self) -> dict:
        """What rank-local state depends on: the [parallel] section (layout, schedule, virtual
        stages, sequence parallelism, ZeRO stage, codec, buckets) but the keys in NOT_LAYOUT."""
        return _in_effect({k: v for k, v in dataclasses.asdict(self.cfg.parallel).items() if k not in NOT_LAYOUT})

    def _same_layout(self, manifest: dict) -> bool:
        """Whether the checkpoint of `manifest` was saved in this layout (_layout)."""
        # Older saves: without NOT_LAYOUT's keys, and without a key added since (its default then).
        saved = {**dataclasses.asdict(ParallelConfig()), **manifest.get("layout", {})}
        saved = _in_effect({k: v for k, v in saved.items() if k not in NOT_LAYOUT})
        return saved == json.loads(json.dumps(self._layout()))  # as stored: lists, not tuples

    def _saved_state(self, params, optimizer, stateful: dict, local: dict, copy: bool = False) -> dict[str, torch.Tensor]:
        """The flat DCP state of this rank: its boxes of the model and optimizer state, its RNG
        state, the `stateful` objects' values and its `local` objects' values. `copy`: of copies
        in CPU memory, which training cannot change (a background write's staging)."""
        own = (lambda t: t.detach().to("cpu", copy=True)) if copy else (lambda t: t.detach())
        mine = pieces(params, optimizer)
        check_optimizer_covered(optimizer, mine)
        state = {}
        for piece in mine:
            full = spec_of(piece.param)[0].full_shape
            boxes = chunks(piece, own(piece.values).reshape(-1))
            if not boxes:  # this rank's slice lies in the vocabulary padding
                continue
            state[f"model.{piece.name}"] = logical(boxes, full, self._mesh_for(piece.values))
            for entry, value in optimizer.state.get(piece.values, {}).items():
                key = f"optim.{piece.name}.{entry}"
                if value.ndim == 0:
                    state[key] = own(value)
                elif value.numel() == piece.end - piece.start:
                    value = own(value)
                    state[key] = logical(chunks(piece, value.reshape(-1)), full, self._mesh_for(value))
                else:
                    raise CheckpointError(f"{key}: optimizer state of shape {tuple(value.shape)} is neither a "
                                          f"scalar nor one value per element of {tuple(piece.values.shape)}")
        for kind, value in devices.rng_states(self.topo.device).items():
            state[f"rng.rank{self.topo.rank}.{kind}"] = value
        for name, obj in stateful.items():
            for key, value in obj.state_dict().items():
                state[f"extra.{name}.{key}"] = own(value) if torch.is_tensor(value) else _as_tensor(value)
        for name, obj in local.items():
            for key, value in obj.state_dict().items():
                state[f"local.rank{self.topo.rank}.{name}.{key}"] = own(value)
        return state

    def _prune(self) -> None:
        """Keep the newest `checkpoint.keep` complete checkpoints; drop crashed partial saves."""
        debris = [p for p in self.root.glob("step_*") if p.name.endswith((PARTIAL, ".old"))]
        for old in complete(self.root)[self.cfg.checkpoint.keep:] + debris:
            _clear(old)

    def load(self, path: Path, params: dict[str, nn.Parameter], optimizer, stateful: dict | None = None,
             local: dict | None = None) -> int:
        """Restore from `path` (written under any layout) and return its step. A weights-only
        checkpoint (from `tetrad convert`) restores the parameters; the optimizer then starts fresh."""
        path = resolve(path)
        manifest = verify(path, self.topo.rank, self.world)
        check_model(manifest, self.cfg.model, path)
        return self._load_verified(path, manifest, params, optimizer, stateful or {}, local or {})

    def _load_verified(self, path: Path, manifest: dict, params, optimizer, stateful: dict, local: dict) -> int:
        """Read the verified checkpoint at `path` into scratch buffers on the host (vocabulary
        padding stays zero), then copy them into the live state: a failure leaves the live state
        untouched, and the device never holds a second copy of this rank's weights and optimizer
        state (12 B a parameter more at resume would turn a run that fits into an OOM there)."""
        reader = SafeReader(path)
        metadata = reader.read_metadata()
        entries = optimizer_entries(metadata) if manifest["optimizer"] else {}
        expected = _expected_shapes(params, entries)
        check_shapes(metadata, expected, path)
        mine = pieces(params, optimizer)
        state, buffers = self._scratch(mine, entries, expected)
        same_layout = self._same_layout(manifest)
        mine_local = f"local.rank{self.topo.rank}."
        for key, meta in metadata.state_dict_metadata.items():
            if (key.startswith((f"rng.rank{self.topo.rank}.", "extra."))
                    or (same_layout and key.startswith(mine_local))):
                state[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
        dcp.load(state, storage_reader=reader, no_dist=not self.topo.distributed)
        _apply(mine, buffers, entries, optimizer)
        self._restore_rng(state)
        for name, obj in stateful.items():
            current = obj.state_dict()
            saved = {k: _like(v, state[f"extra.{name}.{k}"]) for k, v in current.items() if f"extra.{name}.{k}" in state}
            if saved:
                obj.load_state_dict({**current, **saved})
        for name, obj in local.items():
            prefix = f"{mine_local}{name}."
            obj.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})
        self._barrier()
        return manifest["step"]

    def _scratch(self, mine: list[Piece], entries: dict, expected: dict) -> tuple[dict, dict]:
        """(the DCP state to load into, the flat scratch buffer of every model/optimizer key)."""
        state, buffers = {}, {}
        for piece in mine:
            full = spec_of(piece.param)[0].full_shape
            wanted = [(f"model.{piece.name}", piece.values.dtype)]
            wanted += [(f"optim.{piece.name}.{e}", m.properties.dtype) for e, m in entries.get(piece.name, {}).items()]
            for key, dtype in wanted:
                if expected[key] == ():
                    buffers[key] = state[key] = torch.zeros((), dtype=dtype)
                    continue
                buffers[key] = torch.zeros(piece.end - piece.start, dtype=dtype)  # host: see _load_verified
                boxes = chunks(piece, buffers[key])
                if boxes:
                    state[key] = logical(boxes, full, self._mesh_for(buffers[key]))
        return state, buffers

    def _restore_rng(self, state: dict[str, torch.Tensor]) -> None:
        prefix = f"rng.rank{self.topo.rank}."
        mine = {key[len(prefix):]: value for key, value in state.items() if key.startswith(prefix)}
        devices.set_rng_states(mine, self.topo.device)


def _expected_shapes(params: dict[str, nn.Parameter], entries: dict) -> dict[str, tuple[int, ...]]:
    """Every key to read and its logical shape (() for a scalar such as AdamW's step)."""
    expected = {}
    for name, p in params.items():
        full = spec_of(p)[0].full_shape
        expected[f"model.{name}"] = full
        for entry, meta in entries.get(name, {}).items():
            expected[f"optim.{name}.{entry}"] = () if len(meta.size) == 0 else full
    return expected


def _apply(mine: list[Piece], buffers: dict, entries: dict, optimizer) -> None:
    """Copy the loaded scratch buffers into the parameters and the optimizer state."""
    on_device = {id(p) for g in optimizer.param_groups if g.get("fused") or g.get("capturable") for p in g["params"]}
    with torch.no_grad():
        for piece in mine:
            piece.values.view(-1).copy_(buffers[f"model.{piece.name}"])
            restored = {entry: buffers[f"optim.{piece.name}.{entry}"] for entry in entries.get(piece.name, {})}
            if restored:
                optimizer.state[piece.values] = {e: _state_entry(t, piece.values, id(piece.values) in on_device)
                                                 for e, t in restored.items()}
    if isinstance(optimizer, ShardedAdamW):
        zero_loaded(optimizer)


def _state_entry(loaded: torch.Tensor, param: torch.Tensor, step_on_device: bool) -> torch.Tensor:
    """One loaded optimizer-state entry of `param`, where it lives: a moment beside the parameter,
    in its shape; AdamW's `step` as torch's own load_state_dict places it, fp32 on the parameter's
    device for the fused and capturable kernels (`step_on_device`), which read it there (a host
    tensor is a pointer the GPU cannot read), as loaded (on the host) otherwise."""
    if loaded.ndim:
        return loaded.to(param.device).view_as(param)
    return loaded.to(param.device, torch.float32) if step_on_device else loaded


def _as_tensor(value) -> torch.Tensor:
    """A `stateful` number as a 0-d tensor (floats in float64: exact)."""
    return torch.tensor(value, dtype=torch.float64 if isinstance(value, float) else None)


def _like(old, loaded: torch.Tensor):
    """`loaded` in the type `old` had (a number back as a number)."""
    return loaded if torch.is_tensor(old) else type(old)(loaded.item())


def _clear(path: Path) -> None:
    """Remove a folder (or a stray file) of that name, if there is one."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _in_effect(layout: dict) -> dict:
    """`layout` with an idle zero_shard (ZeRO 0, or a block of all dp x cp ranks) as 0: the same
    layout as without it, whose per-rank state it can resume."""
    return {**layout, "zero_shard": zero_shard(SimpleNamespace(**layout))}
