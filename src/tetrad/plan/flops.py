"""FLOP counts of the model family, per token.

Convention (stated once, used for MFU everywhere in tetrad): a multiply-add is 2 FLOPs; a
training step costs 3x the forward (forward + backward for inputs and weights); causal
attention's QK^T and AV are counted **in full** (as Megatron-LM, PaLM and torchtitan count them),
so MFU is comparable with their figures. Hardware FLOPs (HFU) add the recomputed forward.
What a causal kernel actually executes (about half of the attention core) is what the time
model uses (`attention_core_executed`).
"""

from __future__ import annotations

from tetrad.config import ModelConfig


def layer_matmul_flops(m: ModelConfig) -> float:
    """Forward FLOPs per token of one layer's weight matmuls (attention projections and MLP)."""
    hd = m.head_dim
    attn = 2 * m.d_model * (m.n_heads * hd) * 2 + 2 * m.d_model * (m.n_kv_heads * hd) * 2
    mlp = 2 * m.d_model * m.ffn_hidden * (3 if m.mlp == "swiglu" else 2)
    return attn + mlp


def attention_core_flops(m: ModelConfig, seq_len: int) -> float:
    """Forward FLOPs per token of QK^T and AV over the whole sequence (counted in full)."""
    return 2 * 2 * seq_len * m.n_heads * m.head_dim


def head_flops(m: ModelConfig) -> float:
    return 2 * m.d_model * m.vocab_size


def forward_flops_per_token(m: ModelConfig, seq_len: int | None = None) -> float:
    s = seq_len or m.seq_len
    return m.n_layers * (layer_matmul_flops(m) + attention_core_flops(m, s)) + head_flops(m)


def model_flops_per_token(m: ModelConfig, seq_len: int | None = None) -> float:
    """Training FLOPs per token (forward + backward), the numerator of MFU."""
    return 3 * forward_flops_per_token(m, seq_len)


def hardware_flops_per_token(m: ModelConfig, recompute: str, seq_len: int | None = None) -> float:
    """Model FLOPs plus what recomputation repeats: the whole layer forward ("full") or the
    attention core ("selective"); the numerator of HFU."""
    s = seq_len or m.seq_len
    extra = {"none": 0.0, "selective": m.n_layers * attention_core_flops(m, s),
             "full": m.n_layers * (layer_matmul_flops(m) + attention_core_flops(m, s))}[recompute]
    return model_flops_per_token(m, s) + extra


def parameter_count(m: ModelConfig) -> int:
    hd = m.head_dim
    per_layer = (m.d_model * m.n_heads * hd * 2 + m.d_model * m.n_kv_heads * hd * 2
                 + m.d_model * m.ffn_hidden * (3 if m.mlp == "swiglu" else 2)
                 + m.d_model * (2 if m.norm == "rmsnorm" else 4))
    embed = m.vocab_size * m.d_model
    head = 0 if m.tie_embeddings else m.vocab_size * m.d_model
    pos = m.seq_len * m.d_model if m.pos == "learned" else 0
    final_norm = m.d_model * (1 if m.norm == "rmsnorm" else 2)
    return m.n_layers * per_layer + embed + head + pos + final_norm


def narayanan_eq3_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """FLOPs per iteration by Narayanan et al. 2021, Eq. 3 (GPT, full recompute counted)."""
    return 96 * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))
