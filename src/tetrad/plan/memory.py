"""Memory per rank: what each pipeline rank holds, model states by ZeRO stage, activations per
layer, and stated allowances.

Model states, bytes per parameter (weights, gradients, optimizer): fp32 training keeps fp32
weights, fp32 gradients and Adam's two moments, 4 + 4 + 8. Mixed precision (bf16, fp16, fp8
linears) keeps 16-bit weights, fp32 gradients (tetrad, like Megatron-LM, accumulates and reduces
them in fp32) and fp32 master weights plus both moments, 2 + 4 + 12 = 18. The ZeRO paper's
convention, 2 + 2 + 12 = 16 with K = 12, is `ZERO_PAPER_BYTES`. ZeRO-1 shards the optimizer over
the dp x cp group (hybrid ZeRO: over its blocks of parallel.zero_shard ranks; an MoE's E/ep experts
under ep over dp x cp / ep, or zero_shard / ep: moe.expert_shard_ranks), ZeRO-2 also the gradients,
ZeRO-3 also the weights. A rank holds them as the runtime allocates them (`rank_model_states`):
flat buffers of whole buckets, padded (plan/buckets.py), and AdamW's moments over the parameters
alone. Optimizer offload moves the optimizer's part to host memory, counted apart
(`host_memory_by_rank`).

Activations per layer are plan/activations.py's; here the schedule's peak of them (the pipeline
simulator's count of held sets) and what a rank's backward holds beside them. Where layers differ
(model.dense_layers) a rank holds its own layers' parameters and activation sets
(split.rank_chunk_layers). The last stage also holds the multi-token prediction modules
(model.mtp_layers; docs/planner.md): their parameters, an embedding's copy over several stages,
and what each waiting micro-batch keeps for their backward beside the head's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

from tetrad.config import Config, ModelConfig
from tetrad.config.sections import bucket_bytes
from tetrad.model import flops
from tetrad.parallel.pipeline.registry import schedule_spec
from tetrad.parallel.pipeline.split import rank_chunk_layers
from tetrad.plan.activations import (activation_bytes, after_bi_weight, as_run, chunk_weights, loss_bytes, mask_bias_bytes,
                                     mtp_saved_bytes, norm_saved_bytes, rebuilt_bytes)
from tetrad.plan.buckets import (RankBuckets, Shapes, layer_params_on_rank, rank_buckets, shapes, shard_params,
                                 ties_embedding)
from tetrad.plan import moe
from tetrad.plan.latent import widths
from tetrad.plan.pipeline import inflight
from tetrad.plan.stacks import Stack

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


def state_bytes_per_param(dtype: str) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes per parameter for training in `dtype`."""
    return FP32_BYTES if dtype == "fp32" else MIXED_BYTES


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


def codec_residual(parallel, buckets: RankBuckets) -> int:
    """Elements of the gradient codecs' error feedback on a rank (int8, PowerSGD: an fp32 residual
    per element of each bucket, dist/codecs.py): every bucket's whose group has more than one rank
    (under ep the experts' own group may have one: its codec sends nothing and keeps nothing)."""
    if parallel.grad_codec not in ("int8", "powersgd") or parallel.dp * parallel.cp == 1:
        return 0
    return buckets.padded - (buckets.expert_padded if moe.expert_grad_ranks(parallel) == 1 else 0)


