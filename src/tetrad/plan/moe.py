"""What a mixture-of-experts layer adds to the planner's time and memory beyond its GEMMs (those
are layer.py's, over each expert's balanced share of the rows) and its parameters (model/flops.py).

Routing is dropless top-k (model/moe.py): every token's hidden state goes to k experts whatever
the balance, so the k·tokens rows a layer keeps for backward do not depend on it and need no
imbalance margin. Imbalance changes only how those rows split over the E experts' GEMMs: the
time model takes the balanced split (tokens·k/E rows each), the best case for the GEMMs' shapes.
No expert parallelism: every rank holds all E experts (split over tp like the dense MLP).
"""

from __future__ import annotations

from tetrad.config import ModelConfig
from tetrad.model import flops

INDEX_BYTES = 8  # int64 indices: torch.topk's, and the dispatch order's


def routing_saved_bytes_per_token(m: ModelConfig, e: int) -> float:
    """Bytes per token an MoE layer keeps for backward beyond its experts' hidden tensors (0 for a
    dense MLP), whole on every tp rank (routing runs on the MLP's whole input), as model/moe.py
    keeps them: the token's hidden state copied to each of its k experts (the experts' input) and
    the k experts' outputs (kept by their weighing), the router's fp32 probabilities [E] (the
    softmax's output), three int64 indices per assignment (the top-k's, the dispatch order, each
    assignment's token), the fp32 top-k weights and their sum, and the weights cast to the
    activations' dtype (`e` bytes an element) in dispatch order."""
    if not m.n_experts:
        return 0.0
    k = m.experts_per_token
    return 2 * k * m.d_model * e + 4 * m.n_experts + k * (3 * INDEX_BYTES + 4 + e) + 4


def expert_hidden_saved(m: ModelConfig) -> int:
    """Expert-hidden tensors model/moe.py keeps per assignment: the first GEMM's output (and the
    gate's, gated kinds); the activation is recomputed in backward."""
    return 2 if m.gated_mlp else 1


def expert_grad_bytes(m: ModelConfig, tp: int, e: int) -> float:
    """Bytes of one layer's expert weight gradients as the experts' backward makes them, whole [E,
    ...] tensors in the activations' dtype, before they join the fp32 gradient buffer: alive at the
    peak of a layer's backward (0 for a dense MLP, whose per-linear gradients are not counted)."""
    return (flops.mlp_matrix_params(m) / tp * e) if m.n_experts else 0.0


def routing_bytes_per_token(m: ModelConfig, e: int) -> float:
    """HBM bytes per token of an MoE layer's routing, forward (0 for a dense MLP): the router's
    fp32 softmax (read the logits, write the probabilities), top-k over them, the token's hidden
    state copied to each of its k experts (read, write) and their outputs weighed and summed back
    (read k, write one): what a gather/scatter dispatch moves at HBM bandwidth."""
    if not m.n_experts:
        return 0.0
    k = m.experts_per_token
    return 3 * 4 * m.n_experts + m.d_model * e * (2 * k + k + 1)
