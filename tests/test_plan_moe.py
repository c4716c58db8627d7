"""The planner and the FLOP/parameter counts on mixture-of-experts models (model.n_experts > 0):
parameters count all E experts (memory, ZeRO), FLOPs a token's router and k experts (MFU); the
activations of the routed tokens; the expert GEMMs at k/E of their rows; and a Mixtral 8x7B shape
checked against its published 46.7B / 12.9B parameters. Pure Python, no torch model built (but
the last test, which counts the model's own parameters where the model has MoE layers)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tetrad.cli import main
from tetrad.config import load_config
from tetrad.model import flops
from tetrad.plan.buckets import layer_parameters
from tetrad.plan.comm_bytes import comm_bytes_per_step
from tetrad.plan.cost import estimate
from tetrad.plan.hardware import cluster_of, load_cluster
from tetrad.plan.layer import _elementwise, _gemms
from tetrad.plan.moe import routing_bytes_per_token
from tetrad.plan.activations import activation_bytes_per_layer
from tetrad.plan.search import layouts, plan
from tetrad.plan.stacks import EAGER_ELEMENTWISE, STACKS

MID = {"preset": "tiny", "n_layers": 8, "d_model": 1024, "n_heads": 16, "n_kv_heads": 4, "ffn_hidden": 2816,
       "vocab_size": 32000, "seq_len": 2048}
MOE = {"n_experts": 8, "experts_per_token": 2}


def _cfg(model: dict, parallel: dict | None = None, train: dict | None = None):
    return load_config(overrides={"model": model, "parallel": parallel or {},
                                  "train": {"dtype": "bf16", "global_batch": 8, "micro_batch": 1, **(train or {})}},
                       runtime=False)


def _spec_params(m) -> int:
    """The count docs/design.md gives, written out apart from model/flops.py: per layer q, k, v, o; the router
    E·d; E experts of H·d·(3 gated, 2 GELU); two RMSNorms; the embedding and an untied head."""
    hd = m.d_model // m.n_heads
    attn = m.d_model * hd * (2 * m.n_heads + 2 * m.n_kv_heads)
    experts = m.n_experts * m.expert_hidden * m.d_model * (3 if m.mlp in ("swiglu", "geglu") else 2)
    layer = attn + m.n_experts * m.d_model + experts + 2 * m.d_model
    return m.n_layers * layer + 2 * m.vocab_size * m.d_model + m.d_model


def test_mixtral_8x7b_has_its_published_total_and_active_parameters():
    """Mixtral of Experts (Jiang et al. 2024): 46.7B parameters, 12.9B active per token."""
    m = _cfg({"preset": "mixtral-8x7b"}).model
    assert (m.n_experts, m.experts_per_token, m.expert_hidden) == (8, 2, 14336)
    assert flops.parameter_count(m) == _spec_params(m)
    assert flops.parameter_count(m) / 1e9 == pytest.approx(46.7, abs=0.05)
    assert flops.parameter_count(m, active=True) / 1e9 == pytest.approx(12.9, abs=0.05)


def test_glm_4_5_air_has_its_published_total_and_active_parameters():
    """GLM-4.5-Air (Zhipu's model card): 106B parameters, 12B active, both rounded down; the active
    ones without the embedding and the head (8 of 128 experts and the shared one, 45 MoE layers).
    Both leave out its multi-token-prediction module (mtp_layers 1, an MoE layer: 2.38B more)."""
    m = _cfg({"preset": "glm-4.5-air"}).model
    embeddings = 2 * m.vocab_size * m.d_model
    assert m.mtp_layers == 1 and 2.37 <= flops.mtp_parameter_count(m) / 1e9 < 2.38
    assert 106 <= flops.main_parameter_count(m) / 1e9 < 107
    assert 12 <= (flops.main_parameter_count(m, active=True) - embeddings) / 1e9 < 12.5
    assert flops.parameter_count(m) == flops.main_parameter_count(m) + flops.mtp_parameter_count(m)


@pytest.mark.parametrize("model", [{"mlp": "swiglu"}, {"mlp": "gelu"}, {"mlp": "geglu", "expert_ffn_hidden": 512},
                                   {"n_experts": 4, "experts_per_token": 1, "expert_ffn_hidden": 768}])
def test_parameter_counts_follow_the_spec(model):
    m = _cfg({**MID, **MOE, **model}).model
    assert flops.parameter_count(m) == _spec_params(m)
    # what a tp rank holds, as the gradient buckets list it, is flops' count: router whole, experts 1/tp
    for tp in (1, 2, 4):
        assert sum(n for n, _ in layer_parameters(m, tp)) == flops.layer_params(m, tp), tp
    idle = (m.n_experts - m.experts_per_token) * m.expert_hidden * m.d_model * (3 if m.gated_mlp else 2)
    assert flops.parameter_count(m, active=True) == _spec_params(m) - m.n_layers * idle


def test_flops_are_the_active_ones():
    """A token runs its router (2·d·E) and k experts: the FLOPs of a dense model whose MLP is
    k·H wide plus the router's, far below those of the dense model with the same parameters."""
    moe = _cfg({**MID, **MOE}).model
    active = _cfg({**MID, "ffn_hidden": 2 * 2816}).model
    total = _cfg({**MID, "ffn_hidden": 8 * 2816}).model
    router = 3 * MID["n_layers"] * 2 * MID["d_model"] * 8
    assert flops.model_flops_per_token(moe) == flops.model_flops_per_token(active) + router
    assert flops.model_flops_per_token(moe) < 0.5 * flops.model_flops_per_token(total)
    # selective-op recomputes a dense MLP's up projection; an MoE layer's routing keeps all its matmuls
    up = MID["n_layers"] * 2 * MID["d_model"] * 2 * 2816
    extra_of = {"selective": 0, "selective-op": -up, "full": router / 3}
    for recompute, more in extra_of.items():  # HFU: what recompute repeats, of the active ones
        extra = flops.hardware_flops_per_token(moe, recompute) - flops.model_flops_per_token(moe)
        dense = flops.hardware_flops_per_token(active, recompute) - flops.model_flops_per_token(active)
        assert extra == dense + more, recompute


def _three(parallel: dict | None = None, train: dict | None = None):
    """The MoE model, the dense one with its active parameters (MLP k·H) and the dense one with
    its total parameters (MLP E·H), estimated alike on one H100 node."""
    cluster = load_cluster("dgx-h100")
    return [estimate(_cfg(model, {"tp": 2, "dp": 4, "sequence_parallel": True, "zero": 1, **(parallel or {})}, train),
                     cluster)
            for model in ({**MID, **MOE}, {**MID, "ffn_hidden": 2 * 2816}, {**MID, "ffn_hidden": 8 * 2816})]


def test_memory_holds_every_expert_and_the_routed_tokens():
    moe, active, total = _three()
    states = lambda e: e.memory.weights + e.memory.grads + e.memory.optimizer  # noqa: E731
    # model states: all E experts (and the router), as the dense model of the same total parameters
    assert states(moe) == pytest.approx(states(total), rel=0.01)
    assert states(moe) > 2.5 * states(active)  # the embedding and head (65M) alike in both
    # activations: each token's k experts' hidden tensors, not E's
    assert moe.memory.activations < 0.5 * total.memory.activations
    # per layer, beside the dense k·H model's: the experts keep 2 hidden tensors (model/moe.py; eager
    # SwiGLU 4), and whole on every tp rank the k copies in and out (16-bit), the fp32 probabilities
    # [E], three int64 indices, the fp32 and 16-bit weights per assignment and the weights' fp32 sum
    m, (tokens, e, tp, stack) = moe.cfg.model, (2048, 2, 2, STACKS["tetrad"])
    per_layer = activation_bytes_per_layer(m, tokens, tp, True, "none", e, stack)
    dense = activation_bytes_per_layer(active.cfg.model, tokens, tp, True, "none", e, stack)
    hidden = tokens * e * (2 - stack.swiglu_saved) * 2 * 2816 / tp
    routed = tokens * (2 * 2 * 1024 * e + 4 * 8 + 2 * (3 * 8 + 4 + e) + 4)
    assert per_layer == dense + hidden + routed
    # and one layer's [E, H/tp, d] expert gradients (16-bit) while its backward makes them
    grads = 8 * 3 * 2816 / tp * 1024 * e
    assert moe.memory.transient - active.memory.transient == pytest.approx(grads)


def test_expert_gemms_run_at_k_over_e_of_their_rows():
    """Time: E experts' GEMMs over tokens·k/E rows each are slower than one dense k·H GEMM over
    every token, and far faster than the dense model of the same parameters; MFU counts the
    active FLOPs."""
    moe, active, total = _three()
    assert active.step_time_s < moe.step_time_s < total.step_time_s
    assert moe.breakdown["compute"] < 0.6 * total.breakdown["compute"]
    per_gpu = moe.tokens_per_s / moe.cfg.parallel.world_size
    assert moe.model_tflops_per_gpu == pytest.approx(flops.model_flops_per_token(moe.cfg.model) * per_gpu / 1e12)
    # the MLP's GEMMs: E of 2048·2/8 = 512 rows each, tiles emptier than the dense k·H GEMM's of 2048
    gpu = load_cluster("dgx-h100").gpu
    (moe_gemms, _, _), (dense_gemms, _, _) = (_gemms(e.cfg, gpu, 2048) for e in (moe, active))
    assert moe_gemms[:2] == dense_gemms[:2]  # attention alike
    assert sum(moe_gemms[2:]) > 1.15 * sum(dense_gemms[2:])
    # with a few rows an expert's GEMMs cost at least reading its weights
    weights = 8 * 3 * 2816 / 2 * 1024 * 2  # bytes of the experts on a tp rank, bf16
    assert sum(_gemms(moe.cfg, gpu, 8)[0][2:]) >= weights / gpu.hbm_bytes_per_s


@pytest.mark.parametrize("model", [{**MID, **MOE}, MID], ids=["moe", "dense"])
def test_compiled_tetrad_costs_an_moe_layers_routing_as_eager_kernels(model):
    """Under train.compile tetrad runs an MoE layer's routing eagerly (model/moe.py): its
    element-wise bytes, the routed experts' activation and the dispatch and combine, cost the
    eager factor, the rest of the layer's the fused one; a dense model's are all fused."""
    cfg, gpu = _cfg(model), load_cluster("dgx-h100").gpu
    compiled = STACKS["tetrad-compiled"]
    fused_routing = dataclasses.replace(compiled, eager_routing=False)
    (got, _), (fused, _) = (_elementwise(cfg, gpu, stack, 2048) for stack in (compiled, fused_routing))
    m = cfg.model
    routed = 2048 * (2 * 3 * flops.mlp_hidden(m, active=True) + routing_bytes_per_token(m, 2)) if m.n_experts else 0.0
    assert got - fused == pytest.approx((EAGER_ELEMENTWISE - compiled.elementwise_factor) * routed / gpu.hbm_bytes_per_s)
    assert (got > fused) == bool(m.n_experts)


def test_collectives_carry_every_expert_and_the_dense_activations():
    """TP moves the dense MLP's activations (plus the router's small gradient sum); the gradient
    reduction over dp carries every expert's parameters, as the same-parameter dense model's."""
    moe, active, total = (e.cfg for e in _three({"zero": 0}))  # ZeRO-0: the whole router summed
    got = [comm_bytes_per_step(c) for c in (moe, active, total)]
    router_sum = 4 * MID["n_layers"] * 8 * MID["d_model"]  # fp32, summed over tp once a step
    assert got[0]["tp"] == got[1]["tp"] + router_sum + 4  # and the load-balancing loss in the step's sums
    assert got[0]["dp"] == pytest.approx(got[2]["dp"], rel=0.01) and got[0]["dp"] > 2.5 * got[1]["dp"]


def test_search_keeps_tp_dividing_the_experts_width():
    base = _cfg({**MID, **MOE, "expert_ffn_hidden": 1502})  # 2·751: tp 4 cannot split it (the heads and ffn_hidden could)
    assert {x.tp for x in layouts(base, 8, 8)} == {1, 2}


def test_estimate_json_of_an_moe_model(capsys):
    code = main(["estimate", "--cluster", "dgx-h200", "--model.preset=mixtral-8x7b", "--model.seq_len=4096",
                 "--parallel.tp=8", "--parallel.sequence_parallel=true", "--train.global_batch=8",
                 "--train.micro_batch=1", "--train.dtype=bf16", "--train.recompute=full", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == (0 if out["fits"] else 1)
    m = _cfg({"preset": "mixtral-8x7b"}).model
    assert out["params"] == flops.parameter_count(m) and out["active_params"] == flops.parameter_count(m, active=True)
    assert out["peak_memory_gib"] == pytest.approx(sum(out["memory_gib"].values()))
    # every expert's states on each of the 8 tp ranks (1/8 of them): 2 + 4 + 12 bytes a parameter
    layers = m.n_layers * flops.mlp_matrix_params(m) / 8
    assert out["memory_gib"]["weights"] + out["memory_gib"]["grads"] + out["memory_gib"]["optimizer"] > 18 * layers / 2**30
    per_gpu = out["tokens_per_s"] / 8
    m = _cfg({"preset": "mixtral-8x7b", "seq_len": 4096}).model
    assert out["model_tflops_per_gpu"] == pytest.approx(flops.model_flops_per_token(m) * per_gpu / 1e12)
    assert 0 < out["mfu"] < out["hfu"] < 1 and sum(out["time_s"].values()) == pytest.approx(out["step_time_s"])


def test_plan_fits_mixtral_8x7b_on_sixteen_h200s():
    base = _cfg({"preset": "mixtral-8x7b", "seq_len": 4096}, train={"global_batch": 32})
    result = plan(base, cluster_of("H200", 16), top=3)
    best = result.ranked[0]
    assert best.fits and best.peak_memory_gib <= best.usable_gib
    assert 0 < best.mfu < 1
    print(best.cfg.parallel, best.step_time_s, best.peak_memory_gib, best.mfu)


@pytest.mark.parametrize("model", [{"mlp": "swiglu"}, {"mlp": "gelu", "expert_ffn_hidden": 96}])
def test_parameter_count_is_the_models(model):
    import types

    import torch

    from conftest import tiny_config
    from tetrad.model.execution import Execution
    from tetrad.parallel.pipeline.stages import PipelineStages

    cfg = tiny_config(model={**MOE, **model})
    topo = types.SimpleNamespace(tp_size=1, tp_rank=0, coords={"pp": 0}, device=torch.device("cpu"))
    with torch.device("meta"):
        built = PipelineStages(cfg, topo, Execution())
    assert sum(p.numel() for p in built.parameters()) == flops.parameter_count(cfg.model) == _spec_params(cfg.model)