def host_memory_by_rank(cfg: Config) -> list[HostMemory]:
    """Host bytes of one rank of each pipeline rank: offloaded optimizer state, checkpoint staging."""
    p, t = cfg.parallel, cfg.train
    out = []
    for params, buckets in zip(rank_params(cfg), rank_buckets(cfg)):
        owned, updated = _updated_elements(cfg, params, buckets, 0)  # shard 0 holds the most
        optimizer = MOMENT_BYTES * owned + MASTER_BYTES * updated
        host = HostMemory()
        if t.offload_optimizer:
            host.optimizer, host.grads = optimizer, 4 * updated
        if cfg.checkpoint.async_save and cfg.checkpoint.every:
            host.checkpoint = (MOMENT_BYTES + MASTER_BYTES) * owned + 4 * codec_residual(p, buckets)
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
    the head on the last (its own head unless tied on a single stage), both padded to tp rows,
    and there the multi-token prediction modules (their layers `rank_layer_params`', their norms and
    eh_proj: flops.mtp_module_params) and, over several
    stages, the embedding's copy they read (`embedding_copy`)."""
    return _with_ends(cfg, rank_layer_params(cfg))


def embedding_copy(cfg: Config) -> int:
    """Elements of the embedding's copy the last stage holds on one tp rank for the multi-token
    prediction modules: over several stages, unless the head is one (tied embeddings)."""
    m, p = cfg.model, cfg.parallel
    return vocab_shard(m, p.tp) * m.d_model if ties_embedding(m, p.pp * p.vpp) and not m.tie_embeddings else 0


def _with_ends(cfg: Config, layer_params: list[float]) -> list[float]:
    """`rank_params` from each rank's layers' parameters (`rank_layer_params`)."""
    params = list(layer_params)
    m, p = cfg.model, cfg.parallel
    params[0] += vocab_shard(m, p.tp) * m.d_model + (m.seq_len * m.d_model if m.pos == "learned" else 0)
    separate = not m.tie_embeddings or p.pp * p.vpp > 1
    params[-1] += flops.head_params(m, separate=False) + (vocab_shard(m, p.tp) * m.d_model if separate else 0)
    params[-1] += m.mtp_layers * flops.mtp_module_params(m) + embedding_copy(cfg)  # their layers: the rank's
    return params


def rank_layer_params(cfg: Config) -> list[float]:
    """Parameters of each pipeline rank's layers on one tp rank, each of its kind (MoE: E/ep experts),
    the last rank's multi-token prediction modules' layers included (ZeRO-3's blocks); each kind's
    counted once, the ranks' kinds counted by range: the planner weighs many layouts."""
    m, p = cfg.model, cfg.parallel
    mtp = flops.mtp_kind_counts(m)
    per_layer = {kind: layer_params_on_rank(flops.layer_model(m, kind), p.tp, p.ep)
                 for kind in {**flops.kind_counts(m), **mtp}}
    out = [sum(n * per_layer[kind] for kind, n in flops.kind_counts(m, chunks).items())
           for chunks in rank_chunk_layers(cfg)]
    out[-1] += sum(n * per_layer[kind] for kind, n in mtp.items())
    return out


