"""Mixtures of experts in and out (train/hf_moe.py): a MixtralForCausalLM, a Qwen2MoeForCausalLM
(a gated shared expert, q, k and v biases), a Qwen3MoeForCausalLM and a Glm4MoeForCausalLM (GLM-4.5: partial
RoPE, DeepSeek-V3's routing and expert biases, an ungated shared expert) built here by transformers (fp32, random weights, norms and routers given values), saved as the
Hub stores them (each expert's tensors apart), import with transformers' logits, export back to
the same tensors and logits, start a run under tp2 whose first loss is transformers' and whose
step is tp1's, each rank reading its part of each expert's tensors, and decode greedily as
transformers' full forward; a model trained in tetrad exports with its logits; the MoE variants
tetrad lacks are refused in one line."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from conftest import TINY, assert_parity, run_ranks, tiny_config, train_layout
from tetrad.cli import main
from tetrad.config import ConfigError, load_config
from tetrad.data.tokenizer import byte_tokenizer
from tetrad.model.sampling import GREEDY
from tetrad.train import init_from, trainer
from tetrad.train.batches import split_batches
from tetrad.train.checkpoint.store import read_extras
from tetrad.train.convert import checkpoint_folder, read_weights
from tetrad.train.generate import Cache, generate, load_generator, single_process_model
from tetrad.train.hf_architectures import check_exportable, model_config_from_hf
from tetrad.train.hf_moe import DEFAULTS, PARTIAL_ROTARY
from tetrad.train.init_from import check_init_from, stored_expert_biases, stored_weights
from tetrad.train.inputs import model_keys

transformers = pytest.importorskip("transformers")

TOKENS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
TOL = {"atol": 1e-5, "rtol": 1e-5}  # fp32, the same math in another order
SHAPE = {"vocab_size": 256, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 4096, "num_experts_per_tok": 2}
DEEPSEEK = {**SHAPE, "num_key_value_heads": 4, "intermediate_size": 40, "moe_intermediate_size": 12, "kv_lora_rank": 8,
            "qk_nope_head_dim": 6, "qk_rope_head_dim": 4, "v_head_dim": 7, "first_k_dense_replace": 1}
FAMILIES = {
    "mixtral": lambda **k: transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **{**SHAPE, "intermediate_size": 48, "num_local_experts": 4, **k})),
    "qwen3_moe": lambda **k: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **{**SHAPE, "intermediate_size": 40, "moe_intermediate_size": 24, "num_experts": 4, "head_dim": 12,
           "norm_topk_prob": True, **k})),
    "qwen2_moe": lambda **k: transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        **{**SHAPE, "intermediate_size": 40, "moe_intermediate_size": 24, "num_experts": 4,
           "shared_expert_intermediate_size": 36, **k})),
    "glm4_moe": lambda **k: transformers.Glm4MoeForCausalLM(transformers.Glm4MoeConfig(
        **{**SHAPE, "intermediate_size": 40, "moe_intermediate_size": 12, "n_routed_experts": 8, "head_dim": 12,
           "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5, "attention_bias": True, "use_qk_norm": True,
           **k})),
    # latent attention (tests/test_deepseek_hf.py): V3's q through a q_lora_rank-wide latent, V2's
    # a full projection (V2-Lite's), routed by a scaled softmax
    "deepseek_v3": lambda **k: transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        **{**DEEPSEEK, "n_routed_experts": 8, "q_lora_rank": 16, "n_group": 4, "topk_group": 2, **k})),
    "deepseek_v2": lambda **k: transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(
        **{**DEEPSEEK, "n_routed_experts": 4, "q_lora_rank": None, "routed_scaling_factor": 1.5, **k}))}


def write_hf_moe(folder: Path, family: str, **shape) -> None:
    """The family's model as save_pretrained writes it; norms near one, routers and the shared
    expert's gate at std 1 (HF's 0.02 leaves the router's top-k near ties, where a summation order
    could flip a choice), biases (HF's zeros; GLM-4.5's expert biases too) at std 0.1."""
    torch.manual_seed(0)
    hf = FAMILIES[family](**shape)
    hf.apply(hf._init_weights)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.5)
            elif name.endswith("gate.weight"):
                p.normal_(0.0, 1.0)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    hf.save_pretrained(folder, safe_serialization=True)


def hf_logits(hf_dir: Path, tokens: torch.Tensor = TOKENS) -> torch.Tensor:
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").eval()
    with torch.no_grad():
        return hf(tokens).logits


def ours(m, state) -> torch.Tensor:
    with torch.no_grad():
        return single_process_model(m, state)(TOKENS, torch.arange(TOKENS.shape[1]))


def tensor_names(folder: Path) -> set[str]:
    with safe_open(folder / "model.safetensors", "pt") as f:
        return set(f.keys())


ALL_SLIDE = {"use_sliding_window": True, "sliding_window": 5, "layer_types": ["sliding_attention"] * 3}
CASES = {  # name -> (family, config keys, the layers tetrad makes dense)
    "mixtral": ("mixtral", {}, []), "mixtral-window": ("mixtral", {"sliding_window": 5}, []),
    "qwen3_moe": ("qwen3_moe", {}, []),
    "qwen3_moe-window": ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 5}, []),
    "qwen3_moe-dense-unnormalised": ("qwen3_moe", {"mlp_only_layers": [1], "norm_topk_prob": False}, [1]),
    # Qwen3-30B-A3B's long-context YaRN, over an original 1024 (kept, blended, interpolated pairs of 6)
    "qwen3_moe-yarn": ("qwen3_moe", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                      "original_max_position_embeddings": 1024}}, []),
    "qwen2_moe": ("qwen2_moe", {}, []),  # norm_topk_prob false: Qwen2MoeConfig's default
    "qwen2_moe-mlp-only": ("qwen2_moe", {"mlp_only_layers": [0], "num_hidden_layers": 3}, [0]),
    "qwen2_moe-sparse-step-2": ("qwen2_moe", {"decoder_sparse_step": 2, "norm_topk_prob": True, "num_hidden_layers": 3,
                                              **ALL_SLIDE}, [0, 2]),
}


@pytest.mark.parametrize("case", CASES)
def test_an_hf_moe_imports_with_transformers_logits_and_exports_as_itself(tmp_path, case):
    family, shape, dense = CASES[case]
    write_hf_moe(tmp_path / "hf", family, **shape)
    assert main(["convert", str(tmp_path / "hf"), "--to-tetrad", str(tmp_path / "ckpt")]) == 0
    cfg, state = read_weights(tmp_path / "ckpt")
    m = cfg.model
    assert (m.n_experts, m.experts_per_token, m.expert_hidden, m.qk_norm) == \
        (4, 2, 48 if family == "mixtral" else 24, family == "qwen3_moe")
    assert m.sliding_window == shape.get("sliding_window", 0) and m.router_aux_loss == 0.001
    assert m.dense_layers == dense and m.normalize_expert_weights == shape.get("norm_topk_prob", family != "qwen2_moe")
    assert (m.shared_expert_ffn_hidden, m.shared_expert_gate, m.qkv_bias) == \
        ((36, True, True) if family == "qwen2_moe" else (0, False, False))
    theirs = hf_logits(tmp_path / "hf")
    got = ours(m, state)
    torch.testing.assert_close(got, theirs, **TOL)
    assert theirs.abs().max() > 0.3  # a non-trivial comparison
    print(f"{case}: max |logit difference| {(got - theirs).abs().max():.2e}")

    assert main(["convert", str(tmp_path / "ckpt"), "--to-hf", str(tmp_path / "back")]) == 0
    exported = json.loads((tmp_path / "back" / "config.json").read_text())
    assert exported["model_type"] == family
    assert tensor_names(tmp_path / "back") == tensor_names(tmp_path / "hf")  # the Hub's per-expert names
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", attn_implementation="eager")
    assert type(hf).__name__ == exported["architectures"][0]
    torch.testing.assert_close(hf_logits(tmp_path / "back"), theirs, **TOL)


QWEN2_MOE_LAYERS = {"shared_expert_ffn_hidden": 32, "shared_expert_gate": True, "qkv_bias": True, "dense_layers": [0],
                    "normalize_expert_weights": False}


GLM_LAYERS = {"router_score": "sigmoid", "n_experts": 8, "expert_ffn_hidden": 32, "shared_expert_ffn_hidden": 64,
              "dense_layers": [0], "expert_groups": 2, "expert_weight_scale": 2.0, "partial_rotary_factor": 0.5,
              "qk_norm": True, "router_bias_update_rate": 0.01}


@pytest.mark.parametrize("model", [{"expert_ffn_hidden": 48}, {"qk_norm": True, "head_dim": 24}, QWEN2_MOE_LAYERS,
                                   GLM_LAYERS])
def test_a_moe_trained_in_tetrad_exports_with_its_logits(tmp_path, model):
    """Mixtral's experts (no qk-norm) are intermediate_size wide, whatever ffn_hidden says;
    Qwen3-MoE's (qk-norm) moe_intermediate_size; a gated shared expert is Qwen2-MoE's, its dense
    layer intermediate_size wide; sigmoid routing is GLM-4.5's, the expert biases the training
    moved its e_score_correction_bias."""
    moe = {"n_experts": 4, "experts_per_token": 2, "vocab_size": 256, **model}
    cfg = tiny_config(model=moe, train={"steps": 2}, checkpoint={"every": 2}, run={"dir": str(tmp_path / "run")})
    _, state, _ = train_layout(cfg)
    assert main(["convert", str(tmp_path / "run"), "--to-hf", str(tmp_path / "hf")]) == 0
    exported = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert exported["model_type"] == ("glm4_moe" if model.get("router_score") else "qwen3_moe" if model.get("qk_norm")
                                      else "qwen2_moe" if model.get("shared_expert_gate") else "mixtral")
    biases = stored_expert_biases(tmp_path / "run")
    assert all(b.any() for b in biases.values()) == bool(model.get("router_bias_update_rate"))
    with torch.no_grad():
        logits = single_process_model(cfg.model, state, biases=biases)(TOKENS, torch.arange(TOKENS.shape[1]))
    torch.testing.assert_close(hf_logits(tmp_path / "hf"), logits, **TOL)


def config(tmp_path, name, steps=1, **sections):
    raw = {"train": {**TINY["train"], "steps": steps}, "run": {"dir": str(tmp_path / name)}, "model": {"seq_len": 32},
           **sections}
    return load_config(overrides=raw, model_from_inputs=model_keys)


@pytest.mark.dist
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "glm4_moe", "deepseek_v3", "deepseek_v2"])
def test_an_hf_moe_fine_tunes_from_its_folder_under_tp_as_on_one_process(tmp_path, family):
    """init_from the HF folder: the first loss is transformers' on the same batch, and tp2 with SP
    (every expert split by its rows and columns; DeepSeek's heads, each rank reading its heads'
    RoPE rows de-interleaved) takes the steps one process takes."""
    write_hf_moe(tmp_path / "hf", family)
    runs = []
    for parallel in ({}, {"tp": 2, "sequence_parallel": True}):
        cfg = config(tmp_path, f"run{len(runs)}", 2, parallel=parallel, checkpoint={"init_from": str(tmp_path / "hf")})
        assert cfg.model.n_experts == (8 if family in ("glm4_moe", "deepseek_v3") else 4)
        check_init_from(cfg)  # the folder's per-expert tensors fit config.json's model
        runs.append(train_layout(cfg))
    inputs, labels = split_batches(cfg)[0].global_batch_at(0)
    logits = hf_logits(tmp_path / "hf", inputs)
    assert runs[0][0][0] == pytest.approx(float(F.cross_entropy(logits.flatten(0, 1), labels.flatten())), rel=1e-5)
    # tp's bound (tests/test_tp.py): Adam's step moves a weight whose gradient is near zero by the
    # order of sums alone (1.1e-5 on a Mixtral expert's w3 here)
    assert_parity(runs[1], runs[0], atol=1e-4)


def _expert_reads(cfg) -> dict[str, int]:
    """The elements this rank reads of each HF tensor as its Trainer starts (in this forked rank alone)."""
    reads, part = {}, init_from.SafetensorsPart.__getitem__

    def counted(self, box):
        got = part(self, box)
        reads[self.key] = reads.get(self.key, 0) + got.numel()
        return got
    init_from.SafetensorsPart.__getitem__ = counted
    trainer.Trainer(cfg, torch.device("cpu"))
    return reads


@pytest.mark.dist
def test_each_tp_rank_reads_its_part_of_every_experts_tensors(tmp_path):
    write_hf_moe(tmp_path / "hf", "qwen3_moe", num_hidden_layers=1)
    cfg = config(tmp_path, "run", parallel={"tp": 2}, checkpoint={"init_from": str(tmp_path / "hf")})
    with safe_open(tmp_path / "hf" / "model.safetensors", "pt") as f:
        sizes = {k: torch.Size(f.get_slice(k).get_shape()).numel() for k in f.keys()}
    for reads in run_ranks(_expert_reads, 2, cfg):
        experts = {k: n for k, n in reads.items() if ".experts." in k}
        assert len(experts) == 4 * 3
        assert all(n == sizes[k] // 2 for k, n in experts.items()), experts
        assert reads["model.layers.0.mlp.gate.weight"] == sizes["model.layers.0.mlp.gate.weight"]  # replicated


GLM_VARIANTS = {"grouped": {}, "top1-unnormalised-all-moe": {"num_experts_per_tok": 1, "norm_topk_prob": False,
                                                             "first_k_dense_replace": 0, "n_group": 1, "topk_group": 1}}


@pytest.mark.parametrize("variant", GLM_VARIANTS)
def test_glm_4_5_imports_with_transformers_logits_and_exports_as_itself(tmp_path, variant, capsys):
    """GLM-4.5's keys, its e_score_correction_bias as the expert bias (the checkpoint's, the
    folder's read as init_from and generate read it), transformers' logits; the export writes the
    Hub's tensors back, biases included, with the same logits. save_pretrained writes
    num_nextn_predict_layers=1 and no such layer: the model follows the weights (mtp_layers 0),
    with a note (the Hub's multi-token-prediction layers import: tests/test_mtp_hf.py)."""
    write_hf_moe(tmp_path / "hf", "glm4_moe", **GLM_VARIANTS[variant])
    assert main(["convert", str(tmp_path / "hf"), "--to-tetrad", str(tmp_path / "ckpt")]) == 0
    assert "holds 0 of the num_nextn_predict_layers=1 multi-token-prediction layers" in capsys.readouterr().out
    cfg, state = read_weights(tmp_path / "ckpt")
    m, grouped = cfg.model, variant == "grouped"
    assert (m.router_score, m.expert_weight_scale, m.expert_groups, m.expert_groups_per_token) == \
        (("sigmoid", 2.5, 4, 2) if grouped else ("sigmoid", 2.5, 1, 1))
    assert (m.experts_per_token, m.normalize_expert_weights) == ((2, True) if grouped else (1, False))
    assert (m.partial_rotary_factor, m.qkv_bias, m.qk_norm, m.shared_expert_ffn_hidden, m.shared_expert_gate) == \
        (0.5, True, True, 12, False) and m.dense_layers == ([0] if grouped else [])
    biases = read_extras(checkpoint_folder(tmp_path / "ckpt"), "expert_bias")
    assert sorted(biases) == (["layers.1.mlp"] if grouped else ["layers.0.mlp", "layers.1.mlp"])
    theirs = hf_logits(tmp_path / "hf")
    torch.testing.assert_close(single_process_model(m, state, biases=biases)(TOKENS, torch.arange(24)), theirs, **TOL)
    from_folder = single_process_model(m, stored_weights(tmp_path / "hf"), biases=stored_expert_biases(tmp_path / "hf"))
    torch.testing.assert_close(from_folder(TOKENS, torch.arange(24)), theirs, **TOL)
    with torch.no_grad():  # the biases change the picks: without them the logits differ
        assert (single_process_model(m, state)(TOKENS, torch.arange(24)) - theirs).abs().max() > 1e-3

    assert main(["convert", str(tmp_path / "ckpt"), "--to-hf", str(tmp_path / "back")]) == 0
    assert tensor_names(tmp_path / "back") == tensor_names(tmp_path / "hf")
    assert "router_aux_loss_coef" not in json.loads((tmp_path / "back" / "config.json").read_text())  # not Glm4MoeConfig's
    torch.testing.assert_close(hf_logits(tmp_path / "back"), theirs, **TOL)


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v2"])
def test_an_hf_moe_decodes_from_its_folder_as_transformers_full_forward(tmp_path, family):
    write_hf_moe(tmp_path / "hf", family)
    byte_tokenizer().save(str(tmp_path / "hf" / "tokenizer.json"))
    net, _, _ = load_generator(tmp_path / "hf")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    tokens = list(range(100, 110))
    new, _ = generate(net, tokens, 8, GREEDY, cache=Cache())
    with torch.no_grad():
        for _ in range(8):
            tokens.append(int(theirs(torch.tensor([tokens])).logits[0, -1].argmax()))
    assert new == tokens[10:]


MIXTRAL = {"model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2, **SHAPE, "intermediate_size": 48}
QWEN2_MOE = {"model_type": "qwen2_moe", "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
             "shared_expert_intermediate_size": 32, **SHAPE, "intermediate_size": 48}


@pytest.mark.parametrize("hf,named", [
    ({**QWEN2_MOE, "shared_expert_intermediate_size": 0}, "shared_expert_intermediate_size=0"),
    ({**QWEN2_MOE, "decoder_sparse_step": 0}, "decoder_sparse_step=0 is no layer step"),
    ({**QWEN2_MOE, "use_sliding_window": True, "sliding_window": 5, "max_window_layers": 2},  # layer 0 of 2 slides
     r"sliding_window=5 applies to 1 of 2 layers"),
    ({**SHAPE, "model_type": "deepseek", "n_routed_experts": 8, "n_shared_experts": 2}, "deepseek is a mixture of experts"),
    ({**MIXTRAL, "model_type": "olmoe"}, "olmoe is a mixture of experts"),
    ({**SHAPE, "model_type": "glm4_moe", "n_routed_experts": 8, "n_shared_experts": 0}, "n_shared_experts=0"),
    ({**MIXTRAL, "router_jitter_noise": 0.1}, "router_jitter_noise=0.1")])
def test_moe_variants_tetrad_lacks_are_refused_in_one_line(hf, named):
    with pytest.raises(ConfigError, match=named) as e:
        model_config_from_hf(hf, Path("config.json"))
    assert "\n" not in str(e.value)


SHARED_EXPERT = {"shared_expert_ffn_hidden": 32, "shared_expert_gate": True}
GLM = {"router_score": "sigmoid", "expert_ffn_hidden": 32, "shared_expert_ffn_hidden": 64}


@pytest.mark.parametrize("model,named", [
    ({"mlp": "gelu"}, "swiglu experts"),
    ({"qkv_bias": True}, "biases on q, k and v is Qwen2-MoE's"),
    ({"shared_expert_ffn_hidden": 32}, "shared_expert_gate=true"),
    ({**SHARED_EXPERT, "qk_norm": True}, "Qwen2MoeForCausalLM .* has no qk-norm"),
    ({"normalize_expert_weights": False}, "MixtralForCausalLM renormalises"),
    ({"dense_layers": [0]}, "MixtralForCausalLM renormalises"),
    ({"expert_groups": 2, "expert_weight_scale": 2.0}, "softmax has model.expert_weight_scale=2.0, expert_groups=2"),
    ({"partial_rotary_factor": 0.5}, "GLM-4.5's, whose router scores by a sigmoid"),
    ({"router_score": "sigmoid"}, "Glm4MoeForCausalLM, .* has an ungated shared expert"),
    ({**GLM, "shared_expert_gate": True}, "Glm4MoeForCausalLM, .* has an ungated shared expert"),
    ({**GLM, "dense_layers": [1]}, r"dense layers are its first first_k_dense_replace; model.dense_layers=\[1\]"),
    ({**GLM, "expert_groups": 2, "expert_group_score_top": 1},
     "Glm4MoeForCausalLM scores a sigmoid router's expert groups by the sum of their best two")])
def test_a_moe_no_architecture_computes_is_refused_before_export(model, named):
    with pytest.raises(ConfigError, match=named) as e:
        check_exportable(load_config(overrides={"model": {"n_experts": 4, **model}}).model)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("model", [{}, {**SHARED_EXPERT, "qkv_bias": True, "normalize_expert_weights": False},
                                   {"qk_norm": True, "dense_layers": [0], "normalize_expert_weights": False},
                                   {**GLM, "qk_norm": True, "qkv_bias": True, "dense_layers": [1, 0], "expert_groups": 2,
                                    "partial_rotary_factor": 0.5}])
def test_a_moe_an_architecture_computes_exports(model):
    check_exportable(load_config(overrides={"model": {"n_experts": 4, **model}}).model)


@pytest.mark.parametrize("family,config_class", [("mixtral", "MixtralConfig"), ("qwen2_moe", "Qwen2MoeConfig"),
                                                 ("qwen3_moe", "Qwen3MoeConfig"), ("glm4_moe", "Glm4MoeConfig")])
def test_keys_a_config_json_leaves_out_are_the_config_classes_defaults(family, config_class):
    """hf_moe.DEFAULTS (and PARTIAL_ROTARY) are transformers' own; a Qwen2-MoE config.json without
    norm_topk_prob and qkv_bias imports unnormalised, with biases."""
    defaults = getattr(transformers, config_class)()
    assert {key: getattr(defaults, key) for key in DEFAULTS[family]} == DEFAULTS[family]
    if family == "glm4_moe":  # its RoPE on half of each head, in rope_parameters
        assert defaults.rope_parameters["partial_rotary_factor"] == PARTIAL_ROTARY[family]
    if family == "qwen2_moe":
        keys = model_config_from_hf(QWEN2_MOE, Path("config.json"))
        assert (keys["normalize_expert_weights"], keys["qkv_bias"], keys["shared_expert_gate"]) == (False, True, True)
