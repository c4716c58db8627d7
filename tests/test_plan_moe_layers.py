"""The planner on Qwen2-MoE / DeepSeek-MoE layers: a shared expert (model.shared_expert_ffn_hidden,
its gate), dense layers in an MoE model (model.dense_layers), the top-k weights left as the
softmax gives them (normalize_expert_weights = false). Counts written out by hand against
flops.py, the published sizes of Qwen1.5-MoE-A2.7B and DeepSeek-MoE-16B, and the per-stage sums
a pipeline needs where its stages hold different kinds of layer. Pure Python (but the last test,
which counts a built model's parameters)."""

from __future__ import annotations

import pytest

from tetrad.config import load_config
from tetrad.model import flops
from tetrad.plan.activations import activation_bytes_per_layer
from tetrad.plan.buckets import HEADS, SPLIT, layer_parameters
from tetrad.plan.comm_bytes import comm_bytes_per_step
from tetrad.plan.cost import estimate
from tetrad.plan.hardware import load_cluster
from tetrad.plan.memory import rank_params
from tetrad.plan.stacks import STACKS
from tetrad.plan.text import model_line

# Qwen1.5-MoE-A2.7B's config.json: 24 layers of 60 experts of 1408, top-4, a gated shared expert of
# 5632, MHA with qkv bias, untied embeddings (norm_topk_prob false).
QWEN15_MOE = {"n_layers": 24, "d_model": 2048, "n_heads": 16, "n_kv_heads": 16, "ffn_hidden": 5632,
              "vocab_size": 151936, "n_experts": 60, "experts_per_token": 4, "expert_ffn_hidden": 1408,
              "shared_expert_ffn_hidden": 5632, "shared_expert_gate": True, "qkv_bias": True,
              "tie_embeddings": False, "normalize_expert_weights": False}
# DeepSeek-MoE-16B's: 28 layers, the first dense (first_k_dense_replace 1, intermediate 10944), then
# 64 experts of 1408, top-6, 2 shared experts of 1408 (one of 2816, ungated), untied embeddings.
DEEPSEEK_MOE = {"n_layers": 28, "d_model": 2048, "n_heads": 16, "n_kv_heads": 16, "ffn_hidden": 10944,
                "vocab_size": 102400, "n_experts": 64, "experts_per_token": 6, "expert_ffn_hidden": 1408,
                "shared_expert_ffn_hidden": 2816, "dense_layers": [0], "tie_embeddings": False}
TINY = {"preset": "tiny", "n_layers": 4, "d_model": 64, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 128,
        "vocab_size": 256, "seq_len": 64, "n_experts": 4, "experts_per_token": 2, "expert_ffn_hidden": 32,
        "shared_expert_ffn_hidden": 48, "shared_expert_gate": True, "dense_layers": [0]}


def _cfg(model: dict, parallel: dict | None = None, train: dict | None = None):
    return load_config(overrides={"model": model, "parallel": parallel or {},
                                  "train": {"dtype": "bf16", "global_batch": 8, "micro_batch": 1, **(train or {})}},
                       runtime=False)


def test_qwen15_moe_a27b_has_its_published_total_and_active_parameters():
    """Qwen1.5-MoE-A2.7B: 14.3B parameters, 2.7B active (its model card), by hand: per layer the
    attention 4d^2 with 3d of qkv bias, 60 experts of 3·d·1408, the shared expert 3·d·5632 and
    its gate d, the router 60d, two norms; the embedding and the head, the final norm."""
    m = _cfg(QWEN15_MOE).model
    d = 2048
    experts, shared = 60 * 3 * d * 1408, 3 * d * 5632
    layer = 4 * d * d + 3 * d + experts + shared + d + 60 * d + 2 * d
    ends = 2 * 151936 * d + d
    assert flops.parameter_count(m) == 24 * layer + ends == 14_315_784_192
    active = 24 * (layer - experts + 4 * 3 * d * 1408) + ends  # 4 of 60 experts; the shared expert always
    assert flops.parameter_count(m, active=True) == active == 2_689_173_504
    assert (round(flops.parameter_count(m) / 1e9, 1), round(active / 1e9, 1)) == (14.3, 2.7)


