"""The cost model of one layout: step time and its breakdown, memory per rank, MFU and HFU.

Compute: GEMM FLOPs / (peak x the efficiency of that GEMM's shape); the attention core at the
GPU's flash-attention efficiency (a causal kernel executes half the square); element-wise work,
fp8 casts and the optimizer as bytes / HBM bandwidth. Communication: alpha-beta per link class
(NVLink inside a node, the network across nodes) over ring volumes of the byte counts of
`comm_bytes_per_step` (what tetrad.comm counts), each collective exposed or hidden behind the
compute it overlaps. Pipeline: the schedule simulator, fed these per-stage costs, gives the time,
the bubble and the in-flight activations. Nothing here imports torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import lru_cache

from tetrad.config import DEFAULT_BUCKET_MB, Config
from tetrad.parallel.pipeline.registry import build_schedule, schedule_spec
from tetrad.parallel.pipeline.schedules import replay
from tetrad.parallel.pipeline.simulate import StageCosts, peak_held, peak_waiting_loss
from tetrad.parallel.pipeline.split import rank_layers, rank_stages, stage_layers
from tetrad.model import flops
from tetrad.plan.hardware import GPU, Cluster
from tetrad.plan.memory import (
    GIB,
    GPU_RESERVED_GIB,
    Memory,
    activation_bytes,
    after_bi_weight,
    memory_by_rank,
    rank_params,
    state_bytes_per_param,
)
from tetrad.plan.stacks import Stack, load_stack

# Global constants of the time model (measured-style, the same for every run; docs/planner.md).
LINK_EFFICIENCY = 0.8  # achieved share of a link's bandwidth by large ring collectives (NCCL bus bandwidth)
GEMM_HALF_DIM = 128  # a GEMM dimension this small reaches half the large-GEMM efficiency (tile quantisation)
FLASH_BACKWARD_FACTOR = 2.5  # flash backward: 5 matmuls of the forward's 2 (it recomputes the scores)
FP8_CAST_BYTES = 5  # per element cast to fp8 with dynamic scaling: read for amax, read again, write 1 byte (16-bit in)
OPTIMIZER_BYTES_PER_PARAM = 36  # Adam + clipping: read/write weights, master, moments; read grads twice
RING_MERGE_BYTES = 16  # per output element per ring step: log-sum-exp merge of fp32 partial outputs


@dataclass
class Estimate:
    cfg: Config
    step_time_s: float
    tokens_per_s: float
    model_tflops_per_gpu: float
    mfu: float
    hfu: float
    bubble_fraction: float
    memory: Memory  # the rank with the largest total
    memory_by_rank: list  # per pipeline rank
    hbm_gib: float
    usable_gib: float
    breakdown: dict = field(default_factory=dict)  # seconds per step on the busiest rank; sums to the step

    @property
    def peak_memory_gib(self) -> float:
        return self.memory.total / GIB

    @property
    def fits(self) -> bool:
        return self.peak_memory_gib <= self.usable_gib

    def to_json(self) -> dict:
        p, t = self.cfg.parallel, self.cfg.train
        b = self.breakdown
        exposed = sum(v for k, v in b.items() if k.endswith("_comm"))
        return {"step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s,
                "model_tflops_per_gpu": self.model_tflops_per_gpu, "mfu": self.mfu, "hfu": self.hfu,
                "bubble_fraction": self.bubble_fraction, "peak_memory_gib": self.peak_memory_gib,
                "memory_gib": self.memory.gib(), "fits": self.fits, "gpu_memory_gib": self.hbm_gib,
                "usable_memory_gib": self.usable_gib,
                "memory_gib_by_pp_rank": [m.total / GIB for m in self.memory_by_rank],
                "compute_s": b["compute"] + b["recompute"], "exposed_comm_s": exposed, "bubble_s": b["pipeline_bubble"],
                "time_s": dict(b), "parallel": dict(vars(p)),
                "train": {"micro_batch": t.micro_batch, "global_batch": t.global_batch, "recompute": t.recompute,
                          "dtype": t.dtype}}


# ----------------------------------------------------------------------------- primitives

def gemm_efficiency(gpu: GPU, *dims: float) -> float:
    """Large-GEMM efficiency, lowered for each small dimension (tiles left partly empty)."""
    eff = gpu.gemm_efficiency
    for d in dims:
        eff *= d / (d + GEMM_HALF_DIM)
    return eff


def ring_time(op: str, nbytes: float, n: int, alpha: float, bw: float) -> float:
    """Ring-algorithm time of a collective whose counted payload is `nbytes` (tetrad.comm's
    convention), over `n` ranks with per-step latency `alpha` and bandwidth `bw` bytes/s."""
    if n <= 1 or nbytes == 0:
        return 0.0
    factor = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n,
              "all_to_all": (n - 1) / n, "p2p": 1.0}[op]
    steps = {"all_reduce": 2 * (n - 1), "p2p": 1}.get(op, n - 1)
    return steps * alpha + factor * nbytes / bw


def group_link(cluster: Cluster, stride: int, size: int) -> tuple[float, float]:
    """(alpha seconds, bytes/s) of a group of `size` ranks `stride` apart in the global rank order.

    Inside one node it runs over NVLink. Across nodes NCCL builds one ring per network rail, so
    k members per node push k NICs' worth: the bandwidth is min(NVLink, k x NIC) per GPU.
    """
    g, per_node = cluster.gpu, cluster.gpus_per_node
    if stride * size <= per_node:
        return g.intra_alpha_s, g.intra_gbps * 1e9 * LINK_EFFICIENCY
    members = max(1, min(size, per_node // stride))
    return g.inter_alpha_s, min(g.intra_gbps, members * g.inter_gbps) * 1e9 * LINK_EFFICIENCY


def _gemm_dtype(dtype: str) -> str:
    return {"fp16": "bf16"}.get(dtype, dtype)


def mfu_peak(gpu: GPU, dtype: str) -> float:
    """The peak MFU is measured against: fp32's for fp32 training, else the 16-bit dense peak
    (fp8 runs too, as Llama 3 and torchtitan report them)."""
    return gpu.peak("fp32" if dtype == "fp32" else "bf16")


# ----------------------------------------------------------------------------- one layer

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


def layer_cost(cfg: Config, cluster: Cluster, stack: Stack) -> LayerCost:
    """One transformer layer's costs under `cfg`'s layout (what every layer of the model costs)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    gpu = cluster.gpu
    e = activation_bytes(t.dtype)
    hbm = gpu.hbm_bytes_per_s
    tokens = t.micro_batch * m.seq_len // p.cp
    h, hd = m.d_model, m.head_dim
    q, kv, f = m.n_heads * hd / p.tp, m.n_kv_heads * hd / p.tp, m.ffn_hidden / p.tp
    swiglu = m.mlp == "swiglu"

    # Weight GEMMs (K, N): qkv, out-projection, fc1 (gate and up for SwiGLU), fc2. The two
    # backward GEMMs have the same FLOPs and dimensions as the forward one.
    shapes = [(h, q + 2 * kv), (q, h), (h, f * (2 if swiglu else 1)), (f, h)]
    peak = gpu.peak(_gemm_dtype(t.dtype))
    gemm = [2 * tokens * k * n / (peak * gemm_efficiency(gpu, tokens, k, n)) for k, n in shapes]
    cast_f = cast_b = 0.0
    if t.dtype == "fp8":  # dynamic-scaling casts: inputs and weights forward, grad-outputs and both again backward
        cast_f = sum(FP8_CAST_BYTES * (tokens * k + k * n) for k, n in shapes) / hbm
        cast_b = sum(FP8_CAST_BYTES * (tokens * (k + n) + k * n) for k, n in shapes) / hbm

    # Attention core: flash kernels execute the causal half of the square (balanced over cp);
    # materialised scores compute the full square on the GEMM units and round-trip HBM.
    heads = m.n_heads / p.tp
    attn_peak = gpu.peak("fp32" if t.dtype == "fp32" else "bf16")
    if stack.flash_attention:
        eff = gpu.attention_efficiency * _shape(hd) / _shape(128) * _shape(tokens / t.micro_batch)
        attn_f = 4 * tokens * (m.seq_len / 2) * heads * hd / (attn_peak * eff)
        attn_b = FLASH_BACKWARD_FACTOR * attn_f
    else:
        scores = heads * tokens * m.seq_len
        mask = 1 if m.dropout > 0 else 0
        bmm = 4 * tokens * m.seq_len * heads * hd / (attn_peak * gemm_efficiency(gpu, m.seq_len, m.seq_len, hd))
        attn_f = bmm + scores * (2 * e + mask * (2 * e + 1)) / hbm  # softmax (and dropout) read + write
        attn_b = 2 * bmm + scores * (3 * e + mask * (2 * e + 1)) / hbm

    # Element-wise: norms and residual adds over h (split by SP), the activation over f, RoPE
    # on q and k; fused kernels read and write each once forward, twice backward.
    div = p.tp if p.sequence_parallel else 1
    elem_bytes = tokens * e * (10 * h / div + (3 if swiglu else 2) * f + (2 * (q + kv) if m.pos == "rope" else 0))
    elem_f = stack.elementwise_factor * elem_bytes / hbm
    elem_b = 2 * elem_f
    if p.cp > 1 and p.cp_algo == "ring":
        elem_f += p.cp * tokens * q * RING_MERGE_BYTES / hbm
        elem_b += p.cp * tokens * (q + 2 * kv) * RING_MERGE_BYTES / hbm

    compute_f = sum(gemm) + cast_f + attn_f + elem_f
    compute_bi = sum(gemm) + cast_b / 2 + attn_b + elem_b
    compute_bw = sum(gemm) + cast_b / 2
    if not stack.fused_grad_accumulation and cfg.microbatches > 1:
        params = flops.layer_matrix_params(m) / p.tp + flops.layer_norm_params(m)
        compute_bw += params * 12 / hbm  # fp32 accumulator: read it and the new gradient, write it
    tp_f, tp_b = _tp_exposed(cfg, cluster, stack, tokens, e, gemm)
    cp_f, cp_b = _cp_exposed(cfg, cluster, tokens, e, attn_f, attn_b)
    z_f, z_b = _zero3_exposed(cfg, cluster, compute_f, compute_bi + compute_bw)
    # Recomputation runs at the start of the backward: the attention core (selective) or the
    # whole forward, its collectives included (full).
    recompute = {"none": 0.0, "selective": attn_f, "full": compute_f}[t.recompute]
    if t.recompute == "full":
        tp_b, cp_b = tp_b + tp_f, cp_b + cp_f
    return LayerCost(forward=compute_f + tp_f + cp_f + z_f, backward_input=compute_bi + tp_b + cp_b + z_b,
                     backward_weight=compute_bw, recompute=recompute, compute=compute_f + compute_bi + compute_bw,
                     tp_comm=tp_f + tp_b, cp_comm=cp_f + cp_b, zero3_comm=z_f + z_b)


