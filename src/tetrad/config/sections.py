"""The config's sections: typed dataclasses, one per TOML table. The section and key names are
a contract (docs/design.md): users' scripts rely on them. Every numeric key's range is stated in
validation.RANGES, next to the other rules."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Union

from tetrad.config.model_section import ModelConfig

# Gradient bucket size when none is measured ("auto" with nothing to tune, or before the
# measurement: the planner): torch DDP's default.
DEFAULT_BUCKET_MB = 25.0


def hierarchical_blocker(parallel) -> str | None:
    """Why hierarchical reduction cannot reduce this run's gradients (None: it can, given dp x cp
    groups spread evenly over nodes): it replaces the ZeRO 0/1 all-reduce, without a codec.
    Config validation and dist/autotune.py both ask this."""
    if parallel.zero >= 2 or parallel.grad_codec != "none":
        return (f"hierarchical reduces the ZeRO 0/1 all-reduce without a codec; got zero={parallel.zero}, "
                f"grad_codec={parallel.grad_codec!r}")
    if zero_shard(parallel):
        return f"hybrid ZeRO (zero_shard={parallel.zero_shard}) reduces within its shard groups instead"
    return None


def expert_parallel_blocker(parallel) -> str | None:
    """What expert parallelism (parallel.ep > 1) does not take, in one line naming the fix, or
    None: a hybrid ZeRO block that splits an EP group (the experts shard inside the blocks, which
    must hold whole EP groups: docs/design.md "Expert parallelism"). Config validation refuses it;
    the planner skips it."""
    whole, n = parallel.ep * parallel.cp, parallel.dp * parallel.cp  # whole: an EP group's dp x cp span
    s = zero_shard(parallel)
    if parallel.ep == 1 or not s or not (s % whole or n % s):
        return None
    fits = [k for k in range(whole, n, whole) if not n % k]
    return (f"parallel.zero_shard={parallel.zero_shard} must be a multiple of ep*cp = {whole} dividing dp*cp = {n} "
            f"under expert parallelism (each ZeRO shard block holds whole EP groups, so that the experts shard "
            f"inside it too); use zero_shard in {fits + [0]}")


def zero_shard(parallel) -> int:
    """The ranks each ZeRO shard set spans under hybrid sharding (ZeRO 1-3 sharded over blocks of
    that many dp x cp ranks, replicated across them), or 0: sharded over all of dp x cp (also
    where zero_shard is unset, equals dp x cp, or ZeRO is 0)."""
    size = parallel.zero_shard
    return size if parallel.zero >= 1 and 0 < size < parallel.dp * parallel.cp else 0


def shard_ranks(parallel) -> int:
    """The ranks ZeRO shards states over: hybrid ZeRO's block, or all of dp x cp."""
    return zero_shard(parallel) or parallel.dp * parallel.cp


def bucket_bytes(parallel) -> float:
    """Bytes of fp32 gradient per bucket under `parallel` (None: the defaults); "auto" not yet
    measured (dist/autotune.py) counts as DEFAULT_BUCKET_MB, for the planner and the runtime alike."""
    mb = DEFAULT_BUCKET_MB if parallel is None or parallel.grad_bucket_mb == "auto" else parallel.grad_bucket_mb
    return float(mb) * 2**20


class ConfigError(ValueError):
    """A config that cannot run; the message says what to change."""


# parallel.comm_options: the groups that take settings (a pipeline link's take "pp"'s) and each
# setting's type and range: ProcessGroupNCCL.Options' high-priority stream, NCCL's config.
COMM_GROUPS = ("tp", "cp", "dp", "pp", "dp_cp", "dp_cp_intra", "dp_cp_inter", "dp_cp_shard", "dp_cp_replica", "ep",
               "edp_cp", "edp_cp_shard", "embed")
COMM_OPTIONS = {"high_priority_stream": (bool, None), "cga_cluster_size": (int, range(0, 9)),
                "min_ctas": (int, range(1, 65)), "max_ctas": (int, range(1, 65))}

