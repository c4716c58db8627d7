"""Rotary position embedding (RoPE) as transformers computes it: HF Llama's pairing of each head's
dims (i, i + d/2), over the first rotary_dim of them (model.partial_rotary_factor: phi-4-mini
rotates 96 of 128, the rest pass through), with Llama 3.1's, linear (Gemma 3's) or Phi-3's
LongRoPE frequency scaling (model.rope_scaling); Gemma 3's sliding layers take their own theta
(model.rope_local_base_freq) unscaled."""

from __future__ import annotations

import math

import torch

from tetrad.config import ModelConfig


def uses_long_factors(cfg: ModelConfig, length: int | torch.Tensor) -> bool | torch.Tensor:
    """Whether a sequence of `length` tokens takes LongRoPE's long_factor: past
    original_max_position_embeddings, as transformers 5 picks (`dynamic_rope_update`: by the
    largest position id + 1 of each forward call); a tensor `length` compares on the device. Which
    length a call passes is the model's choice (`Transformer.rope`)."""
    s = cfg.rope_scaling
    return s.get("rope_type") == "longrope" and length > s["original_max_position_embeddings"]


def rope_frequencies(cfg: ModelConfig, device: torch.device, long: bool = False, local: bool = False) -> torch.Tensor:
    """RoPE's angle per position of each pair of rotated dims: theta^(-2i/d) over d = rotary_dim;
    under LongRoPE those divided by its factors, long_factor's where `long` (uses_long_factors),
    else short_factor's; under linear scaling all divided by `factor`; under Llama 3.1's
    `rope_scaling` remapped by how many turns they make over the context it was first trained on:
    fewer than low_freq_factor, slowed by `factor` (long context); more than high_freq_factor,
    kept (local order); in between, a linear blend. `local`: a sliding layer's under
    model.rope_local_base_freq (its theta, no scaling: Gemma 3's)."""
    d, s = cfg.rotary_dim, {} if local else cfg.rope_scaling
    theta = cfg.rope_local_base_freq if local else cfg.rope_theta
    exponents = torch.arange(0, d, 2, device=device, dtype=torch.float32) / d
    if s and s["rope_type"] == "longrope":  # transformers' order of operations, for the same rounding
        factors = torch.tensor(s["long_factor" if long else "short_factor"], dtype=torch.float32, device=device)
        return 1.0 / (factors * theta ** exponents)
    inv_freq = 1.0 / theta ** exponents  # as transformers rounds it
    if not s:
        return inv_freq
    if s["rope_type"] == "linear":
        return inv_freq / s["factor"]
    turns = s["original_max_position_embeddings"] * inv_freq / (2 * math.pi)
    kept = ((turns - s["low_freq_factor"]) / (s["high_freq_factor"] - s["low_freq_factor"])).clamp(0, 1)
    return kept * inv_freq + (1 - kept) * inv_freq / s["factor"]


def rope_tables(positions: torch.Tensor, cfg: ModelConfig, inv_freq: torch.Tensor,
                local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of each token's true position (positions: [s], or [b, s] per row under
    train.reset_positions) at frequencies `inv_freq` (rope_frequencies'), laid out for
    `apply_rope`: [1 or b, s, 1, rotary_dim], each half's angles repeated, sin negated on the
    first half; both times LongRoPE's attention_factor, as transformers scales them (the rotated
    dims' share of q.k grows by its square), but for a `local` layer's (rope_frequencies)."""
    rows = positions.float().reshape(-1, positions.shape[-1])  # [1 or b, s]
    angles = rows[:, :, None, None] * inv_freq
    cos, sin = angles.cos(), angles.sin()
    if cfg.rope_scaling.get("rope_type") == "longrope" and not local:
        cos, sin = cos * cfg.rope_scaling["attention_factor"], sin * cfg.rope_scaling["attention_factor"]
    return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (i, i + r/2) of the first r = cos.shape[-1] dims of each head, the HF Llama
    convention: (x1 cos - x2 sin, x2 cos + x1 sin), as x cos + (x2, x1) sin with `rope_tables`'
    signed sin, in fp32; the dims past r pass through (partial RoPE). x: [b, s, heads, d].
    Half the ops of rotating each half apart: this runs on q and k of every layer."""
    r = cos.shape[-1]
    xf = x.float()
    rot = xf[..., :r]
    out = rot * cos + torch.cat([rot[..., r // 2:], rot[..., :r // 2]], dim=-1) * sin
    return (out if r == x.shape[-1] else torch.cat([out, xf[..., r:]], dim=-1)).to(x.dtype)
