"""Memory per rank: model states by ZeRO stage, activations per layer, and allowances.

Model states per parameter (bytes): fp32 training keeps fp32 weights (4), fp32 gradients (4)
and Adam's two moments (8). Mixed precision follows the ZeRO paper's accounting, 2 + 2 + K with
K = 12 (fp32 master weights and both moments), 16 bytes in all. ZeRO-1 shards the optimizer
over the dp x cp group, ZeRO-2 also the gradients, ZeRO-3 also the weights.

Activations follow Korthikanti et al. 2022 (bytes per layer, 16-bit activations, 1-byte dropout
masks), written per tensor so they generalise to GQA, SwiGLU, fp32 activations, flash-style
attention (no s^2 scores kept), TP with or without SP, CP and recomputation.
"""

from __future__ import annotations

from dataclasses import dataclass

from tetrad.config import Config, ModelConfig
from tetrad.plan.flops import parameter_count

GIB = 1024**3

# Allowances, stated: the caching allocator's fragmentation on top of live tensors, and the
# resident baseline of a process that imported torch (Python, torch's libraries) on CPU, where
# the measured figure is the process's peak RSS. On GPUs `max_memory_allocated` has no baseline.
FRAGMENTATION = 0.05
CPU_PROCESS_BASELINE_BYTES = 330 * 1024**2


def state_bytes_per_param(dtype: str) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes per parameter."""
    return (4.0, 4.0, 8.0) if dtype == "fp32" else (2.0, 2.0, 12.0)


@dataclass
class Memory:
    weights: float
    grads: float
    optimizer: float
    activations: float
    other: float

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations + self.other

    def gib(self) -> dict:
        return {k: getattr(self, k) / GIB for k in ("weights", "grads", "optimizer", "activations", "other")}


def model_state_bytes(params: float, dtype: str, zero: int, shards: int) -> tuple[float, float, float]:
    """Bytes of (weights, grads, optimizer) on one rank holding `params` before ZeRO sharding."""
    w, g, o = state_bytes_per_param(dtype)
    return (params * w / (shards if zero >= 3 else 1),
            params * g / (shards if zero >= 2 else 1),
            params * o / (shards if zero >= 1 else 1))


def activation_bytes_per_layer(m: ModelConfig, micro_batch: int, seq_local: int, tp: int, sp: bool,
                               recompute: str, act_bytes: int, flash: bool = True) -> float:
    """Bytes one layer keeps for backward for one micro-batch (seq_local = seq_len / cp)."""
    sbh = seq_local * micro_batch * m.d_model
    if recompute == "full":
        return act_bytes * sbh / (tp if sp else 1)  # only the layer input (Korthikanti: 2sbh in 16 bit)
    kv = m.n_kv_heads / m.n_heads
    f = m.ffn_hidden / m.d_model
    e = act_bytes
    mask = 1 if m.dropout > 0 else 0
    # Replicated over tp unless SP: norm inputs, attention input, MLP input, dropout masks.
    replicated = (2 * e + e + e) * sbh + 2 * mask * sbh
    # Split over tp: q, k, v, attention output (input of wo), MLP hidden tensors.
    split = (e + 2 * e * kv + e) * sbh + e * sbh * kv  # q, k, (v), out-proj input
    split += (3 * e * f if m.mlp == "swiglu" else 2 * e * f) * sbh
    core = 0.0
    if recompute != "selective":
        heads_scores = m.n_heads * seq_local * micro_batch
        if flash:
            core = 4 * heads_scores  # fp32 log-sum-exp per query and head
        else:
            core = (2 * e + mask) * heads_scores * seq_local  # scores, softmax, dropout mask
    return replicated / (tp if sp else 1) + (split + core) / tp


def estimate_memory(cfg: Config, stage_layers: int, inflight: int, first: bool, last: bool,
                    on_cpu: bool, bucket_bytes: float) -> Memory:
    """Peak bytes of one rank of a pipeline stage holding `stage_layers` layers, with `inflight`
    micro-batches' activations alive (from the schedule simulator)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    total_params = parameter_count(m)
    embed = m.vocab_size * m.d_model
    layer_params = (total_params - embed * (1 if m.tie_embeddings else 2)) / m.n_layers
    params = layer_params * stage_layers
    if first:
        params += embed
    if last and (not m.tie_embeddings or p.pp > 1):
        params += embed
    params /= p.tp
    w, g, o = model_state_bytes(params, t.dtype, p.zero, p.dp * p.cp)
    act_bytes = 4 if t.dtype == "fp32" else 2
    seq_local = m.seq_len // p.cp
    per_layer = activation_bytes_per_layer(m, t.micro_batch, seq_local, p.tp, p.sequence_parallel,
                                           t.recompute, act_bytes)
    acts = per_layer * stage_layers * inflight
    if t.recompute == "full":  # one layer's activations rebuilt during its backward
        acts += activation_bytes_per_layer(m, t.micro_batch, seq_local, p.tp, p.sequence_parallel, "none",
                                           act_bytes)
    if last:  # fp32 logits and their gradient for one micro-batch, split over tp
        acts += 2 * 4 * t.micro_batch * seq_local * m.vocab_size / p.tp
    other = FRAGMENTATION * (w + g + o + acts) + bucket_bytes
    if p.zero >= 3:  # one layer gathered in full, and the next one prefetched
        other += 2 * layer_params / p.tp * state_bytes_per_param(t.dtype)[0]
    if on_cpu:
        other += CPU_PROCESS_BASELINE_BYTES
    return Memory(w, g, o, acts, other)
