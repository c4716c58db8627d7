"""The device seam on a machine without a GPU: the dtype check asks CUDA for capabilities and
allocates nothing, the allocator is configured unless the user did, TF32 is a config key, the
accelerator-only metrics are absent on CPU, and AdamW is torch's fused kernel here too."""

import json

import pytest
import torch

from conftest import run_ranks, tiny_config
from tetrad import device as devices
from tetrad.config import ConfigError, load_config, validate_device
from tetrad.train import telemetry
from tetrad.parallel.data.optimizer import build_optimizer


@pytest.fixture
def two_gpus(monkeypatch):
    """A stand-in for CUDA's device queries: two GPUs of the capabilities the test sets. Any
    allocation on "cuda" still fails in this CPU build of torch, so a check that allocates fails."""
    capabilities = {0: (9, 0), 1: (9, 0)}
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(capabilities))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: capabilities[index])
    return capabilities


def test_dtype_check_reads_capabilities_without_allocating(two_gpus):
    cfg = load_config(overrides={"train": {"dtype": "bf16"}})
    validate_device(cfg, "cuda")  # allocating here would raise: torch has no CUDA on this machine
    two_gpus[1] = (7, 5)
    with pytest.raises(ConfigError, match=r"GPU 1 has 7\.5.*use train.dtype='fp32'"):
        validate_device(cfg, "cuda")
    assert devices.dtype_problem("cuda", torch.float16) is None  # 7.5 multiplies fp16


def test_allocator_gets_expandable_segments_unless_the_user_chose():
    env = {}
    devices.configure_allocator("cuda", env)
    assert env == {"PYTORCH_ALLOC_CONF": "expandable_segments:True"}
    for name in devices.ALLOC_CONF_VARIABLES:
        env = {name: "max_split_size_mb:128"}
        devices.configure_allocator("cuda", env)
        assert env == {name: "max_split_size_mb:128"}
    env = {}
    devices.configure_allocator("cpu", env)
    assert env == {}


def test_tf32_is_a_config_key_that_leaves_cpu_matmuls_alone():
    assert load_config().train.tf32 is True
    assert load_config(overrides={"train": {"tf32": False}}).train.tf32 is False
    before = torch.backends.cuda.matmul.fp32_precision
    devices.set_fp32_matmul(torch.device("cpu"), True)
    assert torch.backends.cuda.matmul.fp32_precision == before
    assert not devices.uses_tf32(torch.device("cpu"))


def test_adamw_is_fused_on_cpu():
    params = [torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.randn(4))]
    opt = build_optimizer(params, tiny_config().train)
    assert opt.defaults["fused"] is True


def _train_two_steps(cfg):
    from tetrad.train.trainer import train_on_this_rank
    train_on_this_rank(cfg, "cpu")
    return [json.loads(line) for line in open(f"{cfg.run.dir}/metrics.jsonl")]


def test_accelerator_fields_are_absent_on_cpu():
    """Reserved memory, allocator retries, TF32 and device telemetry are not written as zeros where
    a CPU has none."""
    records = run_ranks(_train_two_steps, 1, tiny_config(train={"steps": 2}))[0]
    assert len(records) == 2
    for record in records:
        assert record["peak_memory_gib"] > 0  # what the CPU does measure is there
        assert not ({"peak_reserved_gib", "alloc_retries", "tf32"} | telemetry.FIELDS.keys()) & record.keys()
    assert devices.accelerator_fields(torch.device("cpu")) == {}


def test_host_buffers_are_plain_for_cpu_tensors():
    """Pinning needs an accelerator (torch refuses it here); a CPU tensor's host buffer is plain
    memory of its shape and dtype. On CUDA the same call pins (bench/gpu_check.py's offload row)."""
    like = torch.ones(3, 5, dtype=torch.bfloat16)
    buf = devices.host_buffer(like)
    assert buf.shape == like.shape and buf.dtype == like.dtype and buf.device.type == "cpu"
    assert not buf.is_pinned() and buf.untyped_storage().data_ptr() != like.untyped_storage().data_ptr()


def _peak_both_ways():
    """PeakMemory's figure with /proc's read just before and just after it, below getrusage's start
    and above it."""
    cpu = torch.device("cpu")
    meter = devices.PeakMemory(cpu)
    low = devices.peak_memory_bytes(cpu, meter.base), meter.bytes(), devices.peak_memory_bytes(cpu, meter.base)
    block = torch.ones((meter.rusage_at_start - meter.base + (64 << 20)) // 4)  # above getrusage's start
    del block
    fast = devices._rusage_bytes() > meter.rusage_at_start
    high = devices.peak_memory_bytes(cpu, meter.base), meter.bytes(), devices.peak_memory_bytes(cpu, meter.base)
    return low, fast, high


# Linux keeps a process's resident pages in per-CPU counters and reads their approximate sum (each
# CPU may hold up to a batch of 32+ pages unfolded), so two reads of the same high-water mark, by
# getrusage or by /proc, can differ by a few pages either way (CI saw 64 KiB) though nothing grew.
KERNEL_COUNTER_SLACK = 1 << 20


def test_peak_memory_by_getrusage_is_proc_vmhwm_in_a_forked_rank():
    """Below and above where getrusage starts (a forked rank's own resident set once clear_refs has
    reset its mark, or a figure the kernel kept from before), PeakMemory says what /proc does (to
    the kernel counters' slack), and never less than nothing."""
    from tetrad import launch
    low, fast, high = launch.run_local(_peak_both_ways, 1, timeout_s=60)[0]
    assert fast and min(low) >= 0 and max(low) < KERNEL_COUNTER_SLACK
    assert high[1] >= 64 << 20
    assert high[0] - KERNEL_COUNTER_SLACK <= high[1] <= high[2] + KERNEL_COUNTER_SLACK
