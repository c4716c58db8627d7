"""`checkpoint.init_from`: a fresh run starts from given weights (fine-tuning, continued
pre-training): a tetrad checkpoint (any layout; its folder, its checkpoint root or its run
folder, as `tetrad generate` and `convert` take) or a Hugging Face model folder (config.json +
*.safetensors of an architecture train/hf_architectures.py maps: Llama, Mistral, Qwen2, Qwen3,
Phi-3, Gemma, Mixtral, Qwen2-MoE, Qwen3-MoE, GLM-4.5, DeepSeek-V2, DeepSeek-V3). Weights only: the optimizer, the step and the data position start afresh.

The model's shape follows the weights (`weights_model_keys`, below the user's own [model] keys), and
every rank fills its parameters with its shard of each logical tensor, one at a time, reading that
shard alone (`stored_weights`, which `tetrad generate` reads by too), so any layout can start from
any source and no rank reads a tensor whole that it keeps a part of.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from tetrad.config import Config, ConfigError, ModelConfig, read_toml
from tetrad.data import shards
from tetrad.data.blend import primary_source
from tetrad.data.tokenizer import load_tokenizer, run_tokenizer
from tetrad.train.checkpoint import MANIFEST, CheckpointError, SafeReader, saved_model, shape_keys, verify
from tetrad.train.checkpoint.store import as_built, one_process, read_extras
from tetrad.train.convert import checkpoint_folder, hf_mismatches
from tetrad.train.hf_folder import hf_model_keys, stale_copies
from tetrad.train.expert_bias import ExpertBias
from tetrad.train.hf_architectures import fused_rows, hf_name
from tetrad.train.hf_deepseek import rope_interleaved, rope_orders
from tetrad.train.hf_fp8 import SCALE, fp8_block, read_part, unscaled
from tetrad.train.hf_moe import expert_bias_names, expert_pieces

HF_CONFIG = "config.json"
Box = tuple[slice, ...]  # one slice per dimension of a logical tensor


def is_hf_folder(path: Path) -> bool:
    return (path / HF_CONFIG).is_file() and not (path / MANIFEST).exists()


def hf_config(path: Path) -> dict:
    """The folder's config.json: a ConfigError (the user's file) where it is not a JSON object."""
    try:
        config = json.loads((path / HF_CONFIG).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path / HF_CONFIG} is not a readable config.json ({e})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path / HF_CONFIG} is not a config.json (a JSON object)")
    return config


def hf_weights_problem(path: Path, model_cfg: ModelConfig) -> str | None:
    """How the HF folder's weights differ from the model its config.json describes, in a few
    words (the first difference, and how many more), or None where they fit."""
    problems = hf_mismatches(path, model_cfg, hf_config(path).get("model_type", ""))
    if not problems:
        return None
    return f"its weights do not match its config.json ({problems[0]}" + \
        (f" and {len(problems) - 1} more)" if len(problems) > 1 else ")")


def _source_model(path: Path) -> dict:
    """The [model] keys of the weights at `path` (an HF folder or a tetrad checkpoint). Either
    way the model keeps its context (max_position_embeddings) when a fine-tune sets a shorter
    seq_len: a tetrad model's is its own context_length, seq_len where it set none."""
    if is_hf_folder(path):
        keys = hf_model_keys(path, hf_config(path))[0]
        del keys["seq_len"]  # the context it was trained to (often 8k-128k), not what fine-tuning needs
        return keys
    keys = saved_model(json.loads((checkpoint_folder(path) / MANIFEST).read_text()))
    if keys["pos"] == "rope":  # a learned position embedding's rows are its seq_len
        keys["max_position_embeddings"] = max(keys.get("max_position_embeddings", 0), keys["seq_len"])
    return keys


def weights_model_keys(source: str) -> dict:
    """The [model] keys of the weights `checkpoint.init_from` names (train/inputs.py's model_keys,
    below the user's own), or none where they cannot be read: check_init_from names the problem."""
    try:
        return _source_model(Path(source))
    except (OSError, ValueError, KeyError, CheckpointError, ConfigError):
        return {}


