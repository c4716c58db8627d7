"""The one config: typed dataclasses, loaded from TOML, overridable as `--section.key=value`.

Everything is checked here, before any process starts, and every error names the fix.
The section and key names are a contract (see docs/design.md): users' scripts rely on them.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Union

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

from tetrad.presets import PRESETS


# Gradient bucket size when none is measured ("auto" with nothing to tune, or before the
# measurement: the planner): torch DDP's default.
DEFAULT_BUCKET_MB = 25.0


class ConfigError(ValueError):
    """A config that cannot run; the message says what to change."""


# parallel.comm_options: the groups that take settings (a pipeline link's take "pp"'s) and each
# setting's type and range: ProcessGroupNCCL.Options' high-priority stream, NCCL's config.
COMM_GROUPS = ("tp", "cp", "dp", "pp", "dp_cp", "dp_cp_intra", "dp_cp_inter", "embed")
COMM_OPTIONS = {"high_priority_stream": (bool, None), "cga_cluster_size": (int, range(0, 9)),
                "min_ctas": (int, range(1, 65)), "max_ctas": (int, range(1, 65))}


@dataclass
class ModelConfig:
    preset: str = "tiny"
    n_layers: int = 4
    d_model: int = 128
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_hidden: int = 384
    vocab_size: int = 256
    seq_len: int = 128
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    mlp: Literal["swiglu", "gelu"] = "swiglu"
    pos: Literal["rope", "learned"] = "rope"
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    dropout: float = 0.0

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


@dataclass
class ParallelConfig:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    vpp: int = 1
    schedule: str = "1f1b"  # a name in parallel/pipeline/registry.py, whose check_config validates it
    # Layers of each of the pp*vpp pipeline stages, e.g. [7, 8, 8, 7]; empty: balanced by FLOPs.
    stage_layers: list[int] = field(default_factory=list)
    zero: int = 0
    sequence_parallel: bool = False
    cp_algo: Literal["ring", "alltoall"] = "ring"
    grad_bucket_mb: Union[float, Literal["auto"]] = DEFAULT_BUCKET_MB
    grad_codec: Literal["none", "bf16", "int8", "powersgd"] = "none"
    hierarchical: Union[bool, Literal["auto"]] = False
    ranks_per_node: int = 8
    # NCCL communicator settings per group, as Megatron-Core's communicator config file has them, e.g.
    # {tp = {high_priority_stream = true, cga_cluster_size = 2, max_ctas = 16}}: COMM_OPTIONS.
    comm_options: dict[str, dict[str, Union[bool, int]]] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp


@dataclass
class TrainConfig:
    steps: int = 200
    global_batch: int = 16
    micro_batch: int = 4
    lr: float = 3e-3
    # After `warmup` steps: cosine or linear decay to lr * min_lr_ratio at the last step, constant,
    # or warmup-stable-decay (lr until the last `decay_fraction` of the steps, then linear decay).
    lr_schedule: Literal["cosine", "linear", "constant", "wsd"] = "cosine"
    min_lr_ratio: float = 0.1
    decay_fraction: float = 0.2
    warmup: int = 20
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    dtype: Literal["fp32", "bf16", "fp16", "fp8"] = "fp32"
    recompute: Literal["none", "selective", "full"] = "none"
    device: Literal["cpu", "cuda", "auto"] = "auto"
    # fp32 master weights and AdamW state in CPU memory instead of the accelerator's.
    offload_optimizer: bool = False
    # torch.compile each transformer block.
    compile: bool = False
    # Validation loss every eval_every steps and at the last step (0: never), over eval_steps
    # held-out global batches.
    eval_every: int = 0
    eval_steps: int = 4
    # fp32 matmuls on TF32 tensor cores (CUDA only; reported as `tf32` in metrics.jsonl).
    tf32: bool = True
    # torch.profiler Chrome traces of these steps (1-based, "3-5" or "4"), one per rank in RUN_DIR/traces/.
    profile: str = ""


@dataclass
class DataConfig:
    # A built-in corpus name, a text file or folder, a token file (.bin of uint16 / .npy), or a
    # shard folder from `tetrad data`.
    source: str = "licenses"
    # Validation tokens: a separate source, or the last val_fraction of `source` held out.
    val_source: str = ""
    val_fraction: float = 0.0


@dataclass
class CheckpointConfig:
    dir: str = ""  # empty: RUN_DIR/checkpoints
    every: int = 0
    keep: int = 2
    resume: str = "auto"  # "auto" | "never" | a checkpoint path
    # A fresh run's starting weights (weights only; optimizer and step start afresh): a tetrad
    # checkpoint or an HF Llama folder. Resuming the run's own checkpoint takes precedence.
    init_from: str = ""


@dataclass
class RunConfig:
    dir: str = "runs/tetrad"
    log_every: int = 10
    # Also write the per-step metrics as TensorBoard scalars to RUN_DIR/tensorboard/ (needs `tensorboard`).
    tensorboard: bool = False
    # Also log them to Weights & Biases (needs `wandb`); the run's name defaults to RUN_DIR's.
    wandb: bool = False
    wandb_project: str = "tetrad"
    wandb_name: str = ""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    run: RunConfig = field(default_factory=RunConfig)

    @property
    def microbatches(self) -> int:
        """Micro-batches per optimizer step on each data-parallel rank."""
        return self.train.global_batch // (self.train.micro_batch * self.parallel.dp)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_toml(self) -> str:
        lines = []
        for section, values in self.to_dict().items():
            lines.append(f"[{section}]")
            lines += [f"{key} = {_toml_value(value)}" for key, value in values.items()]
            lines.append("")
        return "\n".join(lines)


SECTIONS: dict[str, type] = typing.get_type_hints(Config)


# ----------------------------------------------------------------------------- loading

def load_config(path: str | Path | None = None, overrides: list[str] | dict | None = None,
                world_size: int | None = None, runtime: bool = True,
                model_from_inputs: Callable[[dict], dict] | None = None) -> Config:
    """Read a TOML file (optional), apply overrides, resolve the preset, type-check and validate.

    `overrides` is a list of `section.key=value` strings (values parsed as TOML literals, falling
    back to plain strings) or a nested dict. `world_size`, when known (under torchrun), must equal
    dp*tp*pp*cp. `runtime=False` (estimate/plan) also admits what only the cost model knows (fp8).
    `model_from_inputs(raw)` gives [model] keys that the run's inputs decide (the data's vocabulary,
    the shape of the weights it starts from): above the preset, below the user's own keys.
    """
    raw: dict[str, dict] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            raw = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path} is not valid TOML: {e}") from None
    if isinstance(overrides, dict):
        for section, values in overrides.items():
            raw.setdefault(section, {}).update(values)
    else:
        for item in overrides or []:
            section, key, value = _parse_override(item)
            raw.setdefault(section, {})[key] = value
    cfg = _build(raw, model_from_inputs(raw) if model_from_inputs else {})
    validate(cfg, world_size, runtime)
    return cfg


def _parse_override(item: str) -> tuple[str, str, Any]:
    item = item[2:] if item.startswith("--") else item
    if "=" not in item or "." not in item.split("=", 1)[0]:
        raise ConfigError(f"override {item!r} must look like --section.key=value, e.g. --parallel.tp=2")
    dotted, text = item.split("=", 1)
    section, key = dotted.split(".", 1)
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text  # a bare word such as 1f1b or runs/x
    return section, key, value


def _build(raw: dict, from_inputs: dict) -> Config:
    for section in raw:
        if section not in SECTIONS:
            raise ConfigError(f"unknown section [{section}]{_did_you_mean(section, SECTIONS)}; "
                              f"sections are {', '.join(SECTIONS)}")
        if not isinstance(raw[section], dict):
            raise ConfigError(f"[{section}] must be a table of keys, got {raw[section]!r}")
    model_raw = dict(raw.get("model", {}))
    preset = model_raw.get("preset", ModelConfig.preset)
    if preset not in PRESETS:
        raise ConfigError(f"unknown model.preset {preset!r}{_did_you_mean(preset, PRESETS)}; "
                          f"presets are {', '.join(PRESETS)}")
    model_raw = {**PRESETS[preset], **from_inputs, **model_raw, "preset": preset}
    sections = {}
    for name, cls in SECTIONS.items():
        values = model_raw if name == "model" else raw.get(name, {})
        sections[name] = _build_section(name, cls, values)
    return Config(**sections)


def _build_section(section: str, cls: type, values: dict):
    hints = typing.get_type_hints(cls)
    known = [f.name for f in dataclasses.fields(cls)]
    for key, value in values.items():
        if key not in hints:
            raise ConfigError(f"unknown key {section}.{key}{_did_you_mean(key, known)}; "
                              f"[{section}] keys are {', '.join(known)}")
        values[key] = _check_type(f"{section}.{key}", value, hints[key])
    return cls(**values)


def _check_type(name: str, value: Any, hint: Any) -> Any:
    """Return value (ints widened to float where a float is wanted) or raise a ConfigError."""
    options = typing.get_args(hint) if typing.get_origin(hint) in (Union, types.UnionType) else (hint,)
    for option in options:
        if typing.get_origin(option) is Literal:
            if value in typing.get_args(option):
                return value
        elif option is bool:
            if isinstance(value, bool):
                return value
        elif option is float:
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
        elif option in (int, str):
            if isinstance(value, option) and not isinstance(value, bool):
                return value
        elif typing.get_origin(option) is list:
            item = typing.get_args(option)[0]
            if isinstance(value, list):
                return [_check_type(f"{name}[{i}]", v, item) for i, v in enumerate(value)]
        elif typing.get_origin(option) is dict:
            item = typing.get_args(option)[1]
            if isinstance(value, dict):
                return {k: _check_type(f"{name}.{k}", v, item) for k, v in value.items()}
    raise ConfigError(f"{name} must be {_describe(options)}, got {value!r} ({type(value).__name__})")


def _describe(options: tuple) -> str:
    words = []
    for option in options:
        if typing.get_origin(option) is Literal:
            words.append("one of " + ", ".join(repr(v) for v in typing.get_args(option)))
        elif typing.get_origin(option) is list:
            words.append(f"a list of {_describe(typing.get_args(option))}s")
        elif typing.get_origin(option) is dict:
            words.append("a table")
        else:
            words.append({bool: "true or false", int: "an integer", float: "a number",
                          str: "a string"}[option])
    return " or ".join(words)


def _did_you_mean(word: str, choices) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + "}"
    return repr(value)


# ----------------------------------------------------------------------------- validation

def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def profile_steps(spec: str) -> range:
    """The 1-based steps `train.profile` names ("3-5", "4"; "" for none)."""
    if not spec:
        return range(0)
    first, _, last = spec.partition("-")
    try:
        steps = range(int(first), int(last or first) + 1)
    except ValueError:
        steps = range(0)
    if not steps or steps.start < 1:
        raise ConfigError(f"train.profile={spec!r} must name steps like '3-5' or '4' (1-based, first <= last)")
    return steps


def validate(cfg: Config, world_size: int | None = None, runtime: bool = True) -> None:
    """Raise ConfigError for the first problem found, naming the fix."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    profile_steps(t.profile)
    for section, obj in (("model", m), ("parallel", p), ("train", t)):
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            positive = f.name in {"n_layers", "d_model", "n_heads", "n_kv_heads", "ffn_hidden", "vocab_size",
                                  "seq_len", "dp", "tp", "pp", "cp", "vpp", "ranks_per_node", "steps",
                                  "global_batch", "micro_batch", "eval_steps"}
            if positive and v < 1:
                raise ConfigError(f"{section}.{f.name} must be at least 1, got {v}")
    if world_size is not None and p.world_size != world_size:
        others = p.tp * p.pp * p.cp
        fix = (f"set parallel.dp={world_size // others}" if world_size % others == 0
               else f"choose tp*pp*cp dividing {world_size}")
        raise ConfigError(f"dp*tp*pp*cp = {p.dp}*{p.tp}*{p.pp}*{p.cp} = {p.world_size} but the job has "
                          f"{world_size} ranks; {fix}")
    if m.d_model % m.n_heads:
        raise ConfigError(f"d_model={m.d_model} is not divisible by n_heads={m.n_heads}; "
                          f"use n_heads in {_divisors(m.d_model)}")
    if m.n_heads % m.n_kv_heads:
        raise ConfigError(f"n_heads={m.n_heads} is not a multiple of n_kv_heads={m.n_kv_heads}; "
                          f"use n_kv_heads in {_divisors(m.n_heads)}")
    if m.pos == "rope" and m.head_dim % 2:
        raise ConfigError(f"RoPE needs an even head_dim, got d_model/n_heads = {m.head_dim}")
    common = sorted(set(_divisors(m.n_heads)) & set(_divisors(m.n_kv_heads)))
    if m.n_heads % p.tp:
        raise ConfigError(f"tp={p.tp} does not divide n_heads={m.n_heads}; use tp in {common}")
    if m.n_kv_heads % p.tp:
        raise ConfigError(f"tp={p.tp} does not divide n_kv_heads={m.n_kv_heads}; use tp in {common}")
    if m.ffn_hidden % p.tp:
        raise ConfigError(f"tp={p.tp} does not divide ffn_hidden={m.ffn_hidden}; "
                          f"use tp in {sorted(set(common) & set(_divisors(m.ffn_hidden)))}")
    if p.vpp > 1 and p.pp == 1:
        raise ConfigError(f"parallel.vpp={p.vpp} interleaves model chunks over pipeline ranks, and pp=1 has one; "
                          f"set parallel.pp >= 2 or vpp=1")
    stages = p.pp * p.vpp
    if m.n_layers < stages:
        raise ConfigError(f"n_layers={m.n_layers} is fewer than pp*vpp = {p.pp}*{p.vpp} = {stages} pipeline "
                          f"stages; use pp*vpp <= {m.n_layers}")
    if p.stage_layers and (len(p.stage_layers) != stages or sum(p.stage_layers) != m.n_layers
                           or min(p.stage_layers) < 1):
        raise ConfigError(f"parallel.stage_layers={p.stage_layers} must list pp*vpp = {stages} layer counts, each "
                          f">= 1, adding up to n_layers={m.n_layers}; or leave it empty for a balanced split")
    if p.pp > 1:
        if runtime and m.tie_embeddings and p.zero == 3:
            raise ConfigError("tie_embeddings with pp > 1 and zero=3 is not supported yet (the embedding's copy on "
                              "the last stage would need its own gathered bucket); use zero<=2, "
                              "model.tie_embeddings=false or pp=1")
    if p.cp > 1 and m.seq_len % (2 * p.cp):
        ok = [c for c in _divisors(m.seq_len // 2) if c > 1][:8]
        raise ConfigError(f"seq_len={m.seq_len} is not divisible by 2*cp = {2 * p.cp} (the sequence is cut "
                          f"into 2*cp chunks for load balance); use cp in {[1] + ok} or change seq_len")
    if p.sequence_parallel and p.tp > 1 and (m.seq_len // p.cp) % p.tp:
        raise ConfigError(f"sequence_parallel splits each rank's {m.seq_len // p.cp} tokens (seq_len/cp) over "
                          f"tp={p.tp}, which must divide them; use a seq_len that is a multiple of cp*tp = "
                          f"{p.cp * p.tp}, or sequence_parallel=false")
    if p.cp > 1 and p.cp_algo == "alltoall" and (m.n_heads % (p.cp * p.tp) or m.n_kv_heads % (p.cp * p.tp)):
        ok = [c for c in _divisors(m.seq_len // 2) if not m.n_heads % (c * p.tp) and not m.n_kv_heads % (c * p.tp)]
        raise ConfigError(f"cp_algo='alltoall' splits heads over cp*tp = {p.cp}*{p.tp}, which must divide "
                          f"n_heads={m.n_heads} and n_kv_heads={m.n_kv_heads}; use cp in {ok} or cp_algo='ring'")
    if t.global_batch % (t.micro_batch * p.dp):
        raise ConfigError(f"global_batch={t.global_batch} is not divisible by micro_batch*dp = "
                          f"{t.micro_batch}*{p.dp} = {t.micro_batch * p.dp}; use a global_batch that is a "
                          f"multiple of {t.micro_batch * p.dp}, or change micro_batch")
    if p.zero not in (0, 1, 2, 3):
        raise ConfigError(f"parallel.zero must be 0, 1, 2 or 3, got {p.zero}")
    if p.grad_bucket_mb != "auto" and not p.grad_bucket_mb > 0:
        raise ConfigError(f"parallel.grad_bucket_mb must be > 0 (or 'auto'), got {p.grad_bucket_mb}")
    if p.grad_codec != "none" and p.zero >= 2:
        raise ConfigError(f"grad_codec={p.grad_codec!r} compresses the all-reduce of ZeRO 0/1; zero={p.zero} "
                          f"reduce-scatters instead. Use zero<=1 or grad_codec='none'")
    if p.grad_codec == "int8" and p.dp * p.cp > 127:
        raise ConfigError(f"grad_codec='int8' sums int8 over dp*cp = {p.dp * p.cp} ranks, at most 127; "
                          f"use bf16 or hierarchical reduction")
    if p.hierarchical is True:
        if p.zero >= 2 or p.grad_codec != "none":
            raise ConfigError(f"hierarchical=true reduces the ZeRO 0/1 all-reduce without a codec; got "
                              f"zero={p.zero}, grad_codec={p.grad_codec!r}")
        per_node = p.ranks_per_node // p.tp
        if p.ranks_per_node % p.tp or (p.dp * p.cp) % per_node and per_node % (p.dp * p.cp):
            raise ConfigError(f"hierarchical=true needs the dp*cp = {p.dp * p.cp} ranks of a group split evenly "
                              f"over nodes of ranks_per_node={p.ranks_per_node} (tp={p.tp} per replica); "
                              f"use a ranks_per_node that is a multiple of tp and divides or is divided by "
                              f"dp*cp*tp")
    if t.eval_every < 0:
        raise ConfigError(f"train.eval_every must be >= 0 (0 = no validation), got {t.eval_every}")
    _validate_comm_options(p.comm_options)
    if t.warmup < 0 or t.lr <= 0 or not 0 <= t.min_lr_ratio <= 1:
        raise ConfigError(f"need lr > 0, 0 <= min_lr_ratio <= 1 and warmup >= 0; got lr={t.lr}, "
                          f"min_lr_ratio={t.min_lr_ratio}, warmup={t.warmup}")
    if t.lr_schedule == "wsd" and not (0 < t.decay_fraction <= 1 and t.warmup + round(t.decay_fraction * t.steps)
                                       <= t.steps):
        raise ConfigError(f"lr_schedule='wsd' decays over the last decay_fraction={t.decay_fraction} of "
                          f"steps={t.steps}, which must be in (0, 1] and leave room for warmup={t.warmup}")
    if runtime and t.dtype == "fp8":
        raise ConfigError("train.dtype='fp8' is accepted by `tetrad estimate`/`plan` only; the runtime trains "
                          "in fp32, bf16 or fp16")
    if t.dtype == "fp16" and p.grad_codec in ("int8", "powersgd"):
        raise ConfigError(f"train.dtype='fp16' skips steps whose gradients overflow, which would leave inf in "
                          f"grad_codec={p.grad_codec!r}'s error feedback; use train.dtype='bf16' or "
                          f"grad_codec='none'/'bf16'")
    if t.offload_optimizer and t.device == "cpu":
        raise ConfigError("train.offload_optimizer moves optimizer state from an accelerator to CPU memory; with "
                          "train.device='cpu' it is there already: set train.offload_optimizer=false")
    if t.compile and (p.tp > 1 or p.cp > 1):
        raise ConfigError(f"train.compile compiles blocks without collectives inside; tp={p.tp}, cp={p.cp} put "
                          f"communication in every block. Set train.compile=false, or tp=1 and cp=1")
    if not 0.0 <= m.dropout < 1.0:
        raise ConfigError(f"model.dropout must be in [0, 1), got {m.dropout}")
    if runtime and cfg.run.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("run.tensorboard=true needs the optional `tensorboard` package, which is not installed: "
                          "pip install tensorboard (or tetrad[tensorboard]), or set run.tensorboard=false")
    if runtime and cfg.run.wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError("run.wandb=true needs the optional `wandb` package, which is not installed: "
                          "pip install wandb (or tetrad[wandb]), or set run.wandb=false")
    if cfg.run.log_every < 1:
        raise ConfigError(f"run.log_every must be at least 1 (steps between plain log lines), got {cfg.run.log_every}")
    if cfg.checkpoint.keep < 1 or cfg.checkpoint.every < 0:
        raise ConfigError("checkpoint.keep must be >= 1 and checkpoint.every >= 0 (0 = never)")
    if not 0 <= cfg.data.val_fraction < 1 or (cfg.data.val_fraction and cfg.data.val_source):
        raise ConfigError(f"data.val_fraction={cfg.data.val_fraction} must be in [0, 1), and 0 when data.val_source "
                          "is set (validation comes from one or the other)")
    if cfg.train.eval_every and not (cfg.data.val_fraction or cfg.data.val_source):
        raise ConfigError("train.eval_every needs held-out tokens: set data.val_fraction (e.g. 0.01) or "
                          "data.val_source")


def _validate_comm_options(groups: dict) -> None:
    for group, options in groups.items():
        if group not in COMM_GROUPS:
            raise ConfigError(f"parallel.comm_options has no group {group!r}{_did_you_mean(group, COMM_GROUPS)}; "
                              f"groups are {', '.join(COMM_GROUPS)}")
        for key, value in options.items():
            name = f"parallel.comm_options.{group}.{key}"
            if key not in COMM_OPTIONS:
                raise ConfigError(f"unknown setting {name}{_did_you_mean(key, COMM_OPTIONS)}; "
                                  f"settings are {', '.join(COMM_OPTIONS)}")
            kind, allowed = COMM_OPTIONS[key]
            if (kind is bool) != isinstance(value, bool) or (allowed is not None and value not in allowed):
                within = "true or false" if allowed is None else f"an integer in {allowed.start}..{allowed.stop - 1}"
                raise ConfigError(f"{name} must be {within}, got {value!r}")
        if options.get("min_ctas", 1) > options.get("max_ctas", 64):
            raise ConfigError(f"parallel.comm_options.{group}: min_ctas={options['min_ctas']} exceeds "
                              f"max_ctas={options['max_ctas']}; lower min_ctas or raise max_ctas")


def validate_device(cfg: Config, device_type: str) -> None:
    """The checks that need the device `train.device` resolved to (before any rank starts)."""
    from tetrad.device import dtype_problem
    from tetrad.train.precision import model_dtype
    t = cfg.train
    if t.offload_optimizer and device_type == "cpu":
        raise ConfigError("train.offload_optimizer moves optimizer state off an accelerator, and this machine has "
                          "none (train.device resolved to 'cpu'): set train.offload_optimizer=false")
    problem = dtype_problem(device_type, model_dtype(t.dtype)) if t.dtype in ("bf16", "fp16") else None
    if problem:
        other = "bf16" if t.dtype == "fp16" else "fp32"
        raise ConfigError(f"train.dtype={t.dtype!r}: this {device_type} device cannot multiply {t.dtype} "
                          f"matrices ({problem}); use train.dtype={other!r} or 'fp32'")
