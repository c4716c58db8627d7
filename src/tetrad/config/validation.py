"""Validation: every rule a config must meet, checked before any process starts. Each error is one
line that names the fix. First every numeric key against its stated range (RANGES), then the
rules that tie keys together (divisibility, schedules, codecs, devices)."""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass

from tetrad.config.rampup import BatchRamp
from tetrad.config.rope import check_rope
from tetrad.config.experts import check_experts
from tetrad.config.latent import check_latent_attention
from tetrad.config.wording import counted, did_you_mean, divisors
from tetrad.config.sections import (COMM_GROUPS, COMM_OPTIONS, Config, ConfigError,
                                    ParallelConfig, hierarchical_blocker,
                                    zero_shard)


@dataclass(frozen=True)
class Range:
    """Closed or open bounds of a numeric key; floats must also be finite."""

    low: float
    high: float = math.inf
    low_open: bool = False
    high_open: bool = True

    def holds(self, value) -> bool:
        if isinstance(value, float) and not math.isfinite(value):
            return False
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def __str__(self) -> str:
        low = f"{'>' if self.low_open else '>='} {_number(self.low)}"
        if self.high == math.inf:
            return low
        return (f"in {'(' if self.low_open else '['}{_number(self.low)}, {_number(self.high)}"
                f"{')' if self.high_open else ']'}")


def _number(x: float) -> str:
    """Integers in full (2147483648, not 2.14748e+09), other numbers short."""
    return str(x) if isinstance(x, int) else f"{x:g}"


