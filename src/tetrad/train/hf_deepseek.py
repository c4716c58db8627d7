"""DeepSeek-V2 and DeepSeek-V3 in Hugging Face's format (DeepseekV2ForCausalLM,
DeepseekV3ForCausalLM), the part train/hf_moe.py and train/hf_architectures.py hand over: their
config.json keys both ways, their multi-head latent attention's tensor names, their RoPE rows'
order, and what of them tetrad refuses.

Both are tetrad's latent attention (kv_lora_rank > 0; a full query projection where q_lora_rank
is null: DeepSeek-V2-Lite) over the first first_k_dense_replace layers dense and the others a
mixture of experts with an ungated shared expert n_shared_experts x moe_intermediate_size wide.
V3 routes as GLM-4.5 (sigmoid scores, expert groups scored by their two best, a scale, its
e_score_correction_bias: tetrad's expert bias); V2 by a softmax top-k, scaled, never renormalised
(transformers' DeepseekV2TopkRouter reads no norm_topk_prob), its topk_method
'group_limited_greedy' (DeepSeek-V2, V2.5, Coder-V2: 8 groups, 3 kept) a token's experts from
the topk_group of n_group groups with the best single expert: tetrad's expert_group_score_top = 1,
written back as that topk_method.

RoPE's pairs: DeepSeek's checkpoints rotate interleaved pairs of a head's rope dims, (0, 1), (2,
3), ... (V2 always, by complex multiplication; V3 where rope_interleave is true, its config
class's default), tetrad the pairs (i, i + r/2) (Llama's rotate_half). The q and k rope rows of
wq / wq_b and wkv_a are read de-interleaved (evens, then odds: `rope_orders`) and written back
interleaved, so every head's q.k is the same sum in another order. The export writes V3's
rope_interleave true: the Hub's checkpoints' layout, which other readers of them assume too.
"""

from __future__ import annotations

import torch

from tetrad.model.flops import hides_keys
from tetrad.train.hf_mtp import blocks

DEEPSEEK_TYPES = ("deepseek_v2", "deepseek_v3")
# tetrad's latent attention inside a layer -> HF's (wq, wo: Llama's names, hf_architectures.LAYER_NAMES)
LATENT_NAMES = {"attn.wq_a": "self_attn.q_a_proj", "attn.q_a_norm": "self_attn.q_a_layernorm",
                "attn.wq_b": "self_attn.q_b_proj", "attn.wkv_a": "self_attn.kv_a_proj_with_mqa",
                "attn.kv_a_norm": "self_attn.kv_a_layernorm", "attn.wkv_b": "self_attn.kv_b_proj"}
_LATENT = {"kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
           "v_head_dim": 128, "attention_bias": False}
# DeepseekV2Config's and DeepseekV3Config's defaults (transformers 5.25) for the keys a config.json may leave out
DEFAULTS = {"deepseek_v2": {**_LATENT, "n_routed_experts": 64, "num_experts_per_tok": None, "moe_intermediate_size": 1407,
                            "n_shared_experts": 2, "routed_scaling_factor": 1.0, "n_group": None, "topk_group": None,
                            "topk_method": "greedy", "first_k_dense_replace": 0, "norm_topk_prob": False},
            "deepseek_v3": {**_LATENT, "n_routed_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 2048,
                            "n_shared_experts": 1, "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4,
                            "first_k_dense_replace": 3, "norm_topk_prob": True, "rope_interleave": True}}
# model_type -> what its router is, by DeepSeek's own config keys (transformers' classes read neither)
ROUTING = {"deepseek_v2": {"scoring_func": "softmax", "topk_method": "greedy"},
           "deepseek_v3": {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}}


