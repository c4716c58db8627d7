"""FLOP and parameter counts of the model family (GQA, SwiGLU or GELU, tied or untied embeddings,
dense or mixture-of-experts MLPs).

The convention, used for MFU everywhere in tetrad: a multiply-add is 2 FLOPs; a training step
costs 3x the forward (forward, backward for inputs, backward for weights); causal attention's
QK^T and AV are counted **in full**, as if no score were masked (the convention of Megatron-LM's
Narayanan et al. Eq. 3, PaLM and torchtitan), so MFU is comparable with their figures; under a
sliding window shorter than the sequence each query counts the window's keys in full, not the
sequence's (the band a sliding-window kernel computes; as the window grows to the sequence this
is the causal count); the embedding lookup is free and the output head counts. Hardware FLOPs (HFU) add what activation
recomputation repeats. What kernels actually execute (a causal kernel skips about half of the
attention core) is the time model's business (plan/layer.py), not this convention's.

Mixture of experts (model.n_experts = E > 0, top-k, each expert H = expert_hidden wide): the
parameters count all E experts and the router (memory, ZeRO, the optimizer hold them all); the
FLOPs count what a token runs, its router (2·d·E) and its k experts (the active compute), so MFU
is the active FLOPs' share of the peak, as Mixtral's and DeepSeek's reports count it. A shared
expert (model.shared_expert_ffn_hidden, and its gate) is a dense MLP every token runs: active.
Layers differ where model.dense_layers names some: each is a dense model's layer (`layer_model`),
and the model's counts sum over its layers' kinds (`layer_kinds`).

Multi-token prediction (model.mtp_layers = D > 0, model/mtp.py): D modules after the last layer,
each two norms, eh_proj [d, 2d] (replicated over tp), a transformer layer of global index
n_layers + k (MoE where ModelConfig.moe_layer says) and a final norm, sharing the model's embedding
and head. They count as parameters (`mtp_parameter_count`; DeepSeek-V3's 11.6B beside 671B: its
card's 14B adds its checkpoint's own copies of the embedding and head) and in the
FLOPs as Megatron's num_floating_point_operations counts mtp_num_layers: each depth's layer, its
eh_proj and its pass through the head (`mtp_matmul_flops`), its attention core as a main layer's.

Latent attention (model.kv_lora_rank > 0, model/latent_attention.py): its up projections (wq_b or
wq, wkv_b) and wo are split over tp, its down projections (wq_a, wkv_a) and their norms are
replicated; QK^T counts the q/k width (nope + rope), AV the value width v_head_dim (the core's
zero padding of the values to the q/k width is not the model's arithmetic).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from tetrad.config import ModelConfig


def layer_model(m: ModelConfig, moe: bool) -> ModelConfig:
    """The model as one of its layers of that kind sees it: an MoE model's dense layer (`moe`
    False; model.dense_layers) is a dense model's layer, with neither experts nor shared expert.
    Every per-layer count here and in the planner takes it."""
    if moe or not m.n_experts:
        return m
    return replace(m, n_experts=0, shared_expert_ffn_hidden=0, shared_expert_gate=False, dense_layers=[])


def kind_counts(m: ModelConfig, chunks: Sequence[range] | None = None) -> dict[bool, int]:
    """How many layers of `chunks` (ranges of global indices, a pipeline rank's; default: all) are
    of each kind present, keyed by ModelConfig.moe_layer. Counted per range, never per layer: the
    planner asks this of every layout it weighs, and a dense model's answer is the ranges' lengths."""
    chunks = [range(m.n_layers)] if chunks is None else chunks
    total = sum(map(len, chunks))
    if not (m.n_experts and m.dense_layers):  # one kind
        return {bool(m.n_experts): total}
    moe = total - sum(i in c for c in chunks for i in set(m.dense_layers))
    return {kind: n for kind, n in ((True, moe), (False, total - moe)) if n}


def layer_kinds(m: ModelConfig, chunks: Sequence[range] | None = None) -> list[tuple[ModelConfig, int]]:
    """(layer_model of a kind, how many layers of `chunks` (kind_counts) are of it), each kind present."""
    return [(layer_model(m, kind), n) for kind, n in kind_counts(m, chunks).items()]


def over_layers(m: ModelConfig, per_layer, chunks: Sequence[range] | None = None) -> float:
    """The sum of `per_layer`(layer_model) over the layers of `chunks` (default: all) of `m`."""
    return sum(n * per_layer(kind) for kind, n in layer_kinds(m, chunks))


def mtp_chunks(m: ModelConfig) -> list[range]:
    """The global indices of the multi-token prediction modules' layers, n_layers .. n_layers + D - 1,
    as `chunks` for the functions above (empty at D = 0)."""
    return [range(m.n_layers, m.n_layers + m.mtp_layers)]


def mtp_kind_counts(m: ModelConfig) -> dict[bool, int]:
    """`kind_counts` of the multi-token prediction modules' layers ({} without them)."""
    return kind_counts(m, mtp_chunks(m)) if m.mtp_layers else {}


def layer_matmul_flops(m: ModelConfig) -> float:
    """Forward FLOPs per token of one layer's weight matmuls (q, k, v, o projections and the MLP:
    under MoE the router and the token's k experts alone, the shared expert and its gate)."""
    return 2 * (attention_matrix_params(m) + latent_down_params(m) + mlp_matrix_params(m, active=True)
                + router_params(m) + shared_expert_matrix_params(m) + shared_gate_params(m))


def attention_matrix_params(m: ModelConfig) -> int:
    """Weights of one layer's attention linears split over tp: q, k, v and o; under latent
    attention q's (from the q latent, or d_model), wkv_b and wo."""
    if not m.latent_attention:
        return m.d_model * m.head_dim * (2 * m.n_heads + 2 * m.n_kv_heads)
    return m.n_heads * ((m.q_lora_rank or m.d_model) * m.head_dim
                        + m.kv_lora_rank * (m.qk_nope_head_dim + m.v_head_dim) + m.v_head_dim * m.d_model)


def latent_down_params(m: ModelConfig) -> int:
    """Latent attention's down projections wq_a and wkv_a, replicated over tp (0 without it)."""
    return m.d_model * (m.q_lora_rank + m.kv_lora_rank + m.qk_rope_head_dim) if m.latent_attention else 0


def mlp_hidden(m: ModelConfig, active: bool = False) -> int:
    """The MLP's hidden width summed over its matrices' sets: ffn_hidden (dense); under MoE every
    expert's, E·H, or (`active`) a token's k experts', k·H."""
    if not m.n_experts:
        return m.ffn_hidden
    return (m.experts_per_token if active else m.n_experts) * m.expert_hidden


def mlp_matrix_params(m: ModelConfig, active: bool = False) -> int:
    """Weights of one layer's MLP matrices (split over tp): the dense MLP's, all E experts', or
    (`active`) a token's k experts'."""
    return m.d_model * mlp_hidden(m, active) * (3 if m.gated_mlp else 2)


def router_params(m: ModelConfig) -> int:
    """The MoE router's weight [E, d_model], replicated over tp (0 for a dense MLP)."""
    return m.n_experts * m.d_model


def shared_expert_matrix_params(m: ModelConfig) -> int:
    """Weights of an MoE layer's shared expert (split over tp as the dense MLP's; 0 without one)."""
    return m.d_model * m.shared_expert_ffn_hidden * (3 if m.gated_mlp else 2) if m.n_experts else 0


def shared_gate_params(m: ModelConfig) -> int:
    """The shared expert's gate [1, d_model], replicated over tp (0 without one)."""
    return m.d_model if m.n_experts and m.shared_expert_gate else 0


def layer_matrix_params(m: ModelConfig) -> int:
    """Weights of one layer's linears split over tp (every expert's and the shared expert's: the
    router and the shared expert's gate are replicated)."""
    return attention_matrix_params(m) + mlp_matrix_params(m) + shared_expert_matrix_params(m)


def layer_bias_params(m: ModelConfig) -> int:
    """Biases of one layer's q, k and v projections (split over tp, as their weights are)."""
    return (m.n_heads + 2 * m.n_kv_heads) * m.head_dim if m.qkv_bias else 0


def layer_params(m: ModelConfig, tp: int) -> float:
    """Parameters of one layer on a tp rank: its share of the linears' weights and biases, and
    the norms, which every rank holds whole."""
    return ((layer_matrix_params(m) + layer_bias_params(m)) / tp + layer_norm_params(m) + router_params(m)
            + shared_gate_params(m) + latent_down_params(m))


def layer_matmuls(m: ModelConfig) -> list[tuple[int, int, str, int]]:
    """One layer's matmuls in the order its forward runs them, as (input width, output width,
    split over tp, rows per token): q, k, v, the output projection, then gate, up and down
    (SwiGLU) or fc1 and fc2, under MoE the experts' (k rows a token, H wide; the router, small and
    replicated, left out). Latent attention's are wkv_a, wq_a, wq_b (or wq), wkv_b and wo. The
    split: "column" splits the output over tp (the input whole), "row" the input (the output
    whole), "chunk" neither: the weight whole over the rank's own tokens, under sequence
    parallelism its sequence chunk (latent attention's replicated down projections)."""
    f, k = (m.expert_hidden, m.experts_per_token) if m.n_experts else (m.ffn_hidden, 1)
    return [*_attention_matmuls(m), *_mlp_matmuls(m, f, k)]


def _attention_matmuls(m: ModelConfig) -> list[tuple[int, int, str, int]]:
    h, q, kv = m.d_model, m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim
    if not m.latent_attention:
        return [(h, q, "column", 1), (h, kv, "column", 1), (h, kv, "column", 1), (q, h, "row", 1)]
    down = [(h, m.kv_lora_rank + m.qk_rope_head_dim, "chunk", 1)]
    down += [(h, m.q_lora_rank, "chunk", 1), (m.q_lora_rank, q, "column", 1)] if m.q_lora_rank \
        else [(h, q, "column", 1)]
    return [*down, (m.kv_lora_rank, m.n_heads * (m.qk_nope_head_dim + m.v_head_dim), "column", 1),
            (m.n_heads * m.v_head_dim, h, "row", 1)]


def _mlp_matmuls(m: ModelConfig, f: int, rows: int) -> list[tuple[int, int, str, int]]:
    h = m.d_model
    return [(h, f, "column", rows), (h, f, "column", rows), (f, h, "row", rows)] if m.gated_mlp else \
        [(h, f, "column", rows), (f, h, "row", rows)]


def op_checkpoint_matmuls(m: ModelConfig) -> list[tuple[int, int, str, int]]:
    """The matmuls `selective-op`'s policy counts, in forward order (model/llama.py): the
    attention's and the MLP's; under MoE the shared expert's as a dense MLP of its width, the
    routing's (router, routed experts, the shared expert's gate) left out: all kept."""
    if not m.n_experts:
        return layer_matmuls(m)
    shared = _mlp_matmuls(m, m.shared_expert_ffn_hidden, 1) if m.shared_expert_ffn_hidden else []
    return _attention_matmuls(m) + shared


def op_checkpoint_saved_matmuls(m: ModelConfig) -> list[tuple[int, int, str, int]]:
    """The matmuls whose outputs `selective-op` keeps: every other one it counts, from the first,
    and under MoE every one of the routing: the router's and the shared expert's gate's (whole on
    every tp rank, as a row-parallel output), each of a token's k experts'; the rest it recomputes."""
    kept = op_checkpoint_matmuls(m)[0::2]
    if m.n_experts:
        kept += [(m.d_model, m.n_experts + m.shared_expert_gate, "row", 1),
                 *_mlp_matmuls(m, m.expert_hidden, m.experts_per_token)]
    return kept


def layer_norm_params(m: ModelConfig) -> int:
    """Weights of one layer's norms, replicated over tp: the two before attention and the MLP (and
    the sandwich norms after them: Gemma 3), qk-norm's (`layer_qk_norm_params`) and latent
    attention's over its latents."""
    latent = m.q_lora_rank + m.kv_lora_rank if m.latent_attention else 0
    return (4 if m.sandwich_norm else 2) * m.d_model * (2 if m.norm == "layernorm" else 1) + layer_qk_norm_params(m) \
        + latent


def layer_qk_norm_params(m: ModelConfig) -> int:
    """Weights of one layer's q and k norms (one head wide each), whose gradients each tp rank
    makes from its own heads."""
    return 2 * m.head_dim * (2 if m.norm == "layernorm" else 1) if m.qk_norm else 0


def attention_core_flops(m: ModelConfig, seq_len: int) -> float:
    """Forward FLOPs per token of one layer's QK^T and AV over the keys a query may see, counted in
    full: the whole sequence, or the layer's sliding window where that is shorter; the mean over
    the layers where model.layer_types gives them different windows."""
    windows = layer_windows(m)
    keys = sum(min(seq_len, w) if w else seq_len for w in windows) / len(windows)
    return 2 * keys * m.n_heads * (m.head_dim + (m.v_head_dim if m.latent_attention else m.head_dim))


def hides_keys(window: int, length: int) -> bool:
    """Whether a sliding window of `window` keys hides any causal key in a sequence of `length`
    tokens: 0 is no window, and one of `length` or more lets every query see all it would."""
    return 0 < window < length


def layer_windows(m: ModelConfig) -> list[int]:
    """Each layer's sliding window (0: none): model.sliding_window, but in layer_types' full layers."""
    return [m.window_of(i) for i in range(m.n_layers)]


def head_flops(m: ModelConfig) -> float:
    return 2 * m.d_model * m.vocab_size


def eh_proj_params(m: ModelConfig) -> int:
    """A multi-token prediction module's eh_proj [d, 2d], replicated over tp."""
    return 2 * m.d_model * m.d_model


def mtp_matmul_flops(m: ModelConfig) -> float:
    """Forward FLOPs per token of the multi-token prediction modules' matmuls (0 without them):
    each depth's layer, eh_proj and head; what the last pipeline stage runs beside the main head."""
    if not m.mtp_layers:  # the split asks it of every layout the planner weighs: kept cheap
        return 0.0
    layers = sum(layer_matmul_flops(layer_model(m, m.moe_layer(i))) for i in mtp_chunks(m)[0])
    return layers + m.mtp_layers * (2 * eh_proj_params(m) + head_flops(m))


def all_layers(m: ModelConfig) -> int:
    """The model's transformer layers, the multi-token prediction modules' included."""
    return m.n_layers + m.mtp_layers


def forward_flops_per_token(m: ModelConfig, seq_len: int | None = None) -> float:
    s = seq_len or m.seq_len
    return (over_layers(m, layer_matmul_flops) + all_layers(m) * attention_core_flops(m, s) + head_flops(m)
            + mtp_matmul_flops(m))


def model_flops_per_token(m: ModelConfig, seq_len: int | None = None) -> float:
    """Training FLOPs per token (forward + backward): the numerator of MFU."""
    return 3 * forward_flops_per_token(m, seq_len)


def hardware_flops_per_token(m: ModelConfig, recompute: str, seq_len: int | None = None,
                             loss_chunked: bool = False) -> float:
    """Model FLOPs plus what recomputation repeats: each layer's whole forward ("full"), its
    attention core ("selective") or the matmuls per-op checkpointing does not keep
    ("selective-op"), and with the head's loss fused in chunks (`loss_chunked`,
    train.loss_chunk_tokens) every head's logits, made again in backward; the numerator of HFU."""
    s = seq_len or m.seq_len
    core = all_layers(m) * attention_core_flops(m, s)
    chunks = [range(all_layers(m))]  # the modules' layers recompute as the main ones do
    extra = {"none": 0.0, "selective": core, "full": over_layers(m, layer_matmul_flops, chunks) + core,
             "selective-op": over_layers(m, lambda k: layer_matmul_flops(k) - sum(
                 2 * a * b * rows for a, b, _, rows in op_checkpoint_saved_matmuls(k)), chunks)}[recompute]
    heads = (1 + m.mtp_layers) * head_flops(m) if loss_chunked else 0.0
    return model_flops_per_token(m, s) + extra + heads


def embedding_params(m: ModelConfig) -> int:
    """The token embedding, plus learned positions where the model has them (first stage)."""
    return m.vocab_size * m.d_model + (m.seq_len * m.d_model if m.pos == "learned" else 0)


def norm_params(m: ModelConfig) -> int:
    """One d_model-wide norm's weights (and LayerNorm's bias)."""
    return m.d_model * (2 if m.norm == "layernorm" else 1)


def head_params(m: ModelConfig, separate: bool) -> int:
    """The last stage's final norm and, unless it shares the embedding's weight, its head."""
    return norm_params(m) + (m.vocab_size * m.d_model if separate else 0)


def mtp_module_params(m: ModelConfig) -> int:
    """One multi-token prediction module's parameters beside its layer: its three norms (enorm,
    hnorm, the final one) and eh_proj."""
    return 3 * norm_params(m) + eh_proj_params(m)


def _layer_count(active: bool):
    """A layer's parameters, or (`active`) under MoE those one token uses."""
    def per_layer(k: ModelConfig) -> float:
        return layer_params(k, 1) - (mlp_matrix_params(k) - mlp_matrix_params(k, active=True) if active else 0)
    return per_layer


def main_parameter_count(m: ModelConfig, active: bool = False) -> int:
    """`parameter_count` without the multi-token prediction modules: the model a checkpoint's
    card usually quotes (DeepSeek-V3's 671B)."""
    return int(over_layers(m, _layer_count(active))) + embedding_params(m) + head_params(m, not m.tie_embeddings)


def mtp_parameter_count(m: ModelConfig, active: bool = False) -> int:
    """The multi-token prediction modules' own parameters (their layers, norms and eh_proj; the
    embedding and head are the model's), or (`active`) those one token uses; 0 without them."""
    return int(over_layers(m, _layer_count(active), mtp_chunks(m))) + m.mtp_layers * mtp_module_params(m)


def parameter_count(m: ModelConfig, active: bool = False) -> int:
    """The model's parameters (all experts': what memory holds), or (`active`) those one token
    uses: under MoE only its k experts of each MoE layer's E (Mixtral 8x7B: 46.7B and 12.9B;
    Qwen1.5-MoE-A2.7B: 14.3B and 2.7B, its shared expert active); the multi-token prediction
    modules' included (`main_parameter_count` leaves them out)."""
    return main_parameter_count(m, active) + mtp_parameter_count(m, active)


def narayanan_eq3_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """FLOPs per iteration by Narayanan et al. 2021, Eq. 3 (GPT, the recomputed forward counted)."""
    return 96 * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))
