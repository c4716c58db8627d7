"""Gemma in and out (train/hf_gemma.py): a Gemma3ForCausalLM built here by transformers (fp32,
random weights, every norm given a value) imports with transformers' logits: Gemma's RMSNorm (fp32,
1 + weight), GeGLU, the embedding times sqrt(d_model), qk-norm, sandwich norms, its softmax scale
(query_pre_attn_scalar), a sliding layer (window 5 of 32, its own RoPE theta) and a global one
(linear RoPE scaling); exported, transformers loads it as Gemma3ForCausalLM with the same logits;
KV-cached decoding picks transformers' generate's tokens; Gemma 1 likewise; what tetrad lacks
(Gemma 2's softcapping, the multimodal checkpoints) is refused in one line. Parity of every layout
with one process is tests/test_attention_variants.py's (GEMMA3 there)."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from conftest import GEMMA3_HF, TINY, doc_shards, run_ranks, tiny_config, train_layout, write_hf_gemma
from tetrad.cli import main
from tetrad.config import ConfigError, load_config
from tetrad.data.tokenizer import byte_tokenizer
from tetrad.dist.topology import Topology
from tetrad.model import flops
from tetrad.model.sampling import GREEDY
from tetrad.train.batches import split_batches
from tetrad.train.convert import read_weights
from tetrad.train.generate import Cache, generate, load_generator, single_process_model
from tetrad.train.hf_architectures import model_config_from_hf
from tetrad.train.inputs import model_keys
from tetrad.train.trainer import build_model

transformers = pytest.importorskip("transformers")

TOKENS = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
# fp32, the same math in another order: transformers' logits to ~1e-6 (the largest near 1)
TOL = {"atol": 1e-5, "rtol": 1e-5}


def hf_logits(hf_dir: Path) -> torch.Tensor:
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").eval()
    with torch.no_grad():
        return hf(TOKENS).logits


def ours(m, state) -> torch.Tensor:
    with torch.no_grad():
        return single_process_model(m, state)(TOKENS, torch.arange(TOKENS.shape[1]))


# Each feature off in turn must change the logits: the comparison sees every one.
FEATURES = {"norm": "rmsnorm", "sandwich_norm": False, "scale_embeddings": False, "mlp": "swiglu",
            "query_pre_attn_scalar": 0.0, "layer_types": [], "rope_local_base_freq": 0.0, "rope_scaling": {}}


def as_gemma_3_1b_writes_it(config_json: Path, pattern: int) -> None:
    """config.json in the form google/gemma-3-1b's has (transformers 4.50): the RoPE keys top-level
    and sliding_window_pattern, no layer_types, no rope_parameters."""
    hf = json.loads(config_json.read_text())
    rope = hf.pop("rope_parameters")
    del hf["layer_types"]
    hf.update(sliding_window_pattern=pattern, rope_theta=rope["full_attention"]["rope_theta"],
              rope_local_base_freq=rope["sliding_attention"]["rope_theta"], rope_scaling={"rope_type": "linear", "factor": 8.0})
    config_json.write_text(json.dumps(hf))


@pytest.mark.parametrize("family,shape,types", [
    ("gemma3_text", {}, GEMMA3_HF["layer_types"]),
    ("gemma3_text", {"layer_types": ["full_attention", "sliding_attention"], "rope_scaling": None},
     ["full_attention", "sliding_attention"]),
    ("gemma3_text", {"num_hidden_layers": 3, "layer_types": None, "sliding_window_pattern": 2},
     ["sliding_attention", "full_attention", "sliding_attention"]),  # gemma-3-1b's form
    ("gemma", {}, [])])
def test_an_hf_gemma_imports_with_transformers_logits_and_exports_as_itself(tmp_path, family, shape, types):
    write_hf_gemma(tmp_path / "hf", family, **shape)
    if "num_hidden_layers" in shape:
        as_gemma_3_1b_writes_it(tmp_path / "hf" / "config.json", pattern=2)
    assert main(["convert", str(tmp_path / "hf"), "--to-tetrad", str(tmp_path / "ckpt")]) == 0
    cfg, state = read_weights(tmp_path / "ckpt")
    m = cfg.model
    assert (m.norm, m.mlp, m.scale_embeddings, m.tie_embeddings, m.head_dim) == ("gemma_rmsnorm", "geglu", True, True, 24)
    assert m.layer_types == types
    if family == "gemma3_text":
        assert (m.sandwich_norm, m.qk_norm, m.query_pre_attn_scalar, m.sliding_window) == (True, True, 20, 5)
    theirs = hf_logits(tmp_path / "hf")
    torch.testing.assert_close(ours(m, state), theirs, **TOL)
    assert theirs.abs().max() > 0.3  # a non-trivial comparison
    for key, off in FEATURES.items() if family == "gemma3_text" and not shape else ():
        changed = dataclasses.replace(m, **{key: off}, **({"rope_local_base_freq": 0.0} if key == "layer_types" else {}))
        kept = {k: v for k, v in state.items() if "_out_norm" not in k or changed.sandwich_norm}
        assert (ours(changed, kept) - theirs).abs().max() > 1e-3, key

    assert main(["convert", str(tmp_path / "ckpt"), "--to-hf", str(tmp_path / "back")]) == 0
    exported = json.loads((tmp_path / "back" / "config.json").read_text())
    assert exported["architectures"] == ["Gemma3ForCausalLM" if family == "gemma3_text" else "GemmaForCausalLM"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", attn_implementation="eager")
    assert type(hf).__name__ == exported["architectures"][0]
    torch.testing.assert_close(hf_logits(tmp_path / "back"), theirs, **TOL)


def test_a_model_trained_in_tetrad_as_gemma3_exports_with_its_logits(tmp_path):
    """A Gemma-3-shaped model of tetrad's own (untied; a window in every layer, no layer_types: all
    sliding, the same RoPE in every layer) after a few steps: transformers computes it too."""
    model = {**GEMMA3_TETRAD, "tie_embeddings": False, "layer_types": [], "rope_local_base_freq": 0.0,
             "rope_scaling": {}}
    cfg = tiny_config(model={**model, "vocab_size": 256}, checkpoint={"every": 1}, run={"dir": str(tmp_path / "run")})
    _, state, _ = train_layout(cfg)
    assert main(["convert", str(tmp_path / "run"), "--to-hf", str(tmp_path / "hf")]) == 0
    torch.testing.assert_close(hf_logits(tmp_path / "hf"), ours(cfg.model, state), **TOL)


@pytest.mark.dist
def test_an_hf_gemma3_fine_tunes_from_its_folder_under_tp_with_transformers_loss(tmp_path):
    """init_from the HF folder under tp2 with SP: every rank reads its rows; the first step's loss
    is transformers' on the same batch."""
    write_hf_gemma(tmp_path / "hf")
    raw = {"train": {**TINY["train"], "steps": 1}, "run": {"dir": str(tmp_path / "run")}, "model": {"seq_len": 32},
           "parallel": {"tp": 2, "sequence_parallel": True}, "checkpoint": {"init_from": str(tmp_path / "hf")}}
    cfg = load_config(overrides=raw, model_from_inputs=model_keys)
    assert cfg.model.sandwich_norm and cfg.model.layer_types == GEMMA3_HF["layer_types"]
    losses, _, _ = train_layout(cfg)
    inputs, labels = split_batches(cfg)[0].global_batch_at(0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(hf(inputs).logits.flatten(0, 1), labels.flatten())
    assert losses[0] == pytest.approx(float(expected), rel=1e-5)


def full_forward_greedy(hf, prompt: list[int], new: int) -> list[int]:
    """Greedy decoding by transformers' forward over the whole sequence at each step (no cache)."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(new):
            tokens.append(int(hf(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt):]


def test_gemma3_decodes_with_a_kv_cache_as_the_full_forward(tmp_path):
    """A 20-token prompt, 30 greedy tokens: the sliding layer attends over its window's last 5
    cached keys with its own RoPE, the global one over all; then a next turn that keeps the cache
    and runs 3 new prompt tokens after it. Each the tokens greedy decoding by transformers' full
    forward picks (untied: the head scaled up, so that no near-tie can flip). transformers' own
    generate, through its sliding-window cache, picks otherwise at one near-tie of the second turn
    (its top two 0.027 apart), where its full forward agrees with tetrad."""
    write_hf_gemma(tmp_path / "hf", tie_word_embeddings=False)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    with torch.no_grad():
        theirs.lm_head.weight.mul_(20)
    theirs.save_pretrained(tmp_path / "hf2", safe_serialization=True)
    byte_tokenizer().save(str(tmp_path / "hf2" / "tokenizer.json"))
    net, _, _ = load_generator(tmp_path / "hf2")
    cache, prompt = Cache(), list(range(100, 120))
    for max_new in (30, 10):
        new, _ = generate(net, prompt, max_new, GREEDY, cache=cache)
        assert new == full_forward_greedy(theirs, prompt, max_new)
        prompt = prompt + new + [5, 6, 7]
    assert cache.reused == 20 + 30 - 1


def test_a_multimodal_gemma3s_text_tower_imports_and_exports_as_gemma3_for_causal_lm(tmp_path):
    """Gemma3ForConditionalGeneration (the 4B+ checkpoints' architecture: its text_config, its text
    tower under language_model. beside a vision tower and a projector) imports its text tower, the
    vision weights left unread, with the logits transformers' multimodal model gives a text; its
    export is a Gemma3ForCausalLM with them."""
    from tetrad.train.init_from import hf_weights_problem
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "image_size": 28, "patch_size": 14}
    text = {k: v for k, v in GEMMA3_HF.items() if k not in ("rope_theta", "rope_local_base_freq", "rope_scaling")}
    hf = transformers.Gemma3ForConditionalGeneration(transformers.Gemma3Config(text_config=text, vision_config=vision,
                                                                               mm_tokens_per_image=4))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(0.0, 0.5 if "norm" in name else 0.05)
    hf.eval().save_pretrained(tmp_path / "hf", safe_serialization=True)
    with torch.no_grad():
        theirs = hf(input_ids=TOKENS).logits
    assert theirs.abs().max() > 0.3  # a non-trivial comparison
    assert main(["convert", str(tmp_path / "hf"), "--to-tetrad", str(tmp_path / "ckpt")]) == 0
    cfg, state = read_weights(tmp_path / "ckpt")
    assert cfg.model.sandwich_norm and cfg.model.layer_types == GEMMA3_HF["layer_types"]
    assert hf_weights_problem(tmp_path / "hf", cfg.model) is None  # init_from's check: the vision tower is no problem
    torch.testing.assert_close(ours(cfg.model, state), theirs, **TOL)
    assert main(["convert", str(tmp_path / "ckpt"), "--to-hf", str(tmp_path / "text")]) == 0
    assert json.loads((tmp_path / "text" / "config.json").read_text())["architectures"] == ["Gemma3ForCausalLM"]
    torch.testing.assert_close(hf_logits(tmp_path / "text"), theirs, **TOL)


BASE = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128,
        "vocab_size": 256}


@pytest.mark.parametrize("keys,named", [
    ({"model_type": "gemma2"}, "Gemma 2 .*attn_logit_softcapping.* not importable"),
    ({"model_type": "gemma3_text", "final_logit_softcapping": 30.0}, "no logit softcapping .*final_logit_softcapping"),
    ({"model_type": "gemma3_text", "use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"model_type": "gemma3_text", "hidden_activation": "silu"}, "gelu's tanh form .* not 'silu'"),
    ({"model_type": "gemma3_text", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "no 'yarn'"),
    ({"model_type": "gemma", "attention_bias": True}, "no {'attention_bias': True")])
def test_gemmas_tetrad_lacks_are_refused_in_one_line(keys, named):
    with pytest.raises(ConfigError, match=named) as refused:
        model_config_from_hf({**BASE, **keys}, Path("config.json"))
    assert "\n" not in str(refused.value)


def test_a_gemma_that_no_architecture_computes_is_refused_before_export():
    from tetrad.train.hf_architectures import check_exportable
    for change, named in (({"qk_norm": False}, "both model.sandwich_norm and model.qk_norm"),
                          ({"mlp": "swiglu"}, "mlp='geglu'"), ({"norm": "rmsnorm"}, "are Gemma's"),
                          ({"sandwich_norm": False, "qk_norm": False}, "GemmaForCausalLM .* no sliding window"),
                          ({"norm": "rmsnorm", "mlp": "swiglu", "scale_embeddings": False, "sandwich_norm": False,
                            "qk_norm": False, "query_pre_attn_scalar": 0.0, "rope_local_base_freq": 0.0,
                            "layer_types": ["full_attention"] * 2}, "model.layer_types are Gemma's")):
        with pytest.raises(ConfigError, match=named):
            check_exportable(tiny_config(model={**GEMMA3_TETRAD, **change}).model)


GEMMA3_TETRAD = {"norm": "gemma_rmsnorm", "mlp": "geglu", "scale_embeddings": True, "sandwich_norm": True,
                 "qk_norm": True, "head_dim": 24, "query_pre_attn_scalar": 20.0, "sliding_window": 5,
                 "layer_types": ["sliding_attention", "full_attention"], "rope_local_base_freq": 100.0,
                 "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "tie_embeddings": True}


@pytest.mark.parametrize("tied", [True, False])
def test_the_parameter_count_includes_the_sandwich_norms(tied):
    cfg = tiny_config(model={**GEMMA3_TETRAD, "tie_embeddings": tied})
    assert flops.parameter_count(cfg.model) == sum(p.numel() for p in build_model(cfg, Topology.single()).parameters())


def test_attention_flops_count_each_layers_window():
    """One sliding layer (5 keys a query) and one full (32): the mean, 18.5 keys."""
    m = tiny_config(model=GEMMA3_TETRAD).model
    assert flops.attention_core_flops(m, 32) == 4 * 18.5 * m.n_heads * m.head_dim


def test_layer_types_and_local_rope_are_checked_before_start():
    for model, named in (({"layer_types": ["sliding_attention"]}, "for each of the n_layers=2 layers"),
                         ({"layer_types": ["local", "global"]}, "must name one of sliding_attention, full_attention"),
                         ({"rope_local_base_freq": 100.0}, "layer_types is empty"),
                         ({"rope_scaling": {"rope_type": "linear"}}, "missing factor")):
        with pytest.raises(ConfigError, match=named):
            tiny_config(model=model)


def _saved_per_layer():
    """Bytes autograd saves for one forward of a 1-layer Gemma 3 with and without sandwich norms,
    and the planner's bytes a layer keeps for each."""
    from tetrad.plan.activations import activation_bytes_per_layer, as_run
    from tetrad.plan.stacks import STACKS
    from tetrad.train.memory import ActivationMeter
    out = {}
    for sandwich in (False, True):
        cfg = tiny_config(model={**GEMMA3_TETRAD, "n_layers": 1, "layer_types": [], "sliding_window": 0, "seq_len": 64,
                                 "rope_local_base_freq": 0.0, "sandwich_norm": sandwich, "qk_norm": sandwich})
        model = build_model(cfg, Topology.single())
        x = torch.randint(1, cfg.model.vocab_size, (2, 64), generator=torch.Generator().manual_seed(4))
        meter = ActivationMeter()
        with meter.measuring():
            model(x, torch.arange(64))
        planned = activation_bytes_per_layer(cfg.model, 128, 1, False, "none", 4, as_run(cfg, STACKS["tetrad"], True))
        out[sandwich] = meter.peak, planned
    return out


def test_the_planner_counts_what_the_sandwich_norms_and_qk_norm_keep():
    """The difference a Gemma 3 layer's sandwich norms and qk-norm make to the bytes it keeps for
    backward, measured by autograd's hooks, is the planner's (its four norms' fp32 inputs and outputs)."""
    saved = run_ranks(_saved_per_layer, 1)[0]
    measured, planned = saved[True][0] - saved[False][0], saved[True][1] - saved[False][1]
    assert planned == pytest.approx(measured, rel=0.05), (measured, planned)


def test_gemma_3_1bs_parameter_count_is_transformers():
    """gemma-3-1b's shape (26 layers of 4 heads of 256 over 1152, one KV head, a 262144 vocabulary,
    tied): the planner counts transformers' parameters (999,885,952), built on the meta device."""
    shape = {"vocab_size": 262144, "hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 26,
             "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256}
    with torch.device("meta"):
        hf = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**shape))
    keys = model_config_from_hf({**shape, "model_type": "gemma3_text"}, Path("config.json"))
    m = load_config(overrides={"model": {**keys, "seq_len": 4096}}, runtime=False).model
    assert flops.parameter_count(m) == sum(p.numel() for p in hf.parameters()) == 999_885_952
    assert m.layer_types.count("full_attention") == 4 and m.sliding_window == 4096 and m.rope_local_base_freq == 1e4  # defaults


