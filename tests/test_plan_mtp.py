"""Multi-token prediction (model.mtp_layers) in the planner: its parameters and FLOPs against the
spec's formula (helpers/mtp_spec.md: per depth two norms, eh_proj [d, 2d], a layer of global index
n_layers + k, a final norm; the embedding and head shared), the split giving the last stage fewer
layers, the last stage's memory and time growing by the modules, the step's sums by two floats a
depth; the parameters against the model model/mtp.py builds, on one process and per pipeline rank
(tests/test_plan_buckets.py compares the gradient buckets)."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from tetrad.config import load_config
from tetrad.model import flops
from tetrad.model.execution import Execution
from tetrad.parallel.pipeline.stages import PipelineStages
from tetrad.parallel.pipeline.split import balanced_layers, stage_layers
from tetrad.plan.activations import activation_bytes_per_layer, as_run, mtp_saved_bytes
from tetrad.plan.buckets import mtp_parameters, rank_buckets
from tetrad.plan.comm_bytes import comm_bytes_per_step, step_sums
from tetrad.plan.cost import estimate
from tetrad.plan.hardware import cluster_of
from tetrad.plan.memory import rank_params
from tetrad.plan.stacks import STACKS

SMALL = {"preset": "tiny", "n_layers": 4, "d_model": 64, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 160,
         "vocab_size": 300, "seq_len": 64}
MOE = {"n_experts": 4, "experts_per_token": 2, "expert_ffn_hidden": 48, "dense_layers": [0]}


def _cfg(model: dict, parallel: dict | None = None, train: dict | None = None):
    return load_config(overrides={"model": {**SMALL, **model}, "parallel": parallel or {},
                                  "train": {"dtype": "bf16", "global_batch": 8, "micro_batch": 1, **(train or {})}},
                       runtime=False)


def _block(m, moe: bool) -> int:
    """A SwiGLU GQA block's parameters by hand: two norms, q, k, v, o; the MLP's three matrices, or
    the router and E experts'."""
    hd = m.d_model // m.n_heads
    attn = m.d_model * hd * (2 * m.n_heads + 2 * m.n_kv_heads)
    mlp = m.n_experts * (m.d_model + 3 * m.expert_ffn_hidden * m.d_model) if moe else 3 * m.ffn_hidden * m.d_model
    return attn + mlp + 2 * m.d_model


@pytest.mark.parametrize("model", [{"mtp_layers": 1}, {"mtp_layers": 2, **MOE},
                                   {"mtp_layers": 2, "tie_embeddings": True}])
def test_mtp_parameter_count_is_the_spec_formula(model):
    """Per depth: enorm and hnorm (d each), eh_proj (2d x d), its block (MoE where moe_layer(n_layers
    + k) says), the final norm (d); nothing for the embedding or head. The planner's per-rank list
    (buckets.mtp_parameters, whole at tp = 1) is the same count."""
    m = _cfg(model).model
    d = m.d_model
    mtp = sum(3 * d + 2 * d * d + _block(m, m.moe_layer(m.n_layers + k)) for k in range(m.mtp_layers))
    main = dataclasses.replace(m, mtp_layers=0)
    assert flops.mtp_parameter_count(m) == mtp > 0
    assert flops.parameter_count(m) == flops.parameter_count(main) + mtp == flops.main_parameter_count(m) + mtp
    assert sum(n for n, *_ in mtp_parameters(m, 1)) == mtp
    routed = sum(map(m.moe_layer, range(4, 4 + m.mtp_layers)))  # the depths' MoE layers
    idle = (m.n_experts - m.experts_per_token) * 3 * m.expert_ffn_hidden * d * routed
    assert flops.parameter_count(m, active=True) == flops.parameter_count(main, active=True) + mtp - idle


def _built(cfg, rank: int):
    """Pipeline rank `rank`'s model (tp and ep rank 0) on the meta device."""
    p = cfg.parallel
    topo = types.SimpleNamespace(tp_size=p.tp, tp_rank=0, ep_size=p.ep, ep_rank=0, coords={"pp": rank},
                                 device=torch.device("cpu"))
    with torch.device("meta"):
        return PipelineStages(cfg, topo, Execution())


@pytest.mark.parametrize("parallel,model", [({}, {"mtp_layers": 2, **MOE}),
                                            ({"pp": 2, "tp": 2, "dp": 2, "ep": 2}, {"mtp_layers": 1, **MOE}),
                                            ({"pp": 2, "vpp": 2}, {"mtp_layers": 1, "tie_embeddings": True})])
def test_the_counts_are_the_built_models(parallel, model):
    """The model model/mtp.py builds: one process holds parameter_count; each pipeline rank of a
    layout (tp and ep rank 0) what the planner says it holds (rank_params: the last one the
    modules and, over several stages, the embedding's copy)."""
    cfg = _cfg(model, parallel)
    if not parallel:
        assert sum(q.numel() for q in _built(cfg, 0).parameters()) == flops.parameter_count(cfg.model)
    for rank in range(cfg.parallel.pp):
        assert sum(q.numel() for q in _built(cfg, rank).parameters()) == rank_params(cfg)[rank], rank


def test_mtp_flops_add_each_depths_layer_eh_proj_and_head():
    """Megatron's num_floating_point_operations with mtp_num_layers: each depth a layer (matmuls and
    attention core), eh_proj (2 x 2d x d a token) and the head (2 x d x vocab), forward; x3 a step;
    full recompute repeats the modules' layers as it does the main ones'."""
    m = _cfg({"mtp_layers": 2}).model
    main = dataclasses.replace(m, mtp_layers=0)
    layer = flops.layer_matmul_flops(m) + flops.attention_core_flops(m, m.seq_len)
    per_depth = layer + 4 * m.d_model ** 2 + 2 * m.d_model * m.vocab_size
    assert flops.forward_flops_per_token(m) == pytest.approx(flops.forward_flops_per_token(main) + 2 * per_depth)
    assert flops.model_flops_per_token(m) == pytest.approx(3 * flops.forward_flops_per_token(m))
    extra = flops.hardware_flops_per_token(m, "full") - flops.model_flops_per_token(m)
    assert extra == pytest.approx(6 * layer)


