"""Rotary position embedding (RoPE) as transformers computes it: HF Llama's pairing of each head's
dims (i, i + d/2), over the first rotary_dim of them (model.partial_rotary_factor: phi-4-mini
rotates 96 of 128, the rest pass through), with Llama 3.1's, linear (Gemma 3's), Phi-3's
LongRoPE or YaRN frequency scaling (model.rope_scaling; YaRN: DeepSeek-V2/V3, the long-context
Qwen2.5 and Qwen3, gpt-oss); Gemma 3's sliding layers take their own theta
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
    else short_factor's; under linear scaling all divided by `factor`; under YaRN, `_yarn`'s;
    under Llama 3.1's `rope_scaling` remapped by how many turns they make over the context it was
    first trained on: fewer than low_freq_factor, slowed by `factor` (long context); more than
    high_freq_factor, kept (local order); in between, a linear blend. `local`: a sliding layer's under
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
    if s["rope_type"] == "yarn":
        return _yarn(s, d, theta, theta ** exponents)
    turns = s["original_max_position_embeddings"] * inv_freq / (2 * math.pi)
    kept = ((turns - s["low_freq_factor"]) / (s["high_freq_factor"] - s["low_freq_factor"])).clamp(0, 1)
    return kept * inv_freq + (1 - kept) * inv_freq / s["factor"]


def rope_tables(positions: torch.Tensor, cfg: ModelConfig, inv_freq: torch.Tensor,
                local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of each token's true position (positions: [s], or [b, s] per row under
    train.reset_positions) at frequencies `inv_freq` (rope_frequencies'), laid out for
    `apply_rope`: [1 or b, s, 1, rotary_dim], each half's angles repeated, sin negated on the
    first half; both times `attention_factor`, as transformers scales them (the rotated dims'
    share of q.k grows by its square), but for a `local` layer's (rope_frequencies)."""
    rows = positions.float().reshape(-1, positions.shape[-1])  # [1 or b, s]
    angles = rows[:, :, None, None] * inv_freq
    cos, sin = angles.cos(), angles.sin()
    scale = 1.0 if local else attention_factor(cfg)
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)


def attention_factor(cfg: ModelConfig) -> float:
    """What cos and sin are multiplied by: LongRoPE's attention_factor; YaRN's where given, else
    (transformers' inference) mscale(factor, mscale) / mscale(factor, mscale_all_dim) where both
    are nonzero, else mscale(factor) (DeepSeek-V3's mscale = mscale_all_dim = 1 make it 1: its
    scaling is the softmax's, `yarn_softmax_factor`); 1 for the other scalings."""
    s, kind = cfg.rope_scaling, cfg.rope_scaling.get("rope_type")
    if kind == "longrope" or (kind == "yarn" and "attention_factor" in s):
        return s["attention_factor"]
    if kind != "yarn":
        return 1.0
    if s.get("mscale") and s.get("mscale_all_dim"):
        return _mscale(s["factor"], s["mscale"]) / _mscale(s["factor"], s["mscale_all_dim"])
    return _mscale(s["factor"])


def yarn_softmax_factor(cfg: ModelConfig) -> float:
    """What DeepSeek's multi-head latent attention multiplies its softmax scale by under YaRN with a
    nonzero mscale_all_dim: mscale(factor, mscale_all_dim) squared, on every dim of q.k, rotated or
    not (transformers' yarn_apply_mscale; DeepSeek-V3's factor 40: 1.3689^2 = 1.8738); else 1."""
    s = cfg.rope_scaling
    if s.get("rope_type") != "yarn" or not s.get("mscale_all_dim"):
        return 1.0
    m = _mscale(s["factor"], s["mscale_all_dim"])
    return m * m


def _mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature (its paper's eq. 21): 0.1 * mscale * ln(factor) + 1, 1 unscaled."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(s: dict, d: int, theta: float, powers: torch.Tensor) -> torch.Tensor:
    """YaRN's frequencies (NTK-by-parts; `powers`: theta^(2i/d)): each pair's theta^(-2i/d) kept
    (extrapolated) where it turns more than beta_fast times over original_max_position_embeddings,
    divided by `factor` (interpolated) where fewer than beta_slow, a linear ramp over the pairs
    between; the bounds, as dims, floored and ceiled unless truncate is false. transformers' order
    of operations, so its fp32 rounding; its quirk too: the upper bound is capped at d - 1, not at
    the d / 2 pairs."""
    original = s["original_max_position_embeddings"]

    def dim_of(turns: float) -> float:  # the dim whose pair turns `turns` times over the original context
        return (d * math.log(original / (turns * 2 * math.pi))) / (2 * math.log(theta))
    low, high = dim_of(s.get("beta_fast", 32)), dim_of(s.get("beta_slow", 1))
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # a step, not a division by zero
    ramp = ((torch.arange(d // 2, dtype=torch.float32, device=powers.device) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp
    return 1.0 / (s["factor"] * powers) * (1 - kept) + 1.0 / powers * kept


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