def activations_by_rank(cfg: Config, stack: Stack, is_cpu: bool) -> list[tuple[float, float]]:
    """(activations, transient) bytes at the peak of each pipeline rank: the most its schedule
    holds at once (the pipeline simulator's count of layers' activation sets, zero-bubble's
    BI-to-BW remainders weighed by `after_bi_weight`, and on the last stage the head outputs of
    the micro-batches whose loss waits for backward, counted when they are held). The same for
    every ZeRO stage and optimizer offload of a layout: the planner counts it once for them."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    e = activation_bytes(t.dtype)
    tokens = t.micro_batch * m.seq_len // p.cp
    hidden = tokens * m.d_model * e
    stack = as_run(cfg, stack, is_cpu)
    per_layer, chunks = chunk_weights(cfg, stack, tokens, e)  # sets counted in MoE layers' (a dense model's layers')
    rebuilt = rebuilt_bytes(cfg, stack, tokens, e, is_cpu)
    # Final norm and head inputs (under SP the norm's a sequence chunk, the head's gathered unless
    # the stack gathers it again in backward, as every column-parallel input); what the
    # cross-entropy keeps and makes in passing (`loss_bytes`: unfused, the fp32 softmax and the
    # logits' gradient), for the micro-batches whose loss waits for backward (all under GPipe).
    loss_kept, loss_transient = loss_bytes(cfg, tokens, vocab_shard(m, p.tp))
    final_norm = norm_saved_bytes(m, tokens, e, stack) / (p.tp if p.sequence_parallel else 1)  # SP: a chunk
    # The schedule's peak, in layers' sets, with a waiting micro-batch's head whole and with its
    # saved part alone (the softmax kept, the rest transient): their difference is the head's
    # transient at the peak, which may come when no loss waits (zero-bubble's after a BI).
    head_input = hidden / (p.tp if p.sequence_parallel and not stack.sp_saves_gathered_input else 1)
    saved_head = final_norm + head_input + loss_kept + mtp_saved_bytes(cfg, stack, tokens, e, vocab_shard(m, p.tp))
    shared_bias = mask_bias_bytes(cfg, is_cpu) if t.recompute == "none" else 0.0
    held = partial(inflight, p.schedule, p.pp, cfg.microbatches, p.vpp, after_bi_weight(cfg, stack, is_cpu), chunks)
    whole, saved = (held(h / per_layer, shared_bias / per_layer) for h in (saved_head + loss_transient, saved_head))
    if not schedule_spec(p.schedule).splits_backward:
        return [(per_layer * whole[r] + rebuilt[r], rebuilt[r] + per_layer * (whole[r] - saved[r])) for r in range(p.pp)]
    # A BI ends holding its chunk's first layer's input beside the remainder it made for BW (its
    # checkpointed input under recompute, its first norm's otherwise), after the layer it rebuilt
    # is gone: the saved peak may come there (fuzz_estimate 42217: the count 16% over the estimate, with
    # full recompute), the whole peak there or while a layer is rebuilt.
    first_input = (hidden if t.recompute in ("full", "selective-op") else norm_saved_bytes(m, tokens, e, stack)) \
        / (p.tp if p.sequence_parallel else 1)
    whole_end, saved_end = (held(h / per_layer, shared_bias / per_layer, first_input / per_layer)
                            for h in (saved_head + loss_transient, saved_head))
    out = []
    for r in range(p.pp):
        peak = max(per_layer * whole[r] + rebuilt[r], per_layer * whole_end[r])
        out.append((peak, peak - per_layer * saved_end[r]))
    return out


class Held(NamedTuple):
    """What a layout's pipeline ranks hold whatever its ZeRO stage and optimizer offload: the
    parameters of each (`rank_params`), of its layers alone (`rank_layer_params`), its activations
    (`activations_by_rank`), and its layers' largest matrix and per-layer parameters (the larger
    kind's, `_buffers`'). The planner counts it once for a layout's ZeRO stages."""
    params: list[float]
    layer_params: list[float]
    activations: list[tuple[float, float]]
    matrix: float  # fp32 bytes of a layer's largest MLP matrix on a rank (MoE: [E/ep, H, d])
    layer: int  # parameters of the larger kind of layer on a rank
    shapes: Shapes  # what its gradient buckets are laid out from (buckets.shapes)


def held_by_rank(cfg: Config, stack: Stack, is_cpu: bool) -> Held:
    """`Held` of `cfg`'s layout."""
    m, p = cfg.model, cfg.parallel
    kinds = [k for k, _ in flops.layer_kinds(m)]
    layer_params = rank_layer_params(cfg)
    matrix = max(4 * m.d_model * flops.mlp_hidden(k) / p.tp / (p.ep if k.n_experts else 1) for k in kinds)
    return Held(_with_ends(cfg, layer_params), layer_params, activations_by_rank(cfg, stack, is_cpu), matrix,
                max(layer_params_on_rank(k, p.tp, p.ep) for k in kinds), shapes(cfg))


