"""The attention variants of the Qwen families, as every layout trains them:
- q, k and v biases (model.qkv_bias: Qwen2 / Qwen2.5), split over tp with their weights' rows;
- qk-norm (model.qk_norm: Qwen3), an RMSNorm over each head of q and k whose one weight every tp
  rank holds and whose gradient each makes from its own heads (summed over tp even without SP),
  with its own head_dim (q and the attention output n_heads * head_dim wide, not d_model).
The planner must count both wherever it counts parameters. And Gemma 3's block (GEMMA3), as every
layout trains it: Gemma's RMSNorm (fp32, 1 + weight), GeGLU, the embedding times sqrt(d_model),
qk-norm, sandwich norms, its softmax scale, and per-layer attention (a sliding layer of window 5
with its own RoPE theta, a global one with linear RoPE scaling); tied embeddings."""

import json
from functools import lru_cache

import pytest
import torch

from conftest import assert_parity, doc_shards, tiny_config, train_layout
from tetrad.dist.topology import Topology
from tetrad.model.flops import parameter_count
from tetrad.train.checkpoint import MANIFEST, CheckpointError
from tetrad.train.trainer import Trainer, build_model

QWEN2 = {"qkv_bias": True}
QWEN3 = {"qk_norm": True, "head_dim": 24}  # 4 heads of 24 over d_model 64
GEMMA3 = {"norm": "gemma_rmsnorm", "mlp": "geglu", "scale_embeddings": True, "sandwich_norm": True, "qk_norm": True,
          "head_dim": 24, "query_pre_attn_scalar": 20.0, "sliding_window": 5,
          "layer_types": ["sliding_attention", "full_attention"], "rope_local_base_freq": 100.0,
          "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "tie_embeddings": True}
SLIDING, FULL = "sliding_attention", "full_attention"
# family (a layout name's first word) -> (model, train keys that change the training: its reference's)
FAMILIES = {"qwen2": (QWEN2, {}), "qwen3": (QWEN3, {}), "gemma3": (GEMMA3, {}),
            "gemma3docs": (GEMMA3, {"document_mask": True}),  # a mask per window: documents alone, and with it
            "gemma3deep": ({**GEMMA3, "n_layers": 4, "layer_types": [SLIDING, FULL, SLIDING, SLIDING]}, {})}
LAYOUTS = {  # name -> (parallel, model[, train keys that leave the training alone])
    "qwen2-tp2-sp": ({"tp": 2, "sequence_parallel": True}, QWEN2),
    "qwen2-dp2-zero3": ({"dp": 2, "zero": 3}, QWEN2),
    "qwen2-pp2-zb": ({"pp": 2, "schedule": "zb"}, QWEN2),
    "qwen2-cp2-ring": ({"cp": 2, "cp_algo": "ring"}, QWEN2),
    "qwen2-dp2-tp2-zero2": ({"dp": 2, "tp": 2, "zero": 2}, QWEN2),
    "qwen3-tp2": ({"tp": 2}, QWEN3),  # the norm weights' gradients summed over tp without SP
    "qwen3-tp2-sp": ({"tp": 2, "sequence_parallel": True}, QWEN3),
    "qwen3-dp2-tp2-zero1": ({"dp": 2, "tp": 2, "zero": 1}, QWEN3),
    "qwen3-dp2-zero3": ({"dp": 2, "zero": 3}, QWEN3),
    "qwen3-pp2-zb": ({"pp": 2, "schedule": "zb"}, QWEN3),
    "qwen3-cp2-alltoall": ({"cp": 2, "cp_algo": "alltoall"}, QWEN3),
    "gemma3-tp2": ({"tp": 2}, GEMMA3),
    "gemma3-tp2-sp": ({"tp": 2, "sequence_parallel": True}, GEMMA3),
    "gemma3-cp2-ring": ({"cp": 2, "cp_algo": "ring"}, GEMMA3),  # the window's blocks in one layer, all in the other
    "gemma3-cp2-alltoall": ({"cp": 2, "cp_algo": "alltoall"}, GEMMA3),
    "gemma3-pp2-1f1b": ({"pp": 2}, GEMMA3),  # a sliding layer on one stage, the global one on the other
    "gemma3-pp2-zb": ({"pp": 2, "schedule": "zb"}, GEMMA3),
    "gemma3-dp2-zero3": ({"dp": 2, "zero": 3}, GEMMA3),
    "gemma3-dp2-tp2-sp-zero1": ({"dp": 2, "tp": 2, "sequence_parallel": True, "zero": 1}, GEMMA3),
    "gemma3-cp2-ring-tp2-sp": ({"cp": 2, "tp": 2, "sequence_parallel": True}, GEMMA3),
    "gemma3-dp2-zero3-selective": ({"dp": 2, "zero": 3}, GEMMA3, {"recompute": "selective"}),
    "gemma3-cp2-alltoall-compile": ({"cp": 2, "cp_algo": "alltoall"}, GEMMA3, {"compile": True}),
    "gemma3docs-tp2-sp-full": ({"tp": 2, "sequence_parallel": True}, GEMMA3, {"recompute": "full"}),
    "gemma3docs-cp2-ring-selective-op": ({"cp": 2, "cp_algo": "ring"}, GEMMA3, {"recompute": "selective-op"}),
    "gemma3docs-cp2-alltoall": ({"cp": 2, "cp_algo": "alltoall"}, GEMMA3),
    "gemma3deep-pp2-vpp2-interleaved": ({"pp": 2, "vpp": 2, "schedule": "interleaved"}, FAMILIES["gemma3deep"][0]),
}


def _config(family: str, parallel: dict, train: dict):
    model, changes = FAMILIES[family]
    data = {"source": doc_shards()} if changes.get("document_mask") else {}
    return tiny_config(parallel=parallel, model=model, train={**changes, **train}, data=data)


@lru_cache(maxsize=None)
def _train(name: str):
    parallel, _, *train = LAYOUTS[name]
    return train_layout(_config(name.split("-")[0], parallel, train[0] if train else {}),
                        timeout_s=900 if "compile" in name else 300)


@lru_cache(maxsize=None)
def _one_process(family: str):
    return train_layout(_config(family, {}, {}))


@pytest.mark.parametrize("family,leaves", [("qwen2", ("wq.bias", "wk.bias", "wv.bias")),
                                           ("qwen3", ("q_norm.weight", "k_norm.weight")),
                                           ("gemma3", ("q_norm.weight", "attn_out_norm.weight", "mlp_out_norm.weight"))])
def test_the_new_parameters_train(family, leaves):
    """Biases from zero and norm weights from one (Gemma's offsets from zero), to values: a layout
    that dropped their gradients, or reduced them over the wrong ranks, shows in the parity below."""
    _, state, _ = _one_process(family)
    new = [name for name in state if name.endswith(leaves)]
    assert len(new) == len(leaves) * 2  # in each of the two layers
    start = 1.0 if family == "qwen3" else 0.0
    assert all((state[name] - start).abs().min() > 0 for name in new)


@pytest.mark.dist
@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_matches_single_process(name):
    # tp's bound (tests/test_tp.py); with documents test_document_mask's (the losses agree to 1e-7,
    # Adam's 5 steps move a near-zero gradient's weight by the order of sums: 1.2e-4 under tp2+SP)
    atol = 2e-4 if name.startswith("gemma3docs") else 1e-4
    assert_parity(_train(name), _one_process(name.split("-")[0]), atol=atol)


@pytest.mark.parametrize("model", [QWEN2, QWEN3, {**QWEN2, "tie_embeddings": True}, {**QWEN3, "norm": "layernorm"}, GEMMA3])
def test_the_parameter_count_includes_them(model):
    cfg = tiny_config(model=model)
    assert parameter_count(cfg.model) == sum(p.numel() for p in build_model(cfg, Topology.single()).parameters())


def _run(run_dir, steps: int, model: dict) -> None:
    Trainer(tiny_config(model=model, train={"steps": steps}, checkpoint={"every": 1}, run={"dir": str(run_dir)}),
            torch.device("cpu")).fit()


@pytest.mark.parametrize("key,saved,here", [("qkv_bias", True, False), ("qkv_bias", False, True),
                                            ("qk_norm", True, False)])
def test_resuming_with_the_other_variant_is_refused_by_name(tmp_path, key, saved, here):
    """The same run.dir with the variant flipped: its parameters would be dropped from (or missing
    in) the checkpoint, so the resume is refused naming the key, as for any shape key (the
    reviewer's test: true -> false resumed and trained on without the biases)."""
    _run(tmp_path, 1, {key: saved})
    with pytest.raises(CheckpointError, match=rf"written for a different model:\n  model\.{key} = {saved} "
                                              rf"in the checkpoint, {here} here"):
        _run(tmp_path, 2, {key: here})


def test_a_checkpoint_from_before_the_variants_resumes_as_a_model_without_them(tmp_path):
    """A manifest written before qkv_bias, head_dim and qk_norm existed lacks them: that model
    had neither, and heads of d_model / n_heads."""
    _run(tmp_path, 1, {})
    manifest = tmp_path / "checkpoints" / "step_00000001" / MANIFEST
    old = json.loads(manifest.read_text())
    for key in ("qkv_bias", "head_dim", "qk_norm"):
        del old["model"][key]
    manifest.write_text(json.dumps(old))
    _run(tmp_path, 2, {})
    assert (tmp_path / "checkpoints" / "step_00000002").is_dir()
