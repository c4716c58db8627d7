"""`tetrad convert`: a checkpoint from any layout -> HF safetensors -> LlamaForCausalLM gives the same
logits, and HF weights -> tetrad checkpoint gives the same model back."""

import copy
import dataclasses
import importlib.util
import json
import warnings
from pathlib import Path

import pytest
import torch

from conftest import tiny_config, train_layout
from tetrad.cli import main
from tetrad.train.checkpoint import Checkpointer
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
    hf = transformers.LlamaForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").eval()
    with torch.no_grad():
        return hf(TOKENS).logits


# Llama 3.1's RoPE: theta 500000 and its frequency scaling, over an original context shorter than
# the test's 32 tokens, so that every frequency band (kept, blended, slowed) is in use.
LLAMA31_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 16}
LLAMA31_ROPE = {"rope_theta": 500000.0, "rope_scaling": LLAMA31_SCALING}

# fp32, the same math in a different order (as in test_model_hf): 1e-4 catches any real mismatch.
TOL = {"atol": 1e-4, "rtol": 1e-4}


@pytest.mark.dist
@pytest.mark.parametrize("parallel,model", [({"tp": 2}, {"vocab_size": 251}),  # padded vocab under tp
                                            ({"dp": 2}, {"vocab_size": 251, "tie_embeddings": True}),
                                            ({"dp": 2, "tp": 2, "zero": 3}, {"vocab_size": 251}),
                                            ({"pp": 2, "tp": 2, "zero": 1}, {"vocab_size": 251}),
                                            ({"dp": 2}, {"vocab_size": 251, **LLAMA31_ROPE})])
def test_checkpoint_to_hf_and_back(tmp_path, parallel, model):
    cfg = tiny_config(parallel=parallel, model=model, train={"steps": 2, "micro_batch": 1}, checkpoint={"every": 2})
    train_layout(cfg)
    root = Path(cfg.run.dir) / "checkpoints"
    assert main(["convert", str(root), "--to-hf", str(tmp_path / "hf")]) == 0
    ours = load_single(root / "step_00000002", model)
    torch.testing.assert_close(logits(ours), hf_logits(tmp_path / "hf"), **TOL)

    assert main(["convert", str(tmp_path / "hf"), "--to-tetrad", str(tmp_path / "back")]) == 0
    back = load_single(tmp_path / "back", model)
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


def test_rope_read_from_either_transformers_config_form():
    """transformers 4 writes `rope_theta` and `rope_scaling` (its older key `type`) at the top;
    transformers 5 writes `rope_parameters`. Other scalings are refused by name."""
    from tetrad.config import ConfigError
    from tetrad.train.convert import model_config_from_hf
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
    with pytest.raises(ConfigError, match="tetrad's Llama has no {'rope_scaling': {'rope_type': 'yarn'"):
        model_config_from_hf({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, Path("config.json"))


def test_hf_weights_that_do_not_fit_config_are_refused(tmp_path, capsys):
    hf_cfg = transformers.LlamaConfig(vocab_size=251, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    transformers.LlamaForCausalLM(hf_cfg).save_pretrained(tmp_path / "hf", safe_serialization=True)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    assert main(["convert", str(tmp_path / "hf"), "--to-tetrad", str(tmp_path / "ckpt")]) == 1
    err = capsys.readouterr().err
    assert "model.layers.0.mlp.gate_proj.weight: (128, 64) in the file, (96, 64) for config.json's model" in err
    assert not (tmp_path / "ckpt").exists()
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"truncated")  # a broken file: one line, no traceback
    assert main(["convert", str(tmp_path / "hf"), "--to-tetrad", str(tmp_path / "ckpt")]) == 1
    assert "model.safetensors is not a readable safetensors file" in capsys.readouterr().err


def test_to_hf_refuses_a_folder_with_another_exports_shards(tmp_path, capsys):
    """Readers that take every *.safetensors (init_from, --to-tetrad) would mix the two exports."""
    cfg = tiny_config(train={"steps": 1}, checkpoint={"every": 1}, run={"dir": str(tmp_path / "run")})
    Trainer(cfg, torch.device("cpu")).fit()
    out = tmp_path / "hf"
    out.mkdir()
    (out / "model-00001-of-00002.safetensors").write_bytes(b"old")
    assert main(["convert", str(tmp_path / "run"), "--to-hf", str(out)]) == 1
    assert "holds model-00001-of-00002.safetensors from another export; write into a new folder" in \
        capsys.readouterr().err
    assert not (out / "model.safetensors").exists()
    (out / "model-00001-of-00002.safetensors").unlink()
    assert main(["convert", str(tmp_path / "run"), "--to-hf", str(out)]) == 0  # written again over its own export
    assert main(["convert", str(tmp_path / "run"), "--to-hf", str(out)]) == 0



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
        assert main(["convert", str(source), "--to-tetrad", str(tmp_path / "ckpt")]) == 1
        err = capsys.readouterr().err
        assert f"{source} is not a Hugging Face model folder (no config.json)" in err and hint in err, err
        assert err.count("\n") == 1 and not (tmp_path / "ckpt").exists()