def deepseek_refusal(hf: dict, kind: str) -> str | None:
    """Why tetrad cannot import the DeepSeek config.json `hf` (its config class's defaults
    filled in), in a few words; None where it can."""
    heads, kv_heads = hf["num_attention_heads"], hf.get("num_key_value_heads")
    if not hf["kv_lora_rank"]:
        return f"kv_lora_rank={hf['kv_lora_rank']!r}: DeepSeek's latent attention needs a latent of 1 or more"
    if kv_heads not in (None, heads):
        return (f"num_key_value_heads={kv_heads} with num_attention_heads={heads}: latent attention makes every head's "
                "keys and values; transformers' DeepSeek runs only num_key_value_heads = num_attention_heads")
    if hf["first_k_dense_replace"] >= hf["num_hidden_layers"]:
        return None  # every layer dense: no router to check
    said = {key: hf[key] for key in ROUTING[kind] if hf.get(key) not in (None, ROUTING[kind][key])}
    if kind == "deepseek_v2" and hf["topk_method"] == "group_limited_greedy":
        groups, kept = hf["n_group"], hf["topk_group"]
        if not (isinstance(groups, int) and isinstance(kept, int) and min(groups, kept) >= 1):
            return (f"topk_method='group_limited_greedy' with n_group={groups}, topk_group={kept}: its expert groups "
                    "need both, integers of 1 or more")
        said.pop("topk_method")
    if said:
        return f"{said} is not {kind}'s router; tetrad maps {ROUTING[kind]}"
    if kind == "deepseek_v2" and hf["norm_topk_prob"]:
        return ("norm_topk_prob=true: transformers' DeepseekV2 never renormalises the top-k weights, DeepSeek's own "
                "code does (and then leaves routed_scaling_factor out); the two models differ, and DeepSeek-V2's "
                "releases set false")
    if not hf["n_shared_experts"]:
        return f"n_shared_experts={hf['n_shared_experts']!r} leaves the shared expert's weights of nothing"
    if not hf["num_experts_per_tok"]:
        return f"num_experts_per_tok={hf['num_experts_per_tok']!r}: the router needs a k"
    if hf.get("moe_layer_freq", 1) != 1:
        return f"moe_layer_freq={hf['moe_layer_freq']}: transformers' DeepSeek makes every layer past the dense ones MoE"
    if hf.get("seq_aux") is False and hf.get("aux_loss_alpha"):
        return (f"seq_aux=false with aux_loss_alpha={hf['aux_loss_alpha']}: DeepSeek's balance loss over the batch; "
                "tetrad's is per sequence (seq_aux=true); set seq_aux true, or aux_loss_alpha 0")
    return None


def latent_keys(hf: dict, kind: str) -> dict:
    """The [model] keys of DeepSeek's multi-head latent attention (config.json, its config class's
    defaults where it leaves a key out): head_dim is the q/k width, nope + rope (config.json's
    head_dim is HF's RoPE width); every head its own keys and values."""
    hf = {**DEFAULTS[kind], **hf}
    nope, rope = int(hf["qk_nope_head_dim"]), int(hf["qk_rope_head_dim"])
    return {"kv_lora_rank": int(hf["kv_lora_rank"]), "q_lora_rank": int(hf["q_lora_rank"] or 0),
            "qk_nope_head_dim": nope, "qk_rope_head_dim": rope, "v_head_dim": int(hf["v_head_dim"]),
            "head_dim": nope + rope, "n_kv_heads": hf["num_attention_heads"]}


def deepseek_moe_keys(hf: dict, kind: str) -> dict:
    """The [model] keys of DeepSeek's experts (config.json with its config class's defaults),
    beyond their count and k; none where first_k_dense_replace leaves every layer dense.
    router_aux_loss: aux_loss_alpha, DeepSeek's per-sequence balance loss (seq_aux) as tetrad's;
    0 where absent (transformers' configs have none). V2's groups (group_limited_greedy) are
    scored by their best expert, and are none where a token keeps them all (topk_group >= n_group)."""
    width = int(hf["moe_intermediate_size"])
    v3 = kind == "deepseek_v3"
    v2_groups = not v3 and hf["topk_method"] == "group_limited_greedy" and hf["topk_group"] < hf["n_group"]
    return {"expert_ffn_hidden": width, "normalize_expert_weights": bool(hf["norm_topk_prob"]),
            "dense_layers": list(range(min(int(hf["first_k_dense_replace"]), hf["num_hidden_layers"]))),
            "shared_expert_ffn_hidden": int(hf["n_shared_experts"]) * width,
            "router_score": "sigmoid" if v3 else "softmax", "expert_weight_scale": float(hf["routed_scaling_factor"]),
            "expert_groups": int(hf["n_group"] or 1) if v3 or v2_groups else 1,
            "expert_groups_per_token": int(hf["topk_group"] or 1) if v3 or v2_groups else 1,
            **({"expert_group_score_top": 1} if v2_groups else {}),
            "router_aux_loss": float(hf.get("aux_loss_alpha") or 0.0)}