def _shape(d: float) -> float:
    return d / (d + GEMM_HALF_DIM)


def _tp_exposed(cfg: Config, cluster: Cluster, stack: Stack, tokens: int, e: int, gemm: list) -> tuple[float, float]:
    """Exposed TP time per layer per micro-batch, (forward, backward): two all-reduces of the hidden
    states each way (with SP an all-gather and a reduce-scatter each, the same ring time)."""
    p = cfg.parallel
    if p.tp == 1:
        return 0.0, 0.0
    alpha, bw = group_link(cluster, 1, p.tp)
    one = ring_time("all_reduce", tokens * cfg.model.d_model * e, p.tp, alpha, bw)
    if stack.tp_overlap == "none":
        return 2 * one, 2 * one
    # The qkv and fc1 input gradients' all-reduces hide behind those linears' weight-gradient GEMMs.
    backward = max(0.0, one - gemm[0]) + max(0.0, one - gemm[2])
    if stack.tp_overlap == "bwd":
        return 2 * one, backward
    # Async TP also hides the forward's reductions behind the row-parallel GEMMs they follow.
    return max(0.0, one - gemm[1]) + max(0.0, one - gemm[3]), backward


def _cp_exposed(cfg: Config, cluster: Cluster, tokens: int, e: int, attn_f: float,
                attn_b: float) -> tuple[float, float]:
    """Exposed CP time per layer per micro-batch, (forward, backward). Ring: each of cp-1 steps
    sends the K/V block while the previous one is attended (backward: K/V and the fp32 dK/dV
    accumulator), and the last dK/dV hand-off waits. All-to-all: q, k, v and the output re-shard
    each way, exposed."""
    m, p = cfg.model, cfg.parallel
    if p.cp == 1:
        return 0.0, 0.0
    alpha, bw = group_link(cluster, p.tp, p.cp)
    kv = 2 * tokens * m.n_kv_heads * m.head_dim / p.tp
    if p.cp_algo == "ring":
        send_f = ring_time("p2p", kv * e, 2, alpha, bw)
        send_b = ring_time("p2p", kv * (e + 4), 2, alpha, bw)
        forward = (p.cp - 1) * max(0.0, send_f - attn_f / p.cp)
        backward = (p.cp - 1) * max(0.0, send_b - attn_b / p.cp) + ring_time("p2p", kv * 4, 2, alpha, bw)
        return forward, backward
    q = tokens * m.n_heads * m.head_dim / p.tp
    one_way = 2 * (ring_time("all_to_all", q * e, p.cp, alpha, bw)  # q and the output
                   + ring_time("all_to_all", kv / 2 * e, p.cp, alpha, bw))  # k and v
    return one_way, one_way


