"""The planner on multi-head latent attention (model.kv_lora_rank > 0; plan/latent.py): its bytes
per group are the runtime's count, its model states and saved activations the runtime's counted
memory, with and without a query latent; DeepSeek-V3's and DeepSeek-V2-Lite's presets have their
published parameters, and DeepSeek-V3 fits a layout the planner proposes."""

from __future__ import annotations

import dataclasses

import pytest

from conftest import rank_histories, tiny_config, train_layout
from tetrad.config import load_config
from tetrad.model import flops
from tetrad.plan.comm_bytes import comm_bytes_per_step
from tetrad.plan.cost import estimate
from tetrad.plan.hardware import cluster_of, load_cluster
from tetrad.plan.layer import _gemm_time, _op_recomputed_gemms
from tetrad.plan.memory import rank_params

# 8 heads of q/k width 32 + 16 over d_model 256, values 32 (padded to 48 in the core), latents of 96 and 64
MLA = {"kv_lora_rank": 64, "q_lora_rank": 96, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
       "n_heads": 8, "n_kv_heads": 8}
FULL_Q = {**MLA, "q_lora_rank": 0}  # DeepSeek-V2-Lite's: q from the (gathered) input


def _name(case) -> str:
    return "-".join(f"{k}{v}" for k, v in case.items()) or "-"


# tp: the latents gathered under SP (q_lora_rank + kv_lora_rank + rope wide, not d_model), their
# gradient all-reduced without; a full query projection's input gathered too (and again under
# sp_regather); cp: every head's k and v, padded to the q/k width; ZeRO-3 gathers the replicated weights
COMM_LAYOUTS = [({"tp": 2}, {}, MLA), ({"tp": 2, "sequence_parallel": True, "sp_regather": True}, {}, FULL_Q),
                ({"tp": 2, "sequence_parallel": True}, {"recompute": "full"}, FULL_Q),
                ({"cp": 2}, {}, MLA), ({"cp": 2, "cp_algo": "alltoall"}, {"recompute": "full"}, MLA),
                ({"dp": 2, "tp": 2, "sequence_parallel": True, "zero": 3}, {}, MLA)]


@pytest.mark.parametrize("parallel,train,model", COMM_LAYOUTS, ids=_name)
def test_comm_bytes_equal_the_runtime_count(parallel, train, model):
    cfg = tiny_config(parallel=parallel, train={"steps": 2, "device": "cpu", **train}, model=model)
    _, _, history = train_layout(cfg)
    assert all(r["comm_bytes"] == comm_bytes_per_step(cfg) for r in history), (history[-1]["comm_bytes"],
                                                                              comm_bytes_per_step(cfg))


# What the runtime counts (tests/test_plan_runtime.py's counted memory): 0.1-0.3% from the estimate in
# each layout here (selective: q and the up-projected kv the core is rebuilt from, not the padded k and v;
# selective-op under SP: its kept kv down projection's output over the rank's sequence chunk, whose
# count over the whole sequence was 2.9% above).
COUNTED_LAYOUTS = [({"tp": 2, "sequence_parallel": True}, {}, MLA), ({"tp": 2, "sequence_parallel": True}, {}, FULL_Q),
                   ({"cp": 2}, {}, MLA), ({"dp": 2, "zero": 3}, {}, MLA), ({"tp": 2}, {"recompute": "selective"}, MLA),
                   ({"tp": 2, "sequence_parallel": True}, {"recompute": "selective-op"}, MLA)]


@pytest.mark.parametrize("parallel,train,model", COUNTED_LAYOUTS, ids=_name)
def test_counted_memory_matches_the_estimate(parallel, train, model):
    cfg = tiny_config(model={"d_model": 256, "ffn_hidden": 768, "seq_len": 128, "n_layers": 4, **model},
                      parallel=parallel, train={"steps": 2, "device": "cpu", "warmup": 1, "micro_batch": 2,
                                                "global_batch": 8 * parallel.get("dp", 1), **train})
    est = estimate(cfg, load_cluster("cpu"))
    for coords, history in rank_histories(cfg):
        got, want = history[-1]["memory_bytes"], est.memory_by_rank[coords["pp"]]
        # model states as the buckets hold them: the replicated down projections whole on each tp rank
        assert [got[k] for k in ("params", "grads", "optimizer")] == [want.weights, want.grads, want.optimizer]
        saved = want.activations - want.transient
        print(f"{coords}: estimate {saved / 2**20:.3f} MiB, counted {got['activations'] / 2**20:.3f}")
        assert saved == pytest.approx(got["activations"], rel=0.01), (coords, want, got)