def rope_interleaved(hf: dict) -> bool:
    """Whether the config.json's checkpoint rotates interleaved pairs (module docstring)."""
    kind = hf.get("model_type")
    return kind == "deepseek_v2" or (kind == "deepseek_v3" and hf.get("rope_interleave", True) is not False)


def rope_orders(m, interleaved: bool) -> dict[str, torch.Tensor]:
    """tetrad parameter -> `order`, tetrad's row r being the HF tensor's row order[r]: the query
    and the shared key rope rows of latent-attention model `m`'s wq (wq_b) and wkv_a (its main
    layers' and its multi-token-prediction depths' blocks'), read de-interleaved; none where the
    checkpoint's pairs are tetrad's already."""
    if not (interleaved and m.latent_attention):
        return {}
    nope, rope, latent = m.qk_nope_head_dim, m.qk_rope_head_dim, m.kv_lora_rank
    pairs = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])
    head = torch.cat([torch.arange(nope), nope + pairs])
    query = torch.cat([h * (nope + rope) + head for h in range(m.n_heads)])
    key = torch.cat([torch.arange(latent), latent + pairs])
    q_name = "attn.wq_b" if m.q_lora_rank else "attn.wq"
    return {name: order for prefix, _ in blocks(m)
            for name, order in ((f"{prefix}.{q_name}.weight", query), (f"{prefix}.attn.wkv_a.weight", key))}


def deepseek_type(m) -> str:
    """The DeepSeek architecture that computes latent-attention model `m`: V2's for a softmax
    router, V3's for sigmoid scores or no experts (every layer dense)."""
    return "deepseek_v2" if m.n_experts and m.router_score == "softmax" else "deepseek_v3"


def deepseek_export_problem(m) -> str | None:
    """Why no DeepSeek architecture computes latent-attention model `m`, in one line (None: deepseek_type's does)."""
    name = "DeepseekV2ForCausalLM" if deepseek_type(m) == "deepseek_v2" else "DeepseekV3ForCausalLM"
    if (m.norm, m.mlp, m.pos) != ("rmsnorm", "swiglu", "rope") or m.qk_norm or m.qkv_bias:
        return (f"{name}, the one transformers architecture with latent attention, has rmsnorm, swiglu and rope, no "
                f"qk-norm and no biases; this model has norm={m.norm!r}, mlp={m.mlp!r}, pos={m.pos!r}, "
                f"qk_norm={m.qk_norm}, qkv_bias={m.qkv_bias}")
    if m.sandwich_norm or m.scale_embeddings:  # Gemma's, which no DeepSeek computes
        return (f"{name} has neither Gemma's sandwich norms nor its scaled embeddings; this model has "
                f"sandwich_norm={m.sandwich_norm}, scale_embeddings={m.scale_embeddings}")
    if hides_keys(m.sliding_window, m.context_length) or m.layer_types:
        return f"{name} has no sliding window or layer_types; export a model without them"
    if m.rope_scaling.get("rope_type") in ("longrope", "linear"):
        return f"{name} scales RoPE by Llama 3.1's or YaRN's rule; export a model without {m.rope_scaling['rope_type']!r}"
    if not m.n_experts:
        return None
    width, shared = m.expert_hidden, m.shared_expert_ffn_hidden
    if not shared or shared % width or m.shared_expert_gate:
        return (f"{name} has an ungated shared expert n_shared_experts x moe_intermediate_size wide; export a model "
                f"with model.shared_expert_ffn_hidden a multiple of the experts' {width} (it is {shared}) and "
                "shared_expert_gate=false")
    if sorted(m.dense_layers) != list(range(len(m.dense_layers))):
        return (f"{name}'s dense layers are its first first_k_dense_replace; model.dense_layers={m.dense_layers} are "
                f"not layers 0..{len(m.dense_layers) - 1}")
    if m.router_score == "softmax" and m.normalize_expert_weights:
        return ("DeepseekV2ForCausalLM, the latent-attention architecture with a softmax router, never renormalises "
                "the top-k weights; export a model with model.normalize_expert_weights=false, or "
                "model.router_score='sigmoid' (DeepSeek-V3's)")
    return group_score_problem(m, name)


