"""`tetrad convert`: a checkpoint from any layout -> HF safetensors -> LlamaForCausalLM gives the same
logits, and HF weights -> tetrad checkpoint gives the same model back."""

import copy
import dataclasses
import importlib.util
import json
import re
import warnings
from pathlib import Path

import pytest
import torch

from conftest import tiny_config, train_layout, write_hf_qwen
from tetrad.cli import main
from tetrad.train.checkpoint import MANIFEST, Checkpointer
from tetrad.train.trainer import Trainer

transformers = pytest.importorskip("transformers")

TOKENS = torch.randint(0, 251, (2, 32), generator=torch.Generator().manual_seed(0))


def load_single(path: Path, model: dict) -> Trainer:
    """A one-process trainer whose model is restored from `path` (no process group)."""
    cfg = tiny_config(model=model)
    trainer = Trainer(cfg, torch.device("cpu"))
    Checkpointer(cfg, trainer.topo, path.parent).load(path, dict(trainer.model.named_parameters()), trainer.optimizer)
    return trainer


def logits(trainer: Trainer) -> torch.Tensor:
    with torch.no_grad():
        return trainer.model(TOKENS, torch.arange(TOKENS.shape[1]))


def hf_logits(hf_dir: Path) -> torch.Tensor:
    """The logits of the model transformers itself builds from the folder's config.json."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").eval()
    with torch.no_grad():
        return hf(TOKENS).logits


# Llama 3.1's RoPE: theta 500000 and its frequency scaling, over an original context shorter than
# the test's 32 tokens, so that every frequency band (kept, blended, slowed) is in use.
LLAMA31_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 16}
LLAMA31_ROPE = {"rope_theta": 500000.0, "rope_scaling": LLAMA31_SCALING}
# A model trained in tetrad with phi-4-mini's RoPE: half of each head of 16 rotated (4 pairs), under
# LongRoPE with an original context of 16, so the 32-token windows use its long factors.
PARTIAL_LONGROPE = {"partial_rotary_factor": 0.5, "rope_scaling": {
    "rope_type": "longrope", "short_factor": [1.0, 1.5, 2.0, 2.5], "long_factor": [2.0, 4.0, 8.0, 16.0],
    "original_max_position_embeddings": 16, "attention_factor": 1.2}}
# YaRN over an original context of 4096 (kept, blended and interpolated pairs in a head of 16),
# cos and sin times mscale(4, 1) / mscale(4, 0.5) = 1.066
YARN_ROPE = {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
                              "beta_fast": 16.0, "mscale": 1.0, "mscale_all_dim": 0.5}}

# fp32, the same math in a different order (as in test_model_hf): 1e-4 catches any real mismatch.
TOL = {"atol": 1e-4, "rtol": 1e-4}


@pytest.mark.dist
@pytest.mark.parametrize("parallel,model", [({"tp": 2}, {"vocab_size": 251}),  # padded vocab under tp
                                            ({"dp": 2}, {"vocab_size": 251, "tie_embeddings": True}),
                                            ({"dp": 2, "tp": 2, "zero": 3}, {"vocab_size": 251}),
                                            ({"pp": 2, "tp": 2, "zero": 1}, {"vocab_size": 251}),
                                            ({"dp": 2}, {"vocab_size": 251, **LLAMA31_ROPE}),
                                            ({"tp": 2, "sequence_parallel": True}, {"vocab_size": 251, "qkv_bias": True}),
                                            ({"tp": 2}, {"vocab_size": 251, "qk_norm": True, "head_dim": 24}),
                                            # sliding windows shorter than the 32 tokens: Mistral's, Qwen's
                                            ({"cp": 2}, {"vocab_size": 251, "sliding_window": 5}),
                                            ({"cp": 2}, {"vocab_size": 251, **YARN_ROPE}),
                                            ({"dp": 2}, {"vocab_size": 251, "qkv_bias": True, "sliding_window": 5}),
                                            ({"dp": 2}, {"vocab_size": 251, "qk_norm": True, "head_dim": 24,
                                                         "sliding_window": 5}),
                                            ({"pp": 2, "tp": 2}, {"vocab_size": 251, **PARTIAL_LONGROPE})])
def test_checkpoint_to_hf_and_back(tmp_path, parallel, model):
    cfg = tiny_config(parallel=parallel, model=model, train={"steps": 2, "micro_batch": 1}, checkpoint={"every": 2})
    train_layout(cfg)
    root = Path(cfg.run.dir) / "checkpoints"
    assert main(["convert", str(root), "--to-hf", str(tmp_path / "hf")]) == 0
    architecture = ("Qwen3ForCausalLM" if model.get("qk_norm") else "Qwen2ForCausalLM" if model.get("qkv_bias") else
                    "MistralForCausalLM" if model.get("sliding_window") else
                    "Phi3ForCausalLM" if model.get("partial_rotary_factor") else "LlamaForCausalLM")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == [architecture]
    ours = load_single(root / "step_00000002", model)
    torch.testing.assert_close(logits(ours), hf_logits(tmp_path / "hf"), **TOL)

    assert main(["convert", str(tmp_path / "hf"), "--to-tetrad", str(tmp_path / "back")]) == 0
    back = load_single(tmp_path / "back", model)
    from tetrad.train.convert import read_weights
    assert read_weights(tmp_path / "back")[0].model.sliding_window == model.get("sliding_window", 0)
    original, restored = ours.model.state_dict(), back.model.state_dict()
    assert original.keys() == restored.keys()
    assert all(torch.equal(original[k], restored[k]) for k in original)


@pytest.mark.parametrize("rope", [{"rope_theta": 10000.0}, {"rope_theta": 500000.0},
                                  {"rope_theta": 500000.0, "rope_scaling": LLAMA31_SCALING}])
def test_hf_model_to_tetrad(tmp_path, rope):
    """Weights written by transformers itself (not by us) load and give HF's logits, RoPE's theta
    and Llama 3.1's scaling included (transformers 5 writes both under `rope_parameters`)."""
    hf_cfg = transformers.LlamaConfig(vocab_size=251, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                      rms_norm_eps=1e-5, tie_word_embeddings=False,
                                      **copy.deepcopy(rope))  # transformers adds rope_theta to the scaling dict
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(hf_cfg).save_pretrained(tmp_path / "hf", safe_serialization=True)
    with warnings.catch_warnings(record=True) as caught:  # nothing but the command's own line
        warnings.simplefilter("always")
        assert main(["convert", str(tmp_path / "hf"), "--to-tetrad", str(tmp_path / "ckpt")]) == 0
    assert not caught, [str(w.message) for w in caught]
    # As `tetrad generate` reads it: the model its config.toml describes, RoPE included.
    from tetrad.train.convert import read_weights
    from tetrad.train.generate import single_process_model
    cfg, state = read_weights(tmp_path / "ckpt")
    with torch.no_grad():
        ours = single_process_model(cfg.model, state)(TOKENS, torch.arange(TOKENS.shape[1]))
    torch.testing.assert_close(ours, hf_logits(tmp_path / "hf"), **TOL)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_hf_qwen_model_to_tetrad(tmp_path, family):
    """A Qwen2 or Qwen3 folder written by transformers (Llama with q, k and v biases, or with
    qk-norm and heads of 24 over d_model 64) loads with model.qkv_bias or model.qk_norm and
    gives transformers' logits."""
    write_hf_qwen(tmp_path / "hf", family, vocab_size=251, max_position_embeddings=32, rms_norm_eps=1e-6,
                  rope_theta=1e6, tie_word_embeddings=True)
    assert main(["convert", str(tmp_path / "hf"), "--to-tetrad", str(tmp_path / "ckpt")]) == 0
    from tetrad.train.convert import read_weights
    from tetrad.train.generate import single_process_model
    cfg, state = read_weights(tmp_path / "ckpt")
    m = cfg.model
    assert (m.qkv_bias, m.qk_norm, m.head_dim) == ((True, False, 16) if family == "qwen2" else (False, True, 24))
    assert m.tie_embeddings and m.norm_eps == 1e-6
    with torch.no_grad():
        ours = single_process_model(m, state)(TOKENS, torch.arange(TOKENS.shape[1]))
    torch.testing.assert_close(ours, hf_logits(tmp_path / "hf"), **TOL)


