"""The config's sections: typed dataclasses, one per TOML table. The section and key names are
a contract (docs/design.md): users' scripts rely on them. Every numeric key's range is stated in
validation.RANGES, next to the other rules."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Union

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

ROPE_SCALING_KEYS = ("rope_type", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
LONGROPE_KEYS = ("rope_type", "short_factor", "long_factor", "original_max_position_embeddings", "attention_factor")


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
    # The longest sequence the model is meant for, beyond the seq_len it trains at (Megatron-LM's
    # --max-position-embeddings, HF's max_position_embeddings): how far `tetrad generate` reads
    # and what `convert --to-hf` writes, seq_len where that is longer (0: seq_len). An imported
    # model keeps its own, so a Llama 3.1 fine-tuned at seq_len 4096 still generates and exports
    # as the 128k model it is, and one trained past its original context exports the longer.
    max_position_embeddings: int = 0
    # "gemma_rmsnorm": Gemma's, in fp32, times (1 + weight): weights stored as offsets from one.
    norm: Literal["rmsnorm", "layernorm", "gemma_rmsnorm"] = "rmsnorm"
    # "geglu": Gemma's gated MLP, gelu (tanh form) of the gate times up, where SwiGLU takes silu.
    mlp: Literal["swiglu", "gelu", "geglu"] = "swiglu"
    pos: Literal["rope", "learned"] = "rope"
    tie_embeddings: bool = False
    # Biases on the q, k and v projections, as Qwen2 / Qwen2.5 have (HF's Llama `attention_bias`
    # puts one on the output projection too, which tetrad has not).
    qkv_bias: bool = False
    rope_theta: float = 10000.0
    # RoPE frequency scaling (model/rope.py rope_frequencies); empty: none. Llama 3.1's, as HF's
    # config.json holds it: {rope_type = "llama3", factor = 8.0, low_freq_factor = 1.0,
    # high_freq_factor = 4.0, original_max_position_embeddings = 8192}. Phi-3's LongRoPE (Phi-3
    # mini 128k, Phi-3.5, phi-4-mini): {rope_type = "longrope", short_factor = [...], long_factor =
    # [...], original_max_position_embeddings = 4096, attention_factor = 1.19}, a factor per
    # rotated pair (rotary_dim / 2 of them) dividing its frequency, long_factor's for a sequence
    # longer than original_max_position_embeddings, cos and sin times attention_factor.
    rope_scaling: dict[str, Union[str, float, list[float]]] = field(default_factory=dict)
    # RoPE on the first rotary_dim = int(head_dim * partial_rotary_factor) dims of each head
    # (phi-4-mini: 0.75); the others pass through unrotated.
    partial_rotary_factor: float = 1.0
    norm_eps: float = 1e-5
    dropout: float = 0.0
    # Width of each attention head; 0: d_model / n_heads. Qwen3 and Mistral NeMo set their own
    # (Qwen3-4B: 32 heads of 128 over d_model 2560), so q and the attention output are
    # n_heads * head_dim wide, not d_model.
    head_dim: int = 0
    # An RMSNorm over each head of q and of k before RoPE (Qwen3's q_norm and k_norm): one weight
    # of head_dim shared by every head, whose gradient each tp rank makes from its own heads.
    qk_norm: bool = False
    # Sliding-window attention (Mistral v0.1's `sliding_window`, Qwen2's with use_sliding_window):
    # a query at position i sees the keys j with i - sliding_window < j <= i, itself included;
    # 0: every earlier key (model/masks.py). A window of seq_len or more hides nothing.
    sliding_window: int = 0
    # HF's layer_types: "sliding_attention" or "full_attention" per layer (Gemma 3); empty: all alike.
    layer_types: list[str] = field(default_factory=list)
    # RoPE theta of layer_types' sliding layers, unscaled (Gemma 3's rope_local_base_freq, 10000):
    # rope_theta and rope_scaling are then the full layers' alone. 0: every layer takes those.
    rope_local_base_freq: float = 0.0
    # The attention's softmax scale is query_pre_attn_scalar ** -0.5 (HF Gemma's); 0: head_dim's.
    query_pre_attn_scalar: float = 0.0
    # Gemma 3's sandwich norms on the attention's and the MLP's outputs before the residual add.
    sandwich_norm: bool = False
    # The token embedding times sqrt(d_model), rounded to the activations' dtype (Gemma's).
    scale_embeddings: bool = False
    # The Hugging Face architecture `tetrad convert --to-hf` writes where several compute the model:
    # "" picks Llama's, Mistral's, Qwen2's or Qwen3's from the keys above; "phi3" Phi3ForCausalLM's
    # fused q/k/v and gate/up tensors where Phi-3 has the features (an imported Phi-3 keeps it,
    # fine-tuned too). The same math either way.
    hf_model_type: Literal["", "phi3"] = ""
    # Mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE, GLM-4.5; model/moe.py): every layer's MLP, but
    # dense_layers', is n_experts experts of the model's `mlp` kind and a router sending each token
    # to experts_per_token of them (top-k of the router's scores), dropless; 0: a dense MLP in every
    # layer. expert_ffn_hidden: each expert's hidden width (Qwen3-MoE's moe_intermediate_size; 0:
    # ffn_hidden, Mixtral's). router_aux_loss: the coefficient of the sequence-wise load-balancing
    # loss added to the training loss (0: none; not in val_loss). normalize_expert_weights: the k
    # weights renormalised to sum to one (Mixtral, Qwen3-MoE; Qwen2-MoE's norm_topk_prob=false
    # keeps the softmax's). shared_expert_ffn_hidden: the hidden width of a shared expert every MoE
    # layer adds, a dense MLP every token goes through beside its k (Qwen2-MoE's
    # shared_expert_intermediate_size, DeepSeek-MoE's n_shared_experts x moe_intermediate_size);
    # 0: none. shared_expert_gate: its output scaled per token by sigmoid(x . w) (Qwen2-MoE's).
    # dense_layers: the layers (0-based) whose MLP is a dense ffn_hidden-wide one in an MoE model
    # (Qwen2-MoE's mlp_only_layers and decoder_sparse_step, DeepSeek's first_k_dense_replace); not
    # every layer (that model is a dense one: n_experts=0). router_bias_update_rate: DeepSeek-V3's
    # expert bias (added to the scores to pick the top k alone), moved by it each step (0: kept).
    # DeepSeek-V3's routing (model/routing.py): router_score "sigmoid" (its scores; top-k weights
    # renormalised with normalize_expert_weights), expert_weight_scale (the routed experts' weights
    # times it: its routed_scaling_factor), expert_groups (equal groups of experts, in index order)
    # of which each token picks within its expert_groups_per_token best (1 group: no limit), a
    # group scored by its two best scores (Megatron-Core's moe_router_group_topk: by its k / topk
    # best, the same at DeepSeek-V3's top-8 of 4 groups).
    n_experts: int = 0
    experts_per_token: int = 2
    expert_ffn_hidden: int = 0
    router_aux_loss: float = 0.01
    router_bias_update_rate: float = 0.0
    normalize_expert_weights: bool = True
    shared_expert_ffn_hidden: int = 0
    shared_expert_gate: bool = False
    dense_layers: list[int] = field(default_factory=list)
    router_score: Literal["softmax", "sigmoid"] = "softmax"
    expert_weight_scale: float = 1.0
    expert_groups: int = 1
    expert_groups_per_token: int = 1

    def __post_init__(self):
        if not self.head_dim and self.n_heads > 0:
            self.head_dim = self.d_model // self.n_heads

    @property
    def gated_mlp(self) -> bool:
        return self.mlp in ("swiglu", "geglu")  # gate, up and down: three matrices

    def window_of(self, layer: int) -> int:
        """Layer `layer`'s sliding window (0: none): sliding_window, but in layer_types' full layers."""
        return 0 if self.layer_types and self.layer_types[layer] == "full_attention" else self.sliding_window

    def local_rope(self, layer: int) -> bool:
        """Whether layer `layer` takes the sliding layers' RoPE (rope_local_base_freq, unscaled)."""
        return bool(self.rope_local_base_freq and self.layer_types) and self.layer_types[layer] == "sliding_attention"

    def moe_layer(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is a mixture of experts (n_experts, and not in dense_layers)."""
        return bool(self.n_experts) and layer not in self.dense_layers

    @property
    def moe_layers(self) -> int:
        """How many layers' MLP is a mixture of experts (moe_layer)."""
        return sum(map(self.moe_layer, range(self.n_layers)))

    @property
    def weighs_experts(self) -> bool:
        """Whether a token's experts' outputs are weighed by the router: not at top-1 with normalized
        weights, each w / w = 1 (model/moe.py takes the one output as it is; the router then learns
        through the load-balancing loss alone)."""
        return not (self.normalize_expert_weights and self.experts_per_token == 1)

    @property
    def expert_hidden(self) -> int:
        """Each expert's hidden width: expert_ffn_hidden, or ffn_hidden where that is 0."""
        return self.expert_ffn_hidden or self.ffn_hidden

    @property
    def context_length(self) -> int:
        """The most tokens the model reads in one sequence: max_position_embeddings, or seq_len
        where that is longer."""
        return max(self.max_position_embeddings, self.seq_len)

    @property
    def rotary_dim(self) -> int:
        """The dims of each head RoPE rotates, as transformers counts them."""
        return int(self.head_dim * self.partial_rotary_factor)


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
