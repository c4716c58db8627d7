"""Hugging Face's mixtures of experts, the part train/hf_architectures.py hands over:
MixtralForCausalLM (Mistral's attention, a sliding window or none, every layer's MLP Mixtral's
experts) and Qwen3MoeForCausalLM (Qwen3's attention with qk-norm, every layer's MLP top-k of
moe_intermediate_size-wide experts, norm_topk_prob = true): their config.json keys both ways,
their tensor names, and what of the MoE families tetrad refuses (shared experts, dense layers
between MoE ones, unnormalised top-k weights).

The Hub stores each expert's matrices separately (model.layers.i.block_sparse_moe.experts.j.w1.weight
[H, d], Qwen3-MoE's mlp.experts.j.gate_proj.weight; transformers 5 fuses them in memory but its
save_pretrained writes these names), where tetrad keeps one [E, H, d] tensor: an expert parameter
is E HF tensors stacked. `split_experts` names expert j's part of `layers.i.mlp.experts.w1`
`layers.i.mlp.experts.j.w1` (a piece), which hf_name maps to the Hub's name, so that import,
init_from and export treat a piece as they treat a dense parameter.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from tetrad.config import ConfigError

MOE_TYPES = ("mixtral", "qwen3_moe")
# model_type -> the MoE block's name in a layer, and each expert's tensors by tetrad's name
BLOCK = {"mixtral": "block_sparse_moe", "qwen3_moe": "mlp"}
EXPERT = {"mixtral": {"w1": "w1", "w3": "w3", "w2": "w2"},
          "qwen3_moe": {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}}
EXPERT_PARAM = re.compile(r"layers\.(\d+)\.mlp\.experts\.(w[123])$")
EXPERT_PIECE = re.compile(r"mlp\.experts\.(\d+)\.(w[123])$")  # inside a layer
# config.json keys of the MoE families whose layers tetrad's MoE is not (their model_type, or the key)
# MixtralConfig's and Qwen3MoeConfig's defaults (transformers 5.25) for the keys a config.json may leave out
DEFAULTS = {"mixtral": {"num_local_experts": 8, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.001},
            "qwen3_moe": {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                          "router_aux_loss_coef": 0.001}}
SHARED = {"qwen2_moe": "Qwen2-MoE adds a shared expert to every layer (shared_expert_intermediate_size)",
          "deepseek_v2": "DeepSeek-V2 has shared experts and multi-head latent attention",
          "deepseek_v3": "DeepSeek-V3 has shared experts, multi-head latent attention and grouped routing"}


def split_experts(tensors: dict) -> dict:
    """`tensors` (name -> a tensor, or a shape) with every expert parameter [E, ...] as its E
    pieces (layers.i.mlp.experts.j.w1 -> [...]): one HF tensor each."""
    split = {}
    for name, value in tensors.items():
        found = EXPERT_PARAM.match(name)
        if not found:
            split[name] = value
            continue
        layer, leaf = found.groups()
        # a tensor's pieces copied: safetensors writes no tensors that share memory
        pieces = [p.clone() for p in value.unbind(0)] if isinstance(value, torch.Tensor) else [tuple(value[1:])] * value[0]
        split.update({f"layers.{layer}.mlp.experts.{j}.{leaf}": piece for j, piece in enumerate(pieces)})
    return split


def expert_param(name: str) -> str:
    """The parameter piece `name` is part of (`name` itself where it is a parameter)."""
    return re.sub(r"(layers\.\d+\.mlp\.experts)\.\d+\.(w[123])$", r"\1.\2", name)


def expert_pieces(name: str, n_experts: int) -> list[str]:
    """The pieces of expert parameter `name` in order (none for another parameter)."""
    found = EXPERT_PARAM.match(name)
    if not found:
        return []
    layer, leaf = found.groups()
    return [f"layers.{layer}.mlp.experts.{j}.{leaf}" for j in range(n_experts)]


def stack_experts(pieces: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """split_experts undone: each expert parameter's pieces stacked in expert order."""
    whole, parts = {}, {}
    for name, value in pieces.items():
        found = re.match(r"layers\.(\d+)\.mlp\.experts\.(\d+)\.(w[123])$", name)
        if not found:
            whole[name] = value
            continue
        layer, expert, leaf = found.groups()
        parts.setdefault(f"layers.{layer}.mlp.experts.{leaf}", {})[int(expert)] = value
    return {**whole, **{name: torch.stack([got[j] for j in range(len(got))]) for name, got in parts.items()}}


def moe_hf_name(rest: str, model_type: str) -> str | None:
    """The HF name inside model.layers.i of `rest` (a layer's MoE tensor: mlp.router.weight or an
    expert's piece), None for another tensor."""
    if model_type not in MOE_TYPES:
        return None
    if rest == "mlp.router.weight":
        return f"{BLOCK[model_type]}.gate.weight"
    found = EXPERT_PIECE.match(rest)
    if not found:
        return None
    expert, leaf = found.groups()
    return f"{BLOCK[model_type]}.experts.{expert}.{EXPERT[model_type][leaf]}.weight"


