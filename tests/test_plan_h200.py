"""The planner against tetrad's own runs on one GPU, which it was not fitted to: eager and compiled
training of Llama shapes on one H200, measured by bench/gpu_check.py (parts `throughput` and
`planner`) on 2026-12-04 (torch 2.11.0+cu130; tokens/s is the median of the steady steps; where
two runs were made, both are listed). Only the H200 profile's GEMM and fused-attention
efficiencies come from that machine, and from kernel benchmarks (`tetrad bench gemm`), not from
these runs."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pytest

from tetrad.plan.cost import mfu_peak
from tetrad.plan.hardware import load_gpu

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import gpu_check  # noqa: E402  (the check's own configs, so the test estimates exactly what ran)

ONE_B, EIGHT_B_X4 = gpu_check.LLAMA_1B, gpu_check.LLAMA_8B_4_LAYERS
# (label, model keys, train keys, measured tokens/s, measured peak allocated GiB)
MEASURED = [
    ("1B seq 4096 eager", ONE_B, {"global_batch": 4, "micro_batch": 2}, (52090,), 43.9),
    ("1B seq 4096 recompute=full", ONE_B, {"global_batch": 4, "micro_batch": 2, "recompute": "full"},
     (42662, 43224), 33.1),
    ("1B seq 4096 compiled", ONE_B, {"global_batch": 4, "micro_batch": 2, "compile": True}, (58354,), None),
    ("1B seq 16384", {**ONE_B, "seq_len": 16384}, {"global_batch": 2, "micro_batch": 1}, (40311, 40274), 66.9),
    ("Llama-3-8B layers x4 seq 8192", EIGHT_B_X4, {"global_batch": 2, "micro_batch": 1}, (53473, 53289), 49.3),
    # fp32: TF32 matmuls, and attention on SDPA's memory-efficient kernel as 3xTF32 (estimated
    # 4.26x too slow before TF32, then 1.42x before the 3xTF32 attention)
    ("1B seq 2048 fp32", {**ONE_B, "seq_len": 2048}, {"global_batch": 4, "micro_batch": 2, "dtype": "fp32"},
     (20809, 20799), 36.4),
]


def _estimate(model: dict, train: dict, tmp_path):
    cfg = gpu_check.config({"model": model}, str(tmp_path), **{"dtype": "bf16", "steps": 5, "warmup": 1, **train})
    return gpu_check.predicted(cfg, "H200")


@pytest.mark.parametrize("label,model,train,tokens_per_s,peak_gib", MEASURED, ids=[m[0] for m in MEASURED])
def test_h200_runs_within_8_percent(label, model, train, tokens_per_s, peak_gib, tmp_path):
    est = _estimate(model, train, tmp_path)
    ratio = statistics.mean(tokens_per_s) / est.tokens_per_s
    assert 0.92 <= ratio <= 1.08, f"{label}: measured/estimate {ratio:.3f}"
    if peak_gib is not None:  # torch's peak allocated; 2-3 GiB under it before the loss's logit copy was counted
        assert 0.97 <= est.peak_memory_gib / peak_gib <= 1.03, f"{label}: {est.peak_memory_gib:.1f} vs {peak_gib} GiB"


def test_mfu_of_fp32_training_is_over_the_tf32_peak_under_train_tf32():
    """On the H200, MFU 254% was reported for fp32 training on TF32 tensor cores (over the fp32
    peak); the same run reads 34.5% over TF32's."""
    h200 = load_gpu("H200")
    assert mfu_peak(h200, "fp32", tf32=True) == pytest.approx(495e12)
    assert mfu_peak(h200, "fp32", tf32=False) == pytest.approx(67e12)
    assert mfu_peak(h200, "bf16", tf32=True) == pytest.approx(989e12)
    assert mfu_peak(load_gpu("CPU"), "fp32", tf32=True) == mfu_peak(load_gpu("CPU"), "fp32", tf32=False)
