"""Hugging Face's mixtures of experts, the part train/hf_architectures.py hands over:
MixtralForCausalLM (Mistral's attention, a sliding window or none, every layer's MLP Mixtral's
experts), Qwen3MoeForCausalLM (Qwen3's attention with qk-norm, top-k of moe_intermediate_size-wide
experts, renormalised or not, dense layers among them: mlp_only_layers, decoder_sparse_step),
Qwen2MoeForCausalLM (Qwen2's attention, biases on q, k and v; Qwen3-MoE's layers plus a shared
expert scaled by a sigmoid gate) and Glm4MoeForCausalLM (GLM-4.5: RoPE on part of each head,
optional q, k and v biases and qk-norm, its first first_k_dense_replace layers dense, DeepSeek-V3's
sigmoid routing with expert groups, a scale and e_score_correction_bias, tetrad's expert_bias,
and an ungated shared expert), and DeepSeek-V2's and V3's experts (GLM-4.5's, V2's routed by a
softmax; their latent attention is train/hf_deepseek.py's): their config.json keys both ways, their
tensor names, and what of the MoE families tetrad refuses (other families). GLM-4.5's and
DeepSeek-V3's multi-token-prediction layers (the Hub's model.layers.N... past num_hidden_layers)
are train/hf_mtp.py's; those past the depths a model keeps are left out (beyond_layers).

The Hub stores each expert's matrices separately (model.layers.i.block_sparse_moe.experts.j.w1.weight
[H, d], the Qwens' mlp.experts.j.gate_proj.weight; transformers 5 fuses them in memory but its
save_pretrained writes these names), where tetrad keeps one [E, H, d] tensor: an expert parameter
is E HF tensors stacked. `split_experts` names expert j's part of `layers.i.mlp.experts.w1`
`layers.i.mlp.experts.j.w1` (a piece; a depth's block's alike, mtp.k.block.mlp.experts.j.w1), which hf_name maps to the Hub's name, so that import,
init_from and export treat a piece as they treat a dense parameter.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from tetrad.config import ConfigError
from tetrad.model.flops import hides_keys
from tetrad.train.hf_deepseek import (DEEPSEEK_TYPES, DEFAULTS as DEEPSEEK_DEFAULTS, deepseek_moe_keys, deepseek_refusal,
                                      group_score_problem)
from tetrad.train.hf_mtp import MTP_TYPES, beyond, blocks

MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "glm4_moe", *DEEPSEEK_TYPES)
QWEN_MOE = ("qwen2_moe", "qwen3_moe")  # top-k renormalised or not, dense layers among the MoE ones
GATED = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}  # the Qwens' and GLM's MLP tensors
# model_type -> the MoE block's name in a layer, each expert's tensors by tetrad's name, the shared expert's module
BLOCK = {"mixtral": "block_sparse_moe", **dict.fromkeys(MOE_TYPES[1:], "mlp")}
EXPERT = {"mixtral": {"w1": "w1", "w3": "w3", "w2": "w2"}, **dict.fromkeys(MOE_TYPES[1:], GATED)}
SHARED = {"qwen2_moe": "mlp.shared_expert", **dict.fromkeys(("glm4_moe", *DEEPSEEK_TYPES), "mlp.shared_experts")}
CORRECTION_BIAS = "mlp.gate.e_score_correction_bias"  # GLM-4.5's and DeepSeek-V3's expert bias (a buffer) in a layer
BIASED = ("glm4_moe", "deepseek_v3")  # the families with one
BLOCK_PREFIX = r"(?:layers\.\d+|mtp\.\d+\.block)"  # a main layer's, a multi-token-prediction depth's block
EXPERT_PARAM = re.compile(rf"({BLOCK_PREFIX}\.mlp\.experts)\.(w[123])$")
EXPERT_PIECE = re.compile(r"mlp\.experts\.(\d+)\.(w[123])$")  # inside a layer
SHARED_PIECE = re.compile(r"mlp\.shared\.(w[123])\.weight$")  # inside a layer: Qwen2-MoE's shared expert
# MixtralConfig's, Qwen2MoeConfig's and Qwen3MoeConfig's defaults (transformers 5.25) for the keys a
# config.json may leave out
_QWEN = {"norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": [], "router_aux_loss_coef": 0.001}
DEFAULTS = {"mixtral": {"num_local_experts": 8, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.001},
            "qwen2_moe": {**_QWEN, "num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
                          "shared_expert_intermediate_size": 5632, "qkv_bias": True},
            "qwen3_moe": {**_QWEN, "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768},
            "glm4_moe": {"n_routed_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 1408,
                         "n_shared_experts": 1, "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1,
                         "first_k_dense_replace": 1, "norm_topk_prob": True, "use_qk_norm": False,
                         "attention_bias": False},
            **DEEPSEEK_DEFAULTS}
PARTIAL_ROTARY = {"glm4_moe": 0.5}  # Glm4MoeConfig's partial_rotary_factor where config.json gives none
# [model] keys of a model without a mixture of experts (or without what its family lacks)
DENSE = {"n_experts": 0, "expert_ffn_hidden": 0, "normalize_expert_weights": True, "shared_expert_ffn_hidden": 0,
         "shared_expert_gate": False, "dense_layers": [], "router_score": "softmax", "expert_weight_scale": 1.0,
         "expert_groups": 1, "expert_groups_per_token": 1}


def split_experts(tensors: dict) -> dict:
    """`tensors` (name -> a tensor, or a shape) with every expert parameter [E, ...] as its E
    pieces (layers.i.mlp.experts.j.w1 -> [...]): one HF tensor each."""
    split = {}
    for name, value in tensors.items():
        found = EXPERT_PARAM.match(name)
        if not found:
            split[name] = value
            continue
        experts, leaf = found.groups()
        # a tensor's pieces copied: safetensors writes no tensors that share memory
        pieces = [p.clone() for p in value.unbind(0)] if isinstance(value, torch.Tensor) else [tuple(value[1:])] * value[0]
        split.update({f"{experts}.{j}.{leaf}": piece for j, piece in enumerate(pieces)})
    return split


def expert_param(name: str) -> str:
    """The parameter piece `name` is part of (`name` itself where it is a parameter)."""
    return re.sub(rf"({BLOCK_PREFIX}\.mlp\.experts)\.\d+\.(w[123])$", r"\1.\2", name)


def expert_pieces(name: str, n_experts: int) -> list[str]:
    """The pieces of expert parameter `name` in order (none for another parameter)."""
    found = EXPERT_PARAM.match(name)
    if not found:
        return []
    experts, leaf = found.groups()
    return [f"{experts}.{j}.{leaf}" for j in range(n_experts)]


def stack_experts(pieces: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """split_experts undone: each expert parameter's pieces stacked in expert order."""
    whole, parts = {}, {}
    for name, value in pieces.items():
        found = re.match(rf"({BLOCK_PREFIX}\.mlp\.experts)\.(\d+)\.(w[123])$", name)
        if not found:
            whole[name] = value
            continue
        experts, expert, leaf = found.groups()
        parts.setdefault(f"{experts}.{leaf}", {})[int(expert)] = value
    return {**whole, **{name: torch.stack([got[j] for j in range(len(got))]) for name, got in parts.items()}}