INT_MAX = 2**31  # sizes and counts: torch dimensions, ranks and steps stay in int32
SIZE = Range(1, INT_MAX)
COUNT = Range(0, INT_MAX)
POSITIVE = Range(0, low_open=True)
FRACTION = Range(0, 1, high_open=False)
# Every numeric key's range (a test checks that none is missing). Floats must also be finite.
RANGES: dict[str, Range] = {
    **{f"model.{k}": SIZE for k in ("n_layers", "d_model", "n_heads", "n_kv_heads", "ffn_hidden", "vocab_size",
                                    "seq_len")},
    "model.head_dim": COUNT,  # 0: d_model / n_heads
    "model.sliding_window": COUNT,  # 0: no window
    "model.max_position_embeddings": COUNT,  # 0: seq_len
    "model.rope_theta": POSITIVE, "model.norm_eps": POSITIVE, "model.dropout": Range(0, 1),
    "model.partial_rotary_factor": Range(0, 1, low_open=True, high_open=False),
    "model.rope_local_base_freq": Range(0), "model.query_pre_attn_scalar": Range(0),  # 0: as the others, head_dim
    "model.n_experts": COUNT, "model.experts_per_token": SIZE, "model.expert_ffn_hidden": COUNT,  # 0: dense; ffn_hidden
    "model.shared_expert_ffn_hidden": COUNT, "model.dense_layers": COUNT,  # 0: no shared expert
    "model.router_aux_loss": Range(0), "model.router_bias_update_rate": Range(0),  # 0: no expert bias update
    "model.kv_lora_rank": COUNT, "model.q_lora_rank": COUNT,  # 0: no latent attention; a full query projection
    **{f"model.{k}": SIZE for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")},
    "model.expert_weight_scale": POSITIVE, "model.expert_groups": SIZE, "model.expert_groups_per_token": SIZE,
    "model.expert_group_score_top": SIZE,
    "model.mtp_layers": COUNT, "model.mtp_loss_weight": Range(0),  # 0: no multi-token prediction
    **{f"parallel.{k}": SIZE for k in ("dp", "tp", "pp", "cp", "ep", "vpp", "ranks_per_node")},
    "parallel.stage_layers": SIZE, "parallel.zero": Range(0, 3, high_open=False), "parallel.zero_shard": COUNT,
    "parallel.grad_bucket_mb": POSITIVE, "parallel.collective_timeout_s": POSITIVE, "parallel.startup_timeout_s": POSITIVE,
    "train.steps": SIZE, "train.global_batch": SIZE, "train.micro_batch": SIZE, "train.batch_rampup": SIZE,
    "train.warmup": COUNT, "train.loss_chunk_tokens": COUNT,  # 0: the head's logits made whole
    "train.eval_every": COUNT, "train.eval_steps": SIZE,  # eval_every 0: no validation
    "train.lr": POSITIVE, "train.min_lr_ratio": FRACTION, "train.decay_fraction": Range(0, 1, low_open=True,
                                                                                         high_open=False),
    "train.weight_decay": Range(0), "train.grad_clip": Range(0),  # grad_clip 0: no clipping
    "train.adam_beta1": Range(0, 1), "train.adam_beta2": Range(0, 1), "train.adam_eps": POSITIVE,
    "train.seed": Range(0, 2**63),
    "checkpoint.every": COUNT, "checkpoint.keep": SIZE,  # every 0: never
    "run.log_every": SIZE, "data.val_fraction": Range(0, 1),
}


RANGED_KEYS = tuple((name, tuple(name.split("."))) for name in RANGES)  # (name, (section, key))
PARALLEL_SIZES = tuple(f"parallel.{k}" for k in ("dp", "tp", "pp", "cp", "vpp"))
# What a key means, where its range alone does not say what to set instead.
RANGE_HINTS = {"model.sliding_window": "; it is how many keys each query sees, itself included (HF's sliding_window, "
                                       "e.g. 4096); set 0 for no window"}


def check_ranges(cfg: Config) -> None:
    """Every numeric key (list items included) within its RANGES entry, in RANGES' order. Only the
    ranged keys are read: `tetrad plan` validates every candidate layout (tens of thousands)."""
    for name, (section, key) in RANGED_KEYS:
        value = getattr(getattr(cfg, section), key)
        for i, v in enumerate(value) if isinstance(value, list) else [(None, value)]:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or RANGES[name].holds(v):
                continue
            where = name if i is None else f"{name}[{i}]"
            kind = "a finite number" if isinstance(v, float) else "an integer"
            infer = ("; tetrad does not infer a size from -1 (torchtitan does): give each of dp, tp, pp, "
                     "cp, whose product is the number of ranks" if v == -1 and name in PARALLEL_SIZES else "")
            raise ConfigError(f"{where}={v!r} is out of range: it must be {kind} {RANGES[name]}{infer}"
                              f"{RANGE_HINTS.get(name, '')}")


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


def validate(cfg: Config, world_size: int | None = None, runtime: bool = True, ranges: bool = True) -> None:
    """Raise ConfigError for the first problem found, naming the fix (ranges=False: the planner's candidates)."""
    profile_steps(cfg.train.profile)
    if ranges:
        check_ranges(cfg)
    _check_world(cfg.parallel, world_size)
    _check_heads(cfg)
    check_experts(cfg)
    check_latent_attention(cfg.model)  # before RoPE's: its head_dim is nope + rope
    check_rope(cfg.model)
    _check_mtp(cfg.model)
    _check_pipeline(cfg, runtime)
    _check_sequence(cfg)
    _check_gradients(cfg)
    _check_comm_options(cfg.parallel.comm_options)
    _check_training(cfg, runtime)


def _check_mtp(m) -> None:
    """Multi-token prediction's depth k is layer n_layers + k, whose attention kind (window, RoPE)
    per-layer kinds do not name; its input is a token's embedding alone, which learned positions
    would leave without a position (Megatron-Core adds them; tetrad's depths take RoPE's)."""
    if m.mtp_layers and m.layer_types:
        raise ConfigError(f"model.mtp_layers={m.mtp_layers} adds layers past model.layer_types' {len(m.layer_types)}, "
                          "whose attention kind it does not name; unset model.layer_types or set model.mtp_layers=0")
    if m.mtp_layers and m.pos != "rope":
        raise ConfigError(f"model.mtp_layers={m.mtp_layers} takes positions from RoPE, and model.pos={m.pos!r} gives "
                          "its depths' token embeddings none; set model.pos='rope' or set model.mtp_layers=0")


def _check_world(p: ParallelConfig, world_size: int | None) -> None:
    if world_size is not None and p.world_size != world_size:
        others = p.tp * p.pp * p.cp
        fix = (f"set parallel.dp={world_size // others}" if world_size % others == 0
               else f"choose tp*pp*cp dividing {world_size}")
        raise ConfigError(f"dp*tp*pp*cp = {p.dp}*{p.tp}*{p.pp}*{p.cp} = {p.world_size} but the job has "
                          f"{counted(world_size, 'rank')}; {fix}")


def _check_heads(cfg: Config) -> None:
    m, p = cfg.model, cfg.parallel
    if m.d_model % m.n_heads and m.head_dim == m.d_model // m.n_heads:  # head_dim derived, not set
        raise ConfigError(f"d_model={m.d_model} is not divisible by n_heads={m.n_heads}; "
                          f"use n_heads in {divisors(m.d_model)}, or set model.head_dim")
    if m.n_heads % m.n_kv_heads:
        raise ConfigError(f"n_heads={m.n_heads} is not a multiple of n_kv_heads={m.n_kv_heads}; "
                          f"use n_kv_heads in {divisors(m.n_heads)}")
    for name, heads in (("n_heads", m.n_heads), ("n_kv_heads", m.n_kv_heads)):
        if heads % p.tp:
            raise ConfigError(f"tp={p.tp} does not divide {name}={heads}; use tp in {_head_divisors(m)}")
    if m.ffn_hidden % p.tp and not m.n_experts:  # an MoE model's experts are _check_experts'
        raise ConfigError(f"tp={p.tp} does not divide ffn_hidden={m.ffn_hidden}; "
                          f"use tp in {sorted(set(_head_divisors(m)) & set(divisors(m.ffn_hidden)))}")


def _head_divisors(m) -> list[int]:  # for a refusal only: the planner validates thousands of layouts
    return sorted(set(divisors(m.n_heads)) & set(divisors(m.n_kv_heads)))


def _check_pipeline(cfg: Config, runtime: bool) -> None:
    """Virtual stages and the layer split; the schedule's own rules (its name, vpp, the fewest
    micro-batches it runs) are the schedule registry's check_config."""
    m, p = cfg.model, cfg.parallel
    if p.vpp > 1 and p.pp == 1:
        raise ConfigError(f"parallel.vpp={p.vpp} interleaves model chunks over pipeline ranks, and pp=1 has one; "
                          f"set parallel.pp >= 2 or vpp=1")
    stages = p.pp * p.vpp
    if m.n_layers < stages:
        raise ConfigError(f"n_layers={m.n_layers} is fewer than pp*vpp = {p.pp}*{p.vpp} = {stages} pipeline "
                          f"stages; use pp*vpp <= {m.n_layers}")
    if p.stage_layers and (len(p.stage_layers) != stages or sum(p.stage_layers) != m.n_layers):
        raise ConfigError(f"parallel.stage_layers={p.stage_layers} must list pp*vpp = {stages} layer counts, each "
                          f">= 1, adding up to n_layers={m.n_layers}; or leave it empty for a balanced split")


def _check_sequence(cfg: Config) -> None:
    """The model's context, context parallelism's chunks and sequence parallelism's split. SP with a local sequence
    tp does not divide is refused: every tp rank must hold the same number of tokens."""
    m, p = cfg.model, cfg.parallel
    if m.pos == "learned" and m.max_position_embeddings > m.seq_len:
        raise ConfigError(f"model.pos='learned' has a position embedding of seq_len={m.seq_len} rows, so it reads no "
                          f"longer sequence than that; set model.max_position_embeddings=0 (seq_len)")
    if p.cp > 1 and m.seq_len % (2 * p.cp):
        ok = [c for c in divisors(m.seq_len) if c > 1 and m.seq_len % (2 * c) == 0][:8]
        raise ConfigError(f"seq_len={m.seq_len} is not divisible by 2*cp = {2 * p.cp} (the sequence is cut "
                          f"into 2*cp chunks for load balance); use cp in {[1] + ok} or change seq_len")
    if p.sequence_parallel and p.tp > 1 and (m.seq_len // p.cp) % p.tp:
        raise ConfigError(f"sequence_parallel splits each rank's {m.seq_len // p.cp} tokens (seq_len/cp) over "
                          f"tp={p.tp}, which must divide them; use a seq_len that is a multiple of cp*tp = "
                          f"{p.cp * p.tp}, or sequence_parallel=false")
    if p.sp_regather and not (p.sequence_parallel and p.tp > 1):
        raise ConfigError("sp_regather gathers sequence parallelism's input again in backward; it needs "
                          "sequence_parallel=true and tp > 1, or sp_regather=false")
    if p.cp > 1 and p.cp_algo == "alltoall" and (m.n_heads % (p.cp * p.tp) or m.n_kv_heads % (p.cp * p.tp)):
        ok = [c for c in divisors(m.seq_len // 2) if not m.n_heads % (c * p.tp) and not m.n_kv_heads % (c * p.tp)]
        fix = f"cp in {ok} or cp_algo='ring'" if len(ok) > 1 else "cp_algo='ring' (no cp > 1 splits them), or cp=1"
        raise ConfigError(f"cp_algo='alltoall' splits heads over cp*tp = {p.cp}*{p.tp}, which must divide "
                          f"n_heads={m.n_heads} and n_kv_heads={m.n_kv_heads}; use {fix}")


def _check_gradients(cfg: Config) -> None:
    """The batch split over data-parallel ranks, ZeRO, codecs and hierarchical reduction."""
    p, t = cfg.parallel, cfg.train
    if t.global_batch % (t.micro_batch * p.dp):
        raise ConfigError(f"global_batch={t.global_batch} is not divisible by micro_batch*dp = "
                          f"{t.micro_batch}*{p.dp} = {t.micro_batch * p.dp}; use a global_batch that is a "
                          f"multiple of {t.micro_batch * p.dp}, or change micro_batch")
    _check_rampup(t, t.micro_batch * p.dp)
    if p.grad_codec in ("int8", "powersgd") and p.zero >= 2:
        raise ConfigError(f"grad_codec={p.grad_codec!r} compresses the all-reduce of ZeRO 0/1; zero={p.zero} "
                          f"reduce-scatters instead. Use zero<=1, or grad_codec='bf16' or 'none'")
    if p.grad_codec == "int8" and p.dp * p.cp > 127:
        raise ConfigError(f"grad_codec='int8' sums int8 over dp*cp = {p.dp * p.cp} ranks, at most 127; "
                          f"use bf16 or hierarchical reduction")
    _check_zero_shard(p)
    if p.hierarchical is True:
        blocker = hierarchical_blocker(p)
        if blocker:
            raise ConfigError(f"hierarchical=true: {blocker}; use zero<=1 and grad_codec='none', or "
                              f"hierarchical=false ('auto' reduces flat where it cannot)")
        per_node = p.ranks_per_node // p.tp
        if p.ranks_per_node % p.tp or (p.dp * p.cp) % per_node and per_node % (p.dp * p.cp):
            raise ConfigError(f"hierarchical=true needs the dp*cp = {p.dp * p.cp} ranks of a group split evenly "
                              f"over nodes of ranks_per_node={p.ranks_per_node} (tp={p.tp} per replica); "
                              f"use a ranks_per_node that is a multiple of tp and divides or is divided by "
                              f"dp*cp*tp")


def _check_zero_shard(p: ParallelConfig) -> None:
    """Hybrid ZeRO's shard size: whole blocks of dp x cp, with a reduction it composes with."""
    replicas = p.dp * p.cp
    if p.zero_shard and replicas % p.zero_shard:
        raise ConfigError(f"parallel.zero_shard={p.zero_shard} must divide dp*cp = {replicas} (each ZeRO shard set "
                          f"is a block of that many dp x cp ranks); use zero_shard in {divisors(replicas)}, or 0 "
                          f"for all of them")
    if not zero_shard(p):
        return
    if p.grad_codec in ("int8", "powersgd"):
        raise ConfigError(f"grad_codec={p.grad_codec!r} compresses a whole-bucket all-reduce; zero_shard="
                          f"{p.zero_shard} reduce-scatters within shard groups instead. Use grad_codec='bf16' or "
                          f"'none', or zero_shard=0")
    if p.hierarchical is True:
        raise ConfigError(f"hierarchical=true and zero_shard={p.zero_shard} both split the dp*cp reduction by "
                          f"blocks of ranks; set hierarchical=false (zero_shard={p.zero_shard} reduces within "
                          f"its blocks) or zero_shard=0")


def _check_rampup(t, rows: int) -> None:
    """A ramp Megatron-LM's calculator accepts, whose every global batch splits into whole
    micro-batches over dp (`rows` = micro_batch*dp), as Megatron-LM requires at each update."""
    if not t.batch_rampup:
        return
    if len(t.batch_rampup) != 3:
        raise ConfigError(f"train.batch_rampup={t.batch_rampup} must be [start, increment, samples] (Megatron-LM's "
                          "--rampup-batch-size), or [] for a constant global batch")
    start, increment, _ = t.batch_rampup
    if start >= t.global_batch:
        raise ConfigError(f"train.batch_rampup={t.batch_rampup} starts at {start}, which must be below "
                          f"global_batch={t.global_batch} (the batch it ramps up to); lower start, or set [] for none")
    if (t.global_batch - start) % increment:
        raise ConfigError(f"train.batch_rampup={t.batch_rampup} must reach global_batch={t.global_batch} in whole "
                          f"increments: global_batch - start = {t.global_batch - start} is not a multiple of "
                          f"increment={increment}; change start or increment")
    size = BatchRamp.of(t).indivisible(rows)
    if size is not None:
        raise ConfigError(f"train.batch_rampup={t.batch_rampup} runs a global batch of {size}, which is not "
                          f"divisible by micro_batch*dp = {rows}; use a start and an increment that are "
                          f"multiples of {rows}, or change micro_batch")


def _check_comm_options(groups: dict) -> None:
    for group, options in groups.items():
        if group not in COMM_GROUPS:
            raise ConfigError(f"parallel.comm_options has no group {group!r}{did_you_mean(group, COMM_GROUPS, 'parallel.comm_options')}; "
                              f"groups are {', '.join(COMM_GROUPS)}")
        for key, value in options.items():
            name = f"parallel.comm_options.{group}.{key}"
            if key not in COMM_OPTIONS:
                raise ConfigError(f"unknown setting {name}{did_you_mean(key, COMM_OPTIONS, f'parallel.comm_options.{group}')}; "
                                  f"settings are {', '.join(COMM_OPTIONS)}")
            kind, allowed = COMM_OPTIONS[key]
            if (kind is bool) != isinstance(value, bool) or (allowed is not None and value not in allowed):
                within = "true or false" if allowed is None else f"an integer in {allowed.start}..{allowed.stop - 1}"
                raise ConfigError(f"{name} must be {within}, got {value!r}")
        if options.get("min_ctas", 1) > options.get("max_ctas", 64):
            raise ConfigError(f"parallel.comm_options.{group}: min_ctas={options['min_ctas']} exceeds "
                              f"max_ctas={options['max_ctas']}; lower min_ctas or raise max_ctas")


def _check_training(cfg: Config, runtime: bool) -> None:
    """The learning-rate schedule, precision, offload and optional packages."""
    p, t = cfg.parallel, cfg.train
    if t.lr_schedule == "wsd" and t.warmup + round(t.decay_fraction * t.steps) > t.steps:
        raise ConfigError(f"lr_schedule='wsd' decays over the last decay_fraction={t.decay_fraction} of "
                          f"steps={t.steps}, which must leave room for warmup={t.warmup}")
    if cfg.data.val_fraction and cfg.data.val_source:
        raise ConfigError(f"data.val_fraction={cfg.data.val_fraction} must be 0 when data.val_source is set "
                          "(validation comes from one or the other)")
    if t.eval_every and not (cfg.data.val_fraction or cfg.data.val_source):
        raise ConfigError("train.eval_every needs held-out tokens: set data.val_fraction (e.g. 0.01) or "
                          "data.val_source")
    if runtime and t.dtype == "fp8":
        raise ConfigError("train.dtype='fp8' is accepted by `tetrad estimate`/`plan` only; the runtime trains "
                          "in fp32, bf16 or fp16")
    if t.dtype == "fp16" and p.grad_codec in ("int8", "powersgd"):
        raise ConfigError(f"train.dtype='fp16' skips steps whose gradients overflow, which would leave inf in "
                          f"the error feedback of grad_codec={p.grad_codec!r}; use train.dtype='bf16' or "
                          f"grad_codec='none'/'bf16'")
    if t.offload_optimizer and t.device == "cpu":
        raise ConfigError("train.offload_optimizer moves optimizer state from an accelerator to CPU memory; with "
                          "train.device='cpu' it is there already: set train.offload_optimizer=false")
    if runtime and cfg.run.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("run.tensorboard=true needs the optional `tensorboard` package, which is not installed: "
                          "pip install tensorboard (or tetrad[tensorboard]), or set run.tensorboard=false")
    if runtime and cfg.run.wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError("run.wandb=true needs the optional `wandb` package, which is not installed: "
                          "pip install wandb (or tetrad[wandb]), or set run.wandb=false")


def idle_settings(cfg: Config) -> list[str]:
    """Settings this layout leaves without effect (not errors: a config may be shared between
    layouts), and a router they leave untrained, one line each, for the run's first lines: a user
    who set them expects them to act."""
    p, replicas = cfg.parallel, cfg.parallel.dp * cfg.parallel.cp
    notes = []
    if cfg.model.sliding_window >= cfg.model.context_length:
        notes.append(f"model.sliding_window={cfg.model.sliding_window} does nothing at seq_len={cfg.model.seq_len} "
                     "(every query already sees at most seq_len keys)")
    if 0 < cfg.model.max_position_embeddings < cfg.model.seq_len:
        notes.append(f"model.max_position_embeddings={cfg.model.max_position_embeddings} does nothing at seq_len="
                     f"{cfg.model.seq_len} (the model's context is the longer: seq_len, which generate reads to and "
                     "--to-hf exports)")
    if p.sequence_parallel and p.tp == 1:
        notes.append("parallel.sequence_parallel=true does nothing at tp=1 (it splits the sequence over tp)")
    if p.zero and replicas == 1:
        notes.append(f"parallel.zero={p.zero} does nothing at dp*cp=1 (it shards states over dp*cp replicas)")
    if p.zero_shard and p.zero == 0:
        notes.append(f"parallel.zero_shard={p.zero_shard} does nothing at zero=0 (it sets the ranks ZeRO 1-3 "
                     f"shard states over)")
    elif p.zero_shard and p.zero_shard == replicas and replicas > 1:
        notes.append(f"parallel.zero_shard={p.zero_shard} = dp*cp shards over all of them, as zero_shard=0 does")
    m = cfg.model
    if m.router_bias_update_rate and m.experts_per_token == m.n_experts:
        notes.append(f"model.router_bias_update_rate={m.router_bias_update_rate} moves a bias that picks nothing: every "
                     f"token goes to all {m.n_experts} experts (experts_per_token = n_experts); set it to 0 (one "
                     f"all-reduce a step fewer)")
    if m.expert_groups > 1 and m.expert_groups_per_token == m.expert_groups:
        notes.append(f"model.expert_groups={m.expert_groups} limits nothing with expert_groups_per_token = "
                     f"expert_groups (every token keeps every group); lower expert_groups_per_token, or set expert_groups=1")
    if m.n_experts and not m.weighs_experts and not m.router_aux_loss:
        notes.append("model.router_aux_loss=0 leaves the router as initialised at experts_per_token=1 with "
                     "normalize_expert_weights=true (each token's one weight is 1: no gradient reaches the router "
                     "but the load-balancing loss's); set router_aux_loss > 0 or normalize_expert_weights=false")
    if p.grad_codec != "none" and replicas == 1:
        notes.append(f"parallel.grad_codec={p.grad_codec!r} does nothing at dp*cp=1 (no gradient is reduced)")
    return notes


def validate_device(cfg: Config, device_type: str) -> None:
    """The checks that need the device `train.device` resolved to (before any rank starts)."""
    from tetrad.device import DTYPES, dtype_problem
    t = cfg.train
    if t.offload_optimizer and device_type == "cpu":
        raise ConfigError("train.offload_optimizer moves optimizer state off an accelerator, and this machine has "
                          "none (train.device resolved to 'cpu'): set train.offload_optimizer=false")
    problem = dtype_problem(device_type, DTYPES[t.dtype]) if t.dtype in ("bf16", "fp16") else None
    if problem:
        other = "bf16" if t.dtype == "fp16" else "fp32"
        raise ConfigError(f"train.dtype={t.dtype!r}: this {device_type} device cannot multiply {t.dtype} "
                          f"matrices ({problem}); use train.dtype={other!r} or 'fp32'")