@pytest.mark.parametrize("sp", [False, True])
def test_per_op_recompute_runs_the_down_projection_whole_on_the_ranks_own_tokens(sp):
    """selective-op recomputes every other matmul it counts, from the second: with a q latent wq_a,
    wkv_b, the MLP's gate and down. On a tp2 rank the replicated wq_a runs its whole weight over the
    rank's own tokens (all of them without SP, its sequence chunk under SP), not split as a row-parallel
    input; the others their tp share."""
    cfg = load_config(overrides={"model": {"d_model": 256, "ffn_hidden": 768, **MLA},
                                 "parallel": {"tp": 2, "sequence_parallel": sp},
                                 "train": {"recompute": "selective-op", "dtype": "bf16"}}, runtime=False)
    gpu, tokens = cluster_of("H100-SXM", 8).gpu, 4096
    peak = gpu.matmul_peak("bf16", cfg.train.tf32)
    shapes = [(tokens / 2 if sp else tokens, 256, 96), (tokens, 64, 8 * (32 + 32) / 2), (tokens, 256, 768 / 2),
              (tokens, 768 / 2, 256)]
    want = sum(_gemm_time(gpu, peak, "bf16", rows, k, n, 1) for rows, k, n in shapes)
    assert _op_recomputed_gemms(cfg, gpu, tokens) == pytest.approx(want, rel=1e-12)


def _preset(name: str):
    return load_config(overrides={"model": {"preset": name}, "train": {"global_batch": 8, "micro_batch": 1}},
                       runtime=False)


def _counts(cfg) -> tuple[float, float]:
    """(all parameters, those one token uses) in billions, as the planner holds them on one rank:
    model/flops.py's count (MFU's, the model line's)."""
    m = cfg.model
    total = sum(rank_params(cfg))
    moe_layers = m.moe_layers + flops.mtp_kind_counts(m).get(True, 0)  # the multi-token prediction's too
    idle = moe_layers * (m.n_experts - m.experts_per_token) * m.expert_hidden * m.d_model * 3
    assert (total, total - idle) == (flops.parameter_count(m), flops.parameter_count(m, active=True))
    return total / 1e9, (total - idle) / 1e9


def test_deepseek_v3_has_its_published_parameters():
    """DeepSeek-V3's card: 671B parameters, 37B active, and a multi-token-prediction module of 14B
    (685B in all). The preset has that module (mtp_layers 1), counted apart: the main model with the
    embedding and the head 671.03B and 37.55B active; the module 11.61B, which with its own copies of
    the embedding and the head, as DeepSeek's checkpoint stores them (tetrad shares the model's), is
    the card's 14B (13.46B): 684.5B, the card's 685B of 671B + 14B."""
    cfg = _preset("deepseek-v3")
    m = cfg.model
    total, active = _counts(cfg)
    main, mtp = flops.main_parameter_count(m) / 1e9, flops.mtp_parameter_count(m) / 1e9
    assert main == pytest.approx(671.03, abs=0.005) and 37 <= flops.main_parameter_count(m, True) / 1e9 < 38
    assert mtp == pytest.approx(11.61, abs=0.005) and total == pytest.approx(main + mtp, abs=1e-9)
    copies = 2 * m.vocab_size * m.d_model / 1e9
    assert mtp + copies == pytest.approx(13.46, abs=0.005) and total + copies == pytest.approx(684.49, abs=0.005)
    assert 38 <= active < 39, active


def test_deepseek_v2_has_its_published_parameters():
    """DeepSeek-V2's card: 236B parameters, 21B active; counted with the embedding and the head."""
    total, active = _counts(_preset("deepseek-v2"))
    assert total == pytest.approx(235.74, abs=0.005) and 21 <= active < 22, (total, active)


def test_deepseek_v2_lite_has_its_published_parameters():
    """DeepSeek-V2-Lite's card: 15.7B parameters, 2.4B active, which leaves out the embedding's 0.21B
    (2.66B with it)."""
    cfg = _preset("deepseek-v2-lite")
    total, active = _counts(cfg)
    embedding = cfg.model.vocab_size * cfg.model.d_model / 1e9
    assert total == pytest.approx(15.71, abs=0.005) and 2.4 <= active - embedding < 2.5, (total, active)


def test_deepseek_v3_fits_the_layout_the_planner_proposes():
    """`tetrad plan --model deepseek-v3 --cluster h100x1024 --gpus 256 --global-batch 4096` ranks this
    layout first (43 s on the 2-core VM): it fits. (Interleaved, vpp 2, came first before the preset
    had its multi-token-prediction module, which weighs on the last of the 32 stages.)"""
    cfg = _preset("deepseek-v3")
    cfg = dataclasses.replace(
        cfg, parallel=dataclasses.replace(cfg.parallel, pp=16, dp=16, ep=8, zero=1, schedule="1f1b", vpp=1),
        train=dataclasses.replace(cfg.train, global_batch=4096, micro_batch=2, recompute="full", dtype="bf16",
                                  offload_optimizer=True))
    est = estimate(cfg, cluster_of("H100-SXM", 256))
    assert est.fits and 0 < est.mfu < 1, (est.peak_memory_gib, est.mfu)
