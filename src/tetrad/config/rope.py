"""Validation of RoPE's keys: the rotated dims of each head (model.partial_rotary_factor), the
frequency scaling (model.rope_scaling: Llama 3.1's, linear, Phi-3's LongRoPE or YaRN, by HF's names) and
the per-layer attention of model.layer_types (Gemma 3: windows and RoPE per layer), each refusal
one line naming what to change."""

from __future__ import annotations

from tetrad.config.model_section import LONGROPE_KEYS, ROPE_SCALING_KEYS, ModelConfig
from tetrad.config.sections import ConfigError


LAYER_TYPES = ("sliding_attention", "full_attention")
# YaRN's keys as transformers reads them: these three required, the others with its defaults
YARN_KEYS = ("rope_type", "factor", "original_max_position_embeddings")
YARN_OPTIONAL = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate")


def check_layer_types(m: ModelConfig) -> None:
    """model.layer_types names each layer's attention, or none; rope_local_base_freq needs them."""
    if m.layer_types and (len(m.layer_types) != m.n_layers or set(m.layer_types) - set(LAYER_TYPES)):
        raise ConfigError(f"model.layer_types must name one of {', '.join(LAYER_TYPES)} for each of the n_layers="
                          f"{m.n_layers} layers, got {m.layer_types}; or leave it empty (every layer alike)")
    if m.rope_local_base_freq and not m.layer_types:
        raise ConfigError("model.rope_local_base_freq is the RoPE theta of model.layer_types' sliding_attention "
                          "layers, and layer_types is empty; set layer_types, or rope_local_base_freq=0")


def check_rope(m: ModelConfig) -> None:
    """RoPE rotates pairs of dims: an even number of them, at least one pair; the scaling whole."""
    check_layer_types(m)
    if m.pos != "rope":
        for key, does, unset in (("rope_scaling", "scales RoPE's frequencies", not m.rope_scaling),
                                 ("rope_local_base_freq", "sets local layers' RoPE", not m.rope_local_base_freq),
                                 ("partial_rotary_factor", "sets the dims RoPE rotates", m.partial_rotary_factor == 1)):
            if not unset:
                raise ConfigError(f"model.{key} {does}, and model.pos='learned' has none; remove it")
        return
    # latent attention rotates its qk_rope_head_dim alone (config/latent.py): its head_dim may be odd
    if m.partial_rotary_factor == 1 and m.head_dim % 2 and not m.latent_attention:
        raise ConfigError(f"RoPE needs an even head_dim, got {m.head_dim}; use a d_model that is a "
                          f"multiple of 2*n_heads = {2 * m.n_heads}, or model.pos='learned'")
    if m.rotary_dim % 2 or m.rotary_dim < 2:
        raise ConfigError(f"model.partial_rotary_factor={m.partial_rotary_factor:g} rotates int(head_dim * "
                          f"partial_rotary_factor) = {m.rotary_dim} dims of each head of {m.head_dim}; RoPE needs an "
                          f"even number, at least 2: choose a factor that makes it one")
    if not m.rope_scaling:
        return
    kind = m.rope_scaling.get("rope_type")
    if kind not in ("llama3", "longrope", "linear", "yarn") and "rope_type" in m.rope_scaling:
        raise ConfigError(f"model.rope_scaling.rope_type={kind!r}: tetrad has Llama 3.1's 'llama3', 'linear' (Gemma "
                          "3's), Phi-3's 'longrope' and 'yarn' (DeepSeek's, Qwen's) scaling only")
    if kind == "linear":
        _check_keys(m.rope_scaling, ("rope_type", "factor"))
        if not _number(m.rope_scaling["factor"]) or m.rope_scaling["factor"] <= 0:
            raise ConfigError(f"model.rope_scaling.factor must be a number above 0, got {m.rope_scaling['factor']!r}")
        return
    if kind == "yarn":
        _check_keys(m.rope_scaling, YARN_KEYS, YARN_OPTIONAL)
        _check_yarn(m.rope_scaling)
        return
    _check_keys(m.rope_scaling, LONGROPE_KEYS if kind == "longrope" else ROPE_SCALING_KEYS)
    (_check_longrope if kind == "longrope" else _check_llama3)(m)


