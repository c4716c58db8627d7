"""Everything that depends on the kind of device lives here: choosing it, its collective backend,
binding a rank to it, synchronising, and reading its memory counters. The rest of tetrad calls
these and never `torch.cuda` directly.
"""

from __future__ import annotations

import contextlib
import os
import resource
import time

import torch
import torch.distributed as dist

from tetrad.config.sections import ConfigError


# train.dtype's names: the parameter and compute dtype of each.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_device_type(requested: str, option: str = "train.device") -> str:
    """'auto' picks the accelerator torch finds (cuda, xpu, ...) and falls back to cpu; `option`
    is what the user set it with, for the message."""
    if requested == "auto":
        acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        return acc.type if acc is not None else "cpu"
    if requested != "cpu" and not (torch.accelerator.is_available()
                                   and torch.accelerator.current_accelerator().type == requested):
        raise ConfigError(f"{option}={requested!r} but torch sees no {requested} device on this machine; "
                          f"use {option}='cpu' or 'auto'")
    return requested


def backend_for(device_type: str) -> str:
    """The collective backend torch pairs with the device: gloo for cpu, nccl for cuda, ..."""
    return dist.Backend.default_device_backend_map.get(device_type, "gloo")


def local_device_count(device_type: str) -> int:
    return 1 if device_type == "cpu" else torch.accelerator.device_count()


def bind_rank(device_type: str, local_rank: int) -> torch.device:
    """The device this rank computes on; accelerators get one device per local rank."""
    if device_type == "cpu":
        return torch.device("cpu")
    torch.accelerator.set_device_index(local_rank)
    return torch.device(device_type, local_rank)


def configure_allocator(device_type: str, environ=os.environ) -> None:
    """Expandable segments for the CUDA caching allocator (less fragmentation: reserved memory stays
    closer to allocated) unless the user configured the allocator. Call before the process first
    uses CUDA: torch reads the variable once, when its allocator starts; spawned ranks inherit it."""
    if device_type == "cuda" and not any(name in environ for name in ALLOC_CONF_VARIABLES):
        environ["PYTORCH_ALLOC_CONF"] = "expandable_segments:True"


# torch >= 2.9 reads PYTORCH_ALLOC_CONF, and PYTORCH_CUDA_ALLOC_CONF as its deprecated name.
ALLOC_CONF_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


def dtype_problem(device_type: str, dtype: torch.dtype) -> str | None:
    """Why `device_type` on this machine cannot train in `dtype`, or None. CUDA devices are asked
    for their compute capability, which allocates nothing: an allocation here (before ranks bind
    their devices) would open a context on GPU 0 in every process that checks. The CPU is tried."""
    if device_type == "cuda":
        if torch.version.hip:
            return None
        for index in range(torch.cuda.device_count()):
            major, minor = torch.cuda.get_device_capability(index)
            if dtype == torch.bfloat16 and major < 8:
                return f"bf16 needs compute capability 8.0 (Ampere) or newer; GPU {index} has {major}.{minor}"
            if dtype == torch.float16 and (major, minor) < (5, 3):
                return f"fp16 needs compute capability 5.3 or newer; GPU {index} has {major}.{minor}"
        return None
    if device_type == "cpu":
        try:
            x = torch.ones((8, 8), dtype=dtype)
            (x @ x).sum().item()
        except RuntimeError as e:
            return str(e).splitlines()[0]
    return None  # other accelerators: nothing to ask without allocating; a rank fails if unsupported


