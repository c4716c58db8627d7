"""What one transformer layer costs, per micro-batch on one rank (the embedding's and the head's: ends.py).

Compute: GEMM FLOPs / (peak x the efficiency of that GEMM's shape); the attention core at the
GPU's flash-attention efficiency (a causal kernel executes half the square; tetrad's masked
attention what its kernel executes: `_attention_keys`) or, without flash
attention, as batched GEMMs plus the scores' HBM round trips; element-wise work and fp8 casts as
bytes / HBM bandwidth. The layer's TP, CP and ZeRO-3 collectives (links.py) are exposed where
nothing hides them; under FSDP also its copies of the weights and gradients. The pipeline
simulator runs these costs (cost.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from tetrad.config import Config
from tetrad.config.sections import shard_ranks
from tetrad.model import flops
from tetrad.model.flops import hides_keys
from tetrad.plan.comm_bytes import recompute_reduces_output, scatter_bytes
from tetrad.plan.hardware import GPU, Cluster
from tetrad.plan.kernels import masked_attention
from tetrad.plan.latent import latents, projections, regathered_inputs, tp_inputs, widths
from tetrad.plan.links import all_to_all_time, expert_shard_stride, group_link, overlap_slowdown, ring_time
from tetrad.plan.memory import activation_bytes, state_bytes_per_param
from tetrad.plan.buckets import layer_params_on_rank
from tetrad.plan.moe import ep_all_to_alls, expert_grad_bytes, expert_shard_ranks, routing_bytes_per_token
from tetrad.plan.stacks import EAGER_ELEMENTWISE, Stack

GEMM_HALF_DIM = 128  # a GEMM dimension this small reaches half the large-GEMM efficiency (tile quantisation)
FLASH_BACKWARD_FACTOR = 2.5  # flash backward: 5 matmuls of the forward's 2 (it recomputes the scores)
FP8_CAST_BYTES = 5  # per element cast to fp8 with dynamic scaling: read for amax, read again, write 1 byte (16-bit in)
RING_MERGE_BYTES = 16  # per output element per ring step: log-sum-exp merge of fp32 partial outputs
# Seconds of each attention kernel's (forward, backward) relative to FlashAttention-2's at the
# GPU's efficiency. Triton: "FlashAttention-2 is around 1.3-1.5x faster than FlashAttention in
# Triton in the forward pass and around 2x faster in the backward pass" (Dao 2023, FlashAttention-2,
# arXiv 2307.08691, section 4.1).
ATTENTION_KERNELS = {"flash2": (1.0, 1.0), "fused": (1.0, 1.0), "triton": (1.4, 2.0)}


def gemm_efficiency(gpu: GPU, *dims: float) -> float:
    """Large-GEMM efficiency, lowered for each small dimension (tiles left partly empty)."""
    eff = gpu.gemm_efficiency
    for d in dims:
        eff *= d / (d + GEMM_HALF_DIM)
    return eff


@dataclass(frozen=True)
class LayerCost:
    """Seconds for one layer, one micro-batch, on one rank. forward / backward_input /
    backward_weight are what the pipeline simulator runs (exposed communication included);
    the rest break them down."""
    forward: float
    backward_input: float  # without the recompute
    backward_weight: float
    recompute: float  # compute only; its collectives are in backward_input and tp_comm/cp_comm
    compute: float  # forward + backward compute, no recompute, no communication
    tp_comm: float  # exposed per micro-batch (forward + backward, recompute's included)
    cp_comm: float
    zero3_comm: float
    ep_comm: float = 0.0  # expert parallelism's all-to-alls, exposed


def layer_cost(cfg: Config, cluster: Cluster, stack: Stack) -> LayerCost:
    """One transformer layer's costs under `cfg`'s layout, `cfg.model` the layer's kind
    (flops.layer_model: cost.layer_costs gives each kind's)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    tokens = t.micro_batch * m.seq_len // p.cp
    gemm, cast_f, cast_b = _gemms(cfg, cluster.gpu, tokens)
    attn_f, attn_b = _attention_core(cfg, cluster.gpu, stack, tokens)
    elem_f, elem_b = _elementwise(cfg, cluster.gpu, stack, tokens)
    compute_f = sum(gemm) + cast_f + attn_f + elem_f
    # MoE: the experts' (and the router's) weight gradients are made in the input-gradient pass
    # (model/moe.py's one autograd Function), zero-filled there first: BI's under a split backward
    in_bi = gemm[2] + gemm[3] + expert_grad_bytes(m, p.tp, p.ep, activation_bytes(t.dtype)) / cluster.gpu.hbm_bytes_per_s \
        if m.n_experts else 0.0
    compute_bi = sum(gemm) + cast_b / 2 + attn_b + elem_b + in_bi
    compute_bw = sum(gemm) + cast_b / 2 - (gemm[2] + gemm[3] if m.n_experts else 0.0)
    copy_f, copy_bi, copy_bw = _zero3_copies(cfg, cluster.gpu, stack)
    compute_f, compute_bi, compute_bw = compute_f + copy_f, compute_bi + copy_bi, compute_bw + copy_bw
    # Without fused accumulation each micro-batch's gradient is added to the full fp32 buffer, except
    # under FSDP's ZeRO-3, which reduce-scatters every micro-batch and accumulates only its shard.
    fsdp = p.zero == 3 and stack.zero3_impl != "buckets"
    if not stack.fused_grad_accumulation and cfg.microbatches > 1 and not fsdp:
        params = layer_params_on_rank(m, p.tp, p.ep)
        compute_bw += params * 12 / cluster.gpu.hbm_bytes_per_s  # fp32 accumulator: read it and the new gradient, write it
    e = activation_bytes(t.dtype)
    tp_f, tp_b, tp_again = _tp_exposed(cfg, cluster, stack, tokens, e, gemm)
    cp_f, cp_b = _cp_exposed(cfg, cluster, tokens, e, attn_f, attn_b)
    ep_f, ep_b = _ep_exposed(cfg, cluster, tokens, e) if m.n_experts else (0.0, 0.0)  # a dense layer has none
    z_f, z_b = _zero3_exposed(cfg, cluster, compute_f, compute_bi + compute_bw)
    # Recomputation runs at the start of the backward: the attention core (selective; cp's
    # collectives inside it again, in cp_b), the whole forward with its collectives (full), or
    # all of it but the kept matmuls and attention (selective-op; its tp and all-to-all
    # collectives run again too; a ring is replayed, neither merged nor sent again).
    ring_merge_f = _ring_merges(cfg, cluster.gpu, tokens)[0]
    recompute = {"none": 0.0, "selective": attn_f, "full": compute_f,
                 "selective-op": _op_recomputed_gemms(cfg, cluster.gpu, tokens) + elem_f - ring_merge_f + cast_f
                 }[t.recompute]
    if t.recompute in ("full", "selective-op"):  # (the MoE layer's all-to-alls with the rest)
        tp_b, ep_b = tp_b + tp_again, ep_b + ep_f
    return LayerCost(forward=compute_f + tp_f + cp_f + ep_f + z_f,
                     backward_input=compute_bi + tp_b + cp_b + ep_b + z_b,
                     backward_weight=compute_bw, recompute=recompute, compute=compute_f + compute_bi + compute_bw,
                     tp_comm=tp_f + tp_b, cp_comm=cp_f + cp_b, zero3_comm=z_f + z_b, ep_comm=ep_f + ep_b)


def _gemms(cfg: Config, gpu: GPU, tokens: int) -> tuple[list[float], float, float]:
    """Seconds of each weight GEMM (K, N): the attention's input projections together (q, k, v;
    latent attention's down and up projections: plan/latent.py), out-projection, fc1 (gate and up
    for SwiGLU), fc2; the two backward GEMMs have the same FLOPs and dimensions as the forward one. With fp8
    also the dynamic-scaling casts, (forward, backward): inputs and weights forward,
    grad-outputs and both again backward. Under MoE fc1 and fc2 are the experts' (E GEMMs each,
    `_gemm_time`), fc1 with the router's (and the shared expert gate's); a shared expert's fc1 and
    fc2 follow, dense GEMMs over every token (their weight gradients in BW, as a dense MLP's)."""
    m, t = cfg.model, cfg.train
    h, tp = m.d_model, cfg.parallel.tp
    f = flops.mlp_hidden(m, active=True) / tp  # under MoE a token's k experts' k·H
    # (rows, K, N, matrices): a dense layer's GEMMs each one matrix over the micro-batch's tokens
    own = tokens / tp if cfg.parallel.sequence_parallel else tokens  # latent attention's down projections' rows
    inputs = [(own if chunk else tokens, k, n, 1) for k, n, chunk in projections(m, tp)]
    shapes = inputs + [(tokens, widths(m, tp).wo, h, 1)]
    if m.n_experts:  # each local expert's rows (E/ep of them): the balanced share of the k·tokens assignments
        e = m.n_experts // cfg.parallel.ep
        rows, width = tokens * m.experts_per_token / e, m.expert_hidden / cfg.parallel.tp
        shapes += [(rows, h, width * (2 if m.gated_mlp else 1), e), (rows, width, h, e)]
        shared = m.shared_expert_ffn_hidden / cfg.parallel.tp
        shapes += [(tokens, h, shared * (2 if m.gated_mlp else 1), 1), (tokens, shared, h, 1)] if shared else []
    else:
        shapes += [(tokens, h, f * (2 if m.gated_mlp else 1), 1), (tokens, f, h, 1)]
    peak = gpu.matmul_peak(t.dtype, t.tf32)
    gemm = [_gemm_time(gpu, peak, t.dtype, *shape) for shape in shapes]
    gemm = [sum(gemm[:len(inputs)])] + gemm[len(inputs):]
    if m.n_experts:
        gemm[2] += _gemm_time(gpu, peak, t.dtype, tokens, h, m.n_experts + m.shared_expert_gate, 1)  # the router
        # (and the shared expert's gate), replicated over tp
    if t.dtype != "fp8":
        return gemm, 0.0, 0.0
    hbm = gpu.hbm_bytes_per_s
    cast_f = sum(FP8_CAST_BYTES * c * (r * k + k * n) for r, k, n, c in shapes) / hbm
    cast_b = sum(FP8_CAST_BYTES * c * (r * (k + n) + k * n) for r, k, n, c in shapes) / hbm
    return gemm, cast_f, cast_b


def _gemm_time(gpu: GPU, peak: float, dtype: str, rows: float, k: float, n: float, matrices: int) -> float:
    """Seconds of `matrices` GEMMs of `rows` x K x N each (one per expert under MoE): at the
    efficiency of that shape (a few rows per expert leave tiles empty), and never less than
    reading their weights from HBM once (an expert GEMM of few rows is bound by its weights)."""
    compute = matrices * 2 * rows * k * n / (peak * gemm_efficiency(gpu, rows, k, n))
    return max(compute, matrices * k * n * activation_bytes(dtype) / gpu.hbm_bytes_per_s) if matrices > 1 else compute


def _op_recomputed_gemms(cfg: Config, gpu: GPU, tokens: int) -> float:
    """Seconds of the matmuls `selective-op` recomputes: every other one it counts, from the second
    (flops.op_checkpoint_matmuls; an MoE layer's routing keeps all of its own)."""
    m, tp, dtype = cfg.model, cfg.parallel.tp, cfg.train.dtype
    peak = gpu.matmul_peak(dtype, cfg.train.tf32)
    own = tokens / tp if cfg.parallel.sequence_parallel else tokens  # a "chunk" matmul's (flops.layer_matmuls)
    out = 0.0
    for k, n, split, rows in flops.op_checkpoint_matmuls(m)[1::2]:
        r, k, n = {"column": (tokens, k, n / tp), "row": (tokens, k / tp, n), "chunk": (own, k, n)}[split]
        out += _gemm_time(gpu, peak, dtype, r * rows, k, n, 1)
    return out


def _attention_core(cfg: Config, gpu: GPU, stack: Stack, tokens: int) -> tuple[float, float]:
    """(forward, backward) seconds of the attention core: flash kernels execute the causal half
    of the square (balanced over cp); materialised scores compute the full square on the GEMM
    units and round-trip HBM."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    hd, heads = m.head_dim, m.n_heads / p.tp
    peak = gpu.peak("bf16")
    if t.dtype == "fp32":
        # SDPA's fp32 kernel (memory-efficient, CUTLASS) runs on the tensor cores where the GPU has
        # TF32, as 3xTF32 (OpMultiplyAddFastF32: three TF32 products per fp32 one; torch's
        # mem_eff_attention gemm_kernel_utils.h, DefaultGemmType for float at compute capability 8+).
        peak = gpu.peak("tf32") / 3 if "tf32" in gpu.peak_tflops else gpu.peak("fp32")
    if stack.flash_attention:
        keys, fused = _attention_keys(cfg, stack, gpu.is_cpu)
        eff = gpu.attention(fused) * _shape(hd) / _shape(128) * _shape(tokens / t.micro_batch)
        forward = 4 * tokens * keys * heads * hd / (peak * eff)
        slower_f, slower_b = ATTENTION_KERNELS[stack.attention_kernel]
        return slower_f * forward, slower_b * FLASH_BACKWARD_FACTOR * forward
    e, hbm = activation_bytes(t.dtype), gpu.hbm_bytes_per_s
    scores = heads * tokens * m.seq_len
    mask = 1 if m.dropout > 0 else 0
    bmm = 4 * tokens * m.seq_len * heads * hd / (peak * gemm_efficiency(gpu, m.seq_len, m.seq_len, hd))
    forward = bmm + scores * (2 * e + mask * (2 * e + 1)) / hbm  # softmax (and dropout) read + write
    return forward, 2 * bmm + scores * (3 * e + mask * (2 * e + 1)) / hbm


def _attention_keys(cfg: Config, stack: Stack, is_cpu: bool) -> tuple[float, bool]:
    """(keys per query the flash-style kernel computes, whether it is the GPU's fused one). A
    causal kernel computes half the square: seq_len / 2 (fused kernels are 16-bit only). tetrad's
    own masked attention (`stack.tetrad_attention`; plan/kernels.py asks the runtime's choice):
    flash's varlen kernel (FlashAttention-2, not the fused one) computes the window's causal band,
    W - W^2 / (2 seq_len) a query (seq_len / 2 as W reaches seq_len); documents cannot be known
    ahead, so their causal half is the bound it costs. The bias kernels compute the whole square,
    at FlashAttention-2's efficiency (the planner's figure for the memory-efficient kernel). The
    ring's blocks keep the causal half (not modelled apart). Other stacks: the causal half."""
    m, t = cfg.model, cfg.train
    fused = stack.attention_kernel == "fused" and t.dtype != "fp32"
    kernel = masked_attention(cfg, is_cpu) if stack.tetrad_attention else None
    s, windows = m.seq_len, [w if hides_keys(w, m.seq_len) else 0 for w in flops.layer_windows(m)]
    if kernel == "varlen":  # the mean over the layers (model.layer_types: some windowed, some not)
        return sum(w - w * w / (2 * s) if w else s / 2 for w in windows) / len(windows), False
    if kernel == "square":  # a layer neither windowed nor in documents runs the causal kernel
        return sum(s if w or t.document_mask else s / 2 for w in windows) / len(windows), False
    return s / 2, fused


def _elementwise(cfg: Config, gpu: GPU, stack: Stack, tokens: int) -> tuple[float, float]:
    """(forward, backward) seconds of element-wise work: norms and residual adds over h (split by
    SP), the activation over f, RoPE on q and k (latent attention: their assembly from the nope and
    rope parts, and the latents' norms), fused kernels reading and writing each once forward,
    twice backward; the ring's log-sum-exp merges of partial outputs under CP."""
    m, p = cfg.model, cfg.parallel
    e, hbm = activation_bytes(cfg.train.dtype), gpu.hbm_bytes_per_s
    w, f = widths(m, p.tp), flops.mlp_hidden(m, active=True) / p.tp
    div = p.tp if p.sequence_parallel else 1
    act = 3 if m.gated_mlp else 2
    norms = 14 if m.sandwich_norm else 10  # each sandwich norm one more read and write of h
    shared = m.shared_expert_ffn_hidden / p.tp if m.n_experts else 0.0  # an MoE layer's shared expert
    rope = 2 * (w.q + w.k) + 2 * sum(latents(m)) if m.pos == "rope" else 0
    elem_bytes = tokens * e * (norms * m.d_model / div + act * shared + rope)
    # a dense MLP's activation, or the routed experts' and their dispatch and combine
    mlp_bytes = tokens * (e * act * f + routing_bytes_per_token(m, e, p.ep))
    mlp_factor = EAGER_ELEMENTWISE if m.n_experts and stack.eager_routing else stack.elementwise_factor
    forward = (stack.elementwise_factor * elem_bytes + mlp_factor * mlp_bytes) / hbm
    merge_f, merge_b = _ring_merges(cfg, gpu, tokens)
    return forward + merge_f, 2 * forward + merge_b


def _ring_merges(cfg: Config, gpu: GPU, tokens: int) -> tuple[float, float]:
    """(forward, backward) seconds of the ring's fp32 accumulations over its cp steps: the
    log-sum-exp merges of partial outputs, and backward's dq, dk and dv."""
    p = cfg.parallel
    if p.cp == 1 or p.cp_algo != "ring":
        return 0.0, 0.0
    w = widths(cfg.model, p.tp)
    per_width = p.cp * tokens * RING_MERGE_BYTES / gpu.hbm_bytes_per_s
    return per_width * w.out, per_width * (w.q + w.k + w.v)


def _shape(d: float) -> float:
    return d / (d + GEMM_HALF_DIM)


def _tp_exposed(cfg: Config, cluster: Cluster, stack: Stack, tokens: int, e: int,
                gemm: list) -> tuple[float, float, float]:
    """Exposed TP time per layer per micro-batch, (forward, backward, the forward's again under full
    and per-op recompute): two all-reduces of the hidden states each way (with SP an all-gather and
    a reduce-scatter each, the same ring time), latent attention's input collectives at their
    widths (plan/latent.py: its latents'); a recompute runs the output's reduction (SP: its
    reduce-scatter, half the MLP's pair) again only where it reaches it
    (comm_bytes.recompute_reduces_output), as `comm_bytes` counts."""
    m, p = cfg.model, cfg.parallel
    if p.tp == 1:
        return 0.0, 0.0, 0.0
    alpha, bw = group_link(cluster, 1, p.tp)
    one = ring_time("all_reduce", tokens * m.d_model * e, p.tp, alpha, bw)
    inputs = ring_time("all_reduce", tokens * sum(tp_inputs(m)) * e, p.tp, alpha, bw)  # one for q, k and v's
    # the attention's collectives each way: SP's input gather and output reduce-scatter forward,
    # their mirrors backward; without SP the output's all-reduce forward, the input's backward
    attn_f, attn_b = ((inputs + one) / 2,) * 2 if p.sequence_parallel else (one, inputs)
    skipped = 0.0 if recompute_reduces_output(m) else 0.5 if p.sequence_parallel else 1.0  # of the MLP's
    # Under SP a stack that does not keep the gathered input gathers the qkv and fc1 inputs again
    # in backward, started before (and hidden behind) those linears' input-gradient GEMMs.
    regather = ring_time("all_gather", tokens * m.d_model * e, p.tp, alpha, bw) \
        if p.sequence_parallel and not stack.sp_saves_gathered_input else 0.0
    again = regathered_inputs(m)  # the attention's inputs gathered again (latents: none)
    if stack.tp_overlap == "none":
        return attn_f + one, attn_b + one + (again + 1) * regather, attn_f + (1 - skipped) * one
    # The qkv and fc1 input gradients' all-reduces hide behind those linears' weight-gradient GEMMs.
    backward = max(0.0, attn_b - gemm[0]) + max(0.0, one - gemm[2])
    backward += again * max(0.0, regather - gemm[0]) + max(0.0, regather - gemm[2])
    if stack.tp_overlap == "bwd":
        return attn_f + one, backward, attn_f + (1 - skipped) * one
    # Async TP also hides the forward's reductions behind the row-parallel GEMMs they follow.
    attention, mlp = max(0.0, attn_f - gemm[1]), max(0.0, one - gemm[3])
    return attention + mlp, backward, attention + (1 - skipped) * mlp


def _cp_exposed(cfg: Config, cluster: Cluster, tokens: int, e: int, attn_f: float,
                attn_b: float) -> tuple[float, float]:
    """Exposed CP time per layer per micro-batch, (forward, backward). Ring: each of cp-1 steps
    sends the K/V block while the previous one is attended (backward: K/V and the fp32 dK/dV
    accumulator), and the last dK/dV hand-off waits. All-to-all: q, k, v and the output re-shard
    each way, exposed (`all_to_all_time`: across nodes at one NIC a GPU). Backward also repeats
    what the recompute does again: the forward's collectives, all of them under full recompute,
    under per-op recompute the all-to-alls (the ring is replayed: model/replay.py RingReplay),
    under selective the attention core's (the ring's sends; the all-to-alls of q, k and v, not
    the output's)."""
    m, p = cfg.model, cfg.parallel
    if p.cp == 1:
        return 0.0, 0.0
    w = widths(m, p.tp)
    kv = tokens * (w.k + w.v)  # latent attention: every head's k and v (padded): more than GQA's
    if p.cp_algo == "ring":
        alpha, bw = group_link(cluster, p.tp, p.cp)
        send_f = ring_time("p2p", kv * e, 2, alpha, bw)
        send_b = ring_time("p2p", kv * (e + 4), 2, alpha, bw)
        forward = (p.cp - 1) * max(0.0, send_f - attn_f / p.cp)
        backward = (p.cp - 1) * max(0.0, send_b - attn_b / p.cp) + ring_time("p2p", kv * 4, 2, alpha, bw)
        return forward, backward + (forward if cfg.train.recompute in ("selective", "full") else 0.0)
    q, k, v, out = (all_to_all_time(tokens * x * e, p.cp, cluster, p.tp) for x in (w.q, w.k, w.v, w.out))
    one_way = q + k + v + out
    recomputed = {"none": 0.0, "selective": q + k + v}.get(cfg.train.recompute, one_way)
    return one_way, one_way + recomputed


def _ep_exposed(cfg: Config, cluster: Cluster, tokens: int, e: int) -> tuple[float, float]:
    """Exposed EP time per MoE layer per micro-batch, (forward, backward): the counts' all-to-all,
    the dispatch and the combine forward, the two token all-to-alls reversed backward (moe.ep_all_to_alls,
    balanced routing), over the EP group (ep dp neighbours, cp x tp ranks apart: across nodes where
    ep x cp x tp exceeds a node, then at one NIC a GPU: `all_to_all_time`). Nothing overlaps them:
    the experts wait for their rows."""
    m, p = cfg.model, cfg.parallel
    forward, backward = ep_all_to_alls(m, tokens, p.ep, e)
    return tuple(sum(all_to_all_time(x, p.ep, cluster, p.cp * p.tp) for x in xs) for xs in (forward, backward))


def _zero3_exposed(cfg: Config, cluster: Cluster, forward: float, backward: float) -> tuple[float, float]:
    """ZeRO-3: each layer's weights all-gathered for forward and again for backward, every
    micro-batch, prefetched behind the previous layer's compute, which runs slower beside them;
    backward also beside the layer's fp32 gradient reduce-scatter. (Its exposed time is counted
    once per step, as ZeRO-2's: `estimate`.) Hybrid ZeRO gathers and reduce-scatters inside its
    blocks; its sum across the replicas runs once a step, in the last backward (the data-parallel
    reduction's time), not beside every micro-batch's layers. Under ep an MoE layer's E/ep experts
    are gathered and reduce-scattered over their own group (the expert gradient group, or its share
    of the block: moe.expert_shard_ranks), after the rest."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    n, sharded = p.dp * p.cp, shard_ranks(p)
    if p.zero < 3 or n == 1:
        return 0.0, 0.0
    experts = flops.mlp_matrix_params(m) / p.tp / p.ep if p.ep > 1 and m.n_experts else 0.0
    n_e = expert_shard_ranks(p)
    groups = [(layer_params_on_rank(m, p.tp, p.ep) - experts, sharded, group_link(cluster, p.tp, sharded)),
              (experts, n_e, group_link(cluster, expert_shard_stride(cluster.gpus_per_node, p), n_e))]
    gather, scatter = (sum(ring_time(op, params * nbytes, ranks, *link) for params, ranks, link in groups if params)
                       for op, nbytes in (("all_gather", state_bytes_per_param(t.dtype)[0]),
                                          ("reduce_scatter", scatter_bytes(cfg))))
    gpu = cluster.gpu
    return (max(0.0, gather - forward) + overlap_slowdown(gather, forward, gpu),
            max(0.0, gather - backward) + overlap_slowdown(gather + scatter, backward, gpu))


def _zero3_copies(cfg: Config, gpu: GPU, stack: Stack) -> tuple[float, float, float]:
    """(forward, backward_input, backward_weight) seconds of the copies and casts FSDP makes of a
    layer's weights and gradients every micro-batch, at HBM bandwidth: full-size element-wise
    kernels, which take every SM they are given, so those on FSDP's side streams delay the
    layer's kernels by their whole time (unlike NCCL's few CTAs, `links.overlap_slowdown`).
    Shard-sized work (casting the shard for the gather, accumulating the reduced shard) is 1/n
    of this and left out. FSDP2 (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py):
    each gather's output is split into the parameters (`split_with_sizes_copy`, read and write),
    forward and again backward; the gradients are copied into the reduce-scatter input in its
    dtype (`chunk_cat`); fp32 and bf16 are averaged by NCCL itself. FSDP1 (torch/distributed/
    fsdp/_flat_param.py, _runtime_utils.py): gathers straight into the flat parameter, whose
    views autograd tracks, so backward concatenates the gradients into the flat gradient; then
    casts it to the reduce dtype and divides it before the reduce-scatter (its pre-divide
    factor is at least 2 on 2 or more ranks)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    if p.zero < 3 or p.dp * p.cp == 1 or stack.zero3_impl == "buckets":
        return 0.0, 0.0, 0.0
    params = layer_params_on_rank(m, p.tp, p.ep)
    e, r = state_bytes_per_param(t.dtype)[0], stack.grad_reduce_bytes
    per_byte = params / gpu.hbm_bytes_per_s
    if stack.zero3_impl == "fsdp1":
        return 0.0, 0.0, per_byte * (2 * e + (e + r if r != e else 0) + 2 * r)
    return per_byte * 2 * e, per_byte * 2 * e, per_byte * (e + r)
