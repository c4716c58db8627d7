"""Multi-token prediction in Hugging Face's format (train/hf_mtp.py): a tiny DeepSeek-V3 and GLM-4.5
with a multi-token-prediction layer as the Hub stores one (model.layers.N: a decoder layer's tensors,
enorm, hnorm, eh_proj, shared_head.norm and copies of the embedding and head) import as
model.mtp_layers = 1 with each tensor in its place (RoPE rows de-interleaved, experts stacked, its
expert bias), read alike by init_from (a tp2 fine-tune from the folder is one process's), export
back to the same tensors (transformers loads the export and computes the same logits), as the fp8
release's dequantized; fewer depths leave some out with a note, more start those past the
weights' as a fresh run draws them, with a note, alike in every layout; layers past
config.json's depths are counted and left out; a stale copy of the head is said and left out; an
architecture without such layers exports without them, said; a resume with another mtp_layers is
refused naming it."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import FileSystemWriter

from conftest import TINY, assert_parity, train_layout
from test_deepseek_fp8 import FP8, _quantized, _spread
from test_moe_hf import TOKENS, TOL, hf_logits, tensor_names, write_hf_moe
from tetrad.cli import main
from tetrad.config import load_config
from tetrad.dist.topology import Topology
from tetrad.model.moe import expert_biases
from tetrad.train.batches import split_batches
from tetrad.train.building import build_model
from tetrad.train.checkpoint import CheckpointError, digest_files, publish
from tetrad.train.checkpoint.store import check_model, one_process, read_extras
from tetrad.train.convert import checkpoint_folder, logical_shapes, read_weights
from tetrad.train.generate import single_process_model
from tetrad.train.hf_deepseek import deepseek_architecture, rope_orders
from tetrad.train.init_from import check_init_from, stored_expert_biases, stored_weights
from tetrad.train.inputs import model_keys

transformers = pytest.importorskip("transformers")

D = 32  # test_moe_hf's hidden_size
OWN = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
       "norm.weight": "shared_head.norm.weight"}  # tetrad's depth 0 -> the Hub's layer 2


def write_hf_mtp(folder: Path, family: str) -> dict[str, torch.Tensor]:
    """The family's tiny model with its third layer as the Hub's multi-token-prediction layer
    (num_hidden_layers 2, num_nextn_predict_layers 1); its tensors."""
    write_hf_moe(folder, family, num_hidden_layers=3)
    g = torch.Generator().manual_seed(1)
    tensors = load_file(folder / "model.safetensors")
    tensors.update({"model.layers.2.enorm.weight": 1 + 0.5 * torch.randn(D, generator=g),
                    "model.layers.2.hnorm.weight": 1 + 0.5 * torch.randn(D, generator=g),
                    "model.layers.2.eh_proj.weight": 0.2 * torch.randn(D, 2 * D, generator=g),
                    "model.layers.2.shared_head.norm.weight": 1 + 0.5 * torch.randn(D, generator=g),
                    "model.layers.2.embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
                    "model.layers.2.shared_head.head.weight": tensors["lm_head.weight"].clone()})
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    hf = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**hf, "num_hidden_layers": 2, "num_nextn_predict_layers": 1}))
    return tensors


def config(tmp_path, source: Path, **model):
    raw = {"train": {"steps": 1, "global_batch": 2, "micro_batch": 1}, "run": {"dir": str(tmp_path / "run")},
           "checkpoint": {"init_from": str(source)}, "model": {"seq_len": 16, **model}}
    return load_config(overrides=raw, model_from_inputs=model_keys)


def whole(handle) -> torch.Tensor:
    return handle[tuple(slice(0, n) for n in handle.shape)]


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_the_hubs_mtp_layer_imports_in_place_and_exports_back(tmp_path, family, capsys):
    hub = write_hf_mtp(tmp_path / "hf", family)
    assert main(["convert", str(tmp_path / "hf"), "--to-tetrad", str(tmp_path / "ckpt")]) == 0
    assert "tetrad: left out" not in capsys.readouterr().out  # the copies are copies
    cfg, state = read_weights(tmp_path / "ckpt")
    m = cfg.model
    assert m.mtp_layers == 1 and m.moe_layer(2)
    for ours, theirs in OWN.items():
        assert torch.equal(state[f"mtp.0.{ours}"], hub[f"model.layers.2.{theirs}"]), ours
    assert not any("embed_tokens" in n or "shared_head" in n for n in state)  # the model's own are shared
    experts = state["mtp.0.block.mlp.experts.w2"]
    assert experts.shape[0] == m.n_experts and all(torch.equal(experts[j], hub[f"model.layers.2.mlp.experts.{j}.down_proj.weight"])
                                                   for j in range(m.n_experts))
    assert torch.equal(state["mtp.0.block.mlp.router.weight"], hub["model.layers.2.mlp.gate.weight"])
    assert torch.equal(state["mtp.0.block.attn_norm.weight"], hub["model.layers.2.input_layernorm.weight"])
    if family == "deepseek_v3":  # its q and k rope rows de-interleaved, as a main layer's
        order = rope_orders(m, True)["mtp.0.block.attn.wq_b.weight"]
        assert not torch.equal(order, torch.arange(len(order)))
        assert torch.equal(state["mtp.0.block.attn.wq_b.weight"], hub["model.layers.2.self_attn.q_b_proj.weight"][order])
    else:
        assert torch.equal(state["mtp.0.block.attn.wq.bias"], hub["model.layers.2.self_attn.q_proj.bias"])
    biases = read_extras(checkpoint_folder(tmp_path / "ckpt"), "expert_bias")
    assert torch.equal(biases["mtp.0.block.mlp"], hub["model.layers.2.mlp.gate.e_score_correction_bias"])
    assert biases["mtp.0.block.mlp"].abs().max() > 0
    # init_from and generate's reader find every tensor in the folder itself, the biases too
    from_folder = stored_weights(tmp_path / "hf")
    assert all(torch.equal(whole(from_folder(name)), tensor) for name, tensor in state.items())
    assert torch.equal(stored_expert_biases(tmp_path / "hf")["mtp.0.block.mlp"], biases["mtp.0.block.mlp"])
    theirs = hf_logits(tmp_path / "hf")  # transformers skips the layer: the main model's logits
    got = single_process_model(m, state, biases=biases)(TOKENS, torch.arange(TOKENS.shape[1])).detach()
    torch.testing.assert_close(got, theirs, **TOL)

    assert main(["convert", str(tmp_path / "ckpt"), "--to-hf", str(tmp_path / "back")]) == 0
    assert json.loads((tmp_path / "back" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert set(back) == set(hub) and all(torch.equal(back[k], hub[k]) for k in hub)  # interleaved again, the copies
    torch.testing.assert_close(hf_logits(tmp_path / "back"), theirs, **TOL)


def test_init_from_keeps_fewer_depths_and_more_with_a_note(tmp_path, capsys):
    """An HF folder and a tetrad checkpoint alike: model.mtp_layers follows the weights; fewer
    leave the others unread, more start the others fresh (the folder's weights still fit), said in
    one line."""
    write_hf_mtp(tmp_path / "hf", "deepseek_v3")
    assert main(["convert", str(tmp_path / "hf"), "--to-tetrad", str(tmp_path / "ckpt")]) == 0
    for source in (tmp_path / "hf", tmp_path / "ckpt"):
        assert config(tmp_path, source).model.mtp_layers == 1
        check_init_from(config(tmp_path, source))
        capsys.readouterr()
        check_init_from(config(tmp_path, source, mtp_layers=0))
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "left out 1 of its 1 multi-token-prediction depths (model.mtp_layers=0)" in err
        check_init_from(config(tmp_path, source, mtp_layers=3))
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"model.mtp_layers=3 and checkpoint.init_from={str(source)!r} holds 1 " \
            "multi-token-prediction depth: depths 2-3 start fresh" in err


def _without_init_from(cfg):
    return dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, init_from=""))


def test_depths_past_the_weights_start_as_a_fresh_run_s(tmp_path, capsys):
    """Continued pre-training adding depths: from a transformers-saved DeepSeek-V3 (config.json names
    a depth, the files hold none) and from a checkpoint of one depth, at model.mtp_layers=2 the depths
    the weights hold are theirs, the others (their MoE layer's expert bias too) those a fresh run of
    the config draws, said in one line."""
    write_hf_mtp(tmp_path / "hf", "deepseek_v3")
    assert main(["convert", str(tmp_path / "hf"), "--to-tetrad", str(tmp_path / "ckpt")]) == 0
    write_hf_moe(tmp_path / "saved", "deepseek_v3")
    for source, held, fresh in ((tmp_path / "saved", 0, "depths 1-2 start"), (tmp_path / "ckpt", 1, "depth 2 starts")):
        cfg = config(tmp_path, source, mtp_layers=2)
        capsys.readouterr()
        check_init_from(cfg)
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"holds {held} multi-token-prediction depth" in err and f"{fresh} fresh" in err
        model, new = build_model(cfg, Topology.single()), build_model(_without_init_from(cfg), Topology.single())
        weights, drawn = stored_weights(source), dict(new.named_parameters())
        for name, p in model.named_parameters():
            theirs = not name.startswith("mtp.") or int(name.split(".")[1]) < held
            assert torch.equal(p, whole(weights(name)).to(p.dtype) if theirs else drawn[name]), name
        biases, stored = expert_biases(model), stored_expert_biases(source)
        assert not biases["mtp.1.block.mlp"].any() and biases.keys() == expert_biases(new).keys()
        assert set(stored) == {layer for layer in biases if not layer.startswith("mtp.") or int(layer[4]) < held}
        assert all(torch.equal(biases[layer], bias) for layer, bias in stored.items())


@pytest.mark.dist
@pytest.mark.parametrize("family, parallel", [("deepseek_v3", {"tp": 2, "sequence_parallel": True}),
                                              ("llama", {"pp": 2})])
def test_a_fine_tune_adding_a_depth_is_one_process_s(tmp_path, family, parallel):
    """A depth the weights lack (a transformers-saved DeepSeek-V3, an exported Llama) starts alike in
    every layout: tp2 with SP and pp2 take one process's steps and mtp_loss, and the depth trains."""
    if family == "llama":
        _checkpoint(tmp_path / "ckpt", {**TINY["model"], "d_model": 32, "ffn_hidden": 48, "vocab_size": 256})
        assert main(["convert", str(tmp_path / "ckpt"), "--to-hf", str(tmp_path / "hf")]) == 0
    else:
        write_hf_moe(tmp_path / "hf", family)
    cfgs = [load_config(overrides={"train": {**TINY["train"], "steps": 2}, "run": {"dir": str(tmp_path / name)},
                                   "model": {"seq_len": 32, "mtp_layers": 1}, "parallel": layout,
                                   "checkpoint": {"init_from": str(tmp_path / "hf")}}, model_from_inputs=model_keys)
            for name, layout in (("one", {}), ("layout", parallel))]
    ref, got = map(train_layout, cfgs)
    assert_parity(got, ref, atol=1e-4)
    torch.testing.assert_close(torch.tensor([r["mtp_loss"] for r in got[2]]),
                               torch.tensor([r["mtp_loss"] for r in ref[2]]), rtol=1e-5, atol=1e-6)
    start = build_model(cfgs[0], Topology.single()).state_dict()
    assert (ref[1]["mtp.0.eh_proj.weight"] - start["mtp.0.eh_proj.weight"]).abs().max() > 0


@pytest.mark.dist
def test_a_fine_tune_from_the_hubs_mtp_layer_under_tp_is_one_process_s(tmp_path):
    """init_from the folder with its depth: tp2 with SP (each rank reading its part of the depth's
    experts and de-interleaved RoPE rows) takes one process's steps and mtp_loss; the first loss is
    transformers' (the depth does not touch it), and a run leaving the depth out starts with it too."""
    write_hf_mtp(tmp_path / "hf", "deepseek_v3")
    runs = []
    for name, parallel, model in (("tp1", {}, {}), ("tp2", {"tp": 2, "sequence_parallel": True}, {}),
                                  ("none", {}, {"mtp_layers": 0})):
        cfg = load_config(overrides={"train": {**TINY["train"], "steps": 2}, "run": {"dir": str(tmp_path / name)},
                                     "model": {"seq_len": 32, **model}, "parallel": parallel,
                                     "checkpoint": {"init_from": str(tmp_path / "hf")}}, model_from_inputs=model_keys)
        assert cfg.model.mtp_layers == model.get("mtp_layers", 1)
        runs.append(train_layout(cfg))
    assert_parity(runs[1], runs[0], atol=1e-4)
    torch.testing.assert_close(torch.tensor([r["mtp_loss"] for r in runs[1][2]]),
                               torch.tensor([r["mtp_loss"] for r in runs[0][2]]), rtol=1e-5, atol=1e-6)
    inputs, labels = split_batches(cfg)[0].global_batch_at(0)
    first = float(F.cross_entropy(hf_logits(tmp_path / "hf", inputs).flatten(0, 1), labels.flatten()))
    assert runs[0][0][0] == pytest.approx(first, rel=1e-5) and runs[2][0][0] == pytest.approx(first, rel=1e-5)
    assert "mtp_loss" not in runs[2][2][0] and len(runs[0][2][0]["mtp_loss"]) == 1


def test_a_resume_with_other_depths_is_refused_naming_the_key(tmp_path):
    m = load_config(overrides={"model": {"mtp_layers": 1}}).model
    with pytest.raises(CheckpointError, match=r"model.mtp_layers = 1 in the checkpoint, 0 here"):
        check_model({"model": dataclasses.asdict(m)}, dataclasses.replace(m, mtp_layers=0), tmp_path)


def test_a_stale_copy_of_the_head_is_said_and_the_models_own_kept(tmp_path, capsys):
    """A fine-tune by code that computes no depth (transformers') trains the head, not its copy:
    convert and init_from say so in one line and keep the model's own (tetrad's depths share it)."""
    hub = write_hf_mtp(tmp_path / "hf", "deepseek_v3")
    save_file({**hub, "model.layers.2.shared_head.head.weight": torch.zeros_like(hub["lm_head.weight"])},
              tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    assert main(["convert", str(tmp_path / "hf"), "--to-tetrad", str(tmp_path / "ckpt")]) == 0
    out = capsys.readouterr().out
    assert "model.layers.2.shared_head.head.weight is not a copy of the model's own embedding or head" in out
    assert out.count("\n") == 2  # that line, and the one saying where the checkpoint is
    _, state = read_weights(tmp_path / "ckpt")
    assert torch.equal(state["head.weight"], hub["lm_head.weight"])
    check_init_from(config(tmp_path, tmp_path / "hf"))  # init_from says it too, before any rank starts
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "shared_head.head.weight is not a copy of the model's own embedding or head" in err


def test_transformers_save_pretrained_folder_names_depths_it_has_not(tmp_path, capsys):
    """save_pretrained writes num_nextn_predict_layers=1 and no such layer: the model has none."""
    write_hf_moe(tmp_path / "hf", "glm4_moe")
    assert config(tmp_path, tmp_path / "hf").model.mtp_layers == 0
    assert main(["convert", str(tmp_path / "hf"), "--to-tetrad", str(tmp_path / "ckpt")]) == 0
    assert "holds 0 of the num_nextn_predict_layers=1 multi-token-prediction layers its config.json names" \
        in capsys.readouterr().out
    assert read_weights(tmp_path / "ckpt")[0].model.mtp_layers == 0


def test_layers_past_the_depths_config_json_names_are_left_out_and_counted(tmp_path, capsys):
    hub = write_hf_mtp(tmp_path / "hf", "glm4_moe")
    hf = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**hf, "num_nextn_predict_layers": 0}))
    assert main(["convert", str(tmp_path / "hf"), "--to-tetrad", str(tmp_path / "ckpt")]) == 0
    layer = sum(".layers.2." in k for k in hub)
    assert f"tetrad: left out {layer} tensors of multi-token-prediction layers past model.mtp_layers=0\n" \
        in capsys.readouterr().out and layer > 20
    assert read_weights(tmp_path / "ckpt")[0].model.mtp_layers == 0


