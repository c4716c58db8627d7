"""DeepSeek-V3's fp8 release (train/hf_fp8.py) read as its dequantized weights: a tiny V3 built by
transformers (tests/test_moe_hf.py's write_hf_moe), its Linear weights quantized here to
float8_e4m3fn with an inverse scale per 8x8 block (the last blocks of a 12-row or 28-column weight
partial), reads exactly as the folder of its dequantized fp32 weights does: every tensor and part
of one, the logits (transformers' on that folder; tetrad generate's model), convert --to-tetrad (in bf16) and a fine-tune
under tp2 reading each rank's rows and their blocks' scales alone; other quantizations are refused."""

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from conftest import assert_parity, train_layout
from test_moe_hf import TOKENS, TOL, config, hf_logits, write_hf_moe
from tetrad.cli import main
from tetrad.config import ConfigError, ModelConfig
from tetrad.data.tokenizer import byte_tokenizer
from tetrad.train.batches import split_batches
from tetrad.train.convert import read_weights
from tetrad.train.hf_folder import hf_model_keys
from tetrad.train.generate import load_generator, single_process_model
from tetrad.train.hf_architectures import model_config_from_hf
from tetrad.train.checkpoint import CheckpointError
from tetrad.train.init_from import check_init_from, stored_expert_biases, stored_weights

pytest.importorskip("transformers")

BLOCK = [8, 8]
FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": BLOCK}