def moe_hf_name(rest: str, model_type: str) -> str | None:
    """The HF name inside model.layers.i of `rest` (a layer's MoE tensor: mlp.router.weight, an
    expert's piece, Qwen2-MoE's shared expert and its gate), None for another tensor."""
    if model_type not in MOE_TYPES:
        return None
    if rest == "mlp.router.weight":
        return f"{BLOCK[model_type]}.gate.weight"
    if rest == "mlp.shared_gate.weight":
        return "mlp.shared_expert_gate.weight"
    shared = SHARED_PIECE.match(rest)
    if shared:
        return f"{SHARED[model_type]}.{GATED[shared.group(1)]}.weight"
    found = EXPERT_PIECE.match(rest)
    if not found:
        return None
    expert, leaf = found.groups()
    return f"{BLOCK[model_type]}.experts.{expert}.{EXPERT[model_type][leaf]}.weight"


def moe_refusal(hf: dict, kind: str) -> str | None:
    """Why tetrad cannot import the mixture of experts config.json `hf` describes, in a few
    words (None: a dense model, or one of MOE_TYPES tetrad computes)."""
    experts = hf.get("num_local_experts") or hf.get("num_experts") or hf.get("n_routed_experts")
    if (experts or hf.get("n_shared_experts")) and kind not in MOE_TYPES:
        return (f"{kind} is a mixture of experts ({experts} experts) tetrad does not map; it imports "
                "MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM, Glm4MoeForCausalLM, "
                "DeepseekV2ForCausalLM and DeepseekV3ForCausalLM")
    hf = {**DEFAULTS.get(kind, {}), **hf}
    if kind in DEEPSEEK_TYPES:
        return deepseek_refusal(hf, kind)
    if kind == "qwen2_moe" and not hf["shared_expert_intermediate_size"]:
        return ("shared_expert_intermediate_size=0 leaves Qwen2-MoE's shared expert and its gate weights of "
                "nothing; tetrad's model has no such gate without a shared expert")
    if kind == "glm4_moe" and not hf["n_shared_experts"]:
        return "n_shared_experts=0 leaves GLM-4.5's shared expert weights of nothing; tetrad maps one of 1 or more"
    if kind in QWEN_MOE and (not isinstance(hf["decoder_sparse_step"], int) or hf["decoder_sparse_step"] < 1):
        return f"decoder_sparse_step={hf['decoder_sparse_step']!r} is no layer step; a positive integer is"
    return None


