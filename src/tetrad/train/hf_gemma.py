"""Google's Gemma family in Hugging Face's format, the part train/hf_architectures.py hands over:
GemmaForCausalLM (Gemma 1) and Gemma3ForCausalLM (Gemma 3's text models, gemma-3-1b), their
config.json keys both ways and what of the family tetrad refuses; Gemma3ForConditionalGeneration's
text tower (the multimodal 4B+ checkpoints: its text_config, its tensors under "language_model."),
imported, and exported as a Gemma3ForCausalLM.

Both are Llama with Gemma's RMSNorm (fp32, times 1 + weight), GeGLU (gelu's tanh form), the
embedding times sqrt(hidden_size) and tied embeddings; Gemma 3 adds qk-norm, sandwich norms (HF's
post_attention_layernorm is the attention output's norm there, pre_feedforward_layernorm the MLP
input's), its own softmax scale (query_pre_attn_scalar) and per-layer attention: sliding layers
with their own RoPE theta (rope_local_base_freq), global ones with rope_theta and rope_scaling.
transformers' config classes fill keys a config.json leaves out (the multimodal checkpoints'
text_config lists few): DEFAULTS holds theirs (transformers 5.25).
"""

from __future__ import annotations

from pathlib import Path

from tetrad.config import ConfigError
from tetrad.model.flops import hides_keys

GEMMA_TYPES = ("gemma", "gemma3_text")
# model_type -> tetrad layer names whose HF tensor differs from Llama's (hf_architectures.LAYER_NAMES)
RENAMED = {"gemma3_text": {"mlp_norm": "pre_feedforward_layernorm", "attn_out_norm": "post_attention_layernorm",
                           "mlp_out_norm": "post_feedforward_layernorm"}}
