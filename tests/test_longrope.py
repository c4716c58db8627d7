"""Phi-3's LongRoPE (Phi-3 mini 128k, Phi-3.5 mini, phi-4-mini) and RoPE on part of each head
(phi-4-mini's partial_rotary_factor 0.75): a Phi3ForCausalLM transformers writes converts to
tetrad with transformers' logits over a sequence within its original context (LongRoPE's short
factors) and one past it (the long factors), decodes step by step as transformers' generate
does across that threshold, and exports back to a folder transformers loads to the same logits."""

import json
from pathlib import Path

import pytest
import torch

from conftest import tiny_config
from test_convert import TOL, write_hf_phi3
from tetrad.cli import main
from tetrad.config import ConfigError
from tetrad.train.convert import read_weights
from tetrad.train.generate import single_process_model

transformers = pytest.importorskip("transformers")

ORIGINAL = 16  # original_max_position_embeddings: the tests' 12 tokens are within it, 32 past it


def longrope(pairs: int) -> dict:
    """Factors that differ per pair and between the lists, so that a pair or a list mixed up shows."""
    return {"type": "longrope", "short_factor": [1.0 + 0.25 * i for i in range(pairs)],
            "long_factor": [1.5 + 3.0 * i for i in range(pairs)]}


# head_dim 16: LongRoPE over all of it (8 pairs, Phi-3 mini 128k's and Phi-3.5's form, under
# `su`, its oldest name), over 12 dims (phi-4-mini's 0.75: 6 pairs), and 0.5 without scaling.
VARIANTS = {"longrope": {"rope_scaling": {**longrope(8), "type": "su"}},
            "longrope-partial": {"partial_rotary_factor": 0.75, "rope_scaling": longrope(6)},
            "partial": {"partial_rotary_factor": 0.5}}


def write_phi3(folder: Path, variant: str) -> None:
    write_hf_phi3(folder, max_position_embeddings=64, original_max_position_embeddings=ORIGINAL, **VARIANTS[variant])