def _zero3_exposed(cfg: Config, cluster: Cluster, forward: float, backward: float) -> tuple[float, float]:
    """ZeRO-3: each layer's weights all-gathered for forward and again for backward, every
    micro-batch, prefetched behind the previous layer's compute. (Its gradients are reduce-scattered
    once per step, as ZeRO-2's: `estimate`.)"""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    n = p.dp * p.cp
    if p.zero < 3 or n == 1:
        return 0.0, 0.0
    alpha, bw = group_link(cluster, p.tp, n)
    params = flops.layer_matrix_params(m) / p.tp + flops.layer_norm_params(m)
    gather = ring_time("all_gather", params * state_bytes_per_param(t.dtype)[0], n, alpha, bw)
    return max(0.0, gather - forward), max(0.0, gather - backward)


# ----------------------------------------------------------------------------- embedding and head

def _ends(cfg: Config, cluster: Cluster) -> tuple[tuple[float, float, float], tuple[float, float, float]]:
    """(forward, backward_input, backward_weight) seconds per micro-batch of the embedding (first
    stage) and of the final norm, head and cross-entropy (last stage)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    gpu = cluster.gpu
    e = activation_bytes(t.dtype)
    hbm = gpu.hbm_bytes_per_s
    tokens = t.micro_batch * m.seq_len // p.cp
    hidden = tokens * m.d_model * e
    tp_alpha, tp_bw = group_link(cluster, 1, p.tp)
    embed_ar = ring_time("all_reduce", hidden, p.tp, tp_alpha, tp_bw)
    # The lookup; backward materialises a dense (vocab/tp x h) gradient (zeroed, scattered into)
    # and adds it to the fp32 gradient buffer.
    table = m.vocab_size / p.tp * m.d_model
    embed = (hidden / hbm + embed_ar, 0.0, (tokens * m.d_model * (e + 4) + table * (2 * e + 12)) / hbm)
    vocab = m.vocab_size / p.tp
    peak = gpu.peak(_gemm_dtype(t.dtype))
    logits = 2 * tokens * m.d_model * vocab / (peak * gemm_efficiency(gpu, tokens, m.d_model, vocab))
    ce = tokens * vocab * (3 * e + 8) / hbm  # read logits (max, sum-exp, target), fp32 softmax out, grad
    norm = 4 * hidden / hbm
    ce_ar = 3 * ring_time("all_reduce", tokens * 4, p.tp, tp_alpha, tp_bw)  # max, sum-exp, target logit
    input_grad_ar = ring_time("all_reduce", hidden, p.tp, tp_alpha, tp_bw)
    head = (logits + ce / 2 + norm + ce_ar, logits + ce / 2 + 2 * norm + input_grad_ar, logits)
    return embed, head


# ----------------------------------------------------------------------------- pipeline

@lru_cache(maxsize=256)
def _schedule(schedule: str, pp: int, m: int, vpp: int):
    return build_schedule(schedule, pp, m, vpp)  # built (and validated) once per shape


def _steady(schedule: str, pp: int, m: int) -> int:
    """The fewest micro-batches past `schedule`'s warm-up in the same phase as m: from there on it
    repeats every pp micro-batches, so what it costs or holds grows linearly (registry.py)."""
    return schedule_spec(schedule).warmup_rounds * pp + m % pp


@lru_cache(maxsize=65536)
def _simulate(schedule: str, pp: int, m: int, vpp: int, f: tuple, bi: tuple, bw: tuple, p2p: float):
    """(step time, per-rank idle time after its last action) of one simulated schedule: the
    simulator's replay without the timeline it would build for a picture."""
    s = _schedule(schedule, pp, m, vpp)
    _, ends, _ = replay(s, StageCosts(list(f), list(bi), list(bw), p2p).per_stage(s.stages), p2p)
    last = [e[-1] if e else 0.0 for e in ends]
    step = max(last)
    return step, tuple(step - x for x in last)