def test_deepseek_moe_16b_counts_its_dense_first_layer():
    """DeepSeek-MoE-16B: 16.4B parameters, 2.8B active (its paper, Table 5 / model card): 27 MoE
    layers and one dense layer with a 10944-wide SwiGLU MLP."""
    m = _cfg(DEEPSEEK_MOE).model
    d = 2048
    attention, norms = 4 * d * d, 2 * d
    experts = 64 * 3 * d * 1408
    moe = attention + experts + 3 * d * 2816 + 64 * d + norms  # no gate
    dense = attention + 3 * d * 10944 + norms
    ends = 2 * 102400 * d + d
    assert flops.parameter_count(m) == 27 * moe + dense + ends == 16_375_728_128
    active = 27 * (moe - experts + 6 * 3 * d * 1408) + dense + ends
    assert flops.parameter_count(m, active=True) == active == 2_828_650_496
    assert (round(flops.parameter_count(m) / 1e9, 1), round(active / 1e9, 1)) == (16.4, 2.8)


@pytest.mark.parametrize("model", [QWEN15_MOE, DEEPSEEK_MOE])
def test_flops_per_token_sum_each_layers_kind(model):
    """MFU's numerator: 3 x (each layer's 2 x its matrices a token runs (attention, router, k experts,
    shared expert and gate; a dense layer's MLP) + the attention core 4·s·d + the head 2·d·V)."""
    m = _cfg({**model, "seq_len": 4096}).model
    d, s, k, gated = m.d_model, 4096, m.experts_per_token, 3
    attention = 4 * d * d
    moe = attention + k * gated * d * m.expert_hidden + m.n_experts * d + gated * d * m.shared_expert_ffn_hidden \
        + (d if m.shared_expert_gate else 0)
    dense = attention + gated * d * m.ffn_hidden
    n_dense = len(m.dense_layers)
    forward = (m.n_layers - n_dense) * 2 * moe + n_dense * 2 * dense + m.n_layers * 4 * s * d + 2 * d * m.vocab_size
    assert flops.model_flops_per_token(m) == 3 * forward
    # full recompute repeats every layer's forward, each of its kind
    assert flops.hardware_flops_per_token(m, "full") == 4 * forward - 2 * d * m.vocab_size


