"""Model numerics against an implementation nobody here wrote: HF transformers' LlamaForCausalLM
(and Qwen2ForCausalLM, Llama with q, k and v biases, and Qwen3ForCausalLM, Llama with qk-norm)."""

import pytest
import torch

from tetrad.config import load_config
from tetrad.model.llama import Transformer
from tetrad.model.sharding import init_parameters
from tetrad.dist.topology import Topology

transformers = pytest.importorskip("transformers")


def hf_model_from(model: Transformer, cfg) -> "transformers.LlamaForCausalLM | transformers.Qwen2ForCausalLM":
    """transformers' own model holding `model`'s weights: Qwen3's where the model has qk-norm,
    Qwen2's where it has q, k and v biases, else Llama's."""
    shape = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.ffn_hidden,
                 num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
                 head_dim=cfg.head_dim, max_position_embeddings=cfg.seq_len, rms_norm_eps=cfg.norm_eps,
                 rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_embeddings, attn_implementation="eager")
    if cfg.qk_norm:
        hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**shape, use_sliding_window=False)).eval()
    elif cfg.qkv_bias:
        hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**shape, use_sliding_window=False)).eval()
    else:
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape, attention_bias=False, mlp_bias=False)).eval()
    ours = dict(model.named_parameters())
    state = {"model.embed_tokens.weight": ours["embed.weight"], "model.norm.weight": ours["norm.weight"]}
    if not cfg.tie_embeddings:
        state["lm_head.weight"] = ours["head.weight"]
    names = {"attn.wq": "self_attn.q_proj", "attn.wk": "self_attn.k_proj", "attn.wv": "self_attn.v_proj",
             "attn.wo": "self_attn.o_proj", "mlp.w1": "mlp.gate_proj", "mlp.w3": "mlp.up_proj",
             "mlp.w2": "mlp.down_proj", "attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm",
             "attn.q_norm": "self_attn.q_norm", "attn.k_norm": "self_attn.k_norm"}
    for i in range(cfg.n_layers):
        for ours_name, hf_name in names.items():
            for leaf in ("weight", "bias"):
                if f"layers.{i}.{ours_name}.{leaf}" in ours:
                    state[f"model.layers.{i}.{hf_name}.{leaf}"] = ours[f"layers.{i}.{ours_name}.{leaf}"]
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in m or (cfg.tie_embeddings and m == "lm_head.weight") for m in missing)
    if cfg.tie_embeddings:
        hf.tie_weights()
    return hf


QWEN2, QWEN3 = {"qkv_bias": True}, {"qk_norm": True, "head_dim": 24}  # Qwen3: q and o 4 x 24 wide, not d_model


# {"head_dim": 24} alone: a Llama-architecture model with heads of its own width (Mistral NeMo's 128
# over d_model 5120), which transformers' LlamaConfig takes as head_dim.
@pytest.mark.parametrize("kv_heads,tied,variant", [(2, False, {}), (4, True, {}), (2, False, QWEN2), (2, True, QWEN2),
                                                   (2, False, QWEN3), (1, True, QWEN3), (2, False, {"head_dim": 24})])