def hf_model(folder: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()


def tokens(n: int) -> torch.Tensor:
    return torch.randint(0, 251, (2, n), generator=torch.Generator().manual_seed(n))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_a_phi3_with_longrope_or_partial_rope_gives_transformers_logits_and_exports_back(tmp_path, variant):
    """Within the original context and past it, tetrad's logits are transformers' (the scaling
    kept as model keys, attention_factor resolved from max_position_embeddings); the export is a
    Phi3ForCausalLM whose config transformers reads to the same logits, its tensors the same."""
    write_phi3(tmp_path / "hf", variant)
    assert main(["convert", str(tmp_path / "hf"), "--to-tetrad", str(tmp_path / "ckpt")]) == 0
    cfg, state = read_weights(tmp_path / "ckpt")
    m = cfg.model
    assert (m.hf_model_type, m.partial_rotary_factor) == ("phi3", VARIANTS[variant].get("partial_rotary_factor", 1.0))
    ours, theirs = single_process_model(m, state), hf_model(tmp_path / "hf")
    for n in (12, 32):
        with torch.no_grad():
            torch.testing.assert_close(ours(tokens(n), torch.arange(n)), theirs(tokens(n)).logits, **TOL)

    assert main(["convert", str(tmp_path / "ckpt"), "--to-hf", str(tmp_path / "back")]) == 0
    exported = json.loads((tmp_path / "back" / "config.json").read_text())
    assert exported["architectures"] == ["Phi3ForCausalLM"]
    back = hf_model(tmp_path / "back")
    with torch.no_grad():
        for n in (12, 32):
            torch.testing.assert_close(back(tokens(n)).logits, theirs(tokens(n)).logits, **TOL)


def test_longrope_keys_are_what_transformers_computes_with():
    """attention_factor is sqrt(1 + ln(max_position_embeddings / original) / ln(original)) where
    config.json gives neither it nor `factor` (Phi-3 mini 128k: 131072 / 4096); the top-level
    original_max_position_embeddings is Phi3Config's (4096 where absent), over the scaling's own."""
    from tetrad.train.hf_architectures import model_config_from_hf
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    hf = {"model_type": "phi3", "num_hidden_layers": 2, "hidden_size": 3072, "num_attention_heads": 32,
          "intermediate_size": 8192, "vocab_size": 32064, "max_position_embeddings": 131072,
          "original_max_position_embeddings": 4096, "rope_scaling": longrope(48)}
    untopped = {k: v for k, v in hf.items() if k != "original_max_position_embeddings"}
    for config in (hf, {**hf, "rope_scaling": {**longrope(48), "factor": 8.0}}, untopped,
                   {**untopped, "rope_scaling": {**longrope(48), "original_max_position_embeddings": 8192}}):
        ours = model_config_from_hf(config, Path("config.json"))["rope_scaling"]
        phi3 = transformers.Phi3Config(**config)
        _, attention_factor = ROPE_INIT_FUNCTIONS["longrope"](phi3, "cpu")
        assert ours["attention_factor"] == pytest.approx(attention_factor, rel=1e-12), config["rope_scaling"]
        assert ours["original_max_position_embeddings"] == phi3.rope_parameters["original_max_position_embeddings"] == 4096
    assert ours["attention_factor"] == pytest.approx((1 + 5 * 0.6931471805599453 / (12 * 0.6931471805599453)) ** 0.5)
    assert set(ours) == {"rope_type", "short_factor", "long_factor", "original_max_position_embeddings",
                         "attention_factor"}


@pytest.mark.parametrize("variant", ["longrope", "longrope-partial"])
def test_decoding_across_the_original_context_is_transformers_generate(tmp_path, variant):
    """Each decoding step picks LongRoPE's factors by the tokens so far, as transformers does per
    forward call: a prompt of 12 within the original 16 uses the short ones, the steps from the
    17th token on the long ones, the keys cached before then kept as they were rotated. Step by
    step the logits are transformers' with its cache, and the last is not a fresh 24-token pass's."""
    write_phi3(tmp_path / "hf", variant)
    assert main(["convert", str(tmp_path / "hf"), "--to-tetrad", str(tmp_path / "ckpt")]) == 0
    cfg, state = read_weights(tmp_path / "ckpt")
    ours, theirs = single_process_model(cfg.model, state), hf_model(tmp_path / "hf")
    ids = tokens(24)[:1]
    with torch.no_grad():
        out = theirs(ids[:, :12], use_cache=True)
        expected = [out.logits[:, -1]]
        for i in range(12, 24):
            out = theirs(ids[:, i:i + 1], cache=out.cache, use_cache=True)
            expected.append(out.logits[:, -1])
        cache = {}
        got = [ours(ids[:, :12], torch.arange(12), cache=cache)[:, -1]]
        got += [ours(ids[:, i:i + 1], torch.tensor([i]), cache=cache)[:, -1] for i in range(12, 24)]
        fresh = theirs(ids).logits[:, -1]
    torch.testing.assert_close(torch.stack(got), torch.stack(expected), **TOL)
    assert (got[-1] - fresh).abs().max() > 1e-3  # the cache's short-factor keys matter


def test_a_model_only_phi3_computes_exports_as_phi3_or_is_refused():
    """LongRoPE and partial RoPE are Phi3ForCausalLM's alone among the architectures here: a model
    with them exports as Phi-3 whatever its hf_model_type; with what Phi-3 lacks it is refused."""
    from tetrad.train.hf_architectures import check_exportable, exported_type, hf_architecture
    m = tiny_config(model={"partial_rotary_factor": 0.75}).model
    assert (exported_type(m), hf_architecture(m)["partial_rotary_factor"]) == ("phi3", 0.75)
    with pytest.raises(ConfigError, match="^Phi3ForCausalLM, the one transformers architecture with "
                                          "model.partial_rotary_factor, has no model.qk_norm; export"):
        check_exportable(tiny_config(model={"partial_rotary_factor": 0.75, "qk_norm": True}).model)


@pytest.mark.dist
@pytest.mark.parametrize("parallel", [{"tp": 2}, {"pp": 2}, {"cp": 2}])
def test_a_longrope_phi3_fine_tunes_with_transformers_first_loss(tmp_path, parallel):
    """phi-4-mini's form (LongRoPE over 0.75 of each head) straight from its HF folder, trained on
    windows of 32 past the original 16, so on the long factors, as transformers picks them for
    those positions: the first loss is transformers' on the same batch under tp2, pp2 and cp2 (a
    cp rank holds 16 of the window's positions, and must pick the window's factors, not its
    own). The fine-tuned run exports to a Phi-3 that transformers loads to its logits."""
    from test_init_from import config, hf_loss
    from conftest import train_layout
    from tetrad.train.batches import split_batches
    from tetrad.train.init_from import check_init_from
    write_phi3(tmp_path / "hf", "longrope-partial")
    cfg = config(tmp_path, "run", parallel=parallel, checkpoint={"init_from": str(tmp_path / "hf"), "every": 1},
                 model={"seq_len": 32})
    assert (cfg.model.rope_scaling["rope_type"], cfg.model.partial_rotary_factor) == ("longrope", 0.75)
    check_init_from(cfg)
    losses, _, _ = train_layout(cfg)
    inputs, labels = split_batches(cfg)[0].global_batch_at(0)
    assert losses[0] == pytest.approx(hf_loss(tmp_path / "hf", inputs, labels), rel=1e-5)

    assert main(["convert", str(tmp_path / "run"), "--to-hf", str(tmp_path / "tuned")]) == 0
    _, state = read_weights(tmp_path / "run")
    with torch.no_grad():
        torch.testing.assert_close(single_process_model(cfg.model, state)(inputs, torch.arange(32)),
                                   hf_model(tmp_path / "tuned")(inputs).logits, **TOL)


def test_generate_from_a_longrope_phi3_folder_is_transformers_greedy_generate(tmp_path):
    """`tetrad generate HF_DIR` of phi-4-mini's form, greedy from a prompt within the original 16
    tokens to past them: transformers' generate's tokens (before: refused by name). The command's
    reading of the folder; the factors each step picks are test_decoding_across_...'s to show.
    Converted and exported, the folder keeps its pad_token_id (before: Phi-3's dropped)."""
    from tetrad.data.tokenizer import train_bpe
    from tetrad.train.generate import complete, load_generator
    from tetrad.model.sampling import GREEDY
    hf = tmp_path / "hf"
    write_hf_phi3(hf, vocab_size=300, max_position_embeddings=64, original_max_position_embeddings=ORIGINAL,
                  **VARIANTS["longrope-partial"])
    theirs = hf_model(hf)
    with torch.no_grad():
        theirs.lm_head.weight.mul_(20)  # greedy picks far apart: no near-tie that rounding could flip
    theirs.save_pretrained(hf, safe_serialization=True)
    train_bpe(iter(["the licence grants the right to copy the text"] * 4), 300).save(str(hf / "tokenizer.json"))
    model, tokenizer, source = load_generator(hf)
    _, prompt, new = complete(model, tokenizer, "the licence grants", 20, GREEDY, source=source)
    assert len(prompt) < ORIGINAL < len(prompt) + len(new)
    with torch.no_grad():
        expected = theirs.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=20, eos_token_id=None,
                                   pad_token_id=0)[0, len(prompt):].tolist()
    assert new == expected
    # the folder's pad_token_id (0) travels with its tokenizer through a conversion and back
    assert main(["convert", str(hf), "--to-tetrad", str(tmp_path / "ckpt")]) == 0
    assert main(["convert", str(tmp_path / "ckpt"), "--to-hf", str(tmp_path / "back")]) == 0
    assert transformers.AutoConfig.from_pretrained(tmp_path / "back").pad_token_id == 0


def test_a_resume_with_another_partial_rotary_factor_is_said_and_an_older_checkpoint_has_none():
    """partial_rotary_factor leaves the shapes alone and changes what the weights compute: a resume
    may change it (as rope_scaling) and the resume line says so; a manifest from before the key
    is a model that rotates whole heads."""
    import dataclasses
    from tetrad.train.checkpoint.store import behaviour_changes
    saved = dataclasses.asdict(tiny_config().model)
    assert behaviour_changes({"model": saved}, tiny_config(model={"partial_rotary_factor": 0.5}).model) == [
        "model.partial_rotary_factor = 1.0 in the checkpoint, 0.5 here"]
    del saved["partial_rotary_factor"]
    assert behaviour_changes({"model": saved}, tiny_config().model) == []
