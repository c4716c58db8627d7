"""Memory per rank: what each pipeline rank holds, model states by ZeRO stage, activations per
layer, and stated allowances.

Model states, bytes per parameter (weights, gradients, optimizer): fp32 training keeps fp32
weights, fp32 gradients and Adam's two moments, 4 + 4 + 8. Mixed precision (bf16, fp16, fp8
linears) keeps 16-bit weights, fp32 gradients (tetrad, like Megatron-LM, accumulates and reduces
them in fp32) and fp32 master weights plus both moments, 2 + 4 + 12 = 18. The ZeRO paper's
convention, 2 + 2 + 12 = 16 with K = 12, is `ZERO_PAPER_BYTES`. ZeRO-1 shards the optimizer over
the dp x cp group (hybrid ZeRO: over its blocks of parallel.zero_shard ranks; an MoE's E/ep experts
under ep over dp x cp / ep), ZeRO-2 also the gradients, ZeRO-3 also the weights. A rank holds them
as the runtime allocates them (`rank_model_states`): flat buffers of whole buckets, padded
(plan/buckets.py), and AdamW's moments over the parameters alone. Optimizer offload moves the
optimizer's part to host memory, counted apart (`host_memory_by_rank`).

Activations follow Korthikanti et al. 2022, written per saved tensor so that they generalise to
GQA, SwiGLU, fp32, flash attention (no s^2 scores kept, a log-sum-exp instead), TP with or
without SP, CP (a rank holds seq_len/cp tokens) and recomputation: with 16-bit activations,
dropout, GELU and materialised scores they are exactly sbh(34 + 5as/h) per layer. Document
masking adds its bias (`mask_bias_bytes`, a sliding window's too).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from tetrad.config import Config, ModelConfig
from tetrad.config.sections import bucket_bytes
from tetrad.model import flops
from tetrad.model.masks import hides_keys
from tetrad.plan.kernels import masked_attention
from tetrad.parallel.pipeline.registry import schedule_spec
from tetrad.parallel.pipeline.split import chunk_layers, rank_layers
from tetrad.plan.buckets import RankBuckets, rank_buckets, shard_params
from tetrad.plan import moe
from tetrad.plan.pipeline import inflight
from tetrad.plan.stacks import STACKS, Stack

GIB = 1024**3

FP32_BYTES = (4.0, 4.0, 8.0)
MIXED_BYTES = (2.0, 4.0, 12.0)
ZERO_PAPER_BYTES = (2.0, 2.0, 12.0)
MOMENT_BYTES, MASTER_BYTES = 8.0, 4.0  # the optimizer's part: AdamW's two fp32 moments, fp32 masters

# Allowances, stated. The caching allocator's blocks that are free but held (fragmentation), as
# a share of what is allocated and freed during a step (activations and buffers). The CUDA
# context and NCCL's own buffers, outside torch's allocator, kept free when deciding `fits`.
# On CPU the measured figure is a rank's peak resident-set growth since it started
# (tetrad.device.start_memory_tracking), which beyond the parts modelled here holds what any rank
# allocates: the token data, autograd's and Python's objects, gloo's buffers. Measured here
# (2026-12, torch 2.13 CPU): 63-64 MiB for a 2-layer, d_model-64 model whose modelled parts are
# 3-4 MiB.
FRAGMENTATION = 0.10
GPU_RESERVED_GIB = 1.0
CPU_RANK_BASELINE_BYTES = 60 * 1024**2


def as_run(cfg: Config, stack: Stack, is_cpu: bool = False) -> Stack:
    """`stack` as `cfg` runs it: tetrad with `train.compile` is the `tetrad-compiled` stack, and
    tetrad's own stacks keep sequence parallelism's gathered input for backward unless
    `parallel.sp_regather` (model/mappings.py); other stacks do as they do. On CPU torch has no
    fused RMSNorm: the composite runs (measured with autograd's saved-tensor hooks, torch 2.13)."""
    if cfg.train.compile and stack.name == "tetrad":
        stack = STACKS["tetrad-compiled"]
    if is_cpu:
        stack = replace(stack, fused_rms_norm=False)
    if cfg.parallel.sp_regather and stack.name.startswith("tetrad"):
        return replace(stack, sp_saves_gathered_input=False)
    return stack


def state_bytes_per_param(dtype: str) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes per parameter for training in `dtype`."""
    return FP32_BYTES if dtype == "fp32" else MIXED_BYTES


def activation_bytes(dtype: str) -> int:
    """Bytes per activation element: fp32 training keeps fp32 activations, all else 16-bit."""
    return 4 if dtype == "fp32" else 2


@dataclass
class Memory:
    weights: float
    grads: float
    optimizer: float
    activations: float
    other: float
    # The part of `activations` alive at the peak but not saved for backward: the layer a
    # recompute rebuilds during its backward, the logits' gradient (and the fp32 copy of 16-bit
    # logits without tp). The rest is what autograd saves (train/memory.py counts that).
    transient: float = 0.0

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations + self.other

    def gib(self) -> dict:
        return {k: getattr(self, k) / GIB for k in ("weights", "grads", "optimizer", "activations", "other")}


def model_state_bytes(params: float, zero: int, shards: int,
                      per_param: tuple[float, float, float] = MIXED_BYTES) -> tuple[float, float, float]:
    """Bytes of (weights, grads, optimizer) on a rank that holds `params` before ZeRO sharding
    over `shards` ranks."""
    w, g, o = per_param
    return (params * w / (shards if zero >= 3 else 1),
            params * g / (shards if zero >= 2 else 1),
            params * o / (shards if zero >= 1 else 1))


def rank_model_states(cfg: Config, shard: int = 0) -> list[tuple[float, float, float]]:
    """Bytes of (weights, grads, optimizer) on each pipeline rank at index `shard` of the group
    ZeRO shards over (0 holds the most), as parallel/data allocates them: the weights in flat
    buffers of whole padded buckets (under ZeRO, or beside separate masters; fp32 ZeRO-0 keeps
    plain parameters), ZeRO-3 a shard of each; the fp32 gradient buckets, padded (ZeRO-2/3: a
    shard of each); fp32 masters of the owned range, padding included, where they are separate
    (16-bit weights, offload); AdamW's moments of the parameters' elements in the owned range
    (ShardedAdamW's pieces), which in the last shards hold less than a shard."""
    return [_model_states(cfg, params, buckets, shard) for params, buckets in zip(rank_params(cfg), rank_buckets(cfg))]


def _model_states(cfg: Config, params: float, buckets: RankBuckets, shard: int) -> tuple[float, float, float]:
    """`rank_model_states` of a pipeline rank holding `params` parameters in `buckets`."""
    p, t = cfg.parallel, cfg.train
    w, g, _ = state_bytes_per_param(t.dtype)
    separate = t.dtype != "fp32" or t.offload_optimizer
    weights, grads = ((buckets.sharded if p.zero >= z else buckets.padded) * b for z, b in ((3, w), (2, g)))
    if p.zero == 0 and not separate:  # AdamW on the parameters themselves: no flat buffer
        weights = params * w
    owned, updated = _updated_elements(cfg, params, buckets, shard)
    return weights, grads, MOMENT_BYTES * owned + MASTER_BYTES * (updated if separate else 0)


def _updated_elements(cfg: Config, params: float, buckets: RankBuckets, shard: int) -> tuple[float, float]:
    """Elements of (AdamW's moments, the fp32 values it updates) on the rank at `shard`: the
    parameters' elements in its owned range, and that range padding included (all parameters for
    fp32 ZeRO-0 without separate masters): what the device or, offloaded, the host keeps."""
    p, separate = cfg.parallel, cfg.train.dtype != "fp32" or cfg.train.offload_optimizer
    owned = params if p.zero == 0 else shard_params(buckets.buckets, shard, moe.expert_shard(p, shard)) if shard else \
        buckets.first_shard
    updated = buckets.sharded if p.zero >= 1 else buckets.padded if separate else params
    return owned, updated


# Host (CPU) memory, per parameter a rank's optimizer updates (its ZeRO shard; all it holds under
# ZeRO-0), counted as the device's are (`_updated_elements`: padded buckets, unpadded moments).
# Under train.offload_optimizer (parallel/data/optimizer.py, MasterWeights) the fp32 masters and
# AdamW's two moments live there (fp32 training gets separate masters then too), and a pinned
# buffer per bucket takes the owned fp32 gradient, 4 bytes a master's element; the device keeps
# the weights and the gradient buckets. checkpoint.async_save stages a copy of the rank's
# checkpointed state in CPU memory while a background write runs (Checkpointer._saved_state,
# copy=True): the fp32 values of the parameters the optimizer updates and both moments, unpadded,
# and the gradient codec's fp32 error feedback (each whole padded bucket) where it keeps one.


@dataclass
class HostMemory:
    optimizer: float = 0.0
    grads: float = 0.0
    checkpoint: float = 0.0

    @property
    def total(self) -> float:
        return self.optimizer + self.grads + self.checkpoint

    def gib(self) -> dict:
        return {k: getattr(self, k) / GIB for k in ("optimizer", "grads", "checkpoint")}


def host_memory_by_rank(cfg: Config) -> list[HostMemory]:
    """Host bytes of one rank of each pipeline rank: offloaded optimizer state, checkpoint staging."""
    p, t = cfg.parallel, cfg.train
    n = p.dp * p.cp
    residual = n > 1 and p.grad_codec in ("int8", "powersgd")
    out = []
    for params, buckets in zip(rank_params(cfg), rank_buckets(cfg)):
        owned, updated = _updated_elements(cfg, params, buckets, 0)  # shard 0 holds the most
        optimizer = MOMENT_BYTES * owned + MASTER_BYTES * updated
        host = HostMemory()
        if t.offload_optimizer:
            host.optimizer, host.grads = optimizer, 4 * updated
        if cfg.checkpoint.async_save and cfg.checkpoint.every:
            host.checkpoint = (MOMENT_BYTES + MASTER_BYTES) * owned + (4 * buckets.padded if residual else 0.0)
        out.append(host)
    return out


# ----------------------------------------------------------------------------- what a rank holds

def vocab_shard(m: ModelConfig, tp: int) -> int:
    """Vocabulary rows on one tp rank: the vocabulary is padded to a multiple of tp
    (layers.VocabParallelEmbedding)."""
    return math.ceil(m.vocab_size / tp)


def rank_params(cfg: Config) -> list[float]:
    """Parameters each pipeline rank holds on one tp rank: its layers' linears split over tp,
    their norms replicated, the embedding (vocab-parallel) on the first stage, the final norm and
    the head on the last (its own head unless tied on a single stage), both padded to tp rows."""
    m, p = cfg.model, cfg.parallel
    per_layer = moe.rank_layer_params(m, p.tp, p.ep)  # MoE: E/ep experts
    params = [n * per_layer for n in rank_layers(cfg)]
    params[0] += vocab_shard(m, p.tp) * m.d_model + (m.seq_len * m.d_model if m.pos == "learned" else 0)
    separate = not m.tie_embeddings or p.pp * p.vpp > 1
    params[-1] += flops.head_params(m, separate=False) + (vocab_shard(m, p.tp) * m.d_model if separate else 0)
    return params


def norm_saved_bytes(m: ModelConfig, tokens: int, e: int, stack: Stack) -> float:
    """Bytes one norm keeps for backward over `tokens` tokens: its input, or under the composite
    RMSNorm (Stack.fused_rms_norm) two fp32 tensors, as Gemma's always keeps (its fp32 output and
    the fp32 input, fused or not)."""
    return tokens * m.d_model * (8 if m.norm == "gemma_rmsnorm" else _norm_bytes(m, e, stack))


def _norm_bytes(m: ModelConfig, e: int, stack: Stack) -> int:
    return e if m.norm == "layernorm" or (stack.fused_rms_norm and m.norm == "rmsnorm") else 8


def activation_bytes_per_layer(m: ModelConfig, tokens: int, tp: int, sp: bool, recompute: str, e: int,
                               stack: Stack) -> float:
    """Bytes one layer keeps for its backward, for one micro-batch of `tokens` tokens on this
    rank (micro_batch x seq_len / cp), `e` bytes per activation element."""
    div = tp if sp else 1
    hidden = tokens * m.d_model * e
    norm_input = norm_saved_bytes(m, tokens, e, stack)
    if recompute == "full":
        return hidden / div  # only the layer's input (Korthikanti: 2sbh in 16 bit)
    q, kv = m.n_heads * m.head_dim / tp, m.n_kv_heads * m.head_dim / tp
    if recompute == "selective-op":  # the input, the kept matmul outputs (a row-parallel one whole,
        # before its all-reduce or reduce-scatter), the attention's output and fp32 log-sum-exp (under
        # ring cp the ring's merged ones, once: model/replay.py RingReplay)
        kept = sum(n * rows if row else n * rows / tp for _, n, row, rows in flops.op_checkpoint_saved_matmuls(m))
        return hidden / div + tokens * e * (kept + q) + 4 * m.n_heads / tp * tokens
    f = flops.mlp_hidden(m, active=True) / tp  # MoE: each token's k experts' hidden tensors, k·H
    dropout = m.dropout > 0
    # Replicated over tp unless SP: both norms' inputs and the 1-byte dropout masks after
    # attention and MLP; the attention and MLP inputs (norm outputs) too, unless the stack keeps
    # them all-gathered under SP.
    norms = (4 if m.sandwich_norm else 2) * norm_input + (2 * tokens * m.d_model if dropout else 0)
    routed = bool(m.n_experts)  # the router keeps the MLP's input whole (gathered under SP)
    inputs = (2 - routed) * hidden / (1 if sp and stack.sp_saves_gathered_input else div) + routed * hidden
    replicated = norms / div + inputs
    # Split over tp: q, k, v (after RoPE), the attention output, the MLP's hidden tensors.
    mlp = stack.swiglu_saved if m.gated_mlp else 2  # GELU: its input and the fc2 input
    mlp = moe.expert_hidden_saved(m) if m.n_experts else mlp
    split = tokens * e * (q + 2 * kv + stack.attn_out_copies * q + mlp * f)
    replicated += tokens * moe.routing_saved_bytes_per_token(m, e)
    if m.qk_norm:  # q's and k's norms keep their inputs, as the layer's norms do theirs
        split += tokens * (q + kv) * _norm_bytes(m, e, stack)
    core = 0.0
    if recompute != "selective":
        heads = m.n_heads / tp
        if stack.flash_attention:
            core = 4 * heads * tokens  # fp32 log-sum-exp per query and head
        else:  # softmax output, and with dropout its mask and output: Korthikanti's 5as^2b
            core = (e + (e + 1 if dropout else 0)) * heads * tokens * m.seq_len
    return replicated + split + core


def mask_bias_bytes(cfg: Config, is_cpu: bool = False) -> float:
    """Bytes of the mask bias (train.document_mask, a model.sliding_window shorter than seq_len) on
    the local and all-to-all paths, whose kernel takes the whole sequence: [micro_batch, 1,
    seq_len, seq_len] in the activations' dtype with documents, [1, 1, seq_len, seq_len] with a
    window alone (model/masks.py). Without recompute it is built once per micro-batch and model
    chunk and kept by every layer's attention: one per activation set in flight (`memory_by_rank`
    passes it to the simulator as what each set carries). Under recompute each layer builds it in
    the recomputed region and keeps none: the layer rebuilt during backward holds one. The ring
    keeps none: its backward builds each block's mask again from the window's ids. Nor does flash's
    varlen kernel (CUDA, 16-bit: plan/kernels.py), which takes the segments' bounds instead."""
    m, t = cfg.model, cfg.train
    if masked_attention(cfg, is_cpu) != "square":
        return 0.0
    rows = t.micro_batch if t.document_mask else 1
    # one per window the layers mask with (model.layer_types: a sliding and a full layer's differ)
    biases = {w for w in flops.layer_windows(m) if t.document_mask or hides_keys(w, m.seq_len)}
    return len(biases) * rows * m.seq_len ** 2 * activation_bytes(t.dtype)


def deferred_weight_grad_bytes_per_layer(m: ModelConfig, tokens: int, tp: int, e: int) -> float:
    """What one layer still holds between its input-gradient and weight-gradient passes
    (zero-bubble's BI and BW): each linear's input and output gradient. Column-parallel linears
    (qkv, gate/up) take the whole hidden state (gathered under SP) and give 1/tp outputs;
    row-parallel ones (output, down) take 1/tp inputs and give the whole hidden state. MoE's
    experts and router hold nothing: their weight gradients are made in BI (model/moe.py)."""
    h = m.d_model
    q, kv, f = m.n_heads * m.head_dim / tp, m.n_kv_heads * m.head_dim / tp, m.ffn_hidden / tp
    up = 2 * f if m.gated_mlp else f
    mlp_inputs, mlp_grads = (0, 0) if m.n_experts else (h + f, up + h)  # gate/up's and down's
    inputs = h + q + mlp_inputs  # qkv's and the output projection's inputs
    grads = (q + 2 * kv) + h + mlp_grads
    return tokens * e * (inputs + grads)


def after_bi_weight(cfg: Config, stack: Stack, is_cpu: bool = False) -> float:
    """Under zero-bubble, a layer's held memory between BI and BW in units of its activation set
    (what `peak_held` weighs); 1.0 for schedules without a split backward."""
    if not schedule_spec(cfg.parallel.schedule).splits_backward:
        return 1.0
    m, p, t = cfg.model, cfg.parallel, cfg.train
    tokens = t.micro_batch * m.seq_len // p.cp
    e = activation_bytes(t.dtype)
    stack = as_run(cfg, stack, is_cpu)
    full = activation_bytes_per_layer(m, tokens, p.tp, p.sequence_parallel, t.recompute, e, stack)
    return round(deferred_weight_grad_bytes_per_layer(m, tokens, p.tp, e) / full, 2)


def memory_by_rank(cfg: Config, stack: Stack, is_cpu: bool) -> list[Memory]:
    """Peak bytes of one GPU of each pipeline rank. Its activations are the most its schedule
    holds at once (the pipeline simulator's count of layers' activation sets, zero-bubble's
    BI-to-BW remainders weighed by `after_bi_weight`, and on the last stage the head outputs of
    the micro-batches whose loss waits for backward, counted when they are held)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    e = activation_bytes(t.dtype)
    tokens = t.micro_batch * m.seq_len // p.cp
    hidden = tokens * m.d_model * e
    stack = as_run(cfg, stack, is_cpu)
    per_layer = activation_bytes_per_layer(m, tokens, p.tp, p.sequence_parallel, t.recompute, e, stack)
    rebuilt = 0.0
    if t.recompute in ("full", "selective-op"):  # one layer's activations rebuilt during its backward,
        # beyond what the held sets already count for that layer: what it keeps, or under a split
        # backward the larger of that and what it keeps from its BI to its BW (`after_bi_weight`)
        counted = per_layer
        if schedule_spec(p.schedule).splits_backward:
            counted = max(per_layer, deferred_weight_grad_bytes_per_layer(m, tokens, p.tp, e))
        rebuilt = (activation_bytes_per_layer(m, tokens, p.tp, p.sequence_parallel, "none", e, stack)
                   + mask_bias_bytes(cfg, is_cpu) - counted)
    rebuilt += moe.expert_grad_bytes(m, p.tp, p.ep, e)  # MoE: one layer's whole expert gradients, in backward
    # Final norm and head inputs (under SP the norm's a sequence chunk, the head's gathered unless
    # the stack gathers it again in backward, as every column-parallel input); the fp32 softmax of the vocab-parallel cross-entropy and the
    # logits' gradient, for the micro-batches whose loss waits for backward (all under GPipe).
    # Without tp, torch's cross-entropy takes an fp32 copy of 16-bit logits while they are still
    # held, beside its fp32 log-softmax: the logits once more (seen on an H200, docs/gpu.md).
    logit_bytes = 8 + (e if p.tp == 1 and e < 4 else 0)
    logits = tokens * vocab_shard(m, p.tp)
    final_norm = norm_saved_bytes(m, tokens, e, stack) / (p.tp if p.sequence_parallel else 1)  # SP: a chunk
    # The schedule's peak, in layers' sets, with a waiting micro-batch's head whole and with its
    # saved part alone (the softmax kept, the rest transient): their difference is the head's
    # transient at the peak, which may come when no loss waits (zero-bubble's after a BI).
    head_input = hidden / (p.tp if p.sequence_parallel and not stack.sp_saves_gathered_input else 1)
    saved_head = final_norm + head_input + 4 * logits
    shared_bias = mask_bias_bytes(cfg, is_cpu) if t.recompute == "none" else 0.0
    whole, saved = (inflight(p.schedule, p.pp, cfg.microbatches, p.vpp, after_bi_weight(cfg, stack, is_cpu),
                             chunk_layers(cfg), h / per_layer, shared_bias / per_layer)
                    for h in (saved_head + (logit_bytes - 4) * logits, saved_head))
    params, buckets = rank_params(cfg), rank_buckets(cfg)
    per_param = state_bytes_per_param(t.dtype)
    out = []
    layer_params = moe.rank_layer_params(m, p.tp, p.ep)
    for r, layers in enumerate(rank_layers(cfg)):
        weights, grads, optimizer = _model_states(cfg, params[r], buckets[r], 0)
        if t.offload_optimizer:  # on the host (host_memory_by_rank)
            optimizer = 0.0
        buffers = _buffers(cfg, stack, tokens, e, buckets[r].padded, r)
        root = 0.0
        if p.zero >= 3:  # the parameters outside the blocks (embedding, head, norms): one bucket,
            # gathered for the whole step, its full fp32 gradient alive through backward
            root = (params[r] - layers * layer_params) * (per_param[0] + 4)
        acts = per_layer * whole[r] + rebuilt
        # Communication buffers are transient, not activations kept for backward: with the
        # allocator's fragmentation they make up `other`.
        other = buffers + root + FRAGMENTATION * (acts + buffers + root) + (CPU_RANK_BASELINE_BYTES if is_cpu else 0.0)
        transient = rebuilt + per_layer * (whole[r] - saved[r])
        out.append(Memory(weights, grads, optimizer, acts, other, transient))
    return out


def _buffers(cfg: Config, stack: Stack, tokens: int, e: int, padded: int, rank: int) -> float:
    """Communication buffers alive at the peak on pipeline rank `rank`, whose gradient buckets hold
    `padded` elements: ZeRO-2's full buckets in flight, ZeRO-3's gathered layers
    (the current and the prefetched one) and two layers' full gradients (filling, reducing),
    the SP-gathered layer input, CP ring blocks and accumulators, pipeline send/receive buffers."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    hidden = tokens * m.d_model * e
    out = 0.0
    # ZeRO-0/1 reduce in place in the flat gradient buckets (counted as `grads`); ZeRO-2 keeps only
    # its shard, but a bucket's full gradient lives until its reduce-scatter ends: one bucket
    # reducing while the next fills.
    if p.dp * p.cp > 1 and p.zero == 2:  # a parameter larger than the bucket size is a bucket alone:
        # the vocabulary matrices (the embedding on the first stage, the head on the last) are
        # only where they are, the layers' largest matrix anywhere
        vocab = 4 * m.d_model * vocab_shard(m, p.tp)
        head = rank == p.pp - 1 and (not m.tie_embeddings or p.pp * p.vpp > 1)
        largest = [vocab] * ((rank == 0) + head) + [4 * m.d_model * flops.mlp_hidden(m) / p.tp / p.ep] * 2  # MoE: [E/ep, H, d]
        out += min(sum(max(bucket_bytes(cfg.parallel), b) for b in sorted(largest)[-2:]), 4 * padded)
    if p.dp * p.cp > 1 and p.grad_codec in ("int8", "powersgd"):  # error feedback: an fp32 residual per bucket
        out += 4 * padded
    if p.zero >= 3:  # two gathered layers; two layers' fp32 gradients (one filling, one reducing)
        layer = flops.layer_params(m, p.tp)
        out += layer * (2 * state_bytes_per_param(t.dtype)[0] + 2 * 4)
    if p.tp > 1 and p.sequence_parallel and not stack.sp_saves_gathered_input:  # gathered again in backward
        out += 2 * hidden
    if p.cp > 1:
        q, kv = m.n_heads * m.head_dim / p.tp, 2 * m.n_kv_heads * m.head_dim / p.tp
        out += tokens * (2 * kv * e + 2 * kv * 4 + 4 * q)  # K/V in flight, dK/dV fp32, output/dq fp32
    if p.pp > 1:
        out += 2 * hidden / (p.tp if p.sequence_parallel else 1)
    return out