RENAMED["gemma3"] = RENAMED["gemma3_text"]
# model_type -> the prefix of its text tower's tensors (the Hub's and transformers 5's save_pretrained's);
# its vision tower and projector are not read
TEXT_TOWER = {"gemma3": "language_model."}
# GemmaConfig's and Gemma3TextConfig's defaults for what tetrad reads
DEFAULTS = {
    "gemma": {"num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
              "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "rope_theta": 10000.0},
    "gemma3_text": {"vocab_size": 262208, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                    "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131072, "rms_norm_eps": 1e-6,
                    "tie_word_embeddings": True, "query_pre_attn_scalar": 256, "sliding_window": 4096,
                    "sliding_window_pattern": 6, "rope_theta": 1e6, "rope_local_base_freq": 10000.0}}
REFUSED = {
    "gemma2": "Gemma 2 (Gemma2ForCausalLM) caps its attention logits with tanh (attn_logit_softcapping), which "
              "tetrad's attention kernels do not; it is not importable",
    "gemma3n": "Gemma 3n (per-layer embeddings, AltUp) is not tetrad's model; it is not importable"}
TANH_GELU = ("gelu_pytorch_tanh", "gelu_new")


def gemma_config(hf: dict, source: Path) -> dict:
    """config.json of a Gemma model with its config class's defaults where keys are absent,
    refusing (one line) what tetrad does not compute: Gemma 2, the multimodal Gemma 3, softcapping,
    bidirectional attention, another activation."""
    kind = hf.get("model_type")
    if kind in REFUSED:
        raise ConfigError(f"{source}: {REFUSED[kind]}")
    if kind == "gemma3":  # the text tower's config; the embedding tied as the whole model says
        kind, hf = "gemma3_text", {**hf.get("text_config", {}), "model_type": "gemma3_text",
                                   "tie_word_embeddings": hf.get("tie_word_embeddings", True)}
    hf = {**DEFAULTS[kind], **hf}
    caps = {k: hf[k] for k in ("attn_logit_softcapping", "final_logit_softcapping") if hf.get(k) is not None}
    if caps:
        raise ConfigError(f"{source}: tetrad has no logit softcapping ({caps}); Gemma 3 sets neither")
    if hf.get("use_bidirectional_attention"):
        raise ConfigError(f"{source}: use_bidirectional_attention (an encoder's mask) is not a causal LM's; tetrad's "
                          "attention is causal")
    # GemmaConfig takes the "gelu" of Gemma 1's releases to mean its tanh form, as transformers does
    act = hf["hidden_act"] if kind == "gemma" else hf["hidden_activation"]
    if act not in TANH_GELU + (("gelu",) if kind == "gemma" else ()):
        raise ConfigError(f"{source}: tetrad's GeGLU takes gelu's tanh form (gelu_pytorch_tanh), not {act!r}")
    return hf


def gemma3_rope(hf: dict, source: Path) -> tuple[float, dict, float]:
    """(rope_theta, model.rope_scaling, rope_local_base_freq) of a Gemma 3 config.json: transformers 5's
    rope_parameters per layer type, or the older top-level rope_theta, rope_scaling and
    rope_local_base_freq. The scaling is the global layers' alone (linear: 4B and larger);
    sliding layers with one are refused."""
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params:
        full, local = dict(params["full_attention"] or {}), dict(params.get("sliding_attention") or {})
        theta, local_theta = full.pop("rope_theta", hf["rope_theta"]), local.pop("rope_theta", hf["rope_local_base_freq"])
    else:
        full, local = dict(hf.get("rope_scaling") or {}), {}
        theta, local_theta = hf["rope_theta"], hf["rope_local_base_freq"]
    kind, local_kind = full.pop("rope_type", full.pop("type", "default")), local.pop("rope_type", "default")
    if local_kind != "default":
        raise ConfigError(f"{source}: the sliding layers' RoPE scaling ({local_kind!r}) is not Gemma 3's; tetrad "
                          "scales the global layers' alone")
    if kind not in ("default", "linear"):
        raise ConfigError(f"{source}: Gemma 3's RoPE scaling is 'linear'; tetrad's Gemma has no {kind!r}")
    scaling = {"rope_type": "linear", "factor": full.get("factor")} if kind == "linear" else {}
    return float(theta), scaling, float(local_theta)


def gemma_keys(hf: dict, local_theta: float) -> dict:
    """The [model] keys that make tetrad's Llama a Gemma (hf: gemma_config's)."""
    keys = {"norm": "gemma_rmsnorm", "mlp": "geglu", "scale_embeddings": True}
    if hf["model_type"] == "gemma":
        return keys
    layers = hf["num_hidden_layers"]
    pattern = hf["sliding_window_pattern"]
    types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                      for i in range(layers)]
    window = hf["sliding_window"] or 0
    window = window if hides_keys(window, hf["max_position_embeddings"]) else 0
    return {**keys, "sandwich_norm": True, "qk_norm": True, "query_pre_attn_scalar": float(hf["query_pre_attn_scalar"]),
            "layer_types": list(types), "sliding_window": int(window), "rope_local_base_freq": local_theta}


def gemma_type(m) -> str:
    """The Gemma architecture that computes model `m` (its norm is Gemma's): Gemma 3's with sandwich norms."""
    return "gemma3_text" if m.sandwich_norm else "gemma"