def memory_by_rank(cfg: Config, stack: Stack, is_cpu: bool, held: Held | None = None) -> list[Memory]:
    """Peak bytes of one GPU of each pipeline rank: model states, activations, communication
    buffers and the rest; `held`: the layout's (`held_by_rank`, counted here if not given)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    e = activation_bytes(t.dtype)
    tokens = t.micro_batch * m.seq_len // p.cp
    held = held or held_by_rank(cfg, stack, is_cpu)
    stack = as_run(cfg, stack, is_cpu)
    params, buckets = held.params, rank_buckets(cfg, held.shapes)
    per_param = state_bytes_per_param(t.dtype)
    out = []
    for r in range(p.pp):
        weights, grads, optimizer = _model_states(cfg, params[r], buckets[r], 0)
        if t.offload_optimizer:  # on the host (host_memory_by_rank)
            optimizer = 0.0
        buffers = _buffers(cfg, stack, tokens, e, buckets[r], r, held)
        root = 0.0
        if p.zero >= 3:  # the parameters outside the blocks (embedding, head, norms): one bucket,
            # gathered for the whole step, its full fp32 gradient alive through backward
            root = (params[r] - held.layer_params[r]) * (per_param[0] + 4)
        acts, transient = held.activations[r]
        # Communication buffers are transient, not activations kept for backward: with the
        # allocator's fragmentation they make up `other`.
        other = buffers + root + FRAGMENTATION * (acts + buffers + root) + (CPU_RANK_BASELINE_BYTES if is_cpu else 0.0)
        out.append(Memory(weights, grads, optimizer, acts, other, transient))
    return out


def _buffers(cfg: Config, stack: Stack, tokens: int, e: int, buckets: RankBuckets, rank: int, held: Held) -> float:
    """Communication buffers alive at the peak on pipeline rank `rank`, whose gradient buckets hold
    `buckets` (rank_buckets'), of a layout holding `held`: ZeRO-2's full buckets in flight, ZeRO-3's gathered layers
    (the current and the prefetched one) and two layers' full gradients (filling, reducing),
    the SP-gathered layer input, CP ring blocks and accumulators, pipeline send/receive buffers."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    hidden, padded = tokens * m.d_model * e, buckets.padded
    out = 0.0
    # ZeRO-0/1 reduce in place in the flat gradient buckets (counted as `grads`); ZeRO-2 keeps only
    # its shard, but a bucket's full gradient lives until its reduce-scatter ends: one bucket
    # reducing while the next fills.
    if p.dp * p.cp > 1 and p.zero == 2:  # a parameter larger than the bucket size is a bucket alone:
        # the vocabulary matrices (the embedding on the first stage, the head on the last) are
        # only where they are, the layers' largest matrix anywhere
        vocab = 4 * m.d_model * vocab_shard(m, p.tp)
        head = rank == p.pp - 1 and (not m.tie_embeddings or p.pp * p.vpp > 1)
        copy = rank == p.pp - 1 and embedding_copy(cfg) > 0  # the multi-token prediction's embedding
        largest = [vocab] * ((rank == 0) + head + copy) + [held.matrix] * 2
        out += min(sum(max(bucket_bytes(cfg.parallel), b) for b in sorted(largest)[-2:]), 4 * padded)
    out += 4 * codec_residual(p, buckets)
    if p.zero >= 3:  # two gathered layers; two layers' fp32 gradients (one filling, one reducing)
        out += held.layer * (2 * state_bytes_per_param(t.dtype)[0] + 2 * 4)
    if p.tp > 1 and p.sequence_parallel and not stack.sp_saves_gathered_input:  # gathered again in backward
        out += 2 * hidden
    if p.cp > 1:
        w = widths(m, p.tp)
        kv = w.k + w.v
        out += tokens * (2 * kv * e + 2 * kv * 4 + 4 * w.q)  # K/V in flight, dK/dV fp32, output/dq fp32
    if p.pp > 1:
        out += 2 * hidden / (p.tp if p.sequence_parallel else 1)
    return out