def moe_keys(hf: dict, kind: str, source: Path) -> dict:
    """The [model] keys of a Mixtral's, Qwen2-MoE's or Qwen3-MoE's experts (DENSE's for another
    model): Mixtral's experts are intermediate_size wide (expert_ffn_hidden 0: ffn_hidden), the
    Qwens' moe_intermediate_size (their intermediate_size is their dense layers' width). A Qwen's
    layer i is dense where i is in mlp_only_layers or (i + 1) % decoder_sparse_step != 0 (as
    transformers builds it). Mixtral's router_jitter_noise (training's noise on the router's
    input) tetrad has not. A DeepSeek whose first_k_dense_replace covers every layer is dense."""
    problem = moe_refusal(hf, kind)
    if problem:
        raise ConfigError(f"{source}: {problem}")
    if kind not in MOE_TYPES:
        return dict(DENSE)
    if hf.get("router_jitter_noise"):
        raise ConfigError(f"{source}: router_jitter_noise={hf['router_jitter_noise']} (noise on the router's input "
                          "in training) is not tetrad's; set it to 0 to fine-tune without it")
    hf = {**DEFAULTS[kind], **hf}
    if kind in DEEPSEEK_TYPES and hf["first_k_dense_replace"] >= hf["num_hidden_layers"]:
        return dict(DENSE)
    experts = hf.get("num_local_experts") or hf.get("num_experts") or hf.get("n_routed_experts")
    # GLM-4.5 balances without an auxiliary loss: its config has no coefficient
    keys = {**DENSE, "n_experts": int(experts), "experts_per_token": int(hf["num_experts_per_tok"]),
            "router_aux_loss": float(hf.get("router_aux_loss_coef", 0.0))}
    if kind == "glm4_moe":
        return {**keys, **_glm_keys(hf)}
    if kind in DEEPSEEK_TYPES:
        return {**keys, **deepseek_moe_keys(hf, kind)}
    if kind not in QWEN_MOE:
        return keys
    dense = [i for i in range(hf["num_hidden_layers"])
             if i in (hf["mlp_only_layers"] or []) or (i + 1) % hf["decoder_sparse_step"]]
    keys.update(expert_ffn_hidden=int(hf["moe_intermediate_size"]), normalize_expert_weights=bool(hf["norm_topk_prob"]),
                dense_layers=dense)
    if kind == "qwen2_moe":
        keys.update(shared_expert_ffn_hidden=int(hf["shared_expert_intermediate_size"]), shared_expert_gate=True,
                    qkv_bias=bool(hf["qkv_bias"]))
    return keys