@pytest.mark.parametrize("tp", [1, 2])
def test_layer_parameters_of_each_kind_are_flops_count(tp):
    """The bucket list of an MoE layer: the router, the experts, the shared expert split over tp
    like a dense MLP, and its gate [1, d] replicated with its gradient summed over tp (HEADS, as
    the router's); a dense layer's is a dense model's."""
    m = _cfg(TINY).model
    moe, dense = (layer_parameters(flops.layer_model(m, kind), tp) for kind in (True, False))
    assert sum(n for n, _ in moe) == flops.layer_params(flops.layer_model(m, True), tp)
    assert sum(n for n, _ in dense) == flops.layer_params(flops.layer_model(m, False), tp)
    assert moe[-4:] == [(48 // tp * 64, SPLIT)] * 3 + [(64, HEADS)]  # shared w1, w3, w2; gate
    assert dense == layer_parameters(_cfg({k: v for k, v in TINY.items() if k in
                                           ("preset", "n_layers", "d_model", "n_heads", "n_kv_heads",
                                            "ffn_hidden", "vocab_size", "seq_len")}).model, tp)


def test_pipeline_stages_hold_their_own_kinds_of_layer():
    """pp 2 with the first layer dense: rank 0's parameters, time and activations are a dense and
    an MoE layer's, rank 1's two MoE layers' (by default split, 2 and 2)."""
    cfg = _cfg(TINY, {"pp": 2, "stage_layers": [2, 2]}, {"micro_batch": 2})
    m = cfg.model
    moe, dense = (flops.layer_params(flops.layer_model(m, kind), 1) for kind in (True, False))
    params = rank_params(cfg)
    assert params[0] - 256 * 64 == dense + moe  # the embedding on the first
    assert params[1] - 64 - 256 * 64 == 2 * moe  # the final norm and head on the last
    e = estimate(cfg, load_cluster("dgx-h100"))
    uniform = estimate(_cfg({**TINY, "dense_layers": []}, {"pp": 2, "stage_layers": [2, 2]}, {"micro_batch": 2}),
                       load_cluster("dgx-h100"))
    assert e.memory_by_rank[1].weights == uniform.memory_by_rank[1].weights
    assert e.memory_by_rank[0].weights < uniform.memory_by_rank[0].weights
    # activations: rank 0 holds a dense layer's set where the uniform model holds an MoE layer's
    tokens, stack = 2 * 64, STACKS["tetrad"]
    per = [activation_bytes_per_layer(flops.layer_model(m, kind), tokens, 1, False, "none", 2, stack)
           for kind in (True, False)]
    held = 2  # 1F1B: rank 0 of 2 holds two micro-batches' sets at its peak
    assert e.memory_by_rank[0].activations == pytest.approx(uniform.memory_by_rank[0].activations
                                                            - held * (per[0] - per[1]), rel=1e-12)
    assert e.memory_by_rank[1].activations == uniform.memory_by_rank[1].activations


def test_shared_expert_and_gate_activations():
    """An MoE layer's shared expert keeps a dense MLP's hidden tensors of its width (over tp), its
    gate the sigmoid's output and the shared expert's whole-d partial output it scales."""
    m = _cfg(TINY).model
    without = _cfg({**TINY, "shared_expert_ffn_hidden": 0, "shared_expert_gate": False}).model
    ungated = _cfg({**TINY, "shared_expert_gate": False}).model
    tokens, tp, e = 64, 2, 2
    for stack in (STACKS["tetrad"], STACKS["tetrad-compiled"]):  # eager SwiGLU keeps 4 hidden tensors, fused 3
        got = [activation_bytes_per_layer(x, tokens, tp, True, "none", e, stack) for x in (m, ungated, without)]
        assert got[1] - got[2] == tokens * e * stack.swiglu_saved * 48 / tp
        assert got[0] - got[1] == tokens * e * (64 + 1)


def test_shared_expert_linears_hold_their_inputs_and_grads_until_bw():
    """Zero-bubble: the experts, router and gate make their weight gradients in BI, but the shared
    expert's linears (mappings.linear) defer theirs to BW as a dense MLP's: w1/w3's input (the
    whole d) and output gradients (2·S/tp), w2's input (S/tp) and output gradient (d)."""
    from tetrad.plan.activations import deferred_weight_grad_bytes_per_layer

    m, without = _cfg(TINY).model, _cfg({**TINY, "shared_expert_ffn_hidden": 0, "shared_expert_gate": False}).model
    tokens, tp, e = 64, 2, 2
    got = [deferred_weight_grad_bytes_per_layer(x, tokens, tp, e) for x in (m, without)]
    assert got[0] - got[1] == tokens * e * (64 + 48 / tp + 2 * 48 / tp + 64)


def test_unnormalized_expert_weights_keep_no_fp32_weights_or_sum():
    """normalize_expert_weights = false: no division, so neither the fp32 top-k weights nor their
    sum is kept (model/moe.py): 4 bytes per assignment and 4 per token fewer."""
    tokens, stack = 64, STACKS["tetrad"]
    got = [activation_bytes_per_layer(_cfg({**TINY, "normalize_expert_weights": norm}).model, tokens, 1, False,
                                      "none", 2, stack) for norm in (True, False)]
    assert got[0] - got[1] == tokens * (4 * 2 + 4)


def test_ep_and_cp_bytes_count_the_moe_layers_alone():
    """The EP all-to-alls and the load-balancing loss's expert counts over cp run in MoE layers
    alone: a dense first layer of four takes a quarter of them away."""
    ep = [comm_bytes_per_step(_cfg({**TINY, "dense_layers": dense}, {"dp": 2, "ep": 2}))["ep"] for dense in ([], [0])]
    assert ep[1] * 4 == ep[0] * 3 > 0
    cp = [comm_bytes_per_step(_cfg({**TINY, "dense_layers": dense}, {"cp": 2}))["cp"] for dense in ([], [0])]
    assert cp[0] - cp[1] == 8 * 4 * 4  # one layer's fp32 counts of 4 experts, in each of 8 micro-batches


def test_model_line_names_the_shared_expert_and_dense_layers():
    line = model_line(_cfg(DEEPSEEK_MOE).model)
    assert "a shared expert of 2816" in line and "1 dense layer [0] of 10944" in line
    assert "(gated)" in model_line(_cfg(QWEN15_MOE).model)


@pytest.mark.parametrize("model", [{}, {"mlp": "gelu", "dense_layers": [1, 3]}, {"shared_expert_gate": False}])
def test_parameter_count_is_the_built_models(model):
    import types

    import torch

    from tetrad.model.execution import Execution
    from tetrad.parallel.pipeline.stages import PipelineStages

    cfg = _cfg({**TINY, **model})
    topo = types.SimpleNamespace(tp_size=1, tp_rank=0, coords={"pp": 0}, device=torch.device("cpu"))
    with torch.device("meta"):
        built = PipelineStages(cfg, topo, Execution())
    assert sum(p.numel() for p in built.parameters()) == flops.parameter_count(cfg.model)
