"""bench/gpu_check.py without a GPU: it says so and exits, and the parts that run on a CPU do so
with tiny shapes (kernel detection by profiler, fused block against the math path, the planner's
memory prediction, the table)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import run_ranks

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import gpu_check  # noqa: E402


def test_exits_with_a_clear_message_without_cuda():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py")], capture_output=True, text=True,
                          env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "no CUDA GPU" in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stdout == ""


def test_unknown_part_is_refused_with_the_list():
    assert gpu_check.main(["throughput", "nope"]) == 2


def _cpu_parts():
    kernels = {(dtype, gqa, algo): gpu_check.attention_ops("cpu", dtype, gqa, algo, tokens=32)
               for dtype in (torch.float32, torch.bfloat16) for gqa in (False, True) for algo in ("ring", "alltoall")}
    blocks = gpu_check.block_vs_math("cpu", 64, torch.float32, heads=2, dim=16)
    return kernels, blocks


def test_cpu_parts_detect_the_kernel_and_compare_with_math():
    kernels, blocks = run_ranks(_cpu_parts, 1)[0]  # in a child: see test_cp._in_child
    for case, (ops, cuda_kernels) in kernels.items():
        assert ops == {"cpu_flash"}, case  # what choose_kernel picks on CPU, and never the math op
        assert cuda_kernels == set()
    assert blocks["kernel"] == "cpu_flash" and blocks["max_diff"] < 1e-5
    assert blocks["cpu_flash"]["ms"] > 0 and blocks["math"]["ms"] > 0


def test_memory_prediction_of_the_1b_model(tmp_path):
    cfg = gpu_check.config({"model": gpu_check.LLAMA_1B}, str(tmp_path), dtype="bf16", global_batch=4,
                           micro_batch=2, recompute="none")
    none = gpu_check.predicted_peak_gib(cfg, "H200")
    cfg.train.recompute = "full"
    assert 10 < gpu_check.predicted_peak_gib(cfg, "H200") < none < 141  # fits the check's GPU


def test_offload_prediction_of_the_1b_model(tmp_path):
    """The offload row's estimate: the 1B model's optimizer states leave the GPU for the host."""
    cfg = gpu_check.offload_config(str(tmp_path), "auto")  # the config refuses offload on "cpu"
    moved, kept = gpu_check.offload_predictions(cfg, "H200")
    assert cfg.train.offload_optimizer and not kept.cfg.train.offload_optimizer
    assert moved.peak_memory_gib == pytest.approx(kept.peak_memory_gib - kept.memory.optimizer / 2**30)
    assert moved.host_memory.optimizer == kept.memory.optimizer and moved.breakdown["host_copies"] > 0


def test_table_marks_failures_and_a_raising_part_is_a_row():
    def broken():
        raise RuntimeError("CUDA out of memory")
    rows = [("a", True, "fine")] + gpu_check._guarded("broken", broken)
    table = gpu_check.format_table(rows)
    assert "PASS" in table.splitlines()[1] and "FAIL" in table.splitlines()[2]
    assert "broken" in table and "CUDA out of memory" in table


def test_async_checkpoint_part_runs_on_the_cpu():
    """The part that checks a background checkpoint's device-to-host copy on a GPU resumes to the
    straight run's losses on the CPU too."""
    ((name, ok, detail),) = gpu_check.async_checkpoint_resume("cpu")
    assert name == "async save -> resume" and ok, detail


def test_the_chunked_loss_part_runs_on_a_cpu():
    """Its rows on a tiny model: one per run, then the fused run's losses against the unfused
    run's (bf16 rounding in another order: within 1e-2), which pass."""
    rows = gpu_check.chunked_loss("cpu", "H200", steps=2, model={"preset": "tiny", "seq_len": 64}, chunk=24)
    assert [label.split()[-1] for label, _, _ in rows[:2]] == ["loss_chunk_tokens=0", "loss_chunk_tokens=24"]
    assert rows[2][0] == "fused chunked loss against unfused" and rows[2][1], rows[2]