@dataclass
class ParallelConfig:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    # Expert parallelism: each mixture-of-experts layer's experts split over consecutive blocks of
    # this many dp ranks (tokens travel to their experts by all-to-all); must divide dp. Megatron's
    # --expert-model-parallel-size, within dp as there.
    ep: int = 1
    vpp: int = 1
    schedule: str = "1f1b"  # a name in parallel/pipeline/registry.py, whose check_config validates it
    # Layers of each of the pp*vpp pipeline stages, e.g. [7, 8, 8, 7]; empty: balanced by FLOPs.
    stage_layers: list[int] = field(default_factory=list)
    zero: int = 0
    # Hybrid sharding (FSDP2's HSDP, Megatron-Core's partial distributed optimizer): ZeRO 1-3 shard
    # over consecutive blocks of this many dp x cp ranks and replicate across blocks; 0: all of them.
    zero_shard: int = 0
    sequence_parallel: bool = False
    # Under SP, gather a column-parallel linear's input again in backward instead of keeping it
    # gathered (Megatron-LM): (tp-1)/tp of its activation memory for one more all-gather. Off by
    # default: tp=2 on the 2-core CPU (d_model 512, 4 layers, seq 256, batch 4) it saves 8% of the
    # saved activations (110.2 -> 101.2 MiB) for 2-3% more step time.
    sp_regather: bool = False
    cp_algo: Literal["ring", "alltoall"] = "ring"
    grad_bucket_mb: Union[float, Literal["auto"]] = DEFAULT_BUCKET_MB
    grad_codec: Literal["none", "bf16", "int8", "powersgd"] = "none"
    hierarchical: Union[bool, Literal["auto"]] = False
    ranks_per_node: int = 8
    # NCCL communicator settings per group, as Megatron-Core's communicator config file has them, e.g.
    # {tp = {high_priority_stream = true, cga_cluster_size = 2, max_ctas = 16}}: COMM_OPTIONS.
    comm_options: dict[str, dict[str, Union[bool, int]]] = field(default_factory=dict)
    # Seconds a training collective may wait before the job ends naming the ranks that did not
    # arrive; the start-up (process groups, first step) and checkpoint I/O get the longer one.
    collective_timeout_s: float = 180.0
    startup_timeout_s: float = 600.0

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp


@dataclass
class TrainConfig:
    steps: int = 200
    global_batch: int = 16
    micro_batch: int = 4
    # [start, increment, samples]: Megatron-LM's --rampup-batch-size (config/rampup.py): the global
    # batch starts at `start` and grows by `increment` until it is global_batch after `samples`
    # samples; the LR schedule stays step-based. Empty: no ramp.
    batch_rampup: list[int] = field(default_factory=list)
    lr: float = 3e-3
    # After `warmup` steps: cosine or linear decay to lr * min_lr_ratio at the last step, constant,
    # or warmup-stable-decay (lr until the last `decay_fraction` of the steps, then linear decay).
    lr_schedule: Literal["cosine", "linear", "constant", "wsd"] = "cosine"
    min_lr_ratio: float = 0.1
    decay_fraction: float = 0.2
    warmup: int = 20
    weight_decay: float = 0.1  # on matrices only, not on norms and biases
    # AdamW's betas and epsilon (Megatron-LM's and Llama's defaults; 0.999 and 1e-8 are torch's).
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    grad_clip: float = 1.0
    seed: int = 0
    dtype: Literal["fp32", "bf16", "fp16", "fp8"] = "fp32"
    recompute: Literal["none", "selective", "selective-op", "full"] = "none"
    # The output head and its cross-entropy fused, this many tokens of logits at a time
    # (model/chunked_loss.py: Liger's fused linear cross-entropy): the vocabulary-sized logits of
    # a whole micro-batch, its largest activation, never exist, for one more head GEMM in backward.
    # 0: off, the head's logits made whole.
    loss_chunk_tokens: int = 0
    device: Literal["cpu", "cuda", "auto"] = "auto"
    # fp32 master weights and AdamW state in CPU memory instead of the accelerator's.
    offload_optimizer: bool = False
    # torch.compile each transformer block, in every layout: tp's, cp's and zero-bubble's
    # autograd Functions run eagerly between its compiled regions (model/execution.py).
    compile: bool = False
    # Document masking (Llama 3's, torchtitan's block_causal, Megatron-LM's --reset-attention-mask):
    # a token attends only to earlier tokens of its own document, the data's EOS ending each one
    # (the data must be a shard folder from `tetrad data`, whose index names its EOS). Positions
    # (RoPE) run on through the window, as in Llama 3, unless reset_positions.
    document_mask: bool = False
    # Each token's position is its offset within its document (Megatron-LM's --reset-position-ids;
    # packed SFT as torchtune and HF's collators pack): the token after an EOS is at 0. The same
    # data as document_mask; without it, tokens still attend across documents.
    reset_positions: bool = False
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
    # Write checkpoints from a thread while training goes on (train/checkpoint/background.py): the
    # step waits only for the copy of the state into CPU memory.
    async_save: bool = False
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
        """Micro-batches per optimizer step on each data-parallel rank (at train.global_batch: the
        most a batch ramp-up reaches)."""
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