def test_logits_match_hf_llama_and_qwen(kv_heads, tied, variant):
    cfg = load_config(overrides={"model": {"n_kv_heads": kv_heads, "tie_embeddings": tied, "n_layers": 2,
                                           "rope_theta": 10000.0, "seq_len": 32, **variant}}).model
    model = Transformer(cfg, Topology.single())
    init_parameters(model, seed=3)
    with torch.no_grad():  # biases start at 0 and norms at 1: give them values, so that a misplaced one shows
        for name, p in model.named_parameters():
            if name.endswith(".bias") or "norm" in name:
                p.normal_(float("norm" in name), 0.5, generator=torch.Generator().manual_seed(len(name)))
    hf = hf_model_from(model, cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(tokens, torch.arange(cfg.seq_len))
        theirs = hf(tokens).logits
    # fp32, same math in a different order: agreement to ~1e-6 relative; 1e-4 absolute is loose
    # enough for summation-order differences and tight enough to catch any real mismatch.
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    assert ours.abs().max() > 1e-3  # a non-trivial comparison


def hf_gpt2_from(model: Transformer, cfg) -> "transformers.GPT2LMHeadModel":
    """HF's GPT-2 holding tetrad's GPT-variant weights. GPT-2's Conv1D stores weights as
    [in, out] (ours [out, in]) and fuses q, k, v into c_attn; its linear biases, which tetrad's
    GPT variant has not, are zero; gelu_new is GELU's tanh form, the one tetrad uses."""
    hf_cfg = transformers.GPT2Config(
        vocab_size=cfg.vocab_size, n_positions=cfg.seq_len, n_embd=cfg.d_model, n_layer=cfg.n_layers,
        n_head=cfg.n_heads, n_inner=cfg.ffn_hidden, activation_function="gelu_new",
        layer_norm_epsilon=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager")
    hf = transformers.GPT2LMHeadModel(hf_cfg).eval()
    ours = {name: p.detach() for name, p in model.named_parameters()}
    state = {"transformer.wte.weight": ours["embed.weight"], "transformer.wpe.weight": ours["pos_embed"],
             "transformer.ln_f.weight": ours["norm.weight"], "transformer.ln_f.bias": ours["norm.bias"]}
    if not cfg.tie_embeddings:
        state["lm_head.weight"] = ours["head.weight"]
    for i in range(cfg.n_layers):
        layer, hf_layer = f"layers.{i}.", f"transformer.h.{i}."
        qkv = torch.cat([ours[layer + f"attn.{w}.weight"] for w in ("wq", "wk", "wv")])
        linears = {"attn.c_attn": qkv, "attn.c_proj": ours[layer + "attn.wo.weight"],
                   "mlp.c_fc": ours[layer + "mlp.w1.weight"], "mlp.c_proj": ours[layer + "mlp.w2.weight"]}
        for hf_name, weight in linears.items():
            state[hf_layer + hf_name + ".weight"] = weight.t()
            state[hf_layer + hf_name + ".bias"] = torch.zeros(weight.shape[0])
        for ours_name, hf_name in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
            for kind in ("weight", "bias"):
                state[hf_layer + f"{hf_name}.{kind}"] = ours[layer + f"{ours_name}.{kind}"]
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and all(cfg.tie_embeddings and m == "lm_head.weight" for m in missing), (missing, unexpected)
    if cfg.tie_embeddings:
        hf.tie_weights()
    return hf


@pytest.mark.parametrize("tied", [False, True])
def test_gpt_variant_logits_match_hf_gpt2(tied):
    cfg = load_config(overrides={"model": {"norm": "layernorm", "mlp": "gelu", "pos": "learned", "n_heads": 4,
                                           "n_kv_heads": 4, "tie_embeddings": tied, "n_layers": 2, "seq_len": 32}}).model
    model = Transformer(cfg, Topology.single())
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # O(1) activations (GELU's tanh form differs from erf's there) and norms
        for name, p in model.named_parameters():  # away from (1, 0), so every mapping error shows
            mean = 1.0 if "norm.weight" in name else 0.0
            p.normal_(mean, 0.2 if p.ndim == 1 else p.shape[-1] ** -0.5, generator=g)
    hf = hf_gpt2_from(model, cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(tokens, torch.arange(cfg.seq_len))
        theirs = hf(tokens).logits
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)  # fp32, as for Llama above
    assert ours.abs().max() > 1e-3  # a non-trivial comparison


def test_llama31_rope_frequencies_are_transformers_own():
    """Llama 3.1's RoPE scaling at its real sizes (head_dim 128, theta 500000, an 8192-token
    original context stretched 8x), against transformers' computation of the same frequencies."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from tetrad.model.rope import rope_frequencies
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    cfg = load_config(overrides={"model": {"preset": "llama3-8b", "rope_scaling": scaling}}).model
    hf_cfg = transformers.LlamaConfig(hidden_size=cfg.d_model, num_attention_heads=cfg.n_heads, rope_theta=cfg.rope_theta,
                                      rope_scaling=dict(scaling), max_position_embeddings=131072)
    theirs, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    ours = rope_frequencies(cfg, torch.device("cpu"))
    torch.testing.assert_close(ours, theirs.float(), rtol=1e-6, atol=0)
    assert attention_factor == 1.0  # llama3 scaling leaves the angles' cos/sin unscaled
    plain = rope_frequencies(load_config(overrides={"model": {"preset": "llama3-8b"}}).model, torch.device("cpu"))
    assert (ours < plain).sum() > 16 and (ours == plain).sum() > 16  # slowed and kept bands both exist


@pytest.mark.parametrize("model", [{}, {"n_experts": 4}, {"n_experts": 4, "router_score": "sigmoid"}])
def test_linear_rope_scaling_outside_gemma_3_is_refused_before_export(model):
    """hf_rope_scaling writes 'linear' in Gemma 3's keys alone: elsewhere the export would drop it."""
    from tetrad.config import ConfigError
    from tetrad.train.hf_architectures import check_exportable
    scaling = {"rope_type": "linear", "factor": 2.0}
    with pytest.raises(ConfigError, match="model.rope_scaling's 'linear' is Gemma 3's alone here"):
        check_exportable(load_config(overrides={"model": {**model, "rope_scaling": scaling}}).model)