def _glm_keys(hf: dict) -> dict:
    """GLM-4.5's [model] keys beyond the experts' count and k (config.json with Glm4MoeConfig's
    defaults): its first first_k_dense_replace layers dense, n_shared_experts experts' width one
    shared expert without a gate, DeepSeek-V3's routing, its q, k and v biases and qk-norm."""
    width = int(hf["moe_intermediate_size"])
    return {"expert_ffn_hidden": width, "normalize_expert_weights": bool(hf["norm_topk_prob"]),
            "dense_layers": list(range(min(int(hf["first_k_dense_replace"]), hf["num_hidden_layers"]))),
            "shared_expert_ffn_hidden": int(hf["n_shared_experts"]) * width, "router_score": "sigmoid",
            "expert_weight_scale": float(hf["routed_scaling_factor"]), "expert_groups": int(hf["n_group"]),
            "expert_groups_per_token": int(hf["topk_group"]), "qkv_bias": bool(hf["attention_bias"]),
            "qk_norm": bool(hf["use_qk_norm"])}


def expert_bias_names(m, model_type: str) -> dict[str, str]:
    """The HF buffer holding each MoE layer's expert bias, by the layer's name (model/moe.py
    expert_biases': a depth's block's mtp.k.block.mlp is HF layer N + k's): GLM-4.5's and
    DeepSeek-V3's e_score_correction_bias; none in another family (they have none)."""
    if model_type not in BIASED:
        return {}
    return {f"{prefix}.mlp": f"model.layers.{index}.{CORRECTION_BIAS}" for prefix, index in blocks(m)
            if m.moe_layer(index)}


def beyond_layers(key: str, m, model_type: str) -> bool:
    """Whether HF tensor `key` is of GLM-4.5's or DeepSeek-V3's multi-token-prediction layers past
    the depths model `m` keeps (model.mtp_layers): left out, as transformers leaves them all."""
    return model_type in MTP_TYPES and beyond(key, m)


def moe_type(m) -> str:
    """The MoE architecture that computes model `m` (m.n_experts > 0): GLM-4.5's for sigmoid
    scores, Qwen2-MoE's with a shared expert, Qwen3-MoE's with qk-norm, else Mixtral's."""
    if m.router_score == "sigmoid":
        return "glm4_moe"
    if m.shared_expert_ffn_hidden:
        return "qwen2_moe"
    return "qwen3_moe" if m.qk_norm else "mixtral"


def moe_export_problem(m) -> str | None:
    """Why no MoE architecture computes model `m`, in one line (None: moe_type's does)."""
    if (m.norm, m.mlp, m.pos) != ("rmsnorm", "swiglu", "rope"):
        return (f"transformers' mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE, GLM-4.5) have rmsnorm, swiglu "
                f"experts and rope; this model has norm={m.norm!r}, mlp={m.mlp!r}, pos={m.pos!r}")
    if m.rope_scaling.get("rope_type") == "longrope":
        return "LongRoPE is Phi-3's; no transformers mixture of experts has it"
    if m.router_score == "sigmoid":
        return _glm_export_problem(m)
    if m.partial_rotary_factor != 1:
        return ("model.partial_rotary_factor is, among transformers' mixtures of experts, GLM-4.5's, whose router "
                "scores by a sigmoid; export a model with model.router_score='sigmoid', or without partial RoPE")
    if m.expert_weight_scale != 1 or m.expert_groups != 1:
        return (f"MixtralForCausalLM, Qwen2MoeForCausalLM and Qwen3MoeForCausalLM route by a softmax, unscaled and "
                f"ungrouped (Glm4MoeForCausalLM by a sigmoid); this model's softmax has model.expert_weight_scale="
                f"{m.expert_weight_scale}, expert_groups={m.expert_groups}")
    if m.shared_expert_ffn_hidden:
        if not m.shared_expert_gate:
            return ("Qwen2MoeForCausalLM, the one transformers mixture of experts with a shared expert here, scales it "
                    "by a sigmoid gate; export a model with model.shared_expert_gate=true")
        if m.qk_norm:
            return "Qwen2MoeForCausalLM (a shared expert) has no qk-norm; export a model without model.qk_norm"
        return None
    if m.qkv_bias:
        return ("a mixture of experts with biases on q, k and v is Qwen2-MoE's, which has a shared expert; export a "
                "model without model.qkv_bias, or with model.shared_expert_ffn_hidden and shared_expert_gate")
    if not m.qk_norm and (m.dense_layers or not m.normalize_expert_weights):
        return ("MixtralForCausalLM renormalises every layer's top-k weights; model.dense_layers and "
                "normalize_expert_weights=false export as Qwen3-MoE's (with model.qk_norm) or Qwen2-MoE's (with a "
                "gated shared expert)")
    return None