@pytest.mark.parametrize("family", ["mistral", "qwen2", "qwen3"])
def test_hf_sliding_window_models_to_tetrad(tmp_path, family):
    """A Mistral written by transformers with a window of 5 of its 32 tokens, and Qwen2 and Qwen3
    windowed in every layer (max_window_layers 0), load with model.sliding_window = 5 and give
    transformers' logits (which a model without the window does not)."""
    shape = {"vocab_size": 251, "max_position_embeddings": 32, "sliding_window": 5, "rms_norm_eps": 1e-6}
    if family == "mistral":
        hf_cfg = transformers.MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, **shape)
        torch.manual_seed(0)
        transformers.MistralForCausalLM(hf_cfg).save_pretrained(tmp_path / "hf", safe_serialization=True)
    else:
        write_hf_qwen(tmp_path / "hf", family, use_sliding_window=True, max_window_layers=0, **shape)
    assert main(["convert", str(tmp_path / "hf"), "--to-tetrad", str(tmp_path / "ckpt")]) == 0
    from tetrad.train.convert import read_weights
    from tetrad.train.generate import single_process_model
    cfg, state = read_weights(tmp_path / "ckpt")
    assert cfg.model.sliding_window == 5
    with torch.no_grad():
        ours = single_process_model(cfg.model, state)(TOKENS, torch.arange(TOKENS.shape[1]))
        unwindowed = single_process_model(dataclasses.replace(cfg.model, sliding_window=0), state)(
            TOKENS, torch.arange(TOKENS.shape[1]))
    theirs = hf_logits(tmp_path / "hf")
    torch.testing.assert_close(ours, theirs, **TOL)
    assert (unwindowed - theirs).abs().max() > 1e-2