def test_the_split_moves_a_layer_off_the_last_stage():
    """The last stage runs the modules beside the head: balanced, it holds fewer layers."""
    without, with_mtp = (_cfg({"n_layers": 8, "vocab_size": 256, "mtp_layers": d}, {"pp": 2}) for d in (0, 1))
    assert stage_layers(without) == [4, 4]
    assert stage_layers(with_mtp) == [5, 3]
    assert balanced_layers(with_mtp.model, 4)[-1] < balanced_layers(without.model, 4)[-1]


def _pair(parallel: dict, model: dict | None = None, train: dict | None = None):
    """The same layout without and with one MoE module, the layers split alike."""
    base, split = {**MOE, **(model or {})}, {"stage_layers": [2, 2]} if parallel.get("pp", 1) == 2 else {}
    return [_cfg({**base, "mtp_layers": d}, {**split, **parallel}, train) for d in (0, 1)]


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_the_last_stages_memory_grows_by_the_modules_states(zero):
    """Under pp = 2 the last stage holds the module (its own parameters) and a copy of the untied
    embedding; the first stage holds what it did. Its weights, gradients and optimizer states grow
    by their bytes (ZeRO shards them as the rest; even sizes here: no padding), its activations by
    what the module keeps for one micro-batch (1F1B's last stage holds one waiting)."""
    without, with_mtp = _pair({"pp": 2, "dp": 2, "zero": zero})
    m = with_mtp.model
    module = sum(n for n, *_ in mtp_parameters(m, 1)) + m.vocab_size * m.d_model
    assert rank_params(with_mtp)[0] == rank_params(without)[0]
    assert rank_params(with_mtp)[1] == rank_params(without)[1] + module
    cluster = cluster_of("H100-SXM", 4)
    a, b = (estimate(c, cluster).memory_by_rank for c in (without, with_mtp))
    assert b[0].weights + b[0].grads + b[0].optimizer == a[0].weights + a[0].grads + a[0].optimizer
    grown = (b[1].weights + b[1].grads + b[1].optimizer) - (a[1].weights + a[1].grads + a[1].optimizer)
    per_param = {0: 2 + 4 + 12, 1: 2 + 4 + 12 / 2, 3: 18 / 2}[zero]
    assert grown == pytest.approx(module * per_param, rel=1e-9), (grown, module * per_param)
    stack = as_run(with_mtp, STACKS["tetrad"])
    layer = activation_bytes_per_layer(m, m.seq_len, 1, False, "none", 2, stack)  # the depth's: an MoE layer
    kept = layer + mtp_saved_bytes(with_mtp, stack, m.seq_len, 2, m.vocab_size)
    assert b[1].activations - a[1].activations == pytest.approx(kept, rel=1e-9)
    assert b[0].activations == a[0].activations


def test_the_embedding_copy_is_tied_to_the_first_stages():
    """Untied embeddings under MTP and pp > 1: the first stage's embedding and the last stage's copy
    each get a bucket of their own (kept equal over the "embed" group, as a tied head is); the pp
    group carries rank 0's embedding gradient and the step's sums two floats a depth more."""
    without, with_mtp = _pair({"pp": 2, "dp": 2, "zero": 1})
    rows = with_mtp.model.vocab_size * with_mtp.model.d_model
    for rank in (0, 1):
        assert not rank_buckets(without)[rank].buckets[-1].tied
        assert rank_buckets(with_mtp)[rank].buckets[-1].tied and rank_buckets(with_mtp)[rank].buckets[-1].size == rows
    assert step_sums(with_mtp) == step_sums(without) + 8
    a, b = comm_bytes_per_step(without), comm_bytes_per_step(with_mtp)
    assert b["pp"] == a["pp"] + 8 + 4 * rows


def test_on_one_stage_rank_0_runs_the_modules():
    """pp = 1: rank 0 runs the module's layer (its tp collectives and expert all-to-alls) and its
    head; without pipeline stages there is no embedding copy."""
    without, with_mtp = (_cfg({**MOE, "mtp_layers": d}, {"tp": 2, "ep": 2, "dp": 2}) for d in (0, 1))
    m = with_mtp.model
    module = sum(n for n, *_ in mtp_parameters(m, 2, 2))
    assert rank_params(with_mtp)[0] == rank_params(without)[0] + module
    a, b = comm_bytes_per_step(without), comm_bytes_per_step(with_mtp)
    assert b["tp"] > a["tp"] and b["ep"] == pytest.approx(a["ep"] * 4 / 3)  # 3 MoE layers, then 4


@pytest.mark.parametrize("parallel", [{"pp": 2, "dp": 2}, {"tp": 2, "dp": 2, "sequence_parallel": True}])
def test_the_modules_cost_time_on_the_last_stage(parallel):
    """The step grows (the last stage runs a layer, eh_proj and a head more) and its breakdown
    still sums to it."""
    without, with_mtp = _pair(parallel)
    cluster = cluster_of("H100-SXM", 4)
    a, b = (estimate(c, cluster, STACKS["tetrad"]) for c in (without, with_mtp))
    assert b.step_time_s > a.step_time_s
    assert sum(b.breakdown.values()) == pytest.approx(b.step_time_s, rel=1e-9)
    assert b.breakdown["compute"] > a.breakdown["compute"]