def _quantized(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w as float8_e4m3fn and the inverse scale of each block (its largest |w| at e4m3's 448)."""
    rows, cols = -(-w.shape[0] // BLOCK[0]), -(-w.shape[1] // BLOCK[1])
    padded = F.pad(w.abs(), (0, cols * BLOCK[1] - w.shape[1], 0, rows * BLOCK[0] - w.shape[0]))
    scale_inv = padded.view(rows, BLOCK[0], cols, BLOCK[1]).amax(dim=(1, 3)) / 448.0
    return (w / _spread(scale_inv, w.shape)).to(torch.float8_e4m3fn), scale_inv


def _spread(scale_inv: torch.Tensor, shape) -> torch.Tensor:
    return torch.kron(scale_inv, torch.ones(BLOCK))[:shape[0], :shape[1]]


def write_fp8_folders(tmp_path: Path) -> tuple[Path, Path]:
    """A tiny DeepSeek-V3 as its fp8 release stores it (every Linear weight but the embedding, the
    head and the routers') and the folder of its dequantized weights (fp32), as DeepSeek's
    fp8_cast_bf16.py writes one before its rounding."""
    write_hf_moe(tmp_path / "hf", "deepseek_v3")
    fp8, plain = tmp_path / "fp8", tmp_path / "dequantized"
    for folder in (fp8, plain):
        shutil.copytree(tmp_path / "hf", folder)
    tensors, quantized, dequantized = load_file(tmp_path / "hf" / "model.safetensors"), {}, {}
    for key, w in tensors.items():
        if w.dim() == 2 and "embed_tokens" not in key and "lm_head" not in key and not key.endswith("mlp.gate.weight"):
            quantized[key], quantized[key + "_scale_inv"] = _quantized(w)
            dequantized[key] = quantized[key].float() * _spread(quantized[key + "_scale_inv"], w.shape)
        else:
            quantized[key] = dequantized[key] = w
    save_file(quantized, fp8 / "model.safetensors", metadata={"format": "pt"})
    save_file(dequantized, plain / "model.safetensors", metadata={"format": "pt"})
    hf = json.loads((fp8 / "config.json").read_text())
    (fp8 / "config.json").write_text(json.dumps({**hf, "quantization_config": FP8}))
    return fp8, plain


def _logits(m, folder: Path) -> torch.Tensor:
    with torch.no_grad():
        model = single_process_model(m, stored_weights(folder), biases=stored_expert_biases(folder))
        return model(TOKENS, torch.arange(TOKENS.shape[1]))


def test_an_fp8_folder_reads_and_converts_as_its_dequantized_weights(tmp_path):
    fp8, plain = write_fp8_folders(tmp_path)
    stored = load_file(fp8 / "model.safetensors")
    assert stored["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"].dtype == torch.float8_e4m3fn
    assert stored["model.layers.1.self_attn.kv_a_proj_with_mqa.weight_scale_inv"].shape == (2, 4)  # 12 x 32: a half block
    # the folders' model (config.json's num_nextn_predict_layers=1, which save_pretrained writes with no such layer: none)
    m_cfg = hf_model_keys(fp8, json.loads((fp8 / "config.json").read_text()))[0]
    assert m_cfg == hf_model_keys(plain, json.loads((plain / "config.json").read_text()))[0] and m_cfg["mtp_layers"] == 0
    ours, theirs = stored_weights(fp8), stored_weights(plain)
    parts = {"layers.1.attn.wkv_a.weight": (slice(5, 11), slice(3, 27)), "layers.1.attn.wq_b.weight": (slice(13, 29), slice(1, 9)),
             "layers.1.mlp.experts.w2": (slice(1, 3), slice(5, 31), slice(9, 12)), "layers.0.mlp.w1.weight": (slice(20, 40), slice(0, 32)),
             "layers.1.attn_norm.weight": (slice(3, 9),)}
    for name, box in parts.items():  # whole, and a part starting and ending inside blocks (the experts' [E, H, d] too)
        for box in (tuple(slice(0, n) for n in ours(name).shape), box):
            got = ours(name)[box]
            assert got.dtype == torch.float32 and torch.equal(got, theirs(name)[box]), (name, box)
    m = ModelConfig(**m_cfg)
    got, expected = _logits(m, fp8), hf_logits(plain)
    assert torch.equal(got, _logits(m, plain))
    byte_tokenizer().save(str(fp8 / "tokenizer.json"))  # tetrad generate's reader, its checks passed
    generator, _, _ = load_generator(fp8)
    with torch.no_grad():
        assert torch.equal(generator(TOKENS, torch.arange(TOKENS.shape[1])), got)
    torch.testing.assert_close(got, expected, **TOL)
    assert (expected - hf_logits(tmp_path / "hf")).abs().max() > 100 * TOL["atol"]  # the weights were quantized

    for folder in (fp8, plain):
        assert main(["convert", str(folder), "--to-tetrad", str(tmp_path / f"{folder.name}.ckpt")]) == 0
    (_, converted), (_, reference) = read_weights(tmp_path / "fp8.ckpt"), read_weights(tmp_path / "dequantized.ckpt")
    assert converted["layers.1.attn.wkv_a.weight"].dtype == torch.bfloat16  # as the release's other tensors
    assert converted["embed.weight"].dtype == torch.float32  # not quantized: as stored
    assert all(torch.equal(v, reference[k].to(v.dtype)) for k, v in converted.items())
    assert main(["convert", str(tmp_path / "fp8.ckpt"), "--to-hf", str(tmp_path / "back")]) == 0
    assert "quantization_config" not in json.loads((tmp_path / "back" / "config.json").read_text())
    assert not any(k.endswith("_scale_inv") for k in load_file(tmp_path / "back" / "model.safetensors"))


@pytest.mark.dist
def test_an_fp8_folder_fine_tunes_under_tp_as_on_one_process(tmp_path):
    """tp2 with SP: each rank dequantizes its rows (wq_b's 40 split mid-block) or columns from
    their blocks' scales alone; the first loss is transformers' on the dequantized folder."""
    fp8, plain = write_fp8_folders(tmp_path)
    runs = []
    for parallel in ({}, {"tp": 2, "sequence_parallel": True}):
        cfg = config(tmp_path, f"run{len(runs)}", 2, parallel=parallel, checkpoint={"init_from": str(fp8)})
        check_init_from(cfg)  # the weights, their scales aside, fit config.json's model
        runs.append(train_layout(cfg))
    inputs, labels = split_batches(cfg)[0].global_batch_at(0)
    logits = hf_logits(plain, inputs)
    assert runs[0][0][0] == pytest.approx(float(F.cross_entropy(logits.flatten(0, 1), labels.flatten())), rel=1e-5)
    assert_parity(runs[1], runs[0], atol=1e-4)


@pytest.mark.parametrize("quantization,named", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes'"),
    ({**FP8, "fmt": "e5m2"}, "fmt 'e5m2'"),
    ({**FP8, "activation_scheme": "static"}, "activation_scheme 'static'"),
    ({**FP8, "scale_fmt": "ue8m0"}, "scale_fmt 'ue8m0'"),
    ({**FP8, "weight_block_size": None}, "weight_block_size None"),
    ({**FP8, "weight_block_size": [128]}, r"weight_block_size \[128\]"),
    ({**FP8, "weight_block_size": [128, 0]}, r"weight_block_size \[128, 0\]")])
def test_quantizations_tetrad_cannot_dequantize_are_refused_in_one_line(quantization, named):
    hf = {"model_type": "deepseek_v3", "vocab_size": 256, "hidden_size": 32, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 40, "n_routed_experts": 8,
          "first_k_dense_replace": 1, "quantization_config": quantization}
    with pytest.raises(ConfigError, match=named + ".*tetrad dequantizes quant_method 'fp8' with fmt 'e4m3'") as e:
        model_config_from_hf(hf, Path("config.json"))
    assert "\n" not in str(e.value)


def test_an_fp8_weight_without_its_scale_is_refused_by_name(tmp_path, capsys):
    """Its fp8 values alone are not the weight: reading them as they are would train on garbage."""
    fp8, _ = write_fp8_folders(tmp_path)
    tensors = load_file(fp8 / "model.safetensors")
    del tensors["model.layers.1.self_attn.kv_a_proj_with_mqa.weight_scale_inv"]
    save_file(tensors, fp8 / "model.safetensors", metadata={"format": "pt"})
    named = r"kv_a_proj_with_mqa.weight is stored in fp8 with no .*_scale_inv beside it"
    with pytest.raises(CheckpointError, match=named):
        stored_weights(fp8)("layers.1.attn.wkv_a.weight")
    assert main(["convert", str(fp8), "--to-tetrad", str(tmp_path / "ckpt")]) != 0
    assert "is stored in fp8 with no" in capsys.readouterr().err
