"""The attention's widths as the planner counts them, per token on one tp rank, for grouped-query
and multi-head latent attention alike: what the layer's GEMMs, saved activations, tp and cp bytes
and buffers are made of (layer.py, activations.py, comm_bytes.py, memory.py).

Grouped-query attention: q and the output n_heads x head_dim wide, k and v n_kv_heads x head_dim;
its input gathered once for q, k and v (sequence parallelism). Multi-head latent attention
(model.kv_lora_rank > 0, DeepSeek-V2/V3; model/latent_attention.py): every head has its own key
and value (n_kv_heads = n_heads), from latents that replicated down projections make from the
rank's own tokens (under SP its sequence chunk): the keys' and values' (kv_lora_rank, normed, and
the shared rotated key's rope dims) and the query's (q_lora_rank, normed; none at 0, where q is a
full column-parallel projection of the gathered input). The latents go to the heads in one
collective (under SP an all-gather of q_lora_rank + kv_lora_rank + rope, not d_model; without SP
their gradient's all-reduce), then column-parallel up projections make q, k_nope and v. The kernel
takes q, k and v of one width, nope + rope: v is zero-padded to it, and the output's padding is
sliced off before the output projection (n_heads x v_head_dim).
"""

from __future__ import annotations

from typing import NamedTuple

from tetrad.config import ModelConfig


class Widths(NamedTuple):
    """Per token on one tp rank: q, k, v and the output as the attention kernel takes and makes
    them, and the output projection's input."""
    q: float
    k: float
    v: float
    out: float
    wo: float


def widths(m: ModelConfig, tp: int) -> Widths:
    """The attention kernel's tensors' widths and the output projection's input on one tp rank."""
    q = m.n_heads * m.head_dim / tp
    if m.latent_attention:  # v padded to the q/k width (model/latent_attention.py)
        return Widths(q, q, q, q, m.n_heads * m.v_head_dim / tp)
    kv = m.n_kv_heads * m.head_dim / tp
    return Widths(q, kv, kv, q, q)


def latents(m: ModelConfig) -> tuple[int, int]:
    """(the query's latent, the keys' and values' latent with the shared rotated key) per token,
    whole on every tp rank: the down projections' outputs; (0, 0) without latent attention."""
    if not m.latent_attention:
        return 0, 0
    return m.q_lora_rank, m.kv_lora_rank + m.qk_rope_head_dim


def projections(m: ModelConfig, tp: int) -> list[tuple[float, float, bool]]:
    """The attention's input projections as (K, N, on the rank's own tokens) GEMMs per token on
    one tp rank, in forward order (the output projection, `widths().wo` x d_model, apart): q, k and
    v fused for grouped-query attention, over the whole sequence; under latent attention the kv
    down projection, the query's (down then up, or its full projection), then the kv up
    projection, the down projections over the rank's own tokens (under SP its chunk)."""
    h, w = m.d_model, widths(m, tp)
    if not m.latent_attention:
        return [(h, w.q + w.k + w.v, False)]
    q_latent, kv_latent = latents(m)
    query = [(h, q_latent, True), (q_latent, w.q, False)] if q_latent else [(h, w.q, False)]
    return [(h, kv_latent, True), *query, (m.kv_lora_rank, m.n_heads * (m.qk_nope_head_dim + m.v_head_dim) / tp, False)]


def core_inputs(m: ModelConfig, tp: int) -> float:
    """Width of what selective recompute keeps of the attention core's inputs on one tp rank: q, k
    and v; under latent attention q and the up-projected [k_nope, v] (the shared rotated key is
    the latents', kept already): the core builds the keys and pads the values again."""
    w = widths(m, tp)
    if not m.latent_attention:
        return w.q + w.k + w.v
    return w.q + m.n_heads * (m.qk_nope_head_dim + m.v_head_dim) / tp


def tp_inputs(m: ModelConfig) -> list[int]:
    """Widths of the attention's input collectives over tp (SP's all-gathers forward; the
    gradient's all-reduce or reduce-scatter backward): d_model for q, k and v; latent attention's
    latents, and without a query latent the input of q's projection too."""
    if not m.latent_attention:
        return [m.d_model]
    q_latent, kv_latent = latents(m)
    return [q_latent + kv_latent] + ([] if q_latent else [m.d_model])


def regathered_inputs(m: ModelConfig) -> int:
    """How many of the attention's inputs `sp_regather` gathers again in backward (d_model wide):
    q, k and v's one; latent attention's latents none, its full query projection's input one."""
    return 0 if m.latent_attention and m.q_lora_rank else 1