@lru_cache(maxsize=4096)
def inflight(schedule: str, pp: int, m: int, vpp: int, after_bi: float = 1.0) -> tuple[float, ...]:
    """Peak (micro-batch, chunk) activation sets alive per rank, from the schedule's order
    (zero-bubble's BI-to-BW remainders weighing `after_bi` sets: memory.after_bi_weight). Past the
    warm-up the peak grows by the same amount every pp micro-batches (nothing for 1F1B, pp for
    GPipe), so a long schedule is read at two steady lengths and extended."""
    m0 = _steady(schedule, pp, m)
    if m <= m0 + pp:
        return tuple(peak_held(_schedule(schedule, pp, m, vpp), after_bi))
    h0, h1 = (peak_held(_schedule(schedule, pp, n, vpp), after_bi) for n in (m0, m0 + pp))
    return tuple(a + (m - m0) / pp * (b - a) for a, b in zip(h0, h1))


@lru_cache(maxsize=4096)
def loss_waiting(schedule: str, pp: int, m: int, vpp: int) -> float:
    """Micro-batches whose loss waits for its backward at once on the last stage (one under 1F1B,
    all of them under GPipe), extended past the warm-up as `inflight` is."""
    m0 = _steady(schedule, pp, m)
    if m <= m0 + pp:
        return peak_waiting_loss(_schedule(schedule, pp, m, vpp))
    w0, w1 = (peak_waiting_loss(_schedule(schedule, pp, n, vpp)) for n in (m0, m0 + pp))
    return w0 + (m - m0) / pp * (w1 - w0)