def _check_keys(s: dict, keys: tuple[str, ...], optional: tuple[str, ...] = ()) -> None:
    missing, unknown = [k for k in keys if k not in s], [k for k in s if k not in keys + optional]
    if missing or unknown:
        may = f" (and may have {', '.join(optional)})" if optional else ""
        raise ConfigError(f"model.rope_scaling needs {'' if optional else 'exactly '}{', '.join(keys)}{may}"
                          + (f"; missing {', '.join(missing)}" if missing else "")
                          + (f"; unknown {', '.join(unknown)}" if unknown else ""))


def _check_llama3(m: ModelConfig) -> None:
    """Llama 3.1's scaling: its five keys with frequencies it can blend."""
    s = m.rope_scaling
    numbers = {k: s[k] for k in ROPE_SCALING_KEYS[1:]}
    if not all(_number(v) for v in numbers.values()):
        raise ConfigError(f"model.rope_scaling's {', '.join(numbers)} must be numbers, got {numbers}")
    if not (s["factor"] >= 1 and 0 <= s["low_freq_factor"] < s["high_freq_factor"]
            and s["original_max_position_embeddings"] > 0):
        raise ConfigError(f"model.rope_scaling needs factor >= 1, 0 <= low_freq_factor < high_freq_factor and "
                          f"original_max_position_embeddings > 0, got {numbers}")


def _check_yarn(s: dict) -> None:
    """YaRN: numbers that make a ramp (beta_fast > beta_slow > 0 turns), a context stretched, not
    shrunk (factor >= 1, as transformers asks), temperatures that are not negative."""
    numbers = {k: s[k] for k in YARN_KEYS[1:] + YARN_OPTIONAL[:-1] if k in s}
    if not all(_number(v) for v in numbers.values()):
        raise ConfigError(f"model.rope_scaling's {', '.join(numbers)} must be numbers, got {numbers}")
    if not isinstance(s.get("truncate", True), bool):
        raise ConfigError(f"model.rope_scaling.truncate must be true or false, got {s['truncate']!r}")
    fast, slow = s.get("beta_fast", 32), s.get("beta_slow", 1)
    if not (s["factor"] >= 1 and s["original_max_position_embeddings"] > 0 and fast > slow > 0
            and s.get("mscale", 0) >= 0 and s.get("mscale_all_dim", 0) >= 0 and s.get("attention_factor", 1) > 0):
        raise ConfigError(f"YaRN's model.rope_scaling needs factor >= 1, original_max_position_embeddings > 0, "
                          f"beta_fast > beta_slow > 0 (32 and 1 where not given), mscale and mscale_all_dim >= 0 and "
                          f"attention_factor > 0, got {numbers}")


def _check_longrope(m: ModelConfig) -> None:
    """LongRoPE: a positive factor for each rotated pair of dims in both lists, a positive length
    and cos/sin scale."""
    s = m.rope_scaling
    for key in ("original_max_position_embeddings", "attention_factor"):
        if not _number(s[key]) or s[key] <= 0:
            raise ConfigError(f"model.rope_scaling.{key} must be a number above 0, got {s[key]!r}")
    pairs = m.rotary_dim // 2
    for key in ("short_factor", "long_factor"):
        factors = s[key]
        if not isinstance(factors, list) or len(factors) != pairs or not all(_number(f) and f > 0 for f in factors):
            got = f"{len(factors)} of them" if isinstance(factors, list) else repr(factors)
            raise ConfigError(f"model.rope_scaling.{key} must list a number above 0 for each of the rotary_dim / 2 = "
                              f"{pairs} rotated pairs of a head (head_dim {m.head_dim} * partial_rotary_factor "
                              f"{m.partial_rotary_factor:g}), got {got}")


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)