def _glm_export_problem(m) -> str | None:
    """Why Glm4MoeForCausalLM, the one transformers mixture of experts with sigmoid routing, does
    not compute model `m` (None: it does)."""
    width, shared = m.expert_hidden, m.shared_expert_ffn_hidden
    if not shared or shared % width or m.shared_expert_gate:
        return (f"Glm4MoeForCausalLM, the one transformers mixture of experts with sigmoid routing, has an ungated "
                f"shared expert n_shared_experts x moe_intermediate_size wide; export a model with "
                f"model.shared_expert_ffn_hidden a multiple of the experts' {width} (it is {shared}) and "
                f"shared_expert_gate=false")
    if sorted(m.dense_layers) != list(range(len(m.dense_layers))):
        return (f"Glm4MoeForCausalLM's dense layers are its first first_k_dense_replace; model.dense_layers="
                f"{m.dense_layers} are not layers 0..{len(m.dense_layers) - 1}")
    if hides_keys(m.sliding_window, m.context_length):
        return "Glm4MoeForCausalLM has no sliding window; export a model with model.sliding_window=0"
    return group_score_problem(m, "Glm4MoeForCausalLM")


def moe_architecture(m, window: int | None) -> dict:
    """config.json's architecture keys of MoE model `m` (moe_type's): Mixtral's (its experts'
    width is its intermediate_size; no dense layers, top-k renormalised), or a Qwen's (dense layers
    by mlp_only_layers, ffn_hidden wide: the exported intermediate_size; `window` in every layer
    where set: Qwen2-MoE's layer_types all sliding), or GLM-4.5's (its dense layers the first ones,
    ffn_hidden wide; no window; model.mtp_layers multi-token-prediction layers)."""
    common = {"num_experts_per_tok": m.experts_per_token, "output_router_logits": False}
    kind = moe_type(m)
    if kind == "glm4_moe":  # Glm4MoeConfig has no router_aux_loss_coef: GLM-4.5 balances by its biases
        return {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "n_routed_experts": m.n_experts,
                "moe_intermediate_size": m.expert_hidden,
                "n_shared_experts": m.shared_expert_ffn_hidden // m.expert_hidden,
                "norm_topk_prob": m.normalize_expert_weights, "routed_scaling_factor": m.expert_weight_scale,
                "n_group": m.expert_groups, "topk_group": m.expert_groups_per_token,
                "first_k_dense_replace": len(m.dense_layers), "use_qk_norm": m.qk_norm, "attention_bias": m.qkv_bias,
                "partial_rotary_factor": m.partial_rotary_factor, "num_nextn_predict_layers": m.mtp_layers, **common}
    common["router_aux_loss_coef"] = m.router_aux_loss
    if kind == "mixtral":
        return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": m.n_experts,
                "intermediate_size": m.expert_hidden, "sliding_window": window, "router_jitter_noise": 0.0,
                "bos_token_id": None, "eos_token_id": None, **common}
    qwen = {"num_experts": m.n_experts, "moe_intermediate_size": m.expert_hidden,
            "norm_topk_prob": m.normalize_expert_weights, "decoder_sparse_step": 1, "mlp_only_layers": sorted(m.dense_layers),
            "use_sliding_window": window is not None, "sliding_window": window, "max_window_layers": 0, **common}
    if kind == "qwen3_moe":
        return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False, **qwen}
    return {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", **qwen, "qkv_bias": m.qkv_bias,
            "shared_expert_intermediate_size": m.shared_expert_ffn_hidden,
            "layer_types": ["sliding_attention" if window else "full_attention"] * m.n_layers}
