"""Validation of multi-head latent attention's keys (model.kv_lora_rank and the head widths): what
model/latent_attention.py computes, each refusal one line naming what to change."""

from __future__ import annotations

from tetrad.config.model_section import ModelConfig
from tetrad.config.sections import ConfigError


def check_latent_attention(m: ModelConfig) -> None:
    """Latent attention's keys, where model.kv_lora_rank turns it on: DeepSeek's attention alone
    (one key per query head, full RoPE on its own dims, RMSNorm, no biases, no qk-norm)."""
    if not m.latent_attention:
        return
    fix = _unsupported(m)
    if fix:
        raise ConfigError(f"latent attention (model.kv_lora_rank={m.kv_lora_rank}) {fix}")


def _unsupported(m: ModelConfig) -> str:
    """The first key latent attention does not take, as the rest of a refusal ('' if none)."""
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    checks = [
        (m.n_kv_heads != m.n_heads, f"has a key per query head: set model.n_kv_heads={m.n_heads} (n_heads)"),
        (m.head_dim != qk, f"has heads qk_nope_head_dim + qk_rope_head_dim = {qk} wide: set model.head_dim={qk} "
                           "or leave it 0"),
        (m.qk_rope_head_dim % 2, f"rotates qk_rope_head_dim={m.qk_rope_head_dim} dims, which RoPE pairs: "
                                 "make it even"),
        (m.v_head_dim > qk, f"pads values to the query/key width {qk}: set model.v_head_dim <= {qk}"),
        (m.pos != "rope", "takes RoPE on its qk_rope_head_dim dims: set model.pos='rope'"),
        (m.partial_rotary_factor != 1, "rotates qk_rope_head_dim dims of its own: set model.partial_rotary_factor=1"),
        (m.qk_norm, "has norms on its latents, not qk-norm: set model.qk_norm=false"),
        (m.qkv_bias, "has no biases: set model.qkv_bias=false"),
        (m.norm != "rmsnorm", "norms its latents with RMSNorm (DeepSeek's): set model.norm='rmsnorm'"),
        (bool(m.query_pre_attn_scalar), "scales its softmax by (qk_nope_head_dim + qk_rope_head_dim) ** -0.5: "
                                        "set model.query_pre_attn_scalar=0"),
    ]
    return next((fix for bad, fix in checks if bad), "")