def pipeline(schedule: str, pp: int, m: int, vpp: int, f: list, bi: list, bw: list, p2p: float):
    """(step time, per-rank idle tail) from the schedule simulator.

    Costs are normalised to the slowest stage's forward and rounded to 1% of it, so similar
    layouts share a simulation. Past its warm-up (registry.py: one round of pp micro-batches, two
    when interleaved) a schedule is periodic in pp micro-batches, so a long one is simulated at
    m0 and m0 + pp (in the same phase) and extended linearly: exact in steady state, and it keeps
    a search over thousands of micro-batches fast.
    """
    unit = max(f) or 1.0
    norm = lambda xs: tuple(round(x / unit, 2) for x in xs)  # noqa: E731
    nf, nbi, nbw, np2p = norm(f), norm(bi), norm(bw), round(p2p / unit, 3)
    m0 = _steady(schedule, pp, m)
    if m <= m0 + pp:
        t, tail = _simulate(schedule, pp, m, vpp, nf, nbi, nbw, np2p)
    else:
        t0, _ = _simulate(schedule, pp, m0, vpp, nf, nbi, nbw, np2p)
        t1, tail = _simulate(schedule, pp, m0 + pp, vpp, nf, nbi, nbw, np2p)
        t = t1 + (m - m0 - pp) * (t1 - t0) / pp
    return t * unit, [x * unit for x in tail]