def gemma_export_problem(m) -> str | None:
    """Why no Gemma architecture computes model `m`, in one line (None: one does)."""
    if m.norm != "gemma_rmsnorm":
        used = [k for k, on in (("sandwich_norm", m.sandwich_norm), ("scale_embeddings", m.scale_embeddings),
                                ("rope_local_base_freq", m.rope_local_base_freq),
                                ("query_pre_attn_scalar", m.query_pre_attn_scalar not in (0, m.head_dim)),
                                ("layer_types", any(m.window_of(i) != m.sliding_window for i in range(m.n_layers))))
                if on]
        return (f"model.{', model.'.join(used)} are Gemma's, whose norm is model.norm='gemma_rmsnorm'; export a model "
                "without them" if used else None)
    if (m.mlp, m.pos, m.scale_embeddings, m.qkv_bias) != ("geglu", "rope", True, False):
        return ("Gemma's architectures have mlp='geglu', pos='rope', scale_embeddings=true and no qkv_bias; this model "
                f"has mlp={m.mlp!r}, pos={m.pos!r}, scale_embeddings={m.scale_embeddings}, qkv_bias={m.qkv_bias}")
    if m.sandwich_norm != m.qk_norm:
        return "Gemma 3 has both model.sandwich_norm and model.qk_norm, Gemma 1 neither; set both alike"
    if not m.sandwich_norm and (m.layer_types or m.sliding_window or m.rope_local_base_freq or m.rope_scaling
                                or m.query_pre_attn_scalar not in (0, m.head_dim)):
        return ("GemmaForCausalLM (no sandwich norms) has no sliding window, layer_types, rope_local_base_freq, "
                "rope_scaling or query_pre_attn_scalar of its own; drop them, or make the model a Gemma 3")
    if m.partial_rotary_factor != 1:
        return "Gemma's architectures rotate every dim of a head; set model.partial_rotary_factor = 1"
    sliding = "sliding_attention" in m.layer_types if m.layer_types else bool(m.sliding_window)
    if m.rope_scaling and sliding and not m.rope_local_base_freq:  # transformers 4's rope_scaling: global layers'
        return ("Gemma 3 scales the global layers' RoPE alone, its sliding layers take model.rope_local_base_freq "
                "unscaled; set it, or drop model.rope_scaling")
    if m.rope_scaling.get("rope_type", "linear") != "linear":
        return f"Gemma's architectures scale RoPE linearly, not {m.rope_scaling.get('rope_type')!r}"
    return None


def _rope_parameters(m) -> dict:
    """transformers 5's rope_parameters per layer type: the global layers' theta and scaling, the
    sliding layers' own theta unscaled (rope_local_base_freq), or the same as the global ones."""
    full = {"rope_type": m.rope_scaling.get("rope_type", "default"), "rope_theta": m.rope_theta,
            **({"factor": m.rope_scaling["factor"]} if m.rope_scaling else {})}
    local = {"rope_type": "default", "rope_theta": m.rope_local_base_freq} if m.rope_local_base_freq else full
    return {"full_attention": full, "sliding_attention": dict(local)}


def gemma_architecture(m) -> dict:
    """config.json's architecture keys of a Gemma model: Gemma 1's, or Gemma 3's with every layer's
    type (a window covering the context where the model has none, so that HF's sliding layers
    keep their own RoPE and hide nothing), its RoPE per layer type both as transformers 5 writes it
    and as older versions read it, and no softcapping."""
    # no special token ids unless the tokenizer gives them (the config classes' defaults, pad 0, eos 1
    # and bos 2, are Gemma's vocabulary's), as for Phi-3
    common = {"hidden_act": "gelu_pytorch_tanh", "attention_bias": False, "bos_token_id": None, "eos_token_id": None,
              "pad_token_id": None}
    if gemma_type(m) == "gemma":
        return {"architectures": ["GemmaForCausalLM"], "model_type": "gemma", **common}
    window = m.sliding_window if hides_keys(m.sliding_window, m.context_length) else m.context_length
    types = m.layer_types or ["sliding_attention" if m.sliding_window else "full_attention"] * m.n_layers
    rope = _rope_parameters(m)
    return {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": _whole(m.query_pre_attn_scalar or m.head_dim), "sliding_window": window,
            "layer_types": types, "rope_parameters": rope, "rope_local_base_freq": rope["sliding_attention"]["rope_theta"],
            "rope_scaling": {"rope_type": "linear", "factor": m.rope_scaling["factor"]} if m.rope_scaling else None,
            "attn_logit_softcapping": None, "final_logit_softcapping": None, "use_bidirectional_attention": False,
            **common}


def _whole(x: float) -> int | float:
    """x as an int where it is one (Gemma3TextConfig types query_pre_attn_scalar int, strictly)."""
    return int(x) if float(x).is_integer() else x
