"""A pipeline rank's gradient buckets as the runtime lays them out, from the config alone: the
model's parameters listed in the order the model registers them (model/llama.py,
parallel/pipeline/stages.py; tests/test_plan_buckets.py holds the two equal), put through the
runtime's own rule (parallel/bucketing.py, as parallel/data/buffers.py's lay_out). The exact
communication counts (plan/comm_bytes.py) are sums over them: each bucket's padding, the matrix
shape PowerSGD gives it, and which tp-replicated gradients fall into the rank's ZeRO shard,
which an even split over dp x cp misses by up to a whole norm. Under expert parallelism
(parallel.ep > 1) a rank holds E/ep of each layer's experts, laid out by the same rule in buckets
of their own after the dense ones (ZeRO-3: one per block, gathered with the block's), padded for
and sharded over the expert gradient group, or under hybrid ZeRO its zero_shard/ep ranks inside the
block (plan/moe.py `expert_shard_ranks`); at ep = 1 they are dense parameters like any other.
Multi-token prediction (model.mtp_layers) adds its modules after the last stage's head
(`mtp_parameters`), their blocks ZeRO-3's last blocks (parallel/data/buffers.lay_out); over
several stages the last one holds a copy of the embedding for them, tied to the first stage's as
a tied embedding's head is (the "embed" group).
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache
from operator import itemgetter
from typing import NamedTuple

from tetrad.config import Config, ModelConfig
from tetrad.config.sections import bucket_bytes, shard_ranks
from tetrad.dist.codec_shapes import INT8_BLOCK, powersgd_shape
from tetrad.model.flops import layer_model, mtp_chunks
from tetrad.parallel.bucketing import bucket_contents, padded_size
from tetrad.parallel.pipeline.split import layer_split, rank_stages
from tetrad.plan.moe import expert_shard_ranks

# A parameter's kind: split over tp; replicated over tp (norms, learned positions: their gradients
# summed over tp under SP or after a codec that mixes elements); replicated, but each tp rank's
# gradient made from its own heads (qk-norm's: summed over tp always). finalize.reduce_replicated.
# An MoE layer's experts: split over tp (and ep), in buckets of their own under ep > 1.
SPLIT, REPLICATED, HEADS, EXPERTS = 0, 1, 2, 3


class PlannedBucket(NamedTuple):
    padded: int  # elements, padding included (what the bucket's collectives move)
    shard: int  # elements of each rank's ZeRO shard
    replicated: int  # REPLICATED elements in the part finalize sums on the first rank (its shard under ZeRO)
    heads: int  # ... and HEADS elements there
    block: bool  # ZeRO-3: a transformer block's, gathered for each use (otherwise once a step)
    tied: bool  # the embedding tied across pipeline stages
    size: int  # elements of its parameters (padding left out)
    expert: bool = False  # experts' (ep > 1): padded for and sharded over moe.expert_shard_ranks


def _norm(m: ModelConfig, width: int, kind: int) -> list[tuple[int, int]]:
    return [(width, kind)] * (2 if m.norm == "layernorm" else 1)  # weight, and LayerNorm's bias


def _local(rows: int, tp: int) -> int:
    """A dimension's rows on one tp rank (padded to a multiple of tp, model/sharding.new_param)."""
    return -(-rows // tp)


def layer_parameters(m: ModelConfig, tp: int, ep: int = 1) -> list[tuple[int, int]]:
    """(elements on a tp rank, kind) of one transformer block's parameters, in the order Block
    registers them: attention norm, q, k, v (each with its bias), output projection, q and k
    norms; MLP norm, w1, w3 (SwiGLU, GeGLU), w2 (under MoE the router's weight, replicated over
    tp, its gradient summed over tp as qk-norm's, then the experts' w1, w3, w2, each one [E/ep, H,
    d] tensor split on H, then the shared expert's w1, w3, w2, dense, and its gate's [1, d] weight,
    summed over tp as the router's); the sandwich norms (Gemma 3). `m`: the layer's kind
    (flops.layer_model)."""
    d, hd = m.d_model, m.head_dim
    out = _norm(m, d, REPLICATED)
    if m.latent_attention:
        out += _latent_attention(m, tp)
    else:
        for heads in (m.n_heads, m.n_kv_heads, m.n_kv_heads):
            rows = _local(heads * hd, tp)
            out += [(rows * d, SPLIT)] + ([(rows, SPLIT)] if m.qkv_bias else [])
        out.append((d * _local(m.n_heads * hd, tp), SPLIT))
    out += _norm(m, hd, HEADS) * 2 if m.qk_norm else []
    out += _norm(m, d, REPLICATED)
    matrices = 3 if m.gated_mlp else 2
    if m.n_experts:
        out.append((m.n_experts * d, HEADS))  # each tp rank's router gradient a partial: summed
        out += [(m.n_experts // ep * _local(m.expert_hidden, tp) * d, EXPERTS)] * matrices
        out += [(_local(m.shared_expert_ffn_hidden, tp) * d, SPLIT)] * matrices if m.shared_expert_ffn_hidden else []
        out += [(d, HEADS)] if m.shared_expert_gate else []
    else:
        out += [(_local(m.ffn_hidden, tp) * d, SPLIT)] * matrices
    return out + (_norm(m, d, REPLICATED) * 2 if m.sandwich_norm else [])


def _latent_attention(m: ModelConfig, tp: int) -> list[tuple[int, int]]:
    """Latent attention's parameters as model/latent_attention.py registers them: the query's down
    projection, its norm and up projection (or its full projection), the kv down projection and
    norm, the kv up projection, the output projection. The down projections and norms are
    replicated over tp: under SP each rank's gradient covers its own tokens, summed over tp as
    the layer norms' are."""
    d, heads = m.d_model, m.n_heads
    q_rows = _local(heads * m.head_dim, tp)
    query = [(m.q_lora_rank * d, REPLICATED), *_norm(m, m.q_lora_rank, REPLICATED), (q_rows * m.q_lora_rank, SPLIT)] \
        if m.q_lora_rank else [(q_rows * d, SPLIT)]
    kv_up = _local(heads * (m.qk_nope_head_dim + m.v_head_dim), tp) * m.kv_lora_rank
    return query + [((m.kv_lora_rank + m.qk_rope_head_dim) * d, REPLICATED), *_norm(m, m.kv_lora_rank, REPLICATED),
                    (kv_up, SPLIT), (d * _local(heads * m.v_head_dim, tp), SPLIT)]


def layer_params_on_rank(m: ModelConfig, tp: int, ep: int) -> int:
    """Parameters of one layer on a rank, of its experts E/ep: `layer_parameters`' elements (the
    planner's own count, latent attention's replicated down projections whole)."""
    return sum(n for n, _ in layer_parameters(m, tp, ep))


def mtp_parameters(m: ModelConfig, tp: int, ep: int = 1) -> list[tuple[int, int, int | None]]:
    """(elements on a tp rank, kind, the depth whose block holds it or None) of the multi-token
    prediction modules' parameters (none without them), in the order model/mtp.py registers them,
    depth by depth: enorm, hnorm, eh_proj [d, 2d] (replicated over tp, its gradient summed over tp
    under SP as latent attention's down projections'), the block of global index n_layers + k
    (ZeRO-3 gathers it as a block, after the main layers: parallel/data/buffers.lay_out), the final
    norm."""
    out = []
    for k, i in enumerate(mtp_chunks(m)[0]):
        out += [(n, kind, None) for n, kind in _norm(m, m.d_model, REPLICATED) * 2]
        out += [(2 * m.d_model * m.d_model, REPLICATED, None)]
        out += [(n, kind, k) for n, kind in layer_parameters(layer_model(m, m.moe_layer(i)), tp, ep)]
        out += [(n, kind, None) for n, kind in _norm(m, m.d_model, REPLICATED)]
    return out


class Shapes(NamedTuple):
    """What a rank's parameter list depends on, hashable (the layout is cached by it)."""
    layer: tuple[tuple[int, int], ...]  # layer_parameters of an MoE layer (of every layer in a dense model)
    dense: tuple[tuple[int, int], ...]  # ... of a dense layer of an MoE model (model.dense_layers)
    dense_layers: frozenset[int]
    vocab: int  # the embedding's (and the head's) elements on a tp rank
    positions: int  # learned positions' elements (0 under RoPE)
    norm: tuple[tuple[int, int], ...]  # the final norm's
    tie: bool  # tied embeddings
    mtp: tuple[tuple[int, int, int | None], ...]  # mtp_parameters (the last stage's, after the head)


def shapes(cfg: Config) -> Shapes:
    m, tp = cfg.model, cfg.parallel.tp
    moe, dense = (tuple(layer_parameters(layer_model(m, kind), tp, cfg.parallel.ep)) for kind in (True, False))
    return Shapes(moe, dense, frozenset(m.dense_layers) if m.n_experts else frozenset(), _local(m.vocab_size, tp) * m.d_model,
                  m.seq_len * m.d_model if m.pos == "learned" else 0, tuple(_norm(m, m.d_model, REPLICATED)),
                  m.tie_embeddings, tuple(mtp_parameters(m, tp, cfg.parallel.ep)))


def ties_embedding(m: ModelConfig, stages: int) -> bool:
    """Whether the last of `stages` global stages holds a copy of the embedding, kept equal with
    the first's over the "embed" group: as the head of tied embeddings, or for the multi-token
    prediction modules (model.mtp_layers)."""
    return (m.tie_embeddings or m.mtp_layers > 0) and stages > 1


def stage_parameters(s: Shapes, stages: tuple[tuple[range, bool, bool], ...], ties: bool):
    """(each chunk's parameters as (elements, kind, index of their block on this rank or None),
    the embedding tied across stages if this rank holds a copy) of a pipeline rank whose chunks
    hold `stages` (their layers' global indices, first stage, last stage), in the order its
    PipelineStages' chunks register them. `ties`: the embedding is tied across stages."""
    vocab = (s.vocab, SPLIT, None)
    chunks, tied, blocks = [], None, 0
    for layers, first, last in stages:
        chunk = []
        if first:
            chunk += [(s.positions, REPLICATED, None)] if s.positions else []
            chunk += [] if ties else [vocab]
            tied = vocab if ties else tied
        for k, i in enumerate(layers, blocks):
            chunk += [(n, kind, k) for n, kind in (s.dense if i in s.dense_layers else s.layer)]
        blocks += len(layers)
        if last:
            chunk += [(n, kind, None) for n, kind in s.norm]
            chunk += [] if s.tie else [vocab]  # tied on one stage: the embedding's weight
            # the last chunk is the rank's last: its modules' blocks come after every layer's
            chunk += [(n, kind, None if k is None else blocks + k) for n, kind, k in s.mtp]
            tied = vocab if ties else tied
        chunks.append(chunk)
    return chunks, tied


class RankBuckets(NamedTuple):
    buckets: tuple[PlannedBucket, ...]  # in layout order
    padded: int  # their elements, padding included
    blocks: int  # ... of them in ZeRO-3's block buckets
    replicated: int  # their REPLICATED elements in the part finalize sums (PlannedBucket)
    heads: int  # ... and HEADS elements
    factors: int  # PowerSGD: each bucket's matrix's rows + cols, summed (0 under another codec)
    first_shard: int  # parameter elements in the buckets' first shards (`shard_params` 0: the most)
    sharded: int  # elements of one shard of every bucket, padding included (ZeRO's part of `padded`)
    expert_padded: int  # elements of the experts' own buckets (ep > 1), padding included
    expert_size: int  # ... their parameters' elements
    expert_factors: int  # ... and their part of `factors`


def rank_buckets(cfg: Config, s: Shapes | None = None) -> tuple[RankBuckets, ...]:
    """Each pipeline rank's buckets, at dp x cp coordinate 0, laid out over the ranks ZeRO shards
    over (hybrid ZeRO's block, or all of dp x cp; the experts' over `expert_shard_ranks`).
    `s`: `cfg`'s shapes, if known (the same for every ZeRO stage of a layout)."""
    p = cfg.parallel
    return _pipeline(s or shapes(cfg), tuple(layer_split(cfg)), p.pp, p.vpp, ties_embedding(cfg.model, p.pp * p.vpp),
                     shard_ranks(p), p.zero, p.grad_codec, bucket_bytes(p), expert_shard_ranks(p))


# Cached, as the functions below: the search estimates many layouts with the same parameters on a rank.
@lru_cache(maxsize=4096)
def _pipeline(s: Shapes, split: tuple[range, ...], pp: int, vpp: int, ties: bool, n: int, zero: int, codec: str,
              limit: float, experts: int) -> tuple[RankBuckets, ...]:
    last = len(split) - 1
    # where every layer is alike only a stage's count matters: stages of one size share a layout
    split = split if s.dense_layers else tuple(range(len(layers)) for layers in split)
    return tuple(_layout(s, tuple((split[g], g == 0, g == last) for g in rank_stages(pp, vpp, r)), ties, n, zero,
                         codec, limit, experts) for r in range(pp))


class _Content(NamedTuple):
    """A bucket's parameters, whatever the group it is reduced over."""
    size: int  # elements
    spans: tuple[tuple[int, int, int], ...]  # (start, end, kind) of its REPLICATED and HEADS parameters
    block: bool
    tied: bool
    expert: bool


@lru_cache(maxsize=1024)
def _contents(s: Shapes, stages: tuple, ties: bool, zero3: bool, limit: float, apart: bool) -> tuple[_Content, ...]:
    """The buckets' contents in layout order; `apart` (ep > 1): the experts' after the rest, by the same
    rule (ZeRO-3: a bucket of each block's experts)."""
    chunks, tied = stage_parameters(s, stages, ties)
    if apart:
        experts = [[item for item in chunk if item[1] == EXPERTS] for chunk in chunks]
        chunks = [[item for item in chunk if item[1] != EXPERTS] for chunk in chunks]
    items = [item for chunk in chunks for item in chunk]
    blocks = 1 + max((k for _, _, k in items if k is not None), default=-1)
    chunks = [items] if zero3 else chunks  # ZeRO-3's rest in the parameters' order, as lay_out's
    contents = bucket_contents(chunks, itemgetter(0), limit, blocks, itemgetter(2) if zero3 else None, tied)
    out = [_content(b, zero3 and k < blocks, tied is not None and k == len(contents) - 1, False)
           for k, b in enumerate(contents)]
    if apart and zero3:  # each block's experts a bucket of their own, gathered with the block's
        out += [_content(b, True, False, True) for b in bucket_contents([[i for c in experts for i in c]], itemgetter(0),
                                                                        limit, blocks, itemgetter(2)) if b]
    elif apart:
        out += [_content(b, False, False, True) for b in bucket_contents(experts, itemgetter(0), limit)]
    return tuple(out)


def _content(bucket: list, block: bool, tied: bool, expert: bool) -> _Content:
    spans, offset = [], 0
    for numel, kind, _ in bucket:
        spans += [(offset, offset + numel, kind)] if kind in (REPLICATED, HEADS) else []
        offset += numel
    return _Content(offset, tuple(spans), block, tied, expert)


@lru_cache(maxsize=4096)
def _layout(s: Shapes, stages: tuple, ties: bool, n: int, zero: int, codec: str, limit: float,
            experts: int) -> RankBuckets:
    """`experts`: the ranks the experts' buckets are padded for and sharded over (moe.expert_shard_ranks),
    or 0 (ep = 1: no buckets of their own)."""
    align = INT8_BLOCK if codec == "int8" else 1
    contents, planned = _contents(s, stages, ties, zero == 3, limit, experts > 0), {}
    for b in set(contents):  # each kind of layer's alike: a few distinct ones
        group = experts if b.expert else n
        padded = padded_size(b.size, group, align)
        summed = padded if zero == 0 else padded // group  # finalize sums the whole bucket under ZeRO-0
        kinds = [0, 0, 0]
        for lo, hi, kind in b.spans:
            kinds[kind] += max(0, min(hi, summed) - lo)
        planned[b] = PlannedBucket(padded, padded // group, kinds[REPLICATED], kinds[HEADS], b.block, b.tied, b.size,
                                   b.expert)
    out = [planned[b] for b in contents]
    factors = [sum(powersgd_shape(b.padded)) if codec == "powersgd" else 0 for b in out]
    return RankBuckets(tuple(out), sum(b.padded for b in out), sum(b.padded for b in out if b.block),
                       sum(b.replicated for b in out), sum(b.heads for b in out), sum(factors), shard_params(out, 0),
                       sum(b.shard for b in out), sum(b.padded for b in out if b.expert),
                       sum(b.size for b in out if b.expert), sum(f for f, b in zip(factors, out) if b.expert))


def shard_params(buckets: Iterable[PlannedBucket], k: int, k_expert: int | None = None) -> int:
    """Parameter elements (padding left out) in shard k of every bucket (k_expert of the experts'
    own, ep > 1): what AdamW's moments cover on the rank at index k of the group ZeRO shards over
    (optimizer.ShardedAdamW's pieces end where the parameters do). The padding is at a bucket's
    end, so shard 0 holds the most."""
    at = [k, k if k_expert is None else k_expert]
    return sum(max(0, min(b.size, (at[b.expert] + 1) * b.shard) - at[b.expert] * b.shard) for b in buckets)