# ----------------------------------------------------------------------------- the estimate

def estimate(cfg: Config, cluster: Cluster, stack: str | Stack = "tetrad", simulate_pipeline: bool = True) -> Estimate:
    """Predict one layout on `cluster` under software `stack` (stacks.py; default tetrad itself).
    `simulate_pipeline=False` gives a lower bound of the step time instead, without simulating:
    the pipeline's critical path and no data-parallel exposure (the search prunes with it)."""
    stack = load_stack(stack) if isinstance(stack, str) else stack
    asked = cfg
    if stack.zero3_held_under_pp and cfg.parallel.zero == 3 and cfg.parallel.pp > 1:
        cfg = replace(cfg, parallel=replace(cfg.parallel, zero=1))
    m, p, t = cfg.model, cfg.parallel, cfg.train
    gpu = cluster.gpu
    e = activation_bytes(t.dtype)
    micro = cfg.microbatches
    tokens = t.micro_batch * m.seq_len // p.cp
    stages = p.pp * p.vpp

    layer = layer_cost(cfg, cluster, stack)
    embed, head = _ends(cfg, cluster)
    counts = stage_layers(cfg)
    held_by = [rank_stages(p.pp, p.vpp, r) for r in range(p.pp)]  # each rank's global stages
    f = [c * layer.forward for c in counts]
    bi = [c * (layer.backward_input + layer.recompute) for c in counts]
    bw = [c * layer.backward_weight for c in counts]
    for costs, k in ((f, 0), (bi, 1), (bw, 2)):
        costs[0] += embed[k]
        costs[-1] += head[k]
    # The pipeline: a transfer between neighbouring stages is a latency the schedule can hide,
    # or, where the stack blocks on it, part of the sending action (and of the bubble).
    p2p = _p2p_time(cfg, cluster, stack, tokens, e)
    busy = [sum(f[g] + bi[g] + bw[g] for g in held) for held in held_by]
    if stack.pp_blocking_p2p and p.pp > 1:
        f = [x + (p2p if s < stages - 1 else 0.0) for s, x in enumerate(f)]
        bi = [x + (p2p if s > 0 else 0.0) for s, x in enumerate(bi)]
        p2p = 0.0
    work = [sum(f[g] + bi[g] + bw[g] for g in held) for held in held_by]
    if p.pp == 1:
        pipe, tail = micro * work[0], [0.0]
    elif simulate_pipeline:
        pipe, tail = pipeline(p.schedule, p.pp, micro, p.vpp, f, bi, bw, p2p)
    else:  # rank r waits r stage-forwards for its first input and its last gradient has r stages to go
        hops = min(f) + min(bi)
        pipe, tail = max(r * hops + micro * work[r] for r in range(p.pp)), [math.inf] * p.pp
    bubble = 1.0 - micro * sum(busy) / (p.pp * pipe)  # share of rank-time not computing

    # Data parallel over dp x cp, per pipeline rank: the gradient reduction overlaps the last
    # micro-batch's backward (all but the last bucket) and the rank's idle tail of the pipeline.
    dp_exposed, opt, gather = 0.0, 0.0, 0.0
    n = p.dp * p.cp
    alpha, link = group_link(cluster, p.tp, n)
    for r, params in enumerate(rank_params(cfg)):
        shard = params / (n if p.zero >= 1 else 1)
        opt = max(opt, shard * OPTIMIZER_BYTES_PER_PARAM / gpu.hbm_bytes_per_s)
        if n == 1:
            continue
        scatter = p.zero >= 2 or (p.zero == 1 and stack.zero1_reduce_scatter)
        op = "reduce_scatter" if scatter else "all_reduce"
        grads = ring_time(op, params * stack.grad_reduce_bytes, n, alpha, link)
        earlier = 0.0  # ZeRO >= 2 reduce-scatters every micro-batch, hidden behind the next one's work
        if stack.dp_overlap:
            window = sum(bi[g] + bw[g] for g in held_by[r])
            if p.zero >= 2:
                earlier = (micro - 1) * max(0.0, grads - window - sum(f[g] for g in held_by[r]))
            last_bucket = grads * min(1.0, _bucket_bytes(cfg) / (params * stack.grad_reduce_bytes))
            grads = max(last_bucket, grads - window)
        elif p.zero >= 2:
            earlier = (micro - 1) * grads
        dp_exposed = max(dp_exposed, earlier + max(0.0, grads - tail[r]))  # the idle tail hides only the last
        if p.zero in (1, 2):  # updated 16-bit (fp32) weights all-gathered after the optimizer step
            gather = max(gather, ring_time("all_gather", params * state_bytes_per_param(t.dtype)[0], n, alpha, link))
    dp_exposed = max(0.0, dp_exposed)
    step = pipe + dp_exposed + gather + opt

    held = inflight(p.schedule, p.pp, micro, p.vpp, after_bi_weight(cfg, stack))
    memory = memory_by_rank(cfg, stack, held, loss_waiting(p.schedule, p.pp, micro, p.vpp), gpu.is_cpu)
    worst = max(memory, key=lambda x: x.total)
    usable = gpu.hbm_gib - (0.0 if gpu.is_cpu else GPU_RESERVED_GIB)

    busiest = max(range(p.pp), key=lambda r: busy[r])
    layers_busy = rank_layers(cfg)[busiest]
    ends = (sum(embed) if busiest == 0 else 0.0) + (sum(head) if busiest == p.pp - 1 else 0.0)
    breakdown = {"compute": micro * (layers_busy * layer.compute + ends),
                 "recompute": micro * layers_busy * layer.recompute,
                 "tp_comm": micro * layers_busy * layer.tp_comm, "cp_comm": micro * layers_busy * layer.cp_comm,
                 "zero3_comm": micro * layers_busy * layer.zero3_comm,
                 "pipeline_bubble": pipe - micro * busy[busiest],
                 "dp_comm": dp_exposed + gather, "optimizer": opt}

    global_tokens = t.global_batch * m.seq_len
    world = p.world_size
    peak = mfu_peak(gpu, t.dtype)
    model_flops = flops.model_flops_per_token(m) * global_tokens
    hw_flops = flops.hardware_flops_per_token(m, t.recompute) * global_tokens
    return Estimate(asked, step, global_tokens / step, model_flops / step / world / 1e12,
                    model_flops / step / world / peak, hw_flops / step / world / peak, bubble, worst, memory,
                    gpu.hbm_gib, usable, breakdown)


