"""Bytes per optimizer step by group, as tetrad.comm counts them: what the runtime's counters
must equal for the same layout (tests/test_plan_runtime.py, tests/test_breakdown.py)."""

from __future__ import annotations

from tetrad.config import Config
from tetrad.dist.codec_shapes import INT8_BLOCK, POWERSGD_RANK, sums_elementwise
from tetrad.config.sections import shard_ranks, zero_shard
from tetrad.dist.layout import GRAD_DIMS, Layout
from tetrad.model import flops
from tetrad.parallel.bucketing import padded_size
from tetrad.parallel.pipeline.split import rank_chunk_layers, rank_layers
from tetrad.plan.buckets import RankBuckets, rank_buckets, ties_embedding
from tetrad.plan.latent import regathered_inputs, tp_inputs, widths
from tetrad.plan.memory import activation_bytes, state_bytes_per_param, vocab_shard
from tetrad.plan.moe import ep_all_to_alls, expert_shard_ranks

# The step's numbers that need the whole job: one all-reduce of 6 fp32 (squared gradient norm,
# loss, a flag per stop signal and one for a closed stdout) over dp x cp, tp and pp
# (train/trainer.py's _step_sums); under MoE a 7th, the layers' summed load-balancing loss, and
# where expert biases move a float per pipeline stage more; under multi-token prediction two per
# depth, its loss sum and count (`step_sums`).
STEP_SUMS = 6 * 4


def step_sums(cfg: Config) -> int:
    """Bytes of the step's sums in each group they are all-reduced over (STEP_SUMS; MoE: 4 more;
    moving expert biases: 4 a pipeline stage more, each stage's largest expert load; multi-token
    prediction: 8 a depth more)."""
    m = cfg.model
    return STEP_SUMS + (4 if m.n_experts else 0) + (4 * cfg.parallel.pp if _moves_biases(cfg) else 0) \
        + 8 * m.mtp_layers


def expert_bias_bytes(cfg: Config) -> int:
    """Moving expert biases (train/expert_bias.py): the step's all-reduce over dp x cp of the int64
    expert counts [MoE layers, E] of rank 0's stage; nothing at rate 0."""
    return _moe_layers(cfg) * cfg.model.n_experts * 8 if _moves_biases(cfg) else 0


def _moves_biases(cfg: Config) -> bool:
    return cfg.model.router_bias_update_rate > 0


def comm_bytes_per_step(cfg: Config) -> dict[str, int]:
    """Bytes rank 0 (first pipeline stage, first tp/cp/dp coordinate) hands to collectives in one
    optimizer step, by group, under tetrad.comm's convention: all-reduce the tensor, all-gather
    the gathered output, reduce-scatter the unscattered input, all-to-all the input,
    point-to-point what it sends. The dp x cp gradient group counts as "dp" (and the experts'
    gradient group under ep); the EP group's all-to-alls as "ep". Each of tp, pp and dp (dp x cp's
    group) also carries the step's sums (`step_sums`); dp the expert counts where biases move
    (`expert_bias_bytes`). Gradient traffic is summed over rank 0's buckets as the runtime lays
    them out (plan/buckets.py), padding included."""
    p = cfg.parallel
    out = {"tp": _tp_bytes(cfg) if p.tp > 1 else 0, "cp": _cp_bytes(cfg) if p.cp > 1 else 0,
           "pp": _pp_bytes(cfg) if p.pp > 1 else 0,
           "dp": _dp_bytes(cfg) + expert_bias_bytes(cfg) if p.dp * p.cp > 1 else 0,
           "ep": _ep_bytes(cfg)}
    return {k: int(v) for k, v in out.items()}


def _tokens(cfg: Config) -> int:
    """Tokens of one micro-batch on this rank."""
    return cfg.train.micro_batch * cfg.model.seq_len // cfg.parallel.cp


def _hidden(cfg: Config) -> float:
    """Bytes of one micro-batch's hidden states on this rank."""
    return _tokens(cfg) * cfg.model.d_model * activation_bytes(cfg.train.dtype)


def _mtp_on_rank0(cfg: Config) -> int:
    """The multi-token prediction modules rank 0 runs: all of them on a single stage, else none."""
    return cfg.model.mtp_layers if cfg.parallel.pp == 1 else 0