def test_the_fp8_releases_mtp_layer_reads_dequantized(tmp_path):
    """DeepSeek-V3's fp8 release quantizes its MTP layer's Linear weights as a main layer's."""
    hub = write_hf_mtp(tmp_path / "hf", "deepseek_v3")
    quantized, dequantized = {}, {}
    for key, w in hub.items():
        if w.dim() == 2 and ".layers.2." in key and "embed_tokens" not in key and "shared_head.head" not in key:
            quantized[key], quantized[key + "_scale_inv"] = _quantized(w)
            dequantized[key] = quantized[key].float() * _spread(quantized[key + "_scale_inv"], w.shape)
        else:
            quantized[key] = dequantized[key] = w
    for folder, tensors in (("fp8", quantized), ("plain", dequantized)):
        (tmp_path / folder).mkdir()
        save_file(tensors, tmp_path / folder / "model.safetensors", metadata={"format": "pt"})
    hf = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "fp8" / "config.json").write_text(json.dumps({**hf, "quantization_config": FP8}))
    (tmp_path / "plain" / "config.json").write_text(json.dumps(hf))
    assert quantized["model.layers.2.eh_proj.weight"].dtype == torch.float8_e4m3fn
    ours, theirs = stored_weights(tmp_path / "fp8"), stored_weights(tmp_path / "plain")
    for name in ("mtp.0.eh_proj.weight", "mtp.0.block.attn.wq_b.weight", "mtp.0.block.mlp.experts.w1"):
        got = whole(ours(name))
        assert got.dtype == torch.float32 and torch.equal(got, whole(theirs(name))), name
    assert not torch.equal(whole(theirs("mtp.0.eh_proj.weight")), hub["model.layers.2.eh_proj.weight"])  # quantized
    assert main(["convert", str(tmp_path / "fp8"), "--to-tetrad", str(tmp_path / "ckpt")]) == 0
    _, state = read_weights(tmp_path / "ckpt")
    assert torch.equal(state["mtp.0.eh_proj.weight"], whole(theirs("mtp.0.eh_proj.weight")).bfloat16())