def moe_refusal(hf: dict, kind: str) -> str | None:
    """Why tetrad cannot import the mixture of experts config.json `hf` describes, in a few
    words (None: a dense model, or one of MOE_TYPES tetrad computes)."""
    if kind in SHARED or hf.get("n_shared_experts") or hf.get("shared_expert_intermediate_size"):
        why = SHARED.get(kind, f"{kind} has shared experts")
        return f"{why}; tetrad's mixture of experts has routed experts alone (Mixtral's, Qwen3-MoE's)"
    experts = hf.get("num_local_experts") or hf.get("num_experts") or hf.get("n_routed_experts")
    if experts and kind not in MOE_TYPES:
        return (f"{kind} is a mixture of experts ({experts} experts) tetrad does not map; it imports "
                "MixtralForCausalLM and Qwen3MoeForCausalLM")
    if kind != "qwen3_moe":
        return None
    if not hf.get("norm_topk_prob", False):
        return ("norm_topk_prob=false weights each token's experts by their softmax probabilities unnormalised; "
                "tetrad's router renormalises the top-k weights to sum to one (norm_topk_prob=true, Qwen3-MoE's releases)")
    if hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers"):
        return (f"dense layers mixed in (decoder_sparse_step={hf.get('decoder_sparse_step', 1)}, mlp_only_layers="
                f"{hf.get('mlp_only_layers')}); tetrad's mixture of experts is in every layer")
    return None


def moe_keys(hf: dict, kind: str, source: Path) -> dict:
    """The [model] keys of a Mixtral's or Qwen3-MoE's experts (n_experts 0 for another model):
    Mixtral's experts are intermediate_size wide (expert_ffn_hidden 0: ffn_hidden), Qwen3-MoE's
    moe_intermediate_size (its intermediate_size, its dense layers' width, kept for the export).
    Mixtral's router_jitter_noise (training's noise on the router's input) tetrad has not."""
    problem = moe_refusal(hf, kind)
    if problem:
        raise ConfigError(f"{source}: {problem}")
    if kind not in MOE_TYPES:
        return {"n_experts": 0, "expert_ffn_hidden": 0}
    if hf.get("router_jitter_noise"):
        raise ConfigError(f"{source}: router_jitter_noise={hf['router_jitter_noise']} (noise on the router's input "
                          "in training) is not tetrad's; set it to 0 to fine-tune without it")
    hf = {**DEFAULTS[kind], **hf}
    return {"n_experts": int(hf.get("num_local_experts") or hf.get("num_experts")),
            "experts_per_token": int(hf["num_experts_per_tok"]),
            "expert_ffn_hidden": int(hf["moe_intermediate_size"]) if kind == "qwen3_moe" else 0,
            "router_aux_loss": float(hf["router_aux_loss_coef"])}


def moe_type(m) -> str:
    """The MoE architecture that computes model `m` (m.n_experts > 0): Qwen3-MoE's with qk-norm."""
    return "qwen3_moe" if m.qk_norm else "mixtral"


def moe_export_problem(m) -> str | None:
    """Why neither MoE architecture computes model `m`, in one line (None: one does)."""
    if (m.norm, m.mlp, m.pos) != ("rmsnorm", "swiglu", "rope"):
        return (f"MixtralForCausalLM and Qwen3MoeForCausalLM have rmsnorm, swiglu experts and rope; this model has "
                f"norm={m.norm!r}, mlp={m.mlp!r}, pos={m.pos!r}")
    if m.qkv_bias:
        return ("no transformers mixture of experts has biases on q, k and v alone (Qwen2-MoE's shared experts are not "
                "tetrad's); export a model without model.qkv_bias")
    if m.rope_scaling.get("rope_type") == "longrope" or m.partial_rotary_factor != 1:
        return "LongRoPE and model.partial_rotary_factor are Phi-3's; MixtralForCausalLM and Qwen3MoeForCausalLM have neither"
    return None


def moe_architecture(m, window: int | None) -> dict:
    """config.json's architecture keys of MoE model `m`: Qwen3-MoE's for qk-norm (every layer MoE,
    top-k renormalised, `window` in every layer where set), else Mixtral's (its experts'
    width is its intermediate_size)."""
    common = {"num_experts_per_tok": m.experts_per_token, "router_aux_loss_coef": m.router_aux_loss,
              "output_router_logits": False}
    if moe_type(m) == "mixtral":
        return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": m.n_experts,
                "intermediate_size": m.expert_hidden, "sliding_window": window, "router_jitter_noise": 0.0,
                "bos_token_id": None, "eos_token_id": None, **common}
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": m.n_experts,
            "moe_intermediate_size": m.expert_hidden, "norm_topk_prob": True, "decoder_sparse_step": 1,
            "mlp_only_layers": [], "attention_bias": False, "use_sliding_window": window is not None,
            "sliding_window": window, "max_window_layers": 0, **common}