def check_init_from(cfg: Config) -> None:
    """Before any rank starts: the weights exist, are intact, and fit [model] and the data's
    tokenizer (one line if not)."""
    source = cfg.checkpoint.init_from
    if not source:
        return
    path = Path(source)
    if not path.exists():
        raise ConfigError(f"checkpoint.init_from={source!r} does not exist; name a tetrad checkpoint or an HF folder")
    try:
        if not is_hf_folder(path):
            verify(checkpoint_folder(path))
        saved, here = as_built(_source_model(path)), as_built(dataclasses.asdict(cfg.model))
    except (CheckpointError, OSError, ValueError, KeyError) as e:
        raise ConfigError(f"checkpoint.init_from={source!r}: {e}") from None
    differ = [f"{k}={saved.get(k)!r} there, {here[k]!r} here" for k in shape_keys(cfg.model)
              if saved.get(k) != here[k] and k != "mtp_layers"]
    if differ:
        raise ConfigError(f"checkpoint.init_from={source!r} holds a model of another shape ({'; '.join(differ)}); "
                          "drop those [model] keys: they follow the weights")
    held = saved.get("mtp_layers", 0)
    _check_depths(source, held, cfg.model.mtp_layers)
    if is_hf_folder(path):  # config.json fits [model]; the weights the ranks will read must fit it too
        read = dataclasses.replace(cfg.model, mtp_layers=min(held, cfg.model.mtp_layers))  # the depths read
        try:
            problem = hf_weights_problem(path, read)
        except CheckpointError as e:
            raise ConfigError(f"checkpoint.init_from={source!r}: {e}") from None
        if problem:
            raise ConfigError(f"checkpoint.init_from={source!r}: {problem}; export the folder again, or name another")
        held_note = hf_model_keys(path, hf_config(path))[1] if cfg.model.mtp_layers <= held else ""
        for note in (held_note, stale_copies(path, read, *_folder_reader(path))):
            if note:
                print(f"tetrad: {note}", file=sys.stderr)
    _check_tokenizer(cfg, path)


def _folder_reader(path: Path) -> tuple[Callable[[str], torch.Tensor], dict[str, Path]]:
    """A reader of an HF folder's tensors by name, whole, and the file of each name."""
    files: dict[str, Path] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            files.update(dict.fromkeys(f.keys(), file))

    def read(key: str) -> torch.Tensor:
        with safe_open(files[key], "pt") as f:
            return f.get_tensor(key)
    return read, files


def _check_depths(source: str, saved: int, here: int) -> None:
    """Fewer multi-token-prediction depths than the weights hold start without the others; more
    start those past them fresh (`initial_weights`: continued pre-training adding MTP, as
    Megatron-LM's users do); either said in one line."""
    if here > saved:
        fresh = f"depth {here} starts" if here == saved + 1 else f"depths {saved + 1}-{here} start"
        print(f"tetrad: model.mtp_layers={here} and checkpoint.init_from={source!r} holds {saved} multi-token-"
              f"prediction depth{'' if saved == 1 else 's'}: {fresh} fresh (the model's own initialisation)",
              file=sys.stderr)
    if here < saved:
        print(f"tetrad: checkpoint.init_from={source!r}: left out {saved - here} of its {saved} multi-token-prediction "
              f"depths (model.mtp_layers={here})", file=sys.stderr)


def _tokenizer_file(path: Path) -> Path | None:
    """The tokenizer.json the weights at `path` were trained with, where one is known: beside
    them (an HF folder, a converted checkpoint), or in the shard folder their run read."""
    folder = path if is_hf_folder(path) else checkpoint_folder(path)
    if (folder / shards.TOKENIZER).is_file():
        return folder / shards.TOKENIZER
    if is_hf_folder(path) or not (folder / "config.toml").is_file():
        return None
    data = Path(primary_source(read_toml(folder / "config.toml").get("data", {}).get("source", "")))
    return data / shards.TOKENIZER if (data / shards.TOKENIZER).is_file() else None


