"""DeepSeek-V2 and DeepSeek-V3 in and out (train/hf_deepseek.py): tiny models built by
transformers (fp32, random weights; tests/test_moe_hf.py's write_hf_moe) import with
transformers' logits, read as a checkpoint and as the folder itself (init_from and generate's
reader: the RoPE rows de-interleaved as they are read), and export back to the Hub's tensors with
the same logits; V3 with a q latent, its expert groups and biases, interleaved RoPE or not, YaRN;
V2-Lite's full query projection and scaled softmax; V2's (V2.5's, Coder-V2's) group_limited_greedy
expert groups, scored by their best expert; a latent-attention model trained in tetrad exports with
its logits; what tetrad does not compute is refused in one line."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import tiny_config, train_layout
from test_moe_hf import TOKENS, TOL, hf_logits, tensor_names, write_hf_moe
from tetrad.cli import main
from tetrad.config import ConfigError, ModelConfig, load_config
from tetrad.model.rope import apply_rope
from tetrad.train.checkpoint.store import read_extras
from tetrad.train.convert import checkpoint_folder, read_weights
from tetrad.train.generate import single_process_model
from tetrad.train.hf_architectures import check_exportable, model_config_from_hf
from tetrad.train.hf_deepseek import DEFAULTS, rope_orders
from tetrad.train.init_from import stored_expert_biases, stored_weights

transformers = pytest.importorskip("transformers")

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 1024,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
CASES = {  # name -> (family, config keys)
    "v3": ("deepseek_v3", {}),
    "v3-yarn-top1-unnormalised-all-moe": ("deepseek_v3", {"rope_parameters": YARN, "num_experts_per_tok": 1,
                                                          "norm_topk_prob": False, "first_k_dense_replace": 0}),
    "v3-not-interleaved-no-q-latent": ("deepseek_v3", {"rope_interleave": False, "q_lora_rank": None, "n_group": 1,
                                                       "topk_group": 1}),
    "v2-lite": ("deepseek_v2", {}),
    "v2-q-latent-yarn": ("deepseek_v2", {"q_lora_rank": 16, "rope_parameters": YARN}),
    # DeepSeek-V2's, V2.5's and Coder-V2's routing (8 groups, 3 kept), at 4 groups of 2, 2 kept
    "v2-group-limited-greedy": ("deepseek_v2", {"n_routed_experts": 8, "num_experts_per_tok": 3,
                                                "topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2}),
}
ROUTER_KEYS = ("topk_method", "n_group", "topk_group")


@pytest.mark.parametrize("case", CASES)
def test_deepseek_imports_with_transformers_logits_and_exports_as_itself(tmp_path, case, capsys):
    family, shape = CASES[case]
    v3 = family == "deepseek_v3"
    write_hf_moe(tmp_path / "hf", family, **shape)
    assert main(["convert", str(tmp_path / "hf"), "--to-tetrad", str(tmp_path / "ckpt")]) == 0
    # save_pretrained writes V3's num_nextn_predict_layers=1 and no such layer (the Hub's import:
    # tests/test_mtp_hf.py): the model follows the weights, with a note (before: a lone MTP tensor left out)
    assert ("holds 0 of the num_nextn_predict_layers=1 multi-token-prediction layers" in capsys.readouterr().out) == v3
    cfg, state = read_weights(tmp_path / "ckpt")
    m = cfg.model
    assert m.mtp_layers == 0
    assert (m.kv_lora_rank, m.q_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.head_dim) == \
        (8, 16 if shape.get("q_lora_rank", 16 if v3 else None) else 0, 6, 4, 7, 10)
    assert (m.n_heads, m.n_kv_heads, m.ffn_hidden, m.expert_hidden, m.shared_expert_ffn_hidden) == \
        (4, 4, 40, 12, 12 if v3 else 24)
    assert m.router_score == ("sigmoid" if v3 else "softmax") and not m.shared_expert_gate
    assert m.dense_layers == ([] if shape.get("first_k_dense_replace") == 0 else [0])
    assert m.rope_scaling.get("rope_type") == shape.get("rope_parameters", {}).get("rope_type")
    grouped = shape.get("topk_method") == "group_limited_greedy"
    assert (m.expert_groups, m.expert_groups_per_token, m.expert_group_score_top) == \
        ((4, 2, 1) if grouped else (4, 2, 2) if v3 and shape.get("n_group") != 1 else (1, 1, 2))
    biases = read_extras(checkpoint_folder(tmp_path / "ckpt"), "expert_bias")
    assert bool(biases) == v3 and all(b.abs().max() > 0 for b in biases.values())
    theirs = hf_logits(tmp_path / "hf")
    got = single_process_model(m, state, biases=biases)(TOKENS, torch.arange(TOKENS.shape[1])).detach()
    torch.testing.assert_close(got, theirs, **TOL)
    assert theirs.abs().max() > 0.3  # a non-trivial comparison
    print(f"{case}: max |logit difference| {(got - theirs).abs().max():.2e}")
    if grouped:  # the groups scored by their best two instead route some token otherwise: far past TOL
        other = single_process_model(dataclasses.replace(m, expert_group_score_top=2), state)
        assert (other(TOKENS, torch.arange(TOKENS.shape[1])).detach() - theirs).abs().max() > 100 * TOL["atol"]
    from_folder = single_process_model(m, stored_weights(tmp_path / "hf"), biases=stored_expert_biases(tmp_path / "hf"))
    torch.testing.assert_close(from_folder(TOKENS, torch.arange(TOKENS.shape[1])).detach(), theirs, **TOL)

    assert main(["convert", str(tmp_path / "ckpt"), "--to-hf", str(tmp_path / "back")]) == 0
    exported = json.loads((tmp_path / "back" / "config.json").read_text())
    assert exported["model_type"] == family and exported.get("rope_interleave", True)  # the Hub's layout
    if grouped:
        assert [exported[k] for k in ROUTER_KEYS] == ["group_limited_greedy", 4, 2]
    assert tensor_names(tmp_path / "back") == tensor_names(tmp_path / "hf")
    original, back = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    rope_rows_moved = not shape.get("rope_interleave", True)  # written interleaved, read as they were not
    assert all(torch.equal(back[k], original[k]) for k in back if "kv_a_proj" not in k and "q_proj" not in k
               and "q_b_proj" not in k) and any(not torch.equal(back[k], original[k]) for k in back) == rope_rows_moved
    torch.testing.assert_close(hf_logits(tmp_path / "back"), theirs, **TOL)


def _attention_scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    return torch.einsum("bhsd,bhtd->bhst", q, k.expand_as(q))


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_rope_rows_read_de_interleaved_give_transformers_attention_scores(family):
    """tetrad's RoPE (pairs (i, i + r/2)) on the rows rope_orders reads equals DeepSeek's on
    interleaved pairs: V3's apply_rotary_pos_emb_interleave, V2's complex multiplication."""
    m = ModelConfig(n_heads=2, d_model=16, kv_lora_rank=4, qk_nope_head_dim=2, qk_rope_head_dim=6, q_lora_rank=0,
                    n_layers=1)
    orders = rope_orders(m, True)
    torch.manual_seed(0)
    wq, wkv, x = torch.randn(2 * 8, 16), torch.randn(4 + 6, 16), torch.randn(1, 5, 16)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, 6, 2).float() / 6)
    angles = torch.arange(5)[:, None].float() * inv_freq
    q_hf, k_hf = (x @ wq.T).view(1, 5, 2, 8)[..., 2:].transpose(1, 2), (x @ wkv.T)[..., 4:].view(1, 1, 5, 6)
    if family == "deepseek_v3":
        emb = torch.cat([angles, angles], dim=-1)
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave
        q_hf, k_hf = apply_rotary_pos_emb_interleave(q_hf, k_hf, emb.cos()[None], emb.sin()[None])
    else:
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import apply_rotary_emb
        q_hf, k_hf = apply_rotary_emb(q_hf, k_hf, torch.polar(torch.ones_like(angles), angles)[None])
    q = (x @ wq[orders["layers.0.attn.wq.weight"]].T).view(1, 5, 2, 8)[..., 2:]
    k = (x @ wkv[orders["layers.0.attn.wkv_a.weight"]].T)[..., 4:].view(1, 5, 1, 6)
    cos, sin = torch.cat([angles, angles], dim=-1).cos(), torch.cat([angles, angles], dim=-1).sin()
    sin = torch.cat([-sin[:, :3], sin[:, 3:]], dim=-1)  # rope_tables' signed sin
    q, k = apply_rope(q, cos[:, None], sin[:, None]).transpose(1, 2), apply_rope(k, cos[:, None], sin[:, None]).transpose(1, 2)
    torch.testing.assert_close(_attention_scores(q, k), _attention_scores(q_hf, k_hf), atol=1e-5, rtol=1e-5)
    # the same rows without the permutation rotate other pairs: the scores differ
    q_plain = apply_rope((x @ wq.T).view(1, 5, 2, 8)[..., 2:], cos[:, None], sin[:, None]).transpose(1, 2)
    k_plain = apply_rope((x @ wkv.T)[..., 4:].view(1, 5, 1, 6), cos[:, None], sin[:, None]).transpose(1, 2)
    assert (_attention_scores(q_plain, k_plain) - _attention_scores(q_hf, k_hf)).abs().max() > 1e-2


# at tetrad's default norm_eps (1e-5): the latent norms take transformers' 1e-6 whatever it is
MLA = {"kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 12, "n_kv_heads": 4}
V3_LAYERS = {**MLA, "q_lora_rank": 24, "n_experts": 8, "router_score": "sigmoid", "expert_ffn_hidden": 32,
             "shared_expert_ffn_hidden": 64, "dense_layers": [0], "expert_groups": 2, "expert_weight_scale": 2.0,
             "router_bias_update_rate": 0.01}
V2_LAYERS = {**MLA, "n_experts": 4, "expert_ffn_hidden": 32, "shared_expert_ffn_hidden": 32,
             "normalize_expert_weights": False, "expert_weight_scale": 1.5}
V2_GROUPED = {**V2_LAYERS, "n_experts": 8, "experts_per_token": 3, "expert_groups": 4, "expert_groups_per_token": 2,
              "expert_group_score_top": 1}


@pytest.mark.parametrize("model,topk_method", [(MLA, None), (V3_LAYERS, "noaux_tc"), (V2_LAYERS, "greedy"),
                                               (V2_GROUPED, "group_limited_greedy")])
def test_a_latent_attention_model_trained_in_tetrad_exports_with_its_logits(tmp_path, model, topk_method):
    """Sigmoid routing exports as DeepSeek-V3 (its moved expert biases the e_score_correction_bias),
    a softmax as V2 (groups scored by their best as its group_limited_greedy), no experts as V3
    with every layer dense."""
    cfg = tiny_config(model={"vocab_size": 256, **model}, train={"steps": 2}, checkpoint={"every": 2},
                      run={"dir": str(tmp_path / "run")})
    _, state, _ = train_layout(cfg)
    assert main(["convert", str(tmp_path / "run"), "--to-hf", str(tmp_path / "hf")]) == 0
    exported = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert exported["model_type"] == ("deepseek_v2" if "greedy" in str(topk_method) else "deepseek_v3")
    assert exported.get("topk_method") == topk_method
    biases = stored_expert_biases(tmp_path / "run")
    assert [bool(b.any()) for b in biases.values()] == [bool(model.get("router_bias_update_rate"))] * cfg.model.moe_layers
    with torch.no_grad():
        logits = single_process_model(cfg.model, state, biases=biases)(TOKENS, torch.arange(TOKENS.shape[1]))
    torch.testing.assert_close(hf_logits(tmp_path / "hf"), logits, **TOL)


V3_CONFIG = {"model_type": "deepseek_v3", "vocab_size": 256, "hidden_size": 32, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 40, "n_routed_experts": 8,
             "first_k_dense_replace": 1}
V2_CONFIG = {**V3_CONFIG, "model_type": "deepseek_v2", "num_experts_per_tok": 2}


@pytest.mark.parametrize("hf,named", [
    ({**V3_CONFIG, "attention_bias": True}, "'attention_bias': True"),
    ({**V3_CONFIG, "num_key_value_heads": 128}, "num_key_value_heads=128 with num_attention_heads=4"),
    ({**V3_CONFIG, "quantization_config": {"quant_method": "gptq", "bits": 4}}, "quantization_config quant_method 'gptq'"),
    ({**V3_CONFIG, "scoring_func": "softmax"}, "'scoring_func': 'softmax'.* is not deepseek_v3's router"),
    ({**V3_CONFIG, "n_shared_experts": 0}, "n_shared_experts=0"),
    ({**V3_CONFIG, "moe_layer_freq": 2}, "moe_layer_freq=2"),
    ({**V3_CONFIG, "aux_loss_alpha": 0.001, "seq_aux": False}, "seq_aux=false"),
    ({**V2_CONFIG, "topk_method": "group_limited_greedy", "n_group": None, "topk_group": 3},
     "group_limited_greedy' with n_group=None, topk_group=3: its expert groups need both"),
    ({**V2_CONFIG, "norm_topk_prob": True}, "norm_topk_prob=true"),
    ({**V2_CONFIG, "num_experts_per_tok": None}, "num_experts_per_tok=None"),
    ({**V2_CONFIG, "mlp_bias": True}, "'mlp_bias': True")])
def test_deepseek_variants_tetrad_lacks_are_refused_in_one_line(hf, named):
    with pytest.raises(ConfigError, match=named) as e:
        model_config_from_hf(hf, Path("config.json"))
    assert "\n" not in str(e.value)


def test_deepseek_config_keys_map_as_their_config_classes_say():
    """DEFAULTS are transformers' own; DeepSeek-V3's released keys (rope_scaling's older `type`,
    its router's names, aux_loss_alpha) map; V2's group_limited_greedy without a limit is greedy;
    V2's released group_limited_greedy (n_group 8, topk_group 3) is groups scored by their best;
    first_k_dense_replace past the layers is a dense model."""
    for family, config_class in (("deepseek_v2", "DeepseekV2Config"), ("deepseek_v3", "DeepseekV3Config")):
        defaults = getattr(transformers, config_class)()
        assert {key: getattr(defaults, key) for key in DEFAULTS[family]} == DEFAULTS[family]
    released = {**V3_CONFIG, "q_lora_rank": 1536, "scoring_func": "sigmoid", "topk_method": "noaux_tc", "seq_aux": True,
                "aux_loss_alpha": 0.001, "num_nextn_predict_layers": 1, "ep_size": 1, "moe_layer_freq": 1,
                "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                                 "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}}
    keys = model_config_from_hf(released, Path("config.json"))
    assert (keys["n_experts"], keys["experts_per_token"], keys["expert_groups"], keys["expert_groups_per_token"]) == (8, 8, 8, 4)
    assert (keys["router_aux_loss"], keys["rope_scaling"]["rope_type"], keys["rope_scaling"]["factor"]) == (0.001, "yarn", 40)
    assert (keys["head_dim"], keys["n_kv_heads"], keys["q_lora_rank"], keys["dense_layers"]) == (192, 4, 1536, [0])
    unlimited = model_config_from_hf({**V2_CONFIG, "topk_method": "group_limited_greedy", "n_group": 2, "topk_group": 2},
                                     Path("config.json"))
    assert (unlimited["expert_groups"], unlimited["router_score"], unlimited["normalize_expert_weights"]) == \
        (1, "softmax", False)
    v2 = model_config_from_hf({**V2_CONFIG, "n_routed_experts": 160, "num_experts_per_tok": 6,
                               "topk_method": "group_limited_greedy", "n_group": 8, "topk_group": 3}, Path("config.json"))
    assert (v2["expert_groups"], v2["expert_groups_per_token"], v2["expert_group_score_top"], v2["router_score"]) == \
        (8, 3, 1, "softmax")
    assert "expert_group_score_top" not in unlimited
    dense = model_config_from_hf({**V3_CONFIG, "first_k_dense_replace": 2}, Path("config.json"))
    assert (dense["n_experts"], dense["dense_layers"], dense["kv_lora_rank"]) == (0, [], 512)


@pytest.mark.parametrize("model,named", [
    ({**V2_LAYERS, "normalize_expert_weights": True}, "DeepseekV2ForCausalLM, .* never renormalises"),
    ({**V2_LAYERS, "expert_groups": 2}, "DeepseekV2ForCausalLM scores a softmax router's expert groups by their best "
                                        r"score; export a model with model.expert_group_score_top=1 \(it has 2\)"),
    ({**V3_LAYERS, "expert_group_score_top": 1}, "DeepseekV3ForCausalLM scores a sigmoid router's expert groups by the "
                                                 "sum of their best two scores"),
    ({**V3_LAYERS, "shared_expert_ffn_hidden": 0}, "DeepseekV3ForCausalLM has an ungated shared expert"),
    ({**V3_LAYERS, "dense_layers": [1]}, r"first first_k_dense_replace; model.dense_layers=\[1\]"),
    ({**MLA, "sliding_window": 8}, "DeepseekV3ForCausalLM has no sliding window"),
    ({**MLA, "sandwich_norm": True}, "DeepseekV3ForCausalLM has neither Gemma's sandwich norms"),
    ({**MLA, "scale_embeddings": True}, "DeepseekV3ForCausalLM has neither Gemma's .* scale_embeddings=True")])
def test_a_latent_attention_model_no_architecture_computes_is_refused_before_export(model, named):
    with pytest.raises(ConfigError, match=named) as e:
        check_exportable(load_config(overrides={"model": model}).model)
    assert "\n" not in str(e.value)
