"""YaRN RoPE scaling (rope_type "yarn": DeepSeek-V2/V3, the long-context Qwen2.5 and Qwen3,
gpt-oss): frequencies and cos/sin bit for bit transformers' own at the real models' sizes,
the softmax factor of latent attention as transformers' yarn_apply_mscale, refusals naming the
fix, and Qwen2 and Qwen3 folders with YaRN that convert to transformers' logits and export back."""

import json
from pathlib import Path

import pytest
import torch

from conftest import tiny_config, write_hf_qwen
from tetrad.cli import main
from tetrad.config import ConfigError, load_config
from tetrad.model.rope import attention_factor, rope_frequencies, rope_tables, yarn_softmax_factor

transformers = pytest.importorskip("transformers")

DEEPSEEK_V3 = {"rope_type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
               "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
QWEN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
# (head_dim, rope_theta, partial_rotary_factor, rope_scaling)
CASES = {"deepseek-v3": (64, 1e4, 1.0, DEEPSEEK_V3),  # its qk_rope_head_dim, the rotated dims
         "qwen": (128, 1e6, 1.0, QWEN),
         "gpt-oss": (64, 1.5e5, 1.0, {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                                      "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}),
         "attention-factor-partial": (128, 1e4, 0.5, {**QWEN, "original_max_position_embeddings": 2048,
                                                      "attention_factor": 0.8, "beta_fast": 16, "beta_slow": 2}),
         "mscales": (64, 1e4, 1.0, {**DEEPSEEK_V3, "mscale": 1.0, "mscale_all_dim": 0.5})}


def model_and_hf(case: str):
    """tetrad's [model] and transformers' LlamaConfig of one CASES entry."""
    head_dim, theta, partial, scaling = CASES[case]
    model = load_config(overrides={"model": {
        "d_model": 2 * head_dim, "n_heads": 2, "n_kv_heads": 2, "head_dim": head_dim, "rope_theta": theta,
        "partial_rotary_factor": partial, "rope_scaling": dict(scaling)}}, runtime=False).model
    longest = int(scaling["original_max_position_embeddings"] * scaling["factor"])
    hf = transformers.LlamaConfig(hidden_size=2 * head_dim, num_attention_heads=2, head_dim=head_dim, rope_theta=theta,
                                  partial_rotary_factor=partial, rope_scaling=dict(scaling),
                                  max_position_embeddings=longest)
    return model, hf


@pytest.mark.parametrize("case", sorted(CASES))
def test_yarn_frequencies_and_tables_are_transformers_own(case):
    """The frequencies are transformers' ROPE_INIT_FUNCTIONS["yarn"]'s bit for bit (its order of
    operations in fp32), with kept and interpolated pairs both; cos and sin are its rotary
    embedding's, times the same attention factor (given, or inferred from factor and mscales)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    model, hf = model_and_hf(case)
    theirs, factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    ours = rope_frequencies(model, torch.device("cpu"))
    assert torch.equal(ours, theirs) and attention_factor(model) == factor
    plain = 1.0 / model.rope_theta ** (torch.arange(0, model.rotary_dim, 2, dtype=torch.float32) / model.rotary_dim)
    assert (ours == plain).sum() >= 2  # kept pairs, and interpolated ones:
    torch.testing.assert_close(ours[-2:], plain[-2:] / model.rope_scaling["factor"], rtol=1e-6, atol=0)
    positions = torch.arange(300)
    cos, sin = LlamaRotaryEmbedding(hf)(torch.zeros(1, 300, model.head_dim), positions[None])
    our_cos, our_sin = rope_tables(positions, model, ours)
    half = model.rotary_dim // 2
    assert torch.equal(our_cos[:, :, 0], cos) and torch.equal(our_sin[:, :, 0], torch.cat([-sin[..., :half],
                                                                                             sin[..., half:]], -1))


def test_a_local_layers_rope_is_unscaled_under_yarn():
    """Gemma 3's form: the sliding layers' own theta, neither YaRN's frequencies nor its factor."""
    model = tiny_config(model={"rope_scaling": dict(QWEN), "layer_types": ["sliding_attention", "full_attention"],
                               "rope_local_base_freq": 100.0, "sliding_window": 8}).model
    local = rope_frequencies(model, torch.device("cpu"), local=True)
    assert torch.equal(local, 1.0 / 100.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))  # head_dim 16
    cos, _ = rope_tables(torch.arange(4), model, local, local=True)
    assert cos[0, 0, 0, 0] == 1.0 and attention_factor(model) > 1.1


def test_the_softmax_factor_is_transformers_yarn_apply_mscale():
    """DeepSeek's multi-head latent attention's softmax scale times mscale(factor, mscale_all_dim)^2
    (V3's factor 40: 1.8738), as transformers' yarn_apply_mscale; 1 without mscale_all_dim or YaRN."""
    from transformers.modeling_rope_utils import yarn_apply_mscale
    for case in CASES:
        model, hf = model_and_hf(case)
        assert yarn_softmax_factor(model) == pytest.approx(yarn_apply_mscale(hf.rope_parameters, 1.0), rel=1e-15), case
    assert yarn_softmax_factor(model_and_hf("deepseek-v3")[0]) == pytest.approx((0.1 * torch.tensor(40.0).log().item()
                                                                                  + 1) ** 2)
    assert yarn_softmax_factor(model_and_hf("qwen")[0]) == 1.0
    assert yarn_softmax_factor(tiny_config(model={"rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}}).model) == 1.0


REFUSALS = [
    ({"rope_type": "yarn", "factor": 4.0},
     "model.rope_scaling needs rope_type, factor, original_max_position_embeddings "
     "(and may have beta_fast, beta_slow, mscale, mscale_all_dim, attention_factor, truncate); missing "
     "original_max_position_embeddings"),
    ({**QWEN, "low_freq_factor": 1.0}, "; unknown low_freq_factor"),
    ({**QWEN, "factor": 0.5}, "YaRN's model.rope_scaling needs factor >= 1, original_max_position_embeddings > 0, "
     "beta_fast > beta_slow > 0 (32 and 1 where not given)"),
    ({**QWEN, "original_max_position_embeddings": 0}, "YaRN's model.rope_scaling needs factor >= 1"),
    ({**QWEN, "beta_fast": 1, "beta_slow": 32}, "got {'factor': 4.0, 'original_max_position_embeddings': 32768.0, "
     "'beta_fast': 1.0, 'beta_slow': 32.0}"),
    ({**QWEN, "beta_slow": 64}, "beta_fast > beta_slow > 0 (32 and 1 where not given)"),
    ({**QWEN, "attention_factor": 0}, "attention_factor > 0"),
    ({**QWEN, "mscale": -1}, "mscale and mscale_all_dim >= 0"),
    ({**QWEN, "mscale_all_dim": "one"}, "model.rope_scaling's factor, original_max_position_embeddings, "
     "mscale_all_dim must be numbers, got"),
    ({**QWEN, "truncate": "no"}, "model.rope_scaling.truncate must be true or false, got 'no'")]


@pytest.mark.parametrize("scaling,message", REFUSALS)
def test_a_wrong_yarn_scaling_is_refused_naming_the_fix(scaling, message):
    with pytest.raises(ConfigError) as err:
        load_config(overrides={"model": {"rope_scaling": scaling}}, runtime=False)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_the_planner_costs_a_yarn_model_as_the_unscaled_one():
    """RoPE's scaling changes its angles, not its work: estimate takes a YaRN config, the same cost."""
    from tetrad.plan.cost import estimate
    from tetrad.plan.hardware import load_cluster
    sections = {"parallel": {"tp": 8}, "train": {"global_batch": 8, "micro_batch": 1, "dtype": "bf16"}}
    plain = estimate(load_config(overrides={"model": {"preset": "llama3-8b"}, **sections}, runtime=False),
                     load_cluster("dgx-h100"))
    yarn = estimate(load_config(overrides={"model": {"preset": "llama3-8b", "rope_scaling": dict(QWEN)}, **sections},
                                runtime=False), load_cluster("dgx-h100"))
    assert yarn.step_time_s == plain.step_time_s > 0 and yarn.memory == plain.memory


def test_yarn_keys_are_what_transformers_computes_with():
    """Import resolves YaRN as transformers reads config.json: a top-level original context wins
    over the scaling's, `factor` null is max_position_embeddings / original, other nulls are its
    defaults (truncate's null is false); the frequencies and factor of the keys kept are its own."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from tetrad.train.hf_architectures import model_config_from_hf
    hf = {"model_type": "qwen2", "num_hidden_layers": 1, "hidden_size": 256, "num_attention_heads": 2,
          "intermediate_size": 128, "vocab_size": 251, "max_position_embeddings": 131072, "rope_theta": 1e6}
    configs = [{**hf, "rope_scaling": {"type": "yarn", **{k: v for k, v in QWEN.items() if k != "rope_type"}}},
               {**hf, "rope_scaling": {**QWEN, "factor": None, "beta_fast": None, "mscale": None}},
               {**hf, "original_max_position_embeddings": 16384, "rope_scaling": {**QWEN, "truncate": None}}]
    for config in configs:
        keys = model_config_from_hf(config, Path("config.json"))
        shape = ("d_model", "n_heads", "n_kv_heads", "head_dim", "rope_theta", "rope_scaling")
        model = load_config(overrides={"model": {k: keys[k] for k in shape}}, runtime=False).model
        theirs, factor = ROPE_INIT_FUNCTIONS["yarn"](transformers.Qwen2Config(**config), "cpu")
        assert torch.equal(rope_frequencies(model, torch.device("cpu")), theirs) and attention_factor(model) == factor
    assert keys["rope_scaling"] == {**QWEN, "truncate": False, "original_max_position_embeddings": 16384}
    assert model_config_from_hf(configs[1], Path("c"))["rope_scaling"] == {**QWEN, "factor": 131072 / 32768}


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_a_qwen_with_yarn_gives_transformers_logits_and_exports_back(tmp_path, family):
    """A Qwen2.5-form (transformers 4's `type`) and a Qwen3 folder with YaRN over an original
    context of 4096 (so its kept, blended and interpolated pairs all occur in heads of 16 and 24)
    convert to tetrad with transformers' logits, and export to the same architecture and scaling,
    which transformers reads to the same logits."""
    from test_convert import TOKENS, TOL, hf_logits
    from tetrad.train.convert import read_weights
    from tetrad.train.generate import single_process_model
    scaling = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096} if family == "qwen2" else \
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096, "beta_fast": 16.0,
         "attention_factor": 1.25}
    write_hf_qwen(tmp_path / "hf", family, vocab_size=251, max_position_embeddings=16384, rope_theta=1e4,
                  rope_scaling=scaling)
    assert main(["convert", str(tmp_path / "hf"), "--to-tetrad", str(tmp_path / "ckpt")]) == 0
    cfg, state = read_weights(tmp_path / "ckpt")
    assert cfg.model.rope_scaling["rope_type"] == "yarn" and cfg.model.rope_scaling["factor"] == 4.0
    theirs = hf_logits(tmp_path / "hf")
    with torch.no_grad():
        torch.testing.assert_close(single_process_model(cfg.model, state)(TOKENS, torch.arange(TOKENS.shape[1])),
                                   theirs, **TOL)
    assert main(["convert", str(tmp_path / "ckpt"), "--to-hf", str(tmp_path / "back")]) == 0
    exported = json.loads((tmp_path / "back" / "config.json").read_text())
    assert exported["architectures"] == [{"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[family]]
    rope = exported.get("rope_parameters") or exported["rope_scaling"]
    assert (rope["rope_type"], rope["factor"], rope["original_max_position_embeddings"]) == ("yarn", 4.0, 4096)
    torch.testing.assert_close(hf_logits(tmp_path / "back"), theirs, **TOL)


def test_yarn_on_part_of_each_head_is_refused_for_export():
    """Partial RoPE is Phi3ForCausalLM's alone here, and Phi-3 reads `yarn` as LongRoPE."""
    from tetrad.train.hf_architectures import check_exportable
    with pytest.raises(ConfigError, match="^Phi3ForCausalLM, the one transformers architecture with "
                                          "model.partial_rotary_factor, has no YaRN"):
        check_exportable(tiny_config(model={"partial_rotary_factor": 0.5, "rope_scaling": dict(QWEN)}).model)