def _check_tokenizer(cfg: Config, path: Path) -> None:
    """Data in another vocabulary than the weights' (shards of another tokenizer, or text read as
    bytes) trains them on the wrong ids, silently: every token of the data's tokenizer must have
    its id in the weights' (a released model's vocabulary may be larger)."""
    theirs = _tokenizer_file(path)
    if theirs is None:
        return
    try:
        ours, source = run_tokenizer(Path(cfg.data.source), cfg.data.source)
    except ValueError:
        return  # token ids without a tokenizer, or no data (check_data says so)
    try:
        fits = ours.get_vocab().items() <= load_tokenizer(theirs).get_vocab().items()
    except ValueError as e:  # it names the file
        raise ConfigError(str(e)) from None
    if not fits:
        how = "was tokenized with another vocabulary" if source else "is read as bytes, another vocabulary"
        raise ConfigError(f"data.source={cfg.data.source!r} {how} than the weights of checkpoint.init_from="
                          f"{cfg.checkpoint.init_from!r} ({theirs}); tokenize the text with theirs: `tetrad data "
                          f"TEXT --tokenizer {theirs} --out DATA`")


def initial_weights(source: str) -> Callable[[str], SafetensorsPart | ExpertParts | CheckpointPart | None]:
    """name -> a handle to that parameter's logical tensor in `source` (checkpoint.init_from), of
    which each rank reads its shard alone (sharding.init_parameters; its shape checked there);
    None for a multi-token-prediction depth past those the weights hold (`mtp.<k>.*`, k at or past
    their count), which starts at the model's own initialisation, as a fresh run's (its expert
    biases at zero: set_expert_biases)."""
    weights, held = stored_weights(Path(source)), weights_model_keys(source).get("mtp_layers", 0)
    return lambda name: None if name.startswith("mtp.") and int(name.split(".")[1]) >= held else weights(name)


def stored_expert_biases(source: str | Path) -> dict[str, torch.Tensor]:
    """The MoE layers' expert biases (model/moe.py) a tetrad checkpoint holds, by layer name
    (train/expert_bias.py's checkpoint state), or an HF GLM-4.5 or DeepSeek-V3 folder (its
    e_score_correction_bias buffers); none for another HF folder (its family has none: routing starts unbiased) or a
    checkpoint saved without them."""
    path = Path(source)
    if not is_hf_folder(path):
        return read_extras(checkpoint_folder(path), ExpertBias.NAME)
    hf = hf_config(path)
    names = expert_bias_names(ModelConfig(**hf_model_keys(path, hf)[0]), hf.get("model_type", ""))
    wanted, biases = {key: layer for layer, key in names.items()}, {}
    for file in sorted(path.glob("*.safetensors")) if wanted else ():
        with safe_open(file, "pt") as f:
            biases.update({wanted[key]: f.get_tensor(key).float() for key in f.keys() if key in wanted})
    return biases


def stored_weights(path: Path) -> Callable[[str], SafetensorsPart | ExpertParts | CheckpointPart]:
    """name -> a handle to that parameter's logical tensor in a tetrad checkpoint or an HF folder
    at `path`: its `shape`, and `handle[box]` reads that part alone (a rank's shard: training's
    init_parameters, tetrad generate's inference_model)."""
    if not is_hf_folder(path):
        reader = MetadataOnce(checkpoint_folder(path))
        stored = reader.read_metadata().state_dict_metadata

        def in_checkpoint(name: str) -> CheckpointPart:
            if f"model.{name}" not in stored:
                raise CheckpointError(f"{reader.path} has no model.{name}")
            meta = stored[f"model.{name}"]
            return CheckpointPart(reader, f"model.{name}", tuple(meta.size), meta.properties.dtype)
        return in_checkpoint
    hf = hf_config(path)
    model_type = hf.get("model_type", "")
    model_cfg = ModelConfig(**hf_model_keys(path, hf)[0])
    rows = fused_rows(model_cfg, model_type)
    orders = rope_orders(model_cfg, rope_interleaved(hf))  # DeepSeek's RoPE rows, read de-interleaved
    block = fp8_block(hf, path / HF_CONFIG)
    files = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            files.update({key: (file, tuple(f.get_slice(key).get_shape()), f.get_slice(key).get_dtype())
                          for key in f.keys()})

    def in_folder(name: str) -> SafetensorsPart | ExpertParts:
        pieces = expert_pieces(name, model_cfg.n_experts)  # [E, ...]: one HF tensor per expert
        return ExpertParts(tuple(map(in_file, pieces))) if pieces else in_file(name)

    def in_file(name: str) -> SafetensorsPart:
        key, start, stop = rows.get(name, (hf_name(name, model_type, model_cfg.n_layers), 0, None))  # a fused one's part: its rows
        if key not in files:
            raise CheckpointError(f"{path} has no {key}, which model.{name} needs")
        file, shape, dtype = files[key]
        order = tuple(orders[name].tolist()) if name in orders else None
        scales = files[key + SCALE][0] if block and key + SCALE in files else None
        if scales is None and dtype.startswith("F8"):
            raise CheckpointError(unscaled(path, key))
        return SafetensorsPart(file, key, start, (shape[0] if stop is None else stop) - start, shape[1:], order,
                               scales, block)
    return in_folder