def test_attention_that_tetrad_lacks_is_refused_by_name():
    """Llama's output projection bias would be another model, and so would a Qwen2 window in some
    layers only (max_window_layers between 0 and the layer count): both refused by name. Mistral
    7B v0.1's window (4096 of 32768) and a Qwen2 window over every layer convert; windows that
    cover the whole context, or that the config switches off or puts in no layer, are none."""
    from tetrad.config import ConfigError
    from tetrad.train.hf_architectures import model_config_from_hf
    base = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128,
            "vocab_size": 251, "max_position_embeddings": 32768}
    qwen = {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 4096}
    refused = [({"model_type": "llama", "attention_bias": True}, "tetrad's Llama has no {'attention_bias': True"),
               ({**qwen, "max_window_layers": 1}, "sliding_window=4096 applies to 1 of 2 layers \\(max_window_layers=1\\)"
                                                  ".*only max_window_layers=0"),
               ({**qwen, "layer_types": ["full_attention", "sliding_attention"]}, "1 of 2 layers \\(its layer_types\\)")]
    for keys, named in refused:
        with pytest.raises(ConfigError, match=named):
            model_config_from_hf({**base, **keys}, Path("config.json"))
    windows = [({"model_type": "mistral", "sliding_window": 4096}, 4096), ({**qwen, "max_window_layers": 0}, 4096),
               ({**qwen, "layer_types": ["sliding_attention"] * 2}, 4096), ({**qwen, "max_window_layers": 2}, 0),
               ({**qwen}, 0),  # transformers' default max_window_layers, 28, puts the window in no layer of 2
               ({"model_type": "mistral", "sliding_window": None}, 0), ({"model_type": "mistral", "sliding_window": 32768}, 0),
               ({"model_type": "qwen2", "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 0}, 0)]
    for keys, window in windows:
        model = model_config_from_hf({**base, **keys}, Path("config.json"))
        assert (model["sliding_window"], model["qkv_bias"]) == (window, keys["model_type"] == "qwen2"), keys


def test_rope_read_from_either_transformers_config_form():
    """transformers 4 writes `rope_theta` and `rope_scaling` (its older key `type`) at the top;
    transformers 5 writes `rope_parameters`. Other scalings are refused by name."""
    from tetrad.config import ConfigError
    from tetrad.train.hf_architectures import model_config_from_hf
    base = {"num_hidden_layers": 1, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128,
            "vocab_size": 251}
    forms = [{"rope_theta": 5e5, "rope_scaling": LLAMA31_SCALING},
             {"rope_theta": 5e5, "rope_scaling": {"type": "llama3", **{k: v for k, v in LLAMA31_SCALING.items()
                                                                      if k != "rope_type"}}},
             {"rope_parameters": {"rope_theta": 5e5, **LLAMA31_SCALING}}]
    for form in forms:
        keys = model_config_from_hf({**base, **form}, Path("config.json"))
        assert (keys["rope_theta"], keys["rope_scaling"]) == (5e5, LLAMA31_SCALING), form
    plain = model_config_from_hf({**base, "rope_parameters": {"rope_theta": 5e5, "rope_type": "default"}}, Path("c"))
    assert (plain["rope_theta"], plain["rope_scaling"]) == (5e5, {})
    with pytest.raises(ConfigError, match="tetrad's Llama has no {'rope_scaling': {'rope_type': 'dynamic'"):
        model_config_from_hf({**base, "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, Path("config.json"))


def test_an_hf_model_without_a_tokenizer_exports_back_without_one(tmp_path, capsys):
    """transformers' save_pretrained writes no tokenizer: converted and exported again, the model
    has none either, not the byte tokenizer of the default data.source in the converted
    checkpoint's config (256 entries for a vocabulary of 1000)."""
    hf_cfg = transformers.LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    transformers.LlamaForCausalLM(hf_cfg).save_pretrained(tmp_path / "hf", safe_serialization=True)
    assert main(["convert", str(tmp_path / "hf"), "--to-tetrad", str(tmp_path / "ckpt")]) == 0
    assert main(["convert", str(tmp_path / "ckpt"), "--to-hf", str(tmp_path / "back")]) == 0
    assert sorted(p.name for p in (tmp_path / "back").iterdir()) == ["config.json", "model.safetensors"]
    assert "no tokenizer" in capsys.readouterr().out
    # Nor does generate decode its ids as bytes: one line, naming the way out.
    assert main(["generate", str(tmp_path / "ckpt"), "--prompt", "Hi"]) == 2
    err = capsys.readouterr().err
    assert "no tokenizer is known for its 1000 tokens; copy the model's tokenizer.json into" in err
    assert "Traceback" not in err


def test_a_tied_hf_model_whose_file_holds_the_head_too_converts(tmp_path):
    """Some tied exports store lm_head.weight beside the embedding (the same values): transformers
    ties them on load, and so does tetrad, reading the embedding."""
    from safetensors.torch import load_file, save_file
    write_hf_qwen(tmp_path / "hf", "qwen2", vocab_size=251, max_position_embeddings=32, tie_word_embeddings=True)
    weights = load_file(tmp_path / "hf" / "model.safetensors")
    assert "lm_head.weight" not in weights
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    save_file(weights, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    assert main(["convert", str(tmp_path / "hf"), "--to-tetrad", str(tmp_path / "ckpt")]) == 0
    from tetrad.train.convert import read_weights
    from tetrad.train.generate import single_process_model
    cfg, state = read_weights(tmp_path / "ckpt")
    with torch.no_grad():
        ours = single_process_model(cfg.model, state)(TOKENS, torch.arange(TOKENS.shape[1]))
    torch.testing.assert_close(ours, hf_logits(tmp_path / "hf"), **TOL)


def test_hf_weights_that_do_not_fit_config_are_refused(tmp_path, capsys):
    hf_cfg = transformers.LlamaConfig(vocab_size=251, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    transformers.LlamaForCausalLM(hf_cfg).save_pretrained(tmp_path / "hf", safe_serialization=True)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    assert main(["convert", str(tmp_path / "hf"), "--to-tetrad", str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err
    assert "model.layers.0.mlp.gate_proj.weight: (128, 64) in the file, (96, 64) for config.json's model" in err
    assert not (tmp_path / "ckpt").exists()
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"truncated")  # a broken file: one line, no traceback
    assert main(["convert", str(tmp_path / "hf"), "--to-tetrad", str(tmp_path / "ckpt")]) == 2
    assert "model.safetensors is not a readable safetensors file" in capsys.readouterr().err


def test_an_export_refuses_a_folder_that_holds_anything_in_one_line(tmp_path, capsys):
    """--to-hf, as --to-tetrad, writes only into a new or empty folder: a folder with another
    export's shards (readers of every *.safetensors would mix the two), with its own earlier export
    or with the HF model a run was fine-tuned from (a single model.safetensors) is refused, naming
    the fix, and left as it was. --to-hf wrote over the last two silently; --to-tetrad refused an
    empty folder."""
    cfg = tiny_config(train={"steps": 1}, checkpoint={"every": 1}, run={"dir": str(tmp_path / "run")})
    Trainer(cfg, torch.device("cpu")).fit()
    out = tmp_path / "hf"
    out.mkdir()
    (out / "model-00001-of-00002.safetensors").write_bytes(b"old")
    assert main(["convert", str(tmp_path / "run"), "--to-hf", str(out)]) == 2
    assert capsys.readouterr().err == (f"tetrad: --to-hf {out} exists and is not an empty folder; choose a new one, "
                                       "or remove it first\n")
    assert not (out / "model.safetensors").exists()
    (out / "model-00001-of-00002.safetensors").unlink()
    assert main(["convert", str(tmp_path / "run"), "--to-hf", str(out)]) == 0  # an empty folder is a new one
    exported = (out / "model.safetensors").read_bytes()
    (tmp_path / "base").mkdir()
    for name in ("config.json", "model.safetensors"):  # as the HF model a run was fine-tuned from
        (tmp_path / "base" / name).write_bytes(b"base model's " + name.encode())
    for target in (out, tmp_path / "base"):
        kept = {p.name: p.read_bytes() for p in target.iterdir()}
        assert main(["convert", str(tmp_path / "run"), "--to-hf", str(target)]) == 2
        assert capsys.readouterr().err.startswith(f"tetrad: --to-hf {target} exists and is not an empty folder")
        assert {p.name: p.read_bytes() for p in target.iterdir()} == kept
    assert (out / "model.safetensors").read_bytes() == exported
    assert main(["convert", str(out), "--to-tetrad", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err == (f"tetrad: --to-tetrad {tmp_path / 'run'} exists and is not an empty folder; "
                                       "choose a new one, or remove it first\n")
    (tmp_path / "empty").mkdir()
    assert main(["convert", str(out), "--to-tetrad", str(tmp_path / "empty")]) == 0
    assert (tmp_path / "empty" / MANIFEST).is_file()


def test_a_checkpoint_logged_to_wandb_exports_where_wandb_is_not_installed(tmp_path, monkeypatch):
    """The checkpoint's config.toml records the run's run.wandb / run.tensorboard; exporting or
    sampling it on another machine needs neither package (it was refused, naming a key of a file
    inside the checkpoint)."""
    cfg = tiny_config(train={"steps": 1}, checkpoint={"every": 1}, run={"dir": str(tmp_path / "run")})
    Trainer(cfg, torch.device("cpu")).fit()
    saved = tmp_path / "run" / "checkpoints" / "step_00000001"
    logged = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, wandb=True, tensorboard=True))
    (saved / "config.toml").write_text(logged.to_toml())  # as a run on a machine with both writes it
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("wandb", "tensorboard") else find_spec(name, *a))
    assert main(["convert", str(saved), "--to-hf", str(tmp_path / "hf")]) == 0
    assert main(["generate", str(saved), "--prompt", "hi", "--max-new-tokens", "2"]) == 0


def test_exported_tokenizer_names_its_special_tokens(tmp_path):
    """A Llama-3-like tokenizer (<|begin_of_text|> before each text, <|endoftext|> between
    documents) exports with both named: AutoTokenizer knows them, and config.json's ids tell
    HF's generate where text starts and stops."""
    from test_data import _with_begin_of_text
    from tetrad.data.tokenizer import eos_id, train_bpe
    from tetrad.train.convert import _special_token_ids, write_hf_tokenizer
    tokenizer, bos = _with_begin_of_text(train_bpe(iter(["some text to learn a few merges from"]), 300))
    write_hf_tokenizer(tokenizer, tmp_path, 32)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert (hf.bos_token, hf.eos_token) == ("<|begin_of_text|>", "<|endoftext|>")
    assert hf("some text").input_ids[0] == bos
    assert _special_token_ids(tokenizer) == {"eos_token_id": eos_id(tokenizer), "bos_token_id": bos}
    assert _special_token_ids(train_bpe(iter(["text"]), 300)) == {"eos_token_id": 0}  # tetrad's BPE: no prefix


def test_to_tetrad_from_a_folder_that_is_not_hf_is_one_line(tmp_path, capsys):
    """A tetrad run, or any folder without config.json, given to --to-tetrad: one line naming what it
    reads (it was a FileNotFoundError traceback)."""
    cfg = tiny_config(train={"steps": 1}, checkpoint={"every": 1}, run={"dir": str(tmp_path / "run")})
    Trainer(cfg, torch.device("cpu")).fit()
    for source, hint in [(tmp_path / "run", "train from it with --checkpoint.init_from="),
                         (tmp_path / "missing", "config.json and *.safetensors")]:
        assert main(["convert", str(source), "--to-tetrad", str(tmp_path / "ckpt")]) == 2
        err = capsys.readouterr().err
        assert f"{source} is not a Hugging Face model folder (no config.json)" in err and hint in err, err
        assert err.count("\n") == 1 and not (tmp_path / "ckpt").exists()


def write_hf_phi3(folder: Path, **shape) -> None:
    """A Phi-3 folder as transformers writes it (Phi3ForCausalLM: q, k and v in one qkv_proj, gate
    and up in one gate_up_proj; 2 layers, d_model 64, GQA 4:2; `shape` overrides the config's
    keys), its norms given values: they start at one, where a misplaced one would not show."""
    cfg = transformers.Phi3Config(**{"vocab_size": 251, "hidden_size": 64, "intermediate_size": 128,
                                     "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                     "max_position_embeddings": 32, "pad_token_id": 0, "bos_token_id": 1,
                                     "eos_token_id": 2, **shape})
    torch.manual_seed(0)
    hf = transformers.Phi3ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.5)
    hf.save_pretrained(folder, safe_serialization=True)


@pytest.mark.parametrize("window,tied", [(None, False), (5, True)])
def test_hf_phi3_model_to_tetrad_and_back(tmp_path, window, tied):
    """A Phi3ForCausalLM written by transformers (without a window, and tied with one of 5 of its
    32 tokens) converts to tetrad's Llama, its fused q/k/v and gate/up tensors split, and gives
    transformers' logits; exported again it is a Phi3ForCausalLM with the same tensors, which
    transformers loads to the same logits."""
    from safetensors.torch import load_file
    from tetrad.train.convert import read_weights
    from tetrad.train.generate import single_process_model
    write_hf_phi3(tmp_path / "hf", sliding_window=window, tie_word_embeddings=tied, rope_theta=1e6, rms_norm_eps=1e-6)
    assert main(["convert", str(tmp_path / "hf"), "--to-tetrad", str(tmp_path / "ckpt")]) == 0
    cfg, state = read_weights(tmp_path / "ckpt")
    m = cfg.model
    assert (m.hf_model_type, m.sliding_window, m.tie_embeddings, m.n_kv_heads, m.rope_theta, m.norm_eps) == (
        "phi3", window or 0, tied, 2, 1e6, 1e-6)
    with torch.no_grad():
        ours = single_process_model(m, state)(TOKENS, torch.arange(TOKENS.shape[1]))
    theirs = hf_logits(tmp_path / "hf")
    torch.testing.assert_close(ours, theirs, **TOL)

    assert main(["convert", str(tmp_path / "ckpt"), "--to-hf", str(tmp_path / "back")]) == 0
    exported = json.loads((tmp_path / "back" / "config.json").read_text())
    assert (exported["architectures"], exported["sliding_window"]) == (["Phi3ForCausalLM"], window)
    original, back = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert original.keys() == back.keys() and all(torch.equal(original[k], back[k]) for k in original)
    torch.testing.assert_close(hf_logits(tmp_path / "back"), theirs, **TOL)


def test_phi3_weights_that_do_not_fit_config_name_the_fused_tensor(tmp_path, capsys):
    """Shape checks name HF's own tensors: Phi-3's gate_up_proj, not tetrad's gate and up."""
    write_hf_phi3(tmp_path / "hf", num_hidden_layers=1)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    assert main(["convert", str(tmp_path / "hf"), "--to-tetrad", str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err
    assert "model.layers.0.mlp.gate_up_proj.weight: (256, 64) in the file, (192, 64) for config.json's model" in err


PHI3 = {"model_type": "phi3", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
        "intermediate_size": 128, "vocab_size": 251, "max_position_embeddings": 4096}
# Phi-3 mini 128k's (and Phi-3.5's) LongRoPE: a factor for each of the 8 frequencies of a head of 16
LONGROPE = {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}


@pytest.mark.parametrize("keys,named", [
    # LongRoPE and RoPE on part of each head are transformers' Phi-3's, not its Llama's
    ({"model_type": "llama", "rope_scaling": LONGROPE}, "{'rope_scaling': {'rope_type': 'longrope'}}"),
    ({"model_type": "llama", "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     "{'partial_rotary_factor': 0.5}"),
    ({"model_type": "llama", "rope_scaling": {**LONGROPE, "type": "dynamic"}}, "{'rope_scaling': {'rope_type': 'dynamic'}}"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 16}}, "{'rope_scaling': {'rope_type': 'llama3'"),
    ({"attention_dropout": 0.1}, "{'attention_dropout': 0.1}"),
    ({"hidden_act": "gelu"}, "{'hidden_act': 'gelu'}")])
def test_phi3_keys_that_tetrad_lacks_are_refused_by_name(keys, named):
    """What would make a model another than tetrad's is refused in one line naming the key:
    LongRoPE or RoPE over part of each head on an architecture whose transformers class has neither
    (its factor lists left out of the line; `yarn`, LongRoPE's old name on Phi-3, is YaRN elsewhere),
    scaling that transformers' Phi-3 itself has not, dropout on attention probabilities, another
    activation."""
    from tetrad.config import ConfigError
    from tetrad.train.hf_architectures import model_config_from_hf
    with pytest.raises(ConfigError, match=f"^config.json: tetrad's Llama has no {re.escape(named)}"):
        model_config_from_hf({**PHI3, **keys}, Path("config.json"))


def test_phi3_keys_that_leave_its_math_alone_convert():
    """Phi-3 mini 4k's window (2047 of 4096) is model.sliding_window; resid_pdrop is model.dropout
    (the same place: each sublayer's output); transformers 5's Phi-3 reads no embd_pdrop, and
    original_max_position_embeddings only for LongRoPE."""
    from tetrad.train.hf_architectures import model_config_from_hf
    keys = model_config_from_hf({**PHI3, "sliding_window": 2047, "resid_pdrop": 0.1, "embd_pdrop": 0.1,
                                 "original_max_position_embeddings": 4096, "pad_token_id": 32000,
                                 "rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                                     "partial_rotary_factor": 1.0}}, Path("config.json"))
    assert (keys["sliding_window"], keys["dropout"], keys["rope_scaling"], keys["hf_model_type"]) == (2047, 0.1, {}, "phi3")
    assert model_config_from_hf({**PHI3, "sliding_window": None}, Path("c"))["sliding_window"] == 0
    # Phi3Config reads a top-level partial_rotary_factor only where rope_parameters has none
    assert model_config_from_hf({**PHI3, "partial_rotary_factor": 0.75, "rope_parameters": {
        "rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1.0}}, Path("c"))["partial_rotary_factor"] == 1


@pytest.mark.parametrize("keys,named", [
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 6,
                          "long_factor": [2.0] * 8}}, "model.rope_scaling.short_factor must list a number above 0 for "
                                                      "each of the rotary_dim / 2 = 8 rotated pairs"),
    # at the top as transformers 4 wrote phi-4-mini's 0.75 (transformers 5's rope_parameters, where
    # this folder has 1.0, would win over it, in transformers' Phi3Config as here)
    ({"rope_parameters": None, "rope_theta": 1e4, "partial_rotary_factor": 0.1}, "model.partial_rotary_factor=0.1 "
     "rotates int(head_dim * partial_rotary_factor) = 1 dims"),
    ({"attention_dropout": 0.1}, "{'attention_dropout': 0.1}")])
def test_a_refused_phi3_is_one_line_from_convert_and_train(tmp_path, capsys, keys, named):
    """The refusal reaches the user as one line naming the key, no traceback: convert's and
    train's from checkpoint.init_from (exit 2, a config error): what tetrad lacks, and RoPE
    settings it has that do not fit the model (a factor list of the wrong length, an odd number
    of rotated dims)."""
    write_hf_phi3(tmp_path / "hf", num_hidden_layers=1)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, **keys}))
    capsys.readouterr()
    assert main(["convert", str(tmp_path / "hf"), "--to-tetrad", str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and named in err, err
    assert main(["train", f"--checkpoint.init_from={tmp_path / 'hf'}", "--train.steps=1", "--model.seq_len=32",
                 f"--run.dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and named in err, err
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "run").exists()


def test_a_phi3_with_what_phi3_lacks_exports_as_the_architecture_that_has_it(tmp_path):
    """model.hf_model_type = "phi3" on a model with qk-norm, q, k and v biases or Llama 3.1's
    scaling (a fine-tune may add the scaling) would be a Phi-3 that transformers computes otherwise:
    it exports as Qwen3, Qwen2 or Llama, the same math; a window stays Phi-3's."""
    from tetrad.train.hf_architectures import exported_type, hf_architecture
    for variant, written in (({"qk_norm": True}, "Qwen3ForCausalLM"), ({"qkv_bias": True}, "Qwen2ForCausalLM"),
                             (LLAMA31_ROPE, "LlamaForCausalLM"), ({"sliding_window": 5}, "Phi3ForCausalLM")):
        m = tiny_config(model={"hf_model_type": "phi3", "seq_len": 32, **variant}).model
        assert hf_architecture(m)["architectures"] == [written], variant
        assert exported_type(m) == ("phi3" if written == "Phi3ForCausalLM" else ""), variant
    # End to end, names and config together: a Phi-3 fine-tuned with Llama 3.1's scaling
    model = {"hf_model_type": "phi3", "vocab_size": 251, **LLAMA31_ROPE}
    cfg = tiny_config(model=model, train={"steps": 1}, checkpoint={"every": 1}, run={"dir": str(tmp_path / "run")})
    Trainer(cfg, torch.device("cpu")).fit()
    assert main(["convert", str(tmp_path / "run"), "--to-hf", str(tmp_path / "hf")]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    torch.testing.assert_close(logits(load_single(tmp_path / "run" / "checkpoints" / "step_00000001", model)),
                               hf_logits(tmp_path / "hf"), **TOL)


@pytest.mark.parametrize("family", ["qwen2", "phi3"])
def test_an_export_is_sharded_as_save_pretrained_and_reads_a_shard_at_a_time(tmp_path, monkeypatch, family):
    """--max-shard-gb cuts the weights into model-0000i-of-0000N.safetensors of at most that size
    (a larger tensor alone; Phi-3's fused tensors whole) and model.safetensors.index.json names
    each tensor's file, as save_pretrained writes them: transformers loads the folder to the
    source's logits, --to-tetrad reads it back, and the export reads the checkpoint one shard at
    a time, never more than a shard's bytes (so a model larger than the host's memory exports).
    --dtype bf16 writes every tensor, and config.json's torch_dtype, as bf16."""
    from safetensors import safe_open
    from tetrad.train.convert import StoredWeights, read_weights
    (write_hf_phi3 if family == "phi3" else write_hf_qwen)(tmp_path / "hf", max_position_embeddings=32)
    assert main(["convert", str(tmp_path / "hf"), "--to-tetrad", str(tmp_path / "ckpt")]) == 0
    limit = 40 * 2**10  # bytes: the 64 KiB embedding alone, a layer's tensors over a few files
    reads, read = [], StoredWeights.read
    monkeypatch.setattr(StoredWeights, "read", lambda self, names: reads.append(read(self, names)) or reads[-1])
    assert main(["convert", str(tmp_path / "ckpt"), "--to-hf", str(tmp_path / "out"),
                 "--max-shard-gb", str(limit / 2**30)]) == 0
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in (tmp_path / "out").glob("*.safetensors"))
    assert len(files) > 3 and set(index["weight_map"].values()) == set(files)
    assert files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    stored = {}
    for file in files:
        with safe_open(tmp_path / "out" / file, "pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        assert all(index["weight_map"][k] == file for k in tensors)
        assert len(tensors) == 1 or sum(t.nbytes for t in tensors.values()) <= limit
        stored.update(tensors)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in stored.values())
    assert len(reads) == len(files) and max(sum(t.nbytes for t in r.values()) for r in reads) <= 64 * 2**10
    torch.testing.assert_close(hf_logits(tmp_path / "out"), hf_logits(tmp_path / "hf"), **TOL)
    assert main(["convert", str(tmp_path / "out"), "--to-tetrad", str(tmp_path / "back")]) == 0
    ours, back = read_weights(tmp_path / "ckpt")[1], read_weights(tmp_path / "back")[1]
    assert all(torch.equal(back[name], p) for name, p in ours.items())

    assert main(["convert", str(tmp_path / "ckpt"), "--to-hf", str(tmp_path / "bf16"), "--dtype", "bf16"]) == 0
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    with safe_open(tmp_path / "bf16" / "model.safetensors", "pt") as f:
        assert all(torch.equal(f.get_tensor(k), stored[k].bfloat16()) for k in f.keys())