def _p2p_time(cfg: Config, cluster: Cluster, stack: Stack, tokens: int, e: int) -> float:
    """One activation (or gradient) transfer between neighbouring pipeline ranks."""
    p = cfg.parallel
    if p.pp == 1:
        return 0.0
    stride = p.tp * p.cp * p.dp
    alpha, bw = group_link(cluster, stride, 2)
    full = tokens * cfg.model.d_model * e
    if p.tp > 1 and (p.sequence_parallel or stack.pp_scatter_gather):
        t_alpha, t_bw = group_link(cluster, 1, p.tp)
        regather = 0.0 if p.sequence_parallel else ring_time("all_gather", full, p.tp, t_alpha, t_bw)
        return ring_time("p2p", full / p.tp, 2, alpha, bw) + regather
    return ring_time("p2p", full, 2, alpha, bw)


def _bucket_bytes(cfg: Config) -> float:
    b = cfg.parallel.grad_bucket_mb
    return (DEFAULT_BUCKET_MB if b == "auto" else float(b)) * 2**20  # MiB, as the runtime splits them


# ----------------------------------------------------------------------------- bytes, as tetrad.comm counts them

def comm_bytes_per_step(cfg: Config) -> dict[str, int]:
    """Bytes rank 0 (first pipeline stage, first tp/cp/dp coordinate) hands to collectives in one
    optimizer step, by group, under tetrad.comm's convention: all-reduce the tensor, all-gather
    the gathered output, reduce-scatter the unscattered input, all-to-all the input,
    point-to-point what it sends. The dp x cp gradient group counts as "dp". Scalars: the loss
    (dp, pp) and the squared gradient norm (tp, pp, dp), fp32. Not counted: the padding of ZeRO
    buckets to a multiple of dp x cp elements."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    e = activation_bytes(t.dtype)
    w = state_bytes_per_param(t.dtype)[0]
    micro = cfg.microbatches
    tokens = t.micro_batch * m.seq_len // p.cp
    hidden = tokens * m.d_model * e
    layers = rank_layers(cfg)[0]
    sp = p.sequence_parallel
    n = p.dp * p.cp
    params = rank_params(cfg)[0]
    out = {"tp": 0, "cp": 0, "pp": 0, "dp": 0}
    forwards = 2 if t.recompute == "full" else 1  # full recompute repeats the forward's collectives
    if p.tp > 1:
        # Per layer and direction: two all-reduces of the hidden states, or under SP two
        # all-gathers and two reduce-scatters, each counted at the full size. The embedding's
        # all-reduce (SP: reduce-scatter forward, all-gather of its gradient backward). On a
        # single stage also the head's input collective and the cross-entropy's max, sum-exp and
        # target logit (fp32 per token). Under SP, one all-reduce of the replicated (norm) weights'
        # fp32 gradients per step (their dp shard under ZeRO). The gradient norm.
        per_layer = 2 * hidden * (2 if sp else 1)
        # Full recompute repeats the layer's forward up to its last saved tensor (the MLP's output
        # projection input): torch's non-reentrant checkpoint stops there, before the final
        # row-parallel all-reduce / reduce-scatter.
        recomputed = per_layer - hidden if t.recompute == "full" else 0
        per_micro = layers * (2 * per_layer + recomputed) + hidden * (2 if sp else 1)
        if p.pp == 1:
            per_micro += hidden * (2 if sp else 1) + 3 * tokens * 4
        replicated = layers * flops.layer_norm_params(m) + flops.head_params(m, separate=False) * (p.pp == 1)
        replicated += m.seq_len * m.d_model if m.pos == "learned" else 0
        out["tp"] = micro * per_micro + (4 * replicated / (n if p.zero >= 1 else 1) if sp else 0) + 4
    if p.pp > 1:
        # Rank 0 sends each micro-batch's activations on from every chunk, and the gradients of
        # its chunks after the first back to the previous rank (the last one); loss and norm.
        sent = hidden / (p.tp if sp else 1)
        out["pp"] = micro * (2 * p.vpp - 1) * sent + 8
        if m.tie_embeddings:  # the embedding's fp32 gradient summed with its head copy's (its shard under ZeRO-2)
            out["pp"] += 4 * math.ceil(m.vocab_size / p.tp) * m.d_model / (n if p.zero >= 2 else 1)
    if p.cp > 1:
        kv = 2 * tokens * m.n_kv_heads // p.tp * m.head_dim
        if p.cp_algo == "ring":  # K/V cp-1 times forward; backward K/V cp-1 times and the fp32 dK/dV cp times
            out["cp"] = micro * layers * ((p.cp - 1) * kv * e * forwards + (p.cp - 1) * kv * e + p.cp * kv * 4)
        else:  # q, k, v to heads and the output back, each way
            qkvo = tokens * (2 * m.n_heads + 2 * m.n_kv_heads) // p.tp * m.head_dim * e
            out["cp"] = micro * layers * qkvo * (forwards + 1)
    if n > 1:
        if p.zero == 0:  # one all-reduce of the fp32 gradient buckets
            grads = params * 4
        elif p.zero == 1:  # all-reduce, then the updated shards all-gathered
            grads = params * (4 + w)
        elif p.zero == 2:  # a reduce-scatter every micro-batch, then the updated shards all-gathered
            grads = params * (micro * 4 + w)
        else:  # each layer gathered for forward and for backward every micro-batch, the rest once;
            # a reduce-scatter every micro-batch
            block = layers * (flops.layer_matrix_params(m) / p.tp + flops.layer_norm_params(m))
            grads = micro * 2 * block * w + (params - block) * w + micro * params * 4
        out["dp"] = grads + 8
    return {k: int(v) for k, v in out.items()}