def set_fp32_matmul(device: torch.device, tf32: bool) -> None:
    """TF32 tensor cores for fp32 matmuls on CUDA (10 mantissa bits in the products, fp32
    accumulation), or full IEEE fp32. Elsewhere fp32 matmuls stay fp32."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.fp32_precision = "tf32" if tf32 else "ieee"


def uses_tf32(device: torch.device) -> bool:
    return device.type == "cuda" and torch.backends.cuda.matmul.fp32_precision == "tf32"


# Device types with torch's fused (one kernel per step) AdamW.
FUSED_OPTIMIZER_DEVICES = ("cpu", "cuda", "xpu", "mps")


def collective_device(group=None) -> torch.device:
    """The device whose tensors `group`'s backend moves: the CPU for gloo, else this rank's
    accelerator (NCCL takes no CPU tensors)."""
    if dist.get_backend(group) == "gloo":
        return torch.device("cpu")
    return torch.device(torch.accelerator.current_accelerator().type, torch.accelerator.current_device_index())


def prefers_cudnn_attention(device: torch.device) -> bool:
    """Whether torch's SDPA would try cuDNN attention first on `device` (its
    check_prefer_cudnn_attention: Hopper/Blackwell, cuDNN newer than 9.15, cuDNN SDPA enabled)."""
    if device.type != "cuda" or not torch.backends.cudnn.is_available():
        return False
    props = torch.cuda.get_device_properties(device)
    return ((torch.backends.cudnn.version() or 0) > 91500 and props.major in (9, 10) and props.minor in (0, 3)
            and torch.backends.cuda.cudnn_sdp_enabled())


def runs_flash_attention(device: torch.device | str) -> bool:
    """Whether flash and cuDNN attention run on CUDA `device`: compute capability 8.0 (Ampere) or
    newer, which flash_api.cpp checks before any kernel (torch's varlen_attn has no other; SDPA
    never picks flash below it), so a T4 or V100 in fp16 gets the memory-efficient kernel. A
    device named by type alone (the planner's GPU, a bench's "cuda") is taken to be one; ROCm too.
    get_device_properties allocates nothing and torch.compile folds it to a constant."""
    device = torch.device(device)
    if device.type != "cuda" or device.index is None or torch.version.hip:
        return device.type == "cuda"
    return torch.cuda.get_device_properties(device).major >= 8


def fused_attention_kernels(dtype: torch.dtype, head_dim: int, flash: bool = True) -> set[str]:
    """The CUDA attention ops that take heads of `head_dim` in `dtype` on every GPU when called
    directly, as ring attention calls them (torch's sdp_utils.cpp and flash_api.cpp): flash
    (bf16/fp16) a multiple of 8 up to 256 (SDPA pads other sizes to 8 for it; the ring does not),
    except (192, 224], whose backward sm86/89/120 refuse; cuDNN (bf16/fp16) a multiple of 8 up to
    128 (up to 256 only on some GPUs and cuDNN versions); memory-efficient a multiple of 8 in
    bf16/fp16, of 4 in fp32 (its GEMM alignment). Where none does, attention takes the math path
    (the ring its own; one SDPA call torch's), as SDPA falls back to it. `flash`: whether the GPU
    runs flash and cuDNN at all (`runs_flash_attention`)."""
    half = dtype in (torch.bfloat16, torch.float16)
    kernels = {"efficient"} if head_dim > 0 and head_dim % (8 if half else 4) == 0 else set()
    if flash and half and head_dim % 8 == 0 and 0 < head_dim <= 256 and not 192 < head_dim <= 224:
        kernels |= {"flash", "cudnn"} if head_dim <= 128 else {"flash"}
    return kernels


def host_buffer(like: torch.Tensor) -> torch.Tensor:
    """An empty CPU tensor shaped like `like`: pinned (page-locked) when `like` is on an
    accelerator, so copies between the two run at full bus speed and without blocking the host
    (`non_blocking=True`); the CPU's own tensors need no pinning (and torch cannot pin without one)."""
    return torch.empty(like.shape, dtype=like.dtype, pin_memory=like.device.type != "cpu")


def host_to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor copied to `device` with no wait on the host: from pinned memory, non-blocking
    (a pageable copy waits for the device's queue to drain, a host sync). On the CPU, itself."""
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def accelerator_properties(device: torch.device):
    """A CUDA device's properties (name, total_memory, uuid, ...); None on other devices."""
    return torch.cuda.get_device_properties(device) if device.type == "cuda" else None


def memory_gib(device: torch.device) -> float | None:
    """A CUDA device's memory in GiB, as the driver reports it; None on other devices."""
    props = accelerator_properties(device)
    return None if props is None else props.total_memory / 2**30


def rng_states(device: torch.device) -> dict[str, torch.Tensor]:
    """The states of the random generators a rank draws from: the CPU's, and its accelerator's."""
    out = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        out["cuda"] = torch.cuda.get_rng_state(device)
    return out


def set_rng_states(states: dict[str, torch.Tensor], device: torch.device) -> None:
    """Restore what `rng_states` returned (the parts present)."""
    if "cpu" in states:
        torch.set_rng_state(states["cpu"])
    if "cuda" in states and device.type == "cuda":
        torch.cuda.set_rng_state(states["cuda"], device)


def synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


class HostClock:
    """Time marks where the host does the work itself (CPU ranks): perf_counter."""

    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, start: float, end: float) -> float:
        return end - start


class StreamClock:
    """Time marks on an accelerator, where the host only enqueues: an event recorded on the
    current stream completes once everything enqueued before it has, a stream's wait on a
    collective included, so two marks around `work.wait()` measure how long the device waited
    (perf_counter there measures the enqueueing). Read `seconds` after the step's synchronize."""

    def __init__(self, device: torch.device):
        self.device = device

    def mark(self) -> torch.Event:
        event = torch.Event(device=self.device, enable_timing=True)
        event.record()
        return event

    def seconds(self, start: torch.Event, end: torch.Event) -> float:
        end.synchronize()
        return start.elapsed_time(end) / 1000


def clock(device: torch.device) -> HostClock | StreamClock:
    """Where the time of `device`'s work is read: on the host for CPU, on the stream otherwise."""
    return HostClock() if device.type == "cpu" else StreamClock(device)


def phase(name: str, device: torch.device):
    """A named range for torch.profiler traces and, on CUDA, for Nsight Systems (NVTX). Off CUDA
    and outside a profiler it is nothing: entering a profiler range costs more than a tiny
    model's kernel, several times a step."""
    if device.type == "cuda":
        return _ranges(name, nvtx=True)
    return _ranges(name, nvtx=False) if torch._C._autograd._profiler_enabled() else contextlib.nullcontext()


@contextlib.contextmanager
def _ranges(name: str, nvtx: bool):
    with torch.profiler.record_function(name):
        if nvtx:
            torch.cuda.nvtx.range_push(name)
        try:
            yield
        finally:
            if nvtx:
                torch.cuda.nvtx.range_pop()


def profiler_activities(device: torch.device) -> list:
    """What torch.profiler should record on this device: CPU ops, plus the accelerator's kernels."""
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return acts


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def start_memory_tracking(device: torch.device) -> int:
    """Mark where a rank's measured memory starts; returns what peak_memory_bytes should subtract.

    On CPU the figure is the resident set, and a rank forked from a parent (the tests, the local
    launcher) starts with the parent's pages resident: only the growth from here describes the
    rank. Linux lets a process reset its own high-water mark (clear_refs "5"); elsewhere the peak
    since the process started is all there is. On an accelerator the peak allocated bytes are the
    rank's own already: their counter restarts and nothing is subtracted.
    """
    if device.type == "cuda":
        reset_peak_memory(device)
        return 0
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return 0
    return _proc_status_bytes("VmRSS")


def peak_memory_bytes(device: torch.device, since: int = 0) -> int:
    """Peak allocated bytes on an accelerator; on CPU the peak resident set (since the last
    start_memory_tracking on Linux) less `since`, the resident set start_memory_tracking found.
    Never below zero: Linux sums a process's resident pages from per-CPU counters approximately,
    so a high-water mark read soon after the start can sit a few pages under the resident set read
    then, and the rank's peak is never under where it started."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    try:
        peak = _proc_status_bytes("VmHWM")
    except OSError:
        peak = _rusage_bytes()
    return max(0, peak - since)


class PeakMemory:
    """A rank's peak memory from here on: start_memory_tracking, then `bytes()` says what
    peak_memory_bytes would, more cheaply on CPU. getrusage's peak (one system call) is the larger
    of the high-water mark /proc/self/status reports (VmHWM, ~70 us to read mid-run, a fortieth of
    a tiny model's step) and a figure the kernel keeps from before (a forked rank: its parent's
    peak), fixed for the process's life: once getrusage rises above its value at the start, it is
    this rank's high-water mark; until then /proc is read."""

    def __init__(self, device: torch.device):
        self.device = device
        self.base = start_memory_tracking(device)
        self.rusage_at_start = _rusage_bytes() if device.type == "cpu" and self.base > 0 else None

    def bytes(self) -> int:
        if self.rusage_at_start is not None and (now := _rusage_bytes()) > self.rusage_at_start:
            return max(0, now - self.base)
        return peak_memory_bytes(self.device, self.base)


def _rusage_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def accelerator_fields(device: torch.device) -> dict:
    """Per-step metrics only an accelerator has: the caching allocator's peak reserved memory
    since start_memory_tracking (what runs out on a GPU, not only what is allocated), how many
    allocations it retried after freeing its cache (each a synchronising slow path, a sign of
    fragmentation; a running count), and whether fp32 matmuls use TF32. Empty on CPU: the fields
    are absent where the device has none of these, never zero."""
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    return {"peak_reserved_gib": stats.get("reserved_bytes.all.peak", 0) / 2**30,
            "alloc_retries": stats.get("num_alloc_retries", 0), "tf32": uses_tf32(device)}


def _proc_status_bytes(field: str) -> int:
    """A kB field of /proc/self/status (Linux), in bytes."""
    with open("/proc/self/status", "rb") as f:
        text = f.read()  # at once: a read per line costs more than the rest of a tiny step's metrics
    at = text.find(b"\n" + field.encode() + b":")
    if at < 0:
        raise OSError(f"/proc/self/status has no {field}")
    return int(text[at:text.index(b"\n", at + 1)].split()[1]) * 1024


def host_memory_gib() -> tuple[float, float] | None:
    """(GiB the host can still give processes, MemAvailable; this process's resident GiB), or None
    where /proc has neither (not Linux)."""
    try:
        with open("/proc/meminfo", "rb") as f:
            meminfo = f.read()
        at = meminfo.index(b"MemAvailable:")
        available = int(meminfo[at:meminfo.index(b"\n", at)].split()[1]) * 1024
        return available / 2**30, _proc_status_bytes("VmRSS") / 2**30
    except (OSError, ValueError):
        return None


def threads_per_rank(ranks_on_this_machine: int) -> int:
    """Intra-op threads so that local ranks do not oversubscribe the cores (docs/platform.md: 36x
    slower with 2 threads per rank at 8 ranks on 2 cores); an OMP_NUM_THREADS the user set is
    taken as it is, as torchrun does (on a shared machine one thread can be 30x faster than two)."""
    requested = os.environ.get("OMP_NUM_THREADS", "")
    if requested.isdigit() and int(requested) > 0:
        return int(requested)
    return max(1, (os.cpu_count() or 1) // max(1, ranks_on_this_machine))
