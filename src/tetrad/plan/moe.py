"""What a mixture-of-experts layer adds to the planner's time and memory beyond its GEMMs (those
are layer.py's, over each expert's balanced share of the rows) and its parameters (model/flops.py).

Routing is dropless top-k (model/moe.py): every token's hidden state goes to k experts whatever
the balance, so the k·tokens rows a layer keeps for backward do not depend on it and need no
imbalance margin. Imbalance changes only how those rows split over the E experts' GEMMs: the
time model takes the balanced split (tokens·k/E rows each), the best case for the GEMMs' shapes.

Expert parallelism (parallel.ep, docs/design.md "Expert parallelism"): each block of ep consecutive
dp ranks (the EP group, cp·tp ranks apart) splits every MoE layer's experts, E/ep whole experts a
rank (still split over tp), and sends each routed row to the rank holding its expert by
all-to-all. The expert weights are replicated over, and their gradients summed over, the expert
gradient group: the dp·cp/ep ranks with the same place in their EP group (under hybrid ZeRO sharded
over zero_shard/ep of them inside the block and summed over the replicas as the dense buckets are:
`expert_shard_ranks`). Under balanced routing (the planner's assumption) a rank receives as many
rows as it sends, k·tokens, so its activations are those without ep; only the EP group's sum of
its all-to-all bytes is exact whatever the routing.
"""

from __future__ import annotations

from tetrad.config import ModelConfig
from tetrad.config.sections import zero_shard
from tetrad.model import flops

INDEX_BYTES = 8  # int64 indices: torch.topk's, and the dispatch order's


def expert_grad_ranks(parallel) -> int:
    """Ranks of the expert gradient group, dp·cp/ep, which the experts' own buckets are padded
    for and sharded over; 0 at ep = 1, where the experts sit in the dense buckets."""
    return parallel.dp * parallel.cp // parallel.ep if parallel.ep > 1 else 0


def expert_shard_ranks(parallel) -> int:
    """Ranks the experts' own buckets are padded for and sharded over: the expert gradient group,
    or under hybrid ZeRO its share of a block, zero_shard/ep consecutive ranks of it (EXPERT_SHARD,
    which a multiple of ep·cp keeps inside the block; the same dp·cp/zero_shard replicas as the
    dense buckets'); 0 at ep = 1."""
    block = zero_shard(parallel)
    return block // parallel.ep if block and parallel.ep > 1 else expert_grad_ranks(parallel)


def expert_shard(parallel, shard: int) -> int:
    """The place in its expert gradient group of the rank at place `shard` of its dp x cp group
    (dp major, cp minor; dist/layout.py): the experts' buckets' shard it owns. Under hybrid ZeRO,
    `shard` its place in its block, it is the place in its EXPERT_SHARD chunk (the block starts an
    EP group: its dp ranks are whole EP groups)."""
    dp, cp = divmod(shard, parallel.cp)
    return dp // parallel.ep * parallel.cp + cp


def ep_all_to_alls(m: ModelConfig, tokens: int, ep: int, e: int) -> tuple[list[float], list[float]]:
    """The payloads (bytes, tetrad.comm's count: the input, the part the rank keeps included) of one
    MoE layer's all-to-alls over the EP group per micro-batch of `tokens` tokens on the rank, `e`
    bytes an activation, (forward, backward), under balanced routing: forward the int64 expert
    counts [E], the dispatch of its k·tokens rows and the combine of the rows it received (as many);
    backward both token all-to-alls reversed. Empty without ep. Recompute repeats the forward's.
    Per rank this is the balanced figure; the EP group's sum is exact whatever the routing."""
    if ep == 1:
        return [], []
    rows = tokens * m.experts_per_token * m.d_model * e
    return [m.n_experts * INDEX_BYTES, rows, rows], [rows, rows]