def group_score_problem(m, name: str) -> str | None:
    """Why architecture `name` does not score MoE model `m`'s expert groups as `m` does, in one line
    (None: it does): a sigmoid router's (DeepSeek-V3's, GLM-4.5's) by their two best scores' sum, a
    softmax router's (DeepSeek-V2's group_limited_greedy) by their best."""
    want = 2 if m.router_score == "sigmoid" else 1
    if m.expert_groups == 1 or m.expert_group_score_top == want:
        return None
    by = "the sum of their best two scores" if want == 2 else "their best score"
    return (f"{name} scores a {m.router_score} router's expert groups by {by}; export a model with "
            f"model.expert_group_score_top={want} (it has {m.expert_group_score_top}), or expert_groups=1")


def deepseek_architecture(m) -> dict:
    """config.json's architecture keys of latent-attention model `m` (deepseek_type's), beside
    convert's common ones: head_dim as HF writes it (the RoPE width), DeepSeek's own router keys
    for readers other than transformers, V3's model.mtp_layers multi-token-prediction layers (V2
    has none: convert leaves them out); with no experts, V3's
    with every layer dense (first_k_dense_replace = num_hidden_layers + the depths)."""
    kind = deepseek_type(m)
    keys = {"architectures": ["DeepseekV2ForCausalLM" if kind == "deepseek_v2" else "DeepseekV3ForCausalLM"],
            "model_type": kind, "kv_lora_rank": m.kv_lora_rank, "q_lora_rank": m.q_lora_rank or None,
            "qk_nope_head_dim": m.qk_nope_head_dim, "qk_rope_head_dim": m.qk_rope_head_dim,
            "v_head_dim": m.v_head_dim, "head_dim": m.qk_rope_head_dim, "num_key_value_heads": m.n_heads,
            "attention_bias": False, "mlp_bias": False, "bos_token_id": None, "eos_token_id": None,
            **({"rope_interleave": True, "num_nextn_predict_layers": m.mtp_layers} if kind == "deepseek_v3" else {})}
    if not m.n_experts:
        return {**keys, "first_k_dense_replace": m.n_layers + m.mtp_layers}  # the depths' layers dense too
    return {**keys, "n_routed_experts": m.n_experts, "num_experts_per_tok": m.experts_per_token,
            "moe_intermediate_size": m.expert_hidden, "n_shared_experts": m.shared_expert_ffn_hidden // m.expert_hidden,
            "first_k_dense_replace": len(m.dense_layers), "moe_layer_freq": 1, "norm_topk_prob": m.normalize_expert_weights,
            "routed_scaling_factor": m.expert_weight_scale, "n_group": m.expert_groups,
            "topk_group": m.expert_groups_per_token, **_router_keys(m, kind), "aux_loss_alpha": m.router_aux_loss,
            "seq_aux": True, "output_router_logits": False}


def _router_keys(m, kind: str) -> dict:
    """DeepSeek's own scoring_func and topk_method of MoE model `m`: V2's group_limited_greedy
    where its softmax router limits each token's expert groups."""
    limited = kind == "deepseek_v2" and m.expert_groups > 1
    return {**ROUTING[kind], **({"topk_method": "group_limited_greedy"} if limited else {})}