def _layers(cfg: Config) -> int:
    """Rank 0's transformer layers, the multi-token prediction modules' included."""
    return rank_layers(cfg)[0] + _mtp_on_rank0(cfg)


def _moe_layers(cfg: Config) -> int:
    """How many of rank 0's layers are MoE layers (ModelConfig.moe_layer; model.dense_layers' are
    not), the multi-token prediction modules' included."""
    mtp = flops.mtp_kind_counts(cfg.model).get(True, 0) if _mtp_on_rank0(cfg) else 0
    return flops.kind_counts(cfg.model, rank_chunk_layers(cfg)[0]).get(True, 0) + mtp


def recompute_reduces_output(m) -> bool:
    """Whether full and per-op recompute run a layer's final row-parallel all-reduce (reduce-scatter
    under SP) again. They repeat the layer's forward up to its last saved tensor, where torch's
    non-reentrant checkpoint stops: the MLP's output projection input, before that reduction, or
    after it with residual dropout (its mask) or a sandwich norm (its input, the reduction's output)."""
    return m.dropout > 0 or m.sandwich_norm


def _tp_bytes(cfg: Config) -> float:
    """Per layer and direction: two all-reduces of the hidden states, or under SP two
    all-gathers and two reduce-scatters, each counted at the full size. The embedding's
    all-reduce (SP: reduce-scatter forward, all-gather of its gradient backward). On a single
    stage also the head's input collective and the cross-entropy's max, sum-exp and target logit
    (fp32 per token), and each multi-token prediction depth's layer, embedding, head input and
    cross-entropy likewise. With `sp_regather`, the column-parallel inputs' all-gathers again in backward.
    Under SP, or after a codec that mixes elements (finalize.reduce_replicated), one all-reduce
    of the replicated (norm) weights' fp32 gradients per step, otherwise of qk-norm's alone: those
    in the rank's buckets under ZeRO-0, in its shard of each under ZeRO (rank_buckets: the shard
    holds whichever parameters the layout puts there, not an even part). The step's sums."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    hidden, layers, sp, mtp = _hidden(cfg), _layers(cfg), p.sequence_parallel, _mtp_on_rank0(cfg)
    # latent attention's input collectives (its latents'; plan/latent.py) beyond q, k and v's one:
    # forward under SP (all-gathers), backward always (reduce-scatters, all-reduces)
    inputs = _tokens(cfg) * sum(tp_inputs(m)) * activation_bytes(t.dtype) - hidden
    forward = 2 * hidden * (2 if sp else 1) + (inputs if sp else 0)
    last = hidden if recompute_reduces_output(m) else 0
    recomputed = forward - hidden + last if t.recompute in ("full", "selective-op") else 0
    per_micro = layers * (2 * forward + (0 if sp else inputs) + recomputed) + hidden * (2 if sp else 1)
    if p.pp == 1:  # the head's (and each depth's embedding and head)
        per_micro += (1 + mtp) * (hidden * (2 if sp else 1) + 3 * _tokens(cfg) * 4) + mtp * hidden * (2 if sp else 1)
    if sp and p.sp_regather:  # each column-parallel input gathered again in backward: qkv, fc1, the head
        # (an MoE layer's input is gathered once, by tp_input, and kept: no fc1 regather; a shared
        # expert reads that one too; so are latent attention's latents: plan/latent.py)
        per_micro += hidden * ((regathered_inputs(m) + 1) * layers - _moe_layers(cfg) + (p.pp == 1) * (1 + mtp))
    averaged = not sums_elementwise(p.grad_codec, p.dp * p.cp)
    buckets = rank_buckets(cfg)[0]
    summed = buckets.heads + (buckets.replicated if sp or averaged else 0)  # qk-norm: always
    return cfg.microbatches * per_micro + 4 * summed + step_sums(cfg)


def _pp_bytes(cfg: Config) -> float:
    """Rank 0 sends each micro-batch's activations on from every chunk, and the gradients of its
    chunks after the first back to the previous rank (the last one); the step's sums. Tied
    embeddings, or multi-token prediction's copy of it (buckets.ties_embedding): the embedding's
    fp32 gradient summed with the last stage's copy's (its shard under ZeRO-2)."""
    m, p = cfg.model, cfg.parallel
    sent = _hidden(cfg) / (p.tp if p.sequence_parallel else 1)
    out = cfg.microbatches * (2 * p.vpp - 1) * sent + step_sums(cfg)
    if ties_embedding(m, p.pp * p.vpp):  # rank 0's shard of the embedding's bucket, its padding left out (GradReducer.reduce)
        size = vocab_shard(m, p.tp) * m.d_model
        out += 4 * (padded_size(size, shard_ranks(p), 1) // shard_ranks(p) if p.zero >= 2 else size)
    return out


def _cp_bytes(cfg: Config) -> float:
    """Ring: K/V cp-1 times forward (again under selective and full recompute, which run the
    ring again; selective-op replays its kept result: model/replay.py RingReplay); backward
    K/V cp-1 times and the fp32 dK/dV cp times.
    All-to-all: q, k, v to heads and the output back, each way; full and per-op recompute repeat
    all four, selective q, k and v (its recompute stops at the attention kernel's saved outputs,
    before the output's all-to-all). MoE: each layer's fp32 expert counts per sequence, summed
    for the load-balancing loss (model/moe.py _balance_loss), again under full and per-op recompute."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    e, tokens = activation_bytes(t.dtype), _tokens(cfg)
    per_micro = cfg.microbatches * _layers(cfg)
    w = widths(m, p.tp)
    kv = tokens * (w.k + w.v)  # latent attention: every head's k and v (padded): more than GQA's
    counts = cfg.microbatches * _moe_layers(cfg) * m.n_experts * t.micro_batch * 4 \
        * (2 if t.recompute in ("full", "selective-op") else 1)  # MoE layers' alone
    if p.cp_algo == "ring":
        forwards = 2 if t.recompute in ("selective", "full") else 1
        return per_micro * ((p.cp - 1) * kv * e * forwards + (p.cp - 1) * kv * e + p.cp * kv * 4) + counts
    qkv, out = tokens * (w.q + w.k + w.v) * e, tokens * w.out * e
    recomputed = {"none": 0, "selective": qkv, "full": qkv + out, "selective-op": qkv + out}[t.recompute]
    return per_micro * (2 * (qkv + out) + recomputed) + counts


def _ep_bytes(cfg: Config) -> float:
    """Each MoE layer's all-to-alls over the EP group (moe.ep_all_to_alls: balanced routing), forward
    and backward, the forward's again under full and per-op recompute (they rerun the MoE layer)."""
    t = cfg.train
    forward, backward = ep_all_to_alls(cfg.model, _tokens(cfg), cfg.parallel.ep, activation_bytes(t.dtype))
    again = t.recompute in ("full", "selective-op")
    return cfg.microbatches * _moe_layers(cfg) * (sum(forward) * (1 + again) + sum(backward))


def _dp_bytes(cfg: Config) -> float:
    """Over rank 0's buckets, padded (rank_buckets): ZeRO-0: one all-reduce of the fp32 gradient
    buckets; ZeRO-1: that, then the updated shards all-gathered; ZeRO-2: a reduce-scatter every
    micro-batch, then the shards all-gathered; ZeRO-3: each block's bucket gathered for forward
    and for backward every micro-batch, the rest once, and a reduce-scatter every micro-batch.
    Under ep the experts' buckets likewise over their group, unless it is one rank (ep = dp, cp = 1):
    a group of one moves nothing. Hybrid ZeRO: `_hybrid_dp_bytes`. The step's sums."""
    p, micro = cfg.parallel, cfg.microbatches
    w = state_bytes_per_param(cfg.train.dtype)[0]
    buckets = rank_buckets(cfg)[0]
    if zero_shard(p):
        return _hybrid_dp_bytes(cfg, buckets, w) + step_sums(cfg)
    alone = buckets.expert_padded if expert_shard_ranks(p) == 1 else 0
    padded = buckets.padded - alone
    if p.zero == 0:
        grads = _all_reduce_bytes(cfg, buckets)
    elif p.zero == 1:  # the updated shards gathered over whole (padded) buckets
        grads = _all_reduce_bytes(cfg, buckets) + padded * w
    elif p.zero == 2:
        grads = padded * (micro * scatter_bytes(cfg) + w)
    else:  # (ZeRO-3: the experts' buckets are all blocks')
        blocks = buckets.blocks - alone
        grads = (2 * micro * blocks + padded - blocks) * w + micro * padded * scatter_bytes(cfg)
    return grads + step_sums(cfg)


def _hybrid_dp_bytes(cfg: Config, buckets: RankBuckets, w: int) -> float:
    """Hybrid ZeRO (parallel.zero_shard): each reduction a reduce-scatter inside the block of s
    ranks, and its 1/s shard all-reduced over the replicas once a step (ZeRO-1: the last
    micro-batch's reduced shard; ZeRO 2/3: the step's fp32 sum of every micro-batch's); the
    gathers as ZeRO's, inside the block. Under ep the experts' buckets alike over their s/ep ranks
    of the block (moe.expert_shard_ranks) and the same replicas; at ZeRO-3 all of them blocks'."""
    p, expert = cfg.parallel, buckets.expert_padded
    dense = _hybrid_part(cfg, buckets.padded - expert, buckets.blocks - expert * (p.zero == 3), shard_ranks(p), w)
    return dense + (_hybrid_part(cfg, expert, expert * (p.zero == 3), expert_shard_ranks(p), w) if expert else 0)


def _hybrid_part(cfg: Config, padded: int, blocks: int, s: int, w: int) -> float:
    """`_hybrid_dp_bytes` of `padded` elements of buckets (`blocks` of them ZeRO-3's block buckets)
    sharded over s ranks. A group of one rank (s = 1) moves nothing; the replicas are always more."""
    p, micro = cfg.parallel, cfg.microbatches
    inside = s > 1
    scatters = (micro if p.zero >= 2 else 1) * padded * scatter_bytes(cfg) * inside
    replicas = padded / s * (4 if p.zero >= 2 else scatter_bytes(cfg))
    gathers = (2 * micro * blocks + padded - blocks) if p.zero == 3 else padded
    return scatters + replicas + inside * w * gathers


def scatter_bytes(cfg: Config) -> int:
    """Bytes per gradient of ZeRO >= 2's reduce-scatter: fp32, or bf16 under that codec."""
    return 2 if cfg.parallel.grad_codec == "bf16" else 4


def _all_reduce_bytes(cfg: Config, buckets: RankBuckets) -> float:
    """The ZeRO-0/1 gradient all-reduce: flat (gradient_reduce_bytes), or with `hierarchical`
    (dist/hierarchical.py) the dense buckets' a reduce-scatter and an all-gather over rank 0's node
    and an all-reduce of its 1/k shard between nodes, each skipped over a group of one rank (the
    experts' buckets flat over their group, none where it is one rank)."""
    p = cfg.parallel
    dense, experts = gradient_reduce_bytes(cfg, buckets)
    experts *= expert_shard_ranks(p) > 1
    if p.hierarchical is not True:  # "auto" resolves by measuring: counted flat, as the time model does
        return dense + experts
    intra, inter = (next(len(g) for g in half if 0 in g)
                    for half in Layout.of(p).split_by_node(GRAD_DIMS, p.ranks_per_node))
    return (buckets.padded - buckets.expert_padded) * 4 * (2 * (intra > 1) + (inter > 1) / intra) + experts


def gradient_reduce_bytes(cfg: Config, buckets: RankBuckets, plain: float = 4) -> tuple[float, float]:
    """Bytes a rank hands to the ZeRO-0/1 gradient all-reduce of its `buckets` (rank_buckets)
    under `parallel.grad_codec` (dist/codecs.py), `plain` bytes a gradient without one: each
    bucket whole, padding included; PowerSGD's two factors of the bucket's own matrix shape. As
    (the dense buckets', the experts' own buckets'): each group's codec compresses its own (ep)."""
    codec, expert = cfg.parallel.grad_codec, buckets.expert_padded
    return (_coded(codec, buckets.padded - expert, buckets.factors - buckets.expert_factors, plain),
            _coded(codec, expert, buckets.expert_factors, plain))


def _coded(codec: str, padded: int, factors: int, plain: float) -> float:
    """Bytes of `padded` gradient elements under `codec` (PowerSGD: of buckets whose matrices'
    rows + cols sum to `factors`)."""
    if codec == "none":
        return padded * plain
    if codec == "bf16":
        return padded * 2
    if codec == "int8":  # a byte a value and an fp32 scale a block
        return padded * (1 + 4 / INT8_BLOCK)
    return factors * POWERSGD_RANK * 4  # P, then Q, in fp32