def test_a_chunk_makes_one_mask_per_window_and_one_rope_table_per_kind(monkeypatch):
    """Four layers, two sliding and two global: one window bias (the global layers need none) and
    two RoPE tables per forward, under inference mode too (decoding keeps no tables between calls),
    not one per layer."""
    import tetrad.model.llama as llama
    made = {"masks": 0, "tables": 0}

    def counted(name, function):
        def run(*args, **kwargs):
            made[name] += 1
            return function(*args, **kwargs)
        return run
    monkeypatch.setattr(llama, "sequence_mask", counted("masks", llama.sequence_mask))
    monkeypatch.setattr(llama, "rope_tables", counted("tables", llama.rope_tables))
    cfg = tiny_config(model={**GEMMA3_TETRAD, "n_layers": 4, "layer_types": ["sliding_attention", "full_attention"] * 2})
    model = build_model(cfg, Topology.single())
    with torch.inference_mode():
        model(TOKENS, torch.arange(TOKENS.shape[1]))
    assert made == {"masks": 1, "tables": 2}


def _saved_with_documents():
    """Bytes autograd saves for one document-masked forward of a sliding and a global layer, and of
    two global ones (a bias per window: two, then one), and the planner's mask bytes of each."""
    from tetrad.model.documents import Documents
    from tetrad.plan.memory import mask_bias_bytes
    from tetrad.train.memory import ActivationMeter
    out = {}
    for types in (["sliding_attention", "full_attention"], ["full_attention", "full_attention"]):
        # one RoPE for both layers: the sliding layer's own tables would be 12 KiB more to tell apart
        cfg = tiny_config(model={**GEMMA3_TETRAD, "seq_len": 64, "layer_types": types, "rope_local_base_freq": 0.0},
                          train={"document_mask": True, "micro_batch": 2}, data={"source": doc_shards()})
        model = build_model(cfg, Topology.single())
        x = torch.randint(1, cfg.model.vocab_size, (2, 64), generator=torch.Generator().manual_seed(4))
        x[:, 20] = 0  # an EOS: two documents a row
        meter = ActivationMeter()
        with meter.measuring():
            model(x, torch.arange(64), docs=Documents.of_windows(x, 0, torch.device("cpu")))
        out[types[0]] = meter.peak, mask_bias_bytes(cfg, is_cpu=True)
    return out


def test_document_masking_keeps_a_bias_per_window_that_the_planner_counts():
    """Documents with a sliding and a global layer: each window's bias [micro_batch, 1, S, S] is
    made once and kept by its layers (the sliding one with the window in it, the global one of
    documents alone): one bias more than two global layers keep, as the planner counts."""
    saved = run_ranks(_saved_with_documents, 1)[0]
    bias = 2 * 64 * 64 * 4
    assert saved["sliding_attention"][1] == 2 * bias and saved["full_attention"][1] == bias
    assert saved["sliding_attention"][0] - saved["full_attention"][0] == bias