@dataclass(frozen=True)
class SafetensorsPart:
    """Rows [start, start + rows) of tensor `key` of a safetensors file (a fused tensor's part, or
    all of it), read by the box indexed (safetensors reads that slice alone); its row r being the
    file's row order[r] where `order` is given (DeepSeek's RoPE rows: the span the box's rows
    cover is read, a head's rows at most beyond them); dequantized to fp32 where `scales` is given
    (DeepSeek-V3's fp8 release: hf_fp8), from the scales of the blocks the box touches alone."""
    file: Path
    key: str
    start: int
    rows: int
    rest: tuple[int, ...]
    order: tuple[int, ...] | None = None
    scales: Path | None = None  # the file holding a quantized tensor's key + SCALE (hf_fp8), read by `block`
    block: tuple[int, int] | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.rows, *self.rest)

    def __getitem__(self, box: Box) -> torch.Tensor:
        if self.order is None or box[0].start == box[0].stop:
            return self._read(box[0].start, box[0].stop, box[1:])
        rows = torch.tensor(self.order[box[0]])
        low = int(rows.min())
        return self._read(low, int(rows.max()) + 1, box[1:])[rows - low]

    def _read(self, start: int, stop: int, rest: Box) -> torch.Tensor:
        rows = slice(self.start + start, self.start + stop)
        with safe_open(self.file, "pt") as f:
            if self.scales is None:
                return f.get_slice(self.key)[(rows, *rest)]
            with safe_open(self.scales, "pt") as scales:
                return read_part(f, scales, self.key, rows, slice(*rest[0].indices(self.rest[0])[:2]), self.block)


@dataclass(frozen=True)
class ExpertParts:
    """An expert parameter [E, ...] that an HF folder stores as E tensors, one per expert: the
    box's first slice picks the experts, the rest is read from each one's tensor alone (a tp
    rank's rows or columns of every expert)."""
    experts: tuple[SafetensorsPart, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.experts), *self.experts[0].shape)

    def __getitem__(self, box: Box) -> torch.Tensor:
        return torch.stack([self.experts[e][box[1:]] for e in range(box[0].start, box[0].stop)])


class MetadataOnce(SafeReader):
    """A SafeReader of one checkpoint folder that reads (and unpickles) its .metadata once: each
    CheckpointPart's box is a DCP load of its own, which asks the reader for it again, and a
    large model's metadata (every chunk of every tensor) would be read once per tensor."""

    def __init__(self, folder: Path):
        super().__init__(folder)
        self.metadata: Metadata | None = None

    def reset(self, checkpoint_id=None) -> None:
        """DCP's reset before each load; a `checkpoint_id` points the reader at another folder,
        whose metadata is not the one kept."""
        if checkpoint_id and Path(checkpoint_id) != Path(self.path):
            self.metadata = None
        super().reset(checkpoint_id)

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if self.metadata is None:
            self.metadata = super().read_metadata(*args, **kwargs)
        return self.metadata


@dataclass(frozen=True)
class CheckpointPart:
    """Tensor `key` of the tetrad checkpoint (DCP) `reader` reads, read by the box indexed: DCP reads
    the stored chunks that overlap it, each whole (a torch.save record), and copies their overlap."""
    reader: MetadataOnce
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    def __getitem__(self, box: Box) -> torch.Tensor:
        offsets, sizes = [b.start for b in box], [b.stop - b.start for b in box]
        part = torch.empty(sizes, dtype=self.dtype)
        with one_process():
            dcp.load({self.key: part}, storage_reader=self.reader,
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
