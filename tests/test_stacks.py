"""Software stacks as properties of code bases (plan/stacks.py), and the calibration figures:
what each stack changes in an estimate, that the docs say which to choose, and rank agreement."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from tetrad.config import load_config
from tetrad.model import flops
from tetrad.plan.cost import estimate
from tetrad.plan.layer import layer_cost
from tetrad.plan.hardware import cluster_of
from tetrad.plan.reference import agreement, kendall_tau
from tetrad.plan.stacks import STACKS

DOCS = Path(__file__).resolve().parents[1] / "docs" / "planner.md"


def _llama8b(seq_len: int = 8192, **parallel):
    return load_config(overrides={"model": {"preset": "llama3-8b", "seq_len": seq_len},
                                  "parallel": parallel, "train": {"global_batch": 64, "micro_batch": 1,
                                                                  "dtype": "bf16"}}, runtime=False)


def test_megatron_core_hides_the_weight_gather_under_the_next_forward():
    # dp = 64 over 8 nodes, one micro-batch per rank: ZeRO-1's gradient reduce-scatter and its
    # weight all-gather, exposed by a stack that all-gathers after the optimizer step.
    cfg, cluster = _llama8b(dp=64, zero=1), cluster_of("H100-SXM", 64)
    plain, core = (estimate(cfg, cluster, stack) for stack in ("megatron", "megatron-core"))
    assert core.breakdown["dp_comm"] < 0.5 * plain.breakdown["dp_comm"], (plain.breakdown, core.breakdown)
    # Only the data-parallel part (and the attention kernel, below) differs between the two.
    same = {k: v for k, v in plain.breakdown.items() if k not in ("dp_comm", "compute")}
    assert same == pytest.approx({k: v for k, v in core.breakdown.items() if k not in ("dp_comm", "compute")})


@pytest.mark.parametrize("gpu, faster", [("H100-SXM", True), ("A100-80GB-SXM", False)])
def test_fused_attention_is_faster_on_hopper_only(gpu, faster):
    cfg, cluster = _llama8b(seq_len=32768, dp=8), cluster_of(gpu, 8)
    fa2, fused = (estimate(cfg, cluster, stack).breakdown["compute"] for stack in ("megatron", "megatron-core"))
    assert (fused < 0.95 * fa2) if faster else fused == pytest.approx(fa2)


def test_triton_attention_costs_what_the_flashattention2_paper_measured():
    # llm-foundry against itself on FlashAttention-2: forward 1.4x, backward 2x.
    times = {}
    flash2 = replace(STACKS["llm-foundry"], attention_kernel="flash2")
    for seq in (512, 32768):
        cfg, cluster = _llama8b(seq_len=seq, dp=8, zero=3), cluster_of("H100-SXM", 8)
        fa2, triton = (estimate(cfg, cluster, stack).breakdown["compute"] for stack in (flash2, "llm-foundry"))
        times[seq] = triton / fa2
    assert 1.0 < times[512] < 1.05 and 1.4 < times[32768] < 1.9, times


def test_fsdp_copies_cost_their_bytes_through_hbm():
    # Per layer and micro-batch: FSDP2 14 bytes per parameter (two gathers' copy-out, 2 x 4; the
    # gradient's copy into the fp32 reduce-scatter input, 6), FSDP1 18 (flat gradient 4, fp32 cast 6,
    # pre-divide 8), and neither the full fp32 accumulation of tetrad's buckets (12) at 8 micro-batches.
    cfg, cluster = _llama8b(dp=8, zero=3), cluster_of("H100-SXM", 8)
    per_byte = (flops.layer_matrix_params(cfg.model) + flops.layer_norm_params(cfg.model)) / cluster.gpu.hbm_bytes_per_s
    fsdp = STACKS["fsdp"]
    buckets = layer_cost(cfg, cluster, replace(fsdp, zero3_impl="buckets")).compute - 12 * per_byte
    assert layer_cost(cfg, cluster, fsdp).compute == pytest.approx(buckets + 14 * per_byte)
    assert layer_cost(cfg, cluster, replace(fsdp, zero3_impl="fsdp1")).compute == pytest.approx(buckets + 18 * per_byte)
    zero1 = _llama8b(dp=8, zero=1)  # no per-layer gathers, no copies
    assert layer_cost(zero1, cluster, fsdp).compute == layer_cost(zero1, cluster, replace(fsdp, zero3_impl="buckets")).compute


def test_compiled_tetrad_fuses_element_wise_work_and_saves_less():
    # tp 8 + SP on one node: compiling changes the element-wise kernels and saved activations only.
    cfg, cluster = _llama8b(tp=8, sequence_parallel=True), cluster_of("H100-SXM", 8)
    eager, compiled = (estimate(cfg, cluster, stack) for stack in ("tetrad", "tetrad-compiled"))
    assert compiled.breakdown["compute"] < eager.breakdown["compute"]
    assert compiled.memory.activations < eager.memory.activations
    assert {k: v for k, v in compiled.breakdown.items() if k != "compute"} == \
        pytest.approx({k: v for k, v in eager.breakdown.items() if k != "compute"})
    assert compiled.memory.optimizer == eager.memory.optimizer and compiled.memory.grads == eager.memory.grads


def test_a_compiled_run_is_estimated_as_compiled_tetrad():
    # `tetrad estimate` of a config with train.compile = true under the default stack.
    cfg, cluster = _llama8b(tp=8, sequence_parallel=True), cluster_of("H100-SXM", 8)
    compiled_cfg = load_config(overrides={"model": {"preset": "llama3-8b", "seq_len": 8192},
                                          "parallel": {"tp": 8, "sequence_parallel": True},
                                          "train": {"global_batch": 64, "micro_batch": 1, "dtype": "bf16",
                                                    "compile": True}}, runtime=False)
    assert estimate(compiled_cfg, cluster, "tetrad").breakdown == \
        pytest.approx(estimate(cfg, cluster, "tetrad-compiled").breakdown)
    assert estimate(compiled_cfg, cluster, "tetrad").breakdown["compute"] < \
        estimate(cfg, cluster, "tetrad").breakdown["compute"]


def test_docs_say_which_stack_for_which_framework():
    text = DOCS.read_text()
    for name in STACKS:
        assert f"`{name}`" in text, f"docs/planner.md does not mention the stack {name!r}"


def test_kendall_tau_and_pooled_agreement():
    assert kendall_tau([1, 2, 3], [10, 20, 30]) == 1.0
    assert kendall_tau([1, 2, 3], [3, 2, 1]) == -1.0
    assert kendall_tau([1, 2, 3], [1, 3, 2]) == pytest.approx(1 / 3)
    assert kendall_tau([1], [1]) is None
    # Pairs are formed only inside a group (one model on one cluster): a and b never compare.
    summary = agreement([("s", "a", 1.0, 1.1), ("s", "a", 2.0, 2.2), ("s", "b", 10.0, 5.0), ("s", "b", 20.0, 4.0)])
    assert summary["s"]["pairs"] == 2 and summary["s"]["tau"] == 0.0
    assert summary["all"]["mape"] == pytest.approx(100 * (0.1 + 0.1 + 0.5 + 0.8) / 4)
