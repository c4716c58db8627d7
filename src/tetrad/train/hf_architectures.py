"""Hugging Face's causal-LM architectures as tetrad's one model, the one place that knows their
config.json keys and tensor names, both ways: Llama's math throughout, with a sliding window
(MistralForCausalLM), biases on q, k and v (Qwen2ForCausalLM), an RMSNorm over each head of q
and k (Qwen3ForCausalLM), or q, k and v in one tensor and gate and up in another
(Phi3ForCausalLM: Phi-3 mini and medium, phi-4; with LongRoPE, Phi-3 mini 128k and Phi-3.5 mini;
RoPE on 3/4 of each head too, phi-4-mini), Llama 3.1's or YaRN's RoPE scaling (the long-context
Qwen2.5 and Qwen3) elsewhere; Gemma's (GemmaForCausalLM, Gemma3ForCausalLM) config
keys are train/hf_gemma.py's; the mixtures of experts' (MixtralForCausalLM, Qwen2MoeForCausalLM,
Qwen3MoeForCausalLM, Glm4MoeForCausalLM, DeepseekV2ForCausalLM, DeepseekV3ForCausalLM)
train/hf_moe.py's, DeepSeek's latent attention train/hf_deepseek.py's.

A tetrad parameter is a run of rows of one HF tensor (hf_rows): all of it, or its part of a
fused one, so that import, init_from and export split and join Phi-3's tensors alike; an expert
parameter [E, ...] is E HF tensors, one per expert (hf_moe.split_experts: its pieces, each one's).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from tetrad.config import ConfigError
from tetrad.model.flops import hides_keys
from tetrad.train.hf_deepseek import (DEEPSEEK_TYPES, LATENT_NAMES, deepseek_architecture, deepseek_export_problem,
                                      deepseek_type, latent_keys)
from tetrad.train.hf_fp8 import fp8_block
from tetrad.train.hf_gemma import (GEMMA_TYPES, RENAMED, TEXT_TOWER, gemma3_rope, gemma_architecture, gemma_config,
                                   gemma_export_problem, gemma_keys, gemma_type)
from tetrad.train.hf_mtp import MTP_TYPES, layer_of
from tetrad.train.hf_moe import (PARTIAL_ROTARY, moe_architecture, moe_export_problem, moe_hf_name, moe_keys, moe_type,
                                  split_experts)

QWENS = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")  # a window only where use_sliding_window says so
# tetrad name inside layer i -> HF name inside model.layers.i
LAYER_NAMES = {"attn.wq": "self_attn.q_proj", "attn.wk": "self_attn.k_proj", "attn.wv": "self_attn.v_proj",
               "attn.wo": "self_attn.o_proj", "mlp.w1": "mlp.gate_proj", "mlp.w3": "mlp.up_proj",
               "mlp.w2": "mlp.down_proj", "attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm",
               "attn.q_norm": "self_attn.q_norm", "attn.k_norm": "self_attn.k_norm"}
TOP_NAMES = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "head.weight": "lm_head.weight"}
# model_type -> its fused tensors inside a layer -> the tetrad parameters stacked in its rows, in
# order (transformers' Phi3Attention slices qkv as [q; k; v], Phi3MLP chunks gate_up as [gate; up]).
FUSED = {"phi3": {"self_attn.qkv_proj": ("attn.wq", "attn.wk", "attn.wv"), "mlp.gate_up_proj": ("mlp.w1", "mlp.w3")}}
# model.hf_model_type -> config.json's architecture keys; no special token ids unless the tokenizer
# gives them (Phi3Config's defaults, bos 1 and eos and pad 32000, are Phi-3 mini's vocabulary's)
EXPORTED = {"phi3": {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "bos_token_id": None,
                     "eos_token_id": None, "pad_token_id": None, "attention_dropout": 0.0, "embd_pdrop": 0.0}}


def hf_name(name: str, model_type: str, n_layers: int) -> str:
    """The HF tensor that holds tetrad parameter `name` (a fused one's, for `model_type`'s) of a
    model of `n_layers` (a multi-token-prediction depth's are layer n_layers + k's: hf_mtp)."""
    tower = TEXT_TOWER.get(model_type, "")  # a multimodal model's text tower's prefix
    if name in TOP_NAMES:
        return tower + TOP_NAMES[name]
    index, rest = layer_of(name, n_layers)  # layers.I.attn.wq.weight: I, attn.wq.weight
    if name.startswith("mtp.") and ".block." not in name:  # a depth's own enorm, hnorm, eh_proj, norm
        return f"{tower}model.layers.{index}.{rest}"
    if moe_hf_name(rest, model_type):  # the router, an expert's piece
        return f"{tower}model.layers.{index}.{moe_hf_name(rest, model_type)}"
    module, _, leaf = rest.rpartition(".")
    fused = {part: tensor for tensor, parts in FUSED.get(model_type, {}).items() for part in parts}
    names = {**LAYER_NAMES, **LATENT_NAMES, **RENAMED.get(model_type, {})}
    return f"{tower}model.layers.{index}.{fused.get(module, names[module])}.{leaf}"


def hf_rows(shapes: dict[str, tuple[int, ...]], model_type: str, n_layers: int) -> dict[str, tuple[str, int, int]]:
    """tetrad parameter (by its logical shape) -> (the HF tensor holding it, its first row there,
    the row after its last): the whole tensor, or its part of a fused one; an expert parameter's
    pieces (split_experts) by their own names."""
    shapes = split_experts(shapes)
    order = {part: i for parts in FUSED.get(model_type, {}).values() for i, part in enumerate(parts)}
    rows, filled = {}, {}
    for name in sorted(shapes, key=lambda n: order.get(n.split(".", 2)[-1].rpartition(".")[0], 0)):
        key = hf_name(name, model_type, n_layers)
        start = filled.get(key, 0)
        filled[key] = start + shapes[name][0]
        rows[name] = (key, start, filled[key])
    return rows


def fused_rows(m, model_type: str) -> dict[str, tuple[str, int, int]]:
    """hf_rows of the parameters that `model_type`'s fused tensors stack, from the ModelConfig `m`
    alone: a rank of a running job cannot build a model on the meta device to learn shapes."""
    rows_of = {"attn.wq": m.n_heads * m.head_dim, "attn.wk": m.n_kv_heads * m.head_dim,
               "attn.wv": m.n_kv_heads * m.head_dim, "mlp.w1": m.ffn_hidden, "mlp.w3": m.ffn_hidden}
    return hf_rows({f"layers.{i}.{part}.weight": (rows_of[part],) for i in range(m.n_layers)
                    for parts in FUSED.get(model_type, {}).values() for part in parts}, model_type, m.n_layers)


def hf_tensor_shapes(shapes: dict[str, tuple[int, ...]], model_type: str, n_layers: int) -> dict[str, tuple[int, ...]]:
    """The shape of every HF tensor of a model of `n_layers` whose parameters have `shapes`."""
    found: dict[str, tuple[int, ...]] = {}
    shapes = split_experts(shapes)
    for name, (key, _, stop) in hf_rows(shapes, model_type, n_layers).items():
        if stop > found.get(key, (0,))[0]:
            found[key] = (stop, *shapes[name][1:])
    return found


def hf_tensors(state: dict[str, torch.Tensor], model_type: str, n_layers: int) -> dict[str, torch.Tensor]:
    """The HF tensors of tetrad's logical parameters `state` (of a model of `n_layers`): each
    one's, a fused one's parts joined."""
    state = split_experts(state)
    rows = hf_rows({name: tuple(p.shape) for name, p in state.items()}, model_type, n_layers)
    parts: dict[str, list[torch.Tensor]] = {}
    for name, (key, _, _) in sorted(rows.items(), key=lambda item: item[1][1]):
        parts.setdefault(key, []).append(state[name])
    return {key: torch.cat(tensors) if len(tensors) > 1 else tensors[0] for key, tensors in parts.items()}


def _phi3_only(m) -> list[str]:
    """What of model `m` Phi3ForCausalLM alone computes of the architectures here: LongRoPE, RoPE
    on part of each head (transformers' Llama, Mistral and Qwen rotate whole heads)."""
    return [name for name, used in (("LongRoPE (model.rope_scaling)", m.rope_scaling.get("rope_type") == "longrope"),
                                    ("model.partial_rotary_factor", m.partial_rotary_factor != 1)) if used]


def check_exportable(m) -> None:
    """Refuse a model no transformers architecture computes (one line, what to change)."""
    problem = deepseek_export_problem(m) if m.latent_attention else gemma_export_problem(m)
    if problem:
        raise ConfigError(problem)
    if m.rope_scaling.get("rope_type") == "linear" and m.norm != "gemma_rmsnorm":  # hf_rope_scaling would drop it
        raise ConfigError("model.rope_scaling's 'linear' is Gemma 3's alone here: tetrad imports and exports it for no "
                          "other architecture; export a model without it, or with Llama 3.1's 'llama3'")
    if m.latent_attention:
        return
    if m.n_experts and (m.norm == "gemma_rmsnorm" or moe_export_problem(m)):
        raise ConfigError(moe_export_problem(m) or "no transformers architecture has Gemma's norms with a mixture "
                          "of experts; export a model with model.norm='rmsnorm'")
    if m.n_experts:  # moe_export_problem's family computes it
        return
    if m.norm == "gemma_rmsnorm":
        return
    if (m.norm, m.mlp, m.pos) != ("rmsnorm", "swiglu", "rope"):
        raise ConfigError(f"LlamaForCausalLM has rmsnorm, swiglu and rope; this model has norm={m.norm!r}, "
                          f"mlp={m.mlp!r}, pos={m.pos!r}")
    lacks = [name for name, used in (("model.qk_norm", m.qk_norm), ("model.qkv_bias", m.qkv_bias),
                                     ("Llama 3.1's model.rope_scaling", m.rope_scaling.get("rope_type") == "llama3"),
                                     ("YaRN (model.rope_scaling)", m.rope_scaling.get("rope_type") == "yarn"))
             if used]
    if _phi3_only(m) and lacks:
        raise ConfigError(f"Phi3ForCausalLM, the one transformers architecture with {' and '.join(_phi3_only(m))}, "
                          f"has no {' or '.join(lacks)}; export a model without one or the other")
    if m.qk_norm and m.qkv_bias:
        raise ConfigError("no transformers model has qk-norm with biases on q, k and v alone (Qwen3's attention_bias "
                          "puts one on the output projection too); export a model with one of model.qk_norm and "
                          "model.qkv_bias")


def exported_type(m) -> str:
    """The model_type `--to-hf` writes model `m` as: model.hf_model_type's where that architecture
    computes `m` (Phi-3 has no qk-norm, no q, k and v biases and no Llama 3.1 scaling, which a
    fine-tune may have added), else "": the one hf_architecture picks from the model's features;
    Phi-3's for a model only it computes (_phi3_only), whatever model.hf_model_type says; DeepSeek's
    for latent attention."""
    if m.latent_attention:
        return deepseek_type(m)
    if m.norm == "gemma_rmsnorm":
        return gemma_type(m)
    if m.n_experts:
        return moe_type(m)
    if _phi3_only(m):
        return "phi3"
    if m.hf_model_type == "phi3" and (m.qk_norm or m.qkv_bias or m.rope_scaling):
        return ""
    return m.hf_model_type


def hf_architecture(m) -> dict:
    """config.json's architecture keys: Phi-3's where exported_type says so (an imported Phi-3's
    model.hf_model_type, kept), Qwen3's for qk-norm, Qwen2's for q, k and v biases (transformers' Llama
    would put one on the output projection too), else Llama's, or Mistral's (Llama's with a
    sliding window) where model.sliding_window hides keys within the context the export declares
    (context_length: a fine-tune at a seq_len within the window keeps it). Qwen2 and Qwen3 slide in
    every layer from max_window_layers = 0 on; Phi-3 and Mistral in every layer where sliding_window is set."""
    if exported_type(m) in GEMMA_TYPES:
        return gemma_architecture(m)
    if exported_type(m) in DEEPSEEK_TYPES:
        return deepseek_architecture(m)
    window = m.sliding_window if hides_keys(m.sliding_window, m.context_length) else None
    qwen = {"use_sliding_window": window is not None, "sliding_window": window, "max_window_layers": 0}
    if m.n_experts:
        return moe_architecture(m, window)
    if exported_type(m):
        # Phi3Config's LongRoPE reads the top-level original_max_position_embeddings, not the scaling's
        original = int(m.rope_scaling.get("original_max_position_embeddings", m.seq_len))
        return {**EXPORTED[exported_type(m)], "sliding_window": window, "resid_pdrop": m.dropout,
                "original_max_position_embeddings": original, "partial_rotary_factor": m.partial_rotary_factor}
    if m.qk_norm:
        return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False, **qwen}
    if m.qkv_bias:
        return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **qwen}
    if window is not None:
        return {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": window}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False, "mlp_bias": False}


def hf_rope_scaling(scaling: dict) -> dict:
    """config.json's `rope_scaling` for model.rope_scaling (Llama 3.1's, YaRN's, or LongRoPE's with
    its attention_factor, which transformers then takes as given), in the form every transformers reads."""
    if not scaling or scaling.get("rope_type") == "linear":  # Gemma 3's: hf_gemma.gemma_architecture's keys
        return {}
    return {"rope_scaling": {**scaling, "original_max_position_embeddings": int(scaling["original_max_position_embeddings"])}}


def _window_from_hf(hf: dict, kind: str, source: Path) -> int:
    """model.sliding_window of a config.json: Mistral's and Phi-3's `sliding_window` (null: none);
    Qwen2's and Qwen3's where `use_sliding_window` is true, which transformers applies to the
    layers from `max_window_layers` on (or as its `layer_types` list says): every layer or none,
    or refused (tetrad's window is the same in every layer); Qwen2-MoE's to the even layers below
    max_window_layers, unless its layer_types say otherwise; Qwen3-MoE's to every layer (transformers 5
    reads no max_window_layers there). 0 where it covers the whole context."""
    window = hf.get("sliding_window") if hf.get("use_sliding_window", kind not in QWENS) else None
    if window is None or window >= hf.get("max_position_embeddings", 2048):
        return 0
    if kind in ("qwen2", "qwen3", "qwen2_moe"):
        layers, below = hf["num_hidden_layers"], hf.get("max_window_layers", 28)
        slides = (lambda i: i % 2 == 0 and i < below) if kind == "qwen2_moe" else (lambda i: i >= below)
        types = hf.get("layer_types") or ["sliding_attention" if slides(i) else "full_attention" for i in range(layers)]
        sliding = sum(t == "sliding_attention" for t in types)
        if sliding == 0:
            return 0
        if sliding != layers:
            said = "its layer_types" if hf.get("layer_types") else f"max_window_layers={below}"
            alike = "layer_types all sliding or none" if kind == "qwen2_moe" else \
                "max_window_layers=0 (all) or >= num_hidden_layers (none)"
            raise ConfigError(f"{source}: sliding_window={window} applies to {sliding} of {layers} layers ({said}); "
                              f"tetrad's window is the same in every layer: only {alike} converts")
    return int(window)


def _rope_from_hf(hf: dict) -> tuple[float, dict, float]:
    """(rope_theta, model.rope_scaling, partial_rotary_factor) of a config.json: top-level
    `rope_theta` and `rope_scaling` (transformers 4; its older scaling key `type`), or
    `rope_parameters` (transformers 5 writes theta there, and no top-level key). ConfigError-worthy
    scaling comes back as-is: validation names what is wrong with it."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or params)
    theta = float(hf.get("rope_theta", params.get("rope_theta", scaling.get("rope_theta", 1e4))))
    partial = float(scaling.pop("partial_rotary_factor", hf.get("partial_rotary_factor",
                                                                 PARTIAL_ROTARY.get(hf.get("model_type"), 1.0))))
    scaling.pop("rope_theta", None)
    kind = scaling.pop("rope_type", scaling.pop("type", "default"))
    if hf.get("model_type") == "phi3" and kind in ("su", "yarn"):  # Phi3Config's older names of its LongRoPE
        kind = "longrope"
    return theta, {} if kind == "default" else {"rope_type": kind, **scaling}, partial


def _longrope(hf: dict, scaling: dict) -> dict:
    """model.rope_scaling of Phi-3's LongRoPE as transformers' Phi3 computes it: the original
    context is config.json's top-level original_max_position_embeddings (Phi3Config's 4096 where
    absent; it wins over the scaling's own), and attention_factor, where not given, is
    sqrt(1 + ln(factor) / ln(original)) (1 for factor <= 1), factor, where not given, being
    max_position_embeddings / original. Resolved here, once: a fine-tune's model.seq_len is not
    the max_position_embeddings it comes from, so the model keeps the number, not the rule.
    What does not compute comes back None: validation names it."""
    original = hf.get("original_max_position_embeddings", 4096)
    factor, attention = scaling.get("factor"), scaling.get("attention_factor")
    try:
        factor = hf.get("max_position_embeddings", 4096) / original if factor is None else factor
        if attention is None:
            attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    except (TypeError, ValueError, ZeroDivisionError):
        pass
    return {"rope_type": "longrope", "short_factor": scaling.get("short_factor"), "long_factor": scaling.get("long_factor"),
            "original_max_position_embeddings": original, "attention_factor": attention}


def _yarn(hf: dict, scaling: dict) -> dict:
    """model.rope_scaling of YaRN as transformers reads it: original_max_position_embeddings is
    config.json's top-level one where given (standardize_rope_params: it wins over the scaling's),
    else the scaling's, else max_position_embeddings; `factor`, where not given,
    max_position_embeddings / original; keys given as null are transformers' defaults, so left out
    (truncate's as transformers tests it: null is false).
    Resolved once, as _longrope's: the model keeps the numbers. What does not compute comes back
    as it is: validation names it."""
    kept = {k: bool(v) if k == "truncate" else v for k, v in scaling.items() if v is not None or k == "truncate"}
    longest = hf.get("max_position_embeddings", 2048)
    original = hf.get("original_max_position_embeddings", kept.get("original_max_position_embeddings", longest))
    factor = kept.get("factor")
    if factor is None and isinstance(original, (int, float)) and original > 0:
        factor = longest / original
    return {**kept, "factor": factor, "original_max_position_embeddings": original}


def _unsupported(hf: dict, kind: str, scaling: dict, partial: float) -> dict:
    """The config.json keys whose math tetrad's model lacks, with their values. Phi-3's only
    scaling is LongRoPE (its `su` and `yarn` too), Gemma 3's linear, the others' Llama 3.1's or
    YaRN; transformers' Phi-3
    and GLM-4.5 alone rotate part of each head; GLM-4.5's attention_bias is on q, k and v
    (model.qkv_bias), Llama's on the output projection too; dropout is training's alone
    (transformers 5's Phi-3 reads no embd_pdrop; resid_pdrop is model.dropout's place)."""
    unsupported = {k: hf[k] for k in ("attention_bias", "mlp_bias", "attention_dropout")
                   if hf.get(k) and (k, kind) != ("attention_bias", "glm4_moe")}
    if scaling and scaling.get("rope_type") not in {"phi3": ("longrope",), "gemma3_text": ("linear",)}.get(
            kind, ("llama3", "yarn")):
        long = any(isinstance(v, list) for v in scaling.values())  # LongRoPE's factor lists: named, not listed
        unsupported["rope_scaling"] = {"rope_type": scaling["rope_type"]} if long else scaling
    if partial != 1.0 and kind not in ("phi3", "glm4_moe"):  # RoPE on the first part of each head only
        unsupported["partial_rotary_factor"] = partial
    if hf.get("hidden_act", "silu") != "silu" and kind not in GEMMA_TYPES:  # gemma_config checks Gemma's
        unsupported["hidden_act"] = hf["hidden_act"]
    return unsupported


def model_config_from_hf(hf: dict, source: Path) -> dict:
    """[model] keys of an HF Llama (or Mistral, Qwen2, Qwen3, Phi-3, Mixtral, Qwen2-MoE, Qwen3-MoE, GLM-4.5,
    DeepSeek-V2 or DeepSeek-V3, their sliding windows included) config.json; refuse what tetrad's model cannot represent. Qwen2 is Llama with q, k
    and v biases, whatever its config says (it has no key for them); Qwen3 is Llama with qk-norm
    and, often, its own head_dim; Phi-3 is Llama with fused tensors, kept as hf_model_type, and
    maybe LongRoPE (_longrope) and RoPE on part of each head (model.partial_rotary_factor)."""
    kind, local_theta = hf.get("model_type"), 0.0
    if kind is not None and kind.startswith("gemma"):
        hf = gemma_config(hf, source)
        kind = hf["model_type"]  # a multimodal Gemma 3's text tower: gemma3_text
    if kind == "gemma3_text":
        theta, scaling, local_theta = gemma3_rope(hf, source)
        partial = 1.0
    else:
        theta, scaling, partial = _rope_from_hf(hf)
    experts = moe_keys(hf, kind, source)  # Mixtral's, the Qwens', GLM-4.5's, DeepSeek's; other mixtures refused
    unsupported = _unsupported(hf, kind, scaling, partial)
    fp8_block(hf, source)  # DeepSeek-V3's fp8 weights are dequantized as read; other quantizations refused
    if unsupported:
        raise ConfigError(f"{source}: tetrad's Llama has no {unsupported}")
    resolve = {"longrope": _longrope, "yarn": _yarn}.get(scaling.get("rope_type"))
    return {"n_layers": hf["num_hidden_layers"], "d_model": hf["hidden_size"], "n_heads": hf["num_attention_heads"],
            "n_kv_heads": hf.get("num_key_value_heads") or hf["num_attention_heads"],
            "ffn_hidden": hf["intermediate_size"], "vocab_size": hf["vocab_size"],
            "seq_len": hf.get("max_position_embeddings", 2048),
            "max_position_embeddings": hf.get("max_position_embeddings", 2048), "norm": "rmsnorm", "mlp": "swiglu", "pos": "rope",
            "tie_embeddings": bool(hf.get("tie_word_embeddings", False)), "qkv_bias": kind == "qwen2",
            "qk_norm": kind in ("qwen3", "qwen3_moe"), "sandwich_norm": False, "head_dim": hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
            "rope_theta": theta, "sliding_window": _window_from_hf(hf, kind, source),
            "rope_scaling": resolve(hf, scaling) if resolve else scaling,
            "partial_rotary_factor": partial, "norm_eps": float(hf.get("rms_norm_eps", 1e-5)),
            **experts, **(latent_keys(hf, kind) if kind in DEEPSEEK_TYPES else {}),
            "mtp_layers": int(hf.get("num_nextn_predict_layers") or 0) if kind in MTP_TYPES else 0,
            **({"hf_model_type": kind, "dropout": float(hf.get("resid_pdrop") or 0.0)} if kind in FUSED else {}),
            **(gemma_keys(hf, local_theta) if kind in GEMMA_TYPES else {})}