def routing_saved_bytes_per_token(m: ModelConfig, e: int) -> float:
    """Bytes per token an MoE layer keeps for backward beyond its experts' hidden tensors (0 for a
    dense MLP), whole on every tp rank (routing runs on the MLP's whole input), as model/moe.py
    keeps them: the token's hidden state copied to each of its k experts (the experts' input) and
    the k experts' outputs (kept by their weighing), the router's fp32 scores [E] (the softmax's
    or sigmoid's output; a sigmoid's sum too, by which the load-balancing loss divides them),
    three int64 indices per assignment (the top-k's, the dispatch order, each assignment's token),
    the fp32 top-k weights and their sum (their division's; none where
    model.normalize_expert_weights is false: the top-k's own weights are cast and kept no more),
    and the weights cast to the activations' dtype (`e` bytes an element) in dispatch order. Top-1
    with normalized weights weighs nothing (each weight is 1): its expert's output, the top-k's
    indices and the weights are not kept."""
    if not m.n_experts:
        return 0.0
    k, weighed = m.experts_per_token, m.weighs_experts
    normalized = 4 if m.normalize_expert_weights and weighed else 0
    scores = 4 * m.n_experts + (4 if m.router_score == "sigmoid" else 0)
    return ((1 + weighed) * k * m.d_model * e + scores
            + k * ((2 + weighed) * INDEX_BYTES + normalized + weighed * e) + normalized)


def shared_expert_saved_bytes_per_token(m: ModelConfig, tp: int, e: int, hidden_saved: int) -> float:
    """Bytes per token an MoE layer's shared expert keeps for backward (0 without one): its hidden
    tensors as a dense MLP of its width (`hidden_saved` of them, the dense MLP's count), over tp; its
    input is the routing's, kept already. Its gate (model.shared_expert_gate): the sigmoid's output
    and the shared expert's partial output it scales, whole d on each tp rank (model/moe.py _shared)."""
    if not (m.n_experts and m.shared_expert_ffn_hidden):
        return 0.0
    return e * (hidden_saved * m.shared_expert_ffn_hidden / tp + (m.d_model + 1 if m.shared_expert_gate else 0))


def expert_hidden_saved(m: ModelConfig) -> int:
    """Expert-hidden tensors model/moe.py keeps per assignment: the first GEMM's output (and the
    gate's, gated kinds); the activation is recomputed in backward."""
    return 2 if m.gated_mlp else 1


def expert_grad_bytes(m: ModelConfig, tp: int, ep: int, e: int) -> float:
    """Bytes of one layer's expert weight gradients as the experts' backward makes them, whole [E/ep,
    ...] tensors in the activations' dtype, before they join the fp32 gradient buffer: alive at the
    peak of a layer's backward (0 for a dense MLP, whose per-linear gradients are not counted)."""
    return (flops.mlp_matrix_params(m) / tp / ep * e) if m.n_experts else 0.0


def routing_bytes_per_token(m: ModelConfig, e: int, ep: int = 1) -> float:
    """HBM bytes per token of an MoE layer's routing, forward (0 for a dense MLP): the router's
    fp32 scores (read the logits, write the softmax or sigmoid), top-k over them (with expert
    groups, first read for the groups' scores and read and written masked), the token's hidden
    state copied to each of its k experts (read, write) and their outputs weighed and summed back
    (read k, write one; none at top-1 with normalized weights, each 1: the output as it is): what a
    gather/scatter dispatch moves at HBM bandwidth. Under ep the rows received are reordered
    expert-major and their outputs back (model/moe.py _over_ep): k rows a token read and written
    twice more (balanced routing)."""
    if not m.n_experts:
        return 0.0
    k = m.experts_per_token
    weighed = k + 1 if m.weighs_experts else 0
    scores = (3 + (3 if m.expert_groups > 1 else 0)) * 4 * m.n_experts
    return scores + m.d_model * e * (2 * k + weighed + (4 * k if ep > 1 else 0))