def _checkpoint(out: Path, model: dict) -> dict[str, torch.Tensor]:
    """A weights-only tetrad checkpoint of `model` with random weights; its state."""
    cfg = load_config(overrides={"model": model})
    torch.manual_seed(0)
    state = {name: 0.3 * torch.randn(shape) for name, shape in logical_shapes(cfg.model).items()}
    tmp = out.with_name(out.name + ".partial")
    tmp.mkdir(parents=True)
    with one_process():
        dcp.save({f"model.{n}": t for n, t in state.items()}, storage_writer=FileSystemWriter(tmp), no_dist=True)
    publish(tmp, out, cfg, 0, digest_files(tmp, 0, 1), optimizer=False, layout={})
    return state


def test_an_architecture_without_mtp_layers_exports_the_model_without_them(tmp_path, capsys):
    """LlamaForCausalLM has no multi-token-prediction layer: the export leaves the depths out,
    said in one line, and computes the model's logits (before: KeyError 'enorm')."""
    model = {"n_layers": 2, "d_model": 32, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 48, "vocab_size": 256,
             "seq_len": 32, "mtp_layers": 2}
    state = _checkpoint(tmp_path / "ckpt", model)
    assert main(["convert", str(tmp_path / "ckpt"), "--to-hf", str(tmp_path / "hf")]) == 0
    out = capsys.readouterr().out
    assert "tetrad: left out the 2 multi-token-prediction depths (model.mtp_layers): LlamaForCausalLM has no such " \
           "layers" in out
    assert "num_nextn_predict_layers" not in json.loads((tmp_path / "hf" / "config.json").read_text())
    assert not any(".layers.2." in k or ".layers.3." in k for k in tensor_names(tmp_path / "hf"))
    m = load_config(overrides={"model": model}).model
    ours = single_process_model(m, state)(TOKENS, torch.arange(TOKENS.shape[1])).detach()
    torch.testing.assert_close(hf_logits(tmp_path / "hf"), ours, **TOL)


def test_a_dense_latent_models_depths_export_as_dense_layers():
    """A DeepSeek-V3 export without experts makes every layer dense by first_k_dense_replace, the
    depths' layers (n_layers + k) too: else a reader of the config would build them MoE."""
    m = load_config(overrides={"model": {"kv_lora_rank": 16, "q_lora_rank": 24, "qk_nope_head_dim": 12,
                                         "qk_rope_head_dim": 4, "v_head_dim": 12, "n_kv_heads": 4,
                                         "mtp_layers": 2}}).model
    keys = deepseek_architecture(m)
    assert (keys["first_k_dense_replace"], keys["num_nextn_predict_layers"]) == (m.n_layers + 2, 2)
