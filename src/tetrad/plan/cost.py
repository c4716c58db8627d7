"""The cost model of one layout: step time, its breakdown, memory per rank, MFU and HFU.

Compute: GEMM FLOPs / (peak x efficiency of the shape); the attention core at a kernel
efficiency of its own; element-wise work from bytes / HBM bandwidth. Communication: alpha-beta
per link class (NVLink inside a node, the network across nodes) over the byte counts of
`comm_bytes_per_step` (the same numbers tetrad.comm counts). Pipeline time: the schedule
simulator, fed with these per-stage costs. Nothing here imports torch.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from tetrad.config import Config
from tetrad.parallel.pipeline.schedules import build_schedule
from tetrad.parallel.pipeline.simulate import StageCosts, peak_inflight, simulate
from tetrad.plan import flops
from tetrad.plan.hardware import GPU, Cluster
from tetrad.plan.memory import GIB, Memory, estimate_memory

# Global constants of the time model (not per-run fudge factors): see docs/planner.md.
GEMM_HALF_DIM = 96          # a GEMM dimension this small reaches half the large-GEMM efficiency
ATTENTION_EFFICIENCY = 0.30  # flash-style attention forward+backward, fraction of the bf16 peak
FP8_GEMM_DISCOUNT = 0.6      # fp8 linears lose part of their 2x peak to scaling and casts (torchtitan float8)
ELEMENTWISE_BYTES = 40       # bytes moved per hidden element per layer forward by norms, activations, residuals
LINK_EFFICIENCY = 0.8        # achieved fraction of a link's bandwidth for large messages
UNFUSED_ELEMENTWISE_FACTOR = 2  # separate kernels for bias, activation, dropout, residual: about twice the traffic
UNFUSED_SCORE_BYTES = 8      # per score element, forward: write QK^T, softmax read+write, read for AV (16-bit)
OPTIMIZER_BYTES_PER_PARAM = 36  # Adam reads/writes weights, grads, master and two moments


@dataclass
class Estimate:
    cfg: Config
    step_time_s: float
    tokens_per_s: float
    model_tflops_per_gpu: float
    mfu: float
    hfu: float
    bubble_fraction: float
    memory: Memory
    hbm_gib: float
    breakdown: dict = field(default_factory=dict)

    @property
    def peak_memory_gib(self) -> float:
        return self.memory.total / GIB

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.hbm_gib * GIB

    def to_json(self) -> dict:
        return {"step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s,
                "model_tflops_per_gpu": self.model_tflops_per_gpu, "mfu": self.mfu, "hfu": self.hfu,
                "bubble_fraction": self.bubble_fraction, "peak_memory_gib": self.peak_memory_gib,
                "memory_gib": self.memory.gib(), "fits": self.fits, "gpu_memory_gib": self.hbm_gib,
                "time_s": self.breakdown, "parallel": dict(vars(self.cfg.parallel)),
                "micro_batch": self.cfg.train.micro_batch, "recompute": self.cfg.train.recompute,
                "zero": self.cfg.parallel.zero}


def gemm_efficiency(gpu: GPU, *dims: float) -> float:
    """Large-GEMM efficiency, lowered for each small dimension (tiles left partly empty)."""
    eff = gpu.gemm_efficiency
    for d in dims:
        eff *= d / (d + GEMM_HALF_DIM)
    return eff


def _link(cluster: Cluster, spans_nodes: bool) -> tuple[float, float]:
    """(alpha seconds, bytes per second) of the slowest link a group uses."""
    g = cluster.gpu
    if spans_nodes:
        return g.inter_alpha_s, g.inter_gbps * 1e9 * LINK_EFFICIENCY
    return g.intra_alpha_s, g.intra_gbps * 1e9 * LINK_EFFICIENCY


def ring_time(op: str, nbytes: float, n: int, alpha: float, bw: float) -> float:
    """Ring-algorithm time of a collective whose counted payload is `nbytes` (tetrad.comm)."""
    if n <= 1 or nbytes == 0:
        return 0.0
    factor = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n,
              "all_to_all": (n - 1) / n, "p2p": 1.0}[op]
    steps = {"all_reduce": 2 * (n - 1), "p2p": 1}.get(op, n - 1)
    return steps * alpha + factor * nbytes / bw


def stage_layer_counts(n_layers: int, stages: int, head_layers: float = 0.0) -> list[int]:
    return list(_stage_layer_counts(n_layers, stages, round(head_layers, 2)))


@lru_cache(maxsize=4096)
def _stage_layer_counts(n_layers: int, stages: int, head_layers: float) -> tuple[int, ...]:
    """Layers per pipeline stage, balancing cost: the last stage also runs the head, worth
    `head_layers` layers, so it gets fewer layers (each stage keeps at least one)."""
    counts = [0] * stages
    loads = [0.0] * (stages - 1) + [head_layers]
    for _ in range(n_layers):  # greedily give each layer to the least-loaded stage
        i = min(range(stages), key=lambda k: (loads[k], k))
        counts[i] += 1
        loads[i] += 1
    for i in range(stages):  # a stage without layers is not allowed: take one from the largest
        if counts[i] == 0:
            j = max(range(stages), key=lambda k: counts[k])
            counts[j] -= 1
            counts[i] = 1
    return tuple(counts)


@lru_cache(maxsize=65536)
def _simulate(schedule: str, pp: int, m: int, vpp: int, f: tuple, bi: tuple, bw: tuple, p2p: float):
    return simulate(build_schedule(schedule, pp, m, vpp), StageCosts(list(f), list(bi), list(bw), p2p)).step_time


@lru_cache(maxsize=4096)
def _inflight(schedule: str, pp: int, m: int, vpp: int) -> tuple[int, ...]:
    """Peak in-flight micro-batch activations per rank: the schedule's order alone decides it,
    and past 3*pp micro-batches it stops growing (except GPipe's, which holds all m)."""
    if schedule == "gpipe":
        return tuple(m * vpp for _ in range(pp))
    return tuple(peak_inflight(build_schedule(schedule, pp, min(m, 3 * pp), vpp)))


def _pipeline(schedule: str, pp: int, m: int, vpp: int, f: list, bi: list, bw: list, p2p: float):
    """(step time, bubble fraction) from the schedule simulator.

    Costs are normalised and rounded to 2 significant digits (1% of the slowest stage) so
    similar layouts share one simulation. Beyond a few rounds the schedules are periodic, so a long one is simulated at
    m0 and m0 + pp micro-batches and extended linearly: exact in steady state, and it keeps a
    search over thousands of micro-batches fast.
    """
    unit = max(f) or 1.0
    norm = lambda xs: tuple(round(x / unit, 2) for x in xs)  # noqa: E731
    nf, nbi, nbw, np2p = norm(f), norm(bi), norm(bw), round(p2p / unit, 2)
    m0 = 2 * pp
    if m <= m0 + pp or pp == 1:
        t = _simulate(schedule, pp, m, vpp, nf, nbi, nbw, np2p)
    else:
        t0 = _simulate(schedule, pp, m0, vpp, nf, nbi, nbw, np2p)
        t1 = _simulate(schedule, pp, m0 + pp, vpp, nf, nbi, nbw, np2p)
        t = t1 + (m - m0 - pp) * (t1 - t0) / pp
    busy = m * (sum(nf) + sum(nbi) + sum(nbw))
    return t * unit, 1.0 - busy / (pp * t)


def estimate(cfg: Config, cluster: Cluster, kernels: str = "fused", simulate_pipeline: bool = True) -> Estimate:
    """Predict one layout. `kernels` is the software stack's kind: "fused" (flash attention and
    fused or compiled element-wise ops: tetrad's SDPA path, most stacks since 2022) or
    "unfused" (attention scores materialised in HBM, more element-wise traffic: Megatron-LM 2021).
    `simulate_pipeline=False` replaces the simulated pipeline time by its lower bound (the
    busiest rank's work, no bubble): the search uses it to skip layouts that cannot win."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    gpu = cluster.gpu
    world = p.world_size
    dtype = "bf16" if t.dtype in ("bf16", "fp16") else t.dtype
    gemm_peak = gpu.peak_tflops.get(dtype, gpu.peak_tflops["bf16"]) * 1e12
    attn_peak = gpu.peak_tflops["fp32" if t.dtype == "fp32" else "bf16"] * 1e12
    act_bytes = 4 if t.dtype == "fp32" else 2
    seq_local = m.seq_len // p.cp
    tokens = t.micro_batch * seq_local  # tokens of one micro-batch on one rank
    per_node = cluster.gpus_per_node
    stages = p.pp * p.vpp
    microbatches = t.global_batch // (t.micro_batch * p.dp)

    # --- one layer, one micro-batch, forward
    hd = m.head_dim
    gemm_dims = [(m.d_model, (m.n_heads + 2 * m.n_kv_heads) * hd / p.tp), (m.n_heads * hd / p.tp, m.d_model),
                 (m.d_model, m.ffn_hidden / p.tp), (m.ffn_hidden / p.tp, m.d_model)]
    gemm_flops = tokens * flops.layer_matmul_flops(m) / p.tp
    eff = sum(gemm_efficiency(gpu, tokens, k, n) for k, n in gemm_dims) / len(gemm_dims)
    if t.dtype == "fp8":
        eff *= FP8_GEMM_DISCOUNT
    t_gemm = gemm_flops / (gemm_peak * eff)
    # Causal kernels execute about half of the full QK^T / AV work.
    core = tokens * flops.attention_core_flops(m, m.seq_len) / p.tp
    if kernels == "fused":
        t_attn = 0.5 * core / (attn_peak * ATTENTION_EFFICIENCY)
    else:  # full QK^T on the GEMM units, plus the scores' round trips through HBM
        scores = t.micro_batch * m.n_heads / p.tp * seq_local * m.seq_len
        bmm_eff = gemm_efficiency(gpu, seq_local, m.seq_len, hd)  # batched per head: head_dim is a GEMM dimension
        t_attn = core / (attn_peak * bmm_eff) + scores * UNFUSED_SCORE_BYTES / (gpu.hbm_gbps * 1e9)
    elementwise = ELEMENTWISE_BYTES * (UNFUSED_ELEMENTWISE_FACTOR if kernels == "unfused" else 1)
    t_elem = tokens * m.d_model * elementwise * act_bytes / 2 / (p.tp if p.sequence_parallel else 1) \
        / (gpu.hbm_gbps * 1e9)
    tp_alpha, tp_bw = _link(cluster, p.tp > per_node)
    tp_bytes = tokens * m.d_model * act_bytes
    t_tp = 2 * (ring_time("all_gather", tp_bytes, p.tp, tp_alpha, tp_bw) +
                ring_time("reduce_scatter", tp_bytes, p.tp, tp_alpha, tp_bw)) if p.sequence_parallel \
        else 2 * ring_time("all_reduce", tp_bytes, p.tp, tp_alpha, tp_bw)
    cp_alpha, cp_bw = _link(cluster, p.tp * p.cp > per_node)
    kv_bytes = 2 * tokens * m.n_kv_heads / p.tp * hd * act_bytes
    if p.cp_algo == "ring":  # K/V pass cp-1 times, overlapped with the block attention
        t_cp_fwd = max(0.0, (p.cp - 1) * ring_time("p2p", kv_bytes, p.cp, cp_alpha, cp_bw) - t_attn)
    else:  # q, k, v to heads and the output back
        a2a = tokens * (2 * m.n_heads + 2 * m.n_kv_heads) / p.tp * hd * act_bytes
        t_cp_fwd = ring_time("all_to_all", a2a, p.cp, cp_alpha, cp_bw)
    layer_fwd = t_gemm + t_attn + t_elem + t_tp + t_cp_fwd
    # Attention backward does 2.5x the forward's matmuls (flash recomputes the scores).
    layer_bwd_input = t_gemm + 1.5 * t_attn + t_elem + t_tp + 2 * t_cp_fwd
    layer_bwd_weight = t_gemm + 1.0 * t_attn + t_elem
    recompute = {"none": 0.0, "selective": t_attn, "full": layer_fwd}[t.recompute]

    # --- per pipeline stage (global stage order), head and embedding on their stages
    head_flops = tokens * flops.head_flops(m) / p.tp
    t_head = head_flops / (gemm_peak * gemm_efficiency(gpu, tokens, m.d_model, m.vocab_size / p.tp))
    counts = stage_layer_counts(m.n_layers, stages, 3 * t_head / (layer_fwd + layer_bwd_input + layer_bwd_weight))
    f_cost = [c * layer_fwd for c in counts]
    bi_cost = [c * (layer_bwd_input + recompute) for c in counts]
    bw_cost = [c * layer_bwd_weight for c in counts]
    f_cost[-1] += t_head
    bi_cost[-1] += t_head
    bw_cost[-1] += t_head
    pp_alpha, pp_bw = _link(cluster, p.tp * p.cp * p.dp >= per_node and p.pp > 1)
    t_p2p = ring_time("p2p", tokens * m.d_model * act_bytes, 2, pp_alpha, pp_bw) if p.pp > 1 else 0.0
    inflight = _inflight(p.schedule, p.pp, microbatches, p.vpp)
    if simulate_pipeline:
        pipe_time, bubble = _pipeline(p.schedule, p.pp, microbatches, p.vpp, f_cost, bi_cost, bw_cost, t_p2p)
    else:
        work = [sum(f_cost[c * p.pp + r] + bi_cost[c * p.pp + r] + bw_cost[c * p.pp + r] for c in range(p.vpp))
                for r in range(p.pp)]
        pipe_time, bubble = microbatches * max(work), 0.0

    # --- data parallel: gradient reduction over dp x cp, overlapped with the backward
    params_rank = flops.parameter_count(m) / (p.tp * p.pp)
    grad_bytes = params_rank * 4  # gradients are accumulated and reduced in fp32 (Megatron, tetrad)
    dp_n = p.dp * p.cp
    dp_alpha, dp_bw = _link(cluster, world // p.pp > per_node)
    t_dp = ring_time("all_reduce", grad_bytes, dp_n, dp_alpha, dp_bw)
    if p.zero >= 3:  # weights gathered for forward and backward, hidden behind compute by prefetch
        t_dp += 2 * ring_time("all_gather", params_rank * act_bytes, dp_n, dp_alpha, dp_bw)
    overlap_window = max(bi_cost) + max(bw_cost)  # the last micro-batch's backward
    if p.zero >= 3:
        overlap_window = pipe_time
    last_bucket = t_dp * min(1.0, _bucket_mb(cfg) * 1e6 / max(grad_bytes, 1.0))  # starts only after backward ends
    t_dp_exposed = max(last_bucket, t_dp - overlap_window)
    opt_params = params_rank / (dp_n if p.zero >= 1 else 1)
    t_opt = opt_params * OPTIMIZER_BYTES_PER_PARAM / (gpu.hbm_gbps * 1e9)
    step = pipe_time + t_dp_exposed + t_opt

    # --- memory of the worst stage
    worst = None
    for rank in range(p.pp):
        layers = sum(counts[chunk * p.pp + rank] for chunk in range(p.vpp))
        mem = estimate_memory(cfg, layers, inflight[rank] / p.vpp if p.vpp > 1 else inflight[rank],
                              first=rank == 0, last=rank == p.pp - 1, on_cpu=gpu.name == "CPU",
                              bucket_bytes=2 * _bucket_mb(cfg) * 1e6)
        if worst is None or mem.total > worst.total:
            worst = mem

    global_tokens = t.global_batch * m.seq_len
    model_flops = flops.model_flops_per_token(m) * global_tokens
    hw_flops = flops.hardware_flops_per_token(m, t.recompute) * global_tokens
    peak = gpu.peak_tflops.get(dtype, gpu.peak_tflops["bf16"]) * 1e12
    breakdown = {"pipeline": pipe_time, "compute_per_microbatch_layer": t_gemm + t_attn + t_elem,
                 "tp_comm_per_microbatch_layer": t_tp, "cp_comm_exposed_per_microbatch_layer": t_cp_fwd,
                 "pp_p2p_per_transfer": t_p2p, "dp_comm": t_dp, "dp_comm_exposed": t_dp_exposed,
                 "optimizer": t_opt, "bubble": bubble * pipe_time}
    return Estimate(cfg, step, global_tokens / step, model_flops / step / world / 1e12,
                    model_flops / step / world / peak, hw_flops / step / world / peak, bubble, worst,
                    gpu.hbm_gib, breakdown)


def _bucket_mb(cfg: Config) -> float:
    b = cfg.parallel.grad_bucket_mb
    return 25.0 if b == "auto" else float(b)


def comm_bytes_per_step(cfg: Config) -> dict[str, int]:
    """Bytes rank 0 (first pipeline stage, first tp/cp/dp coordinate) hands to collectives in
    one step, by group, under tetrad.comm's convention (all-reduce: the tensor; all-gather: the
    output; reduce-scatter: the input; point-to-point: what it sends). Scalars: the step's
    loss (dp, pp) and gradient norm (tp, pp), fp32."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    act = 4 if t.dtype == "fp32" else 2
    micro = t.global_batch // (t.micro_batch * p.dp)
    tokens = t.micro_batch * m.seq_len // p.cp
    hidden = tokens * m.d_model * act
    counts = stage_layer_counts(m.n_layers, p.pp * p.vpp)
    layers = sum(counts[chunk * p.pp] for chunk in range(p.vpp))
    out = {"tp": 0, "cp": 0, "pp": 0, "dp": 0}
    if p.tp > 1:
        # Per layer, forward and backward: two all-reduces of the hidden states (or, with SP, an
        # all-gather and a reduce-scatter of the same size each); the embedding's output
        # all-reduce; the last stage's head input gradient and cross-entropy's max, sum-exp
        # and target logit (fp32 per token).
        per_layer = 2 * 2 * hidden * (2 if p.sequence_parallel else 1)
        per_micro = layers * per_layer + hidden
        if p.pp == 1:
            per_micro += hidden + 3 * tokens * 4
        out["tp"] = micro * per_micro + 4
    if p.pp > 1:
        out["pp"] = micro * p.vpp * hidden + 4 + 4
    if p.cp > 1:
        kv = 2 * tokens * m.n_kv_heads // p.tp * m.head_dim * act
        if p.cp_algo == "ring":  # K/V sent cp-1 times forward; K/V and dK/dV cp-1 times backward
            out["cp"] = micro * layers * (p.cp - 1) * (kv + 2 * kv)
        else:  # q, k, v forward and out backward... each way: forward 4 all-to-alls, backward 4
            qkvo = tokens * (2 * m.n_heads + 2 * m.n_kv_heads) // p.tp * m.head_dim * act
            out["cp"] = micro * layers * 2 * qkvo
    if p.dp * p.cp > 1:
        split, replicated = map(sum, zip(*(_stage_params(cfg, counts, chunk * p.pp) for chunk in range(p.vpp))))
        out["dp"] = int((split / p.tp + replicated) * 4) + 4
    return out


def _stage_params(cfg: Config, counts: list[int], stage: int) -> tuple[float, float]:
    """(tp-split, tp-replicated) parameter counts of a pipeline stage: norms and learned
    positions are replicated over tp, everything else is split."""
    m = cfg.model
    norm = m.d_model * (1 if m.norm == "rmsnorm" else 2)
    embed = m.vocab_size * m.d_model
    per_layer = (flops.parameter_count(m) - embed * (1 if m.tie_embeddings else 2)
                 - (m.seq_len * m.d_model if m.pos == "learned" else 0) - norm) / m.n_layers
    split, replicated = counts[stage] * (per_layer - 2 * norm), counts[stage] * 2 * norm
    if stage == 0:
        split += embed
        replicated += m.seq_len * m.d_model if m.pos == "learned" else 0
    if stage == len(counts) - 1:
        split += 0 if m.tie_embeddings and len(counts) == 1 else embed
        replicated += norm
    return split, replicated
