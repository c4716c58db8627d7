"""Device telemetry next to the step breakdown, DCGM-style: GPU utilisation, memory-bandwidth
utilisation, PCIe, NVLink and NIC throughput, sampled by a background thread (never on the
training thread) and averaged over each step into metrics.jsonl.

Counters come from NVML (the `pynvml` module, package nvidia-ml-py, when importable) and, for
InfiniBand NICs, from the port counters Linux exposes in /sys/class/infiniband. A field is
written only where its source exists: on CPU, or without pynvml, there are none (absent, not
zero). Fields and units: docs/gpu.md.
"""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path
from typing import Callable

import torch

from tetrad import device as devices
from tetrad.config import profile_steps

# Every field a sample may carry, with the label the report shows.
FIELDS = {"gpu_util_pct": "GPU busy %", "mem_bw_util_pct": "memory bandwidth busy %",
          "pcie_tx_gbps": "PCIe tx GB/s", "pcie_rx_gbps": "PCIe rx GB/s",
          "nvlink_tx_gbps": "NVLink tx GB/s", "nvlink_rx_gbps": "NVLink rx GB/s",
          "nic_tx_gbps": "NIC tx GB/s", "nic_rx_gbps": "NIC rx GB/s"}

Reader = Callable[[], dict]  # one sample: field -> value (rates already per second)


class TelemetrySampler:
    """Calls `read` every `interval_s` on a daemon thread; `take()` returns the mean of each field
    over the samples since the previous take (and always at least one fresh sample)."""

    def __init__(self, read: Reader, interval_s: float = 0.5):
        self.read, self.interval_s = read, interval_s
        self._samples: list[dict] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tetrad-telemetry", daemon=True)

    def start(self) -> "TelemetrySampler":
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval_s)

    def _sample(self) -> None:
        sample = self.read()
        with self._lock:
            self._samples.append(sample)

    def take(self) -> dict:
        with self._lock:
            samples, self._samples = self._samples, []
        if not samples:
            samples = [self.read()]
        fields = {k for s in samples for k in s}
        return {k: sum(s[k] for s in samples if k in s) / sum(k in s for s in samples) for k in sorted(fields)}

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()


def for_device(device: torch.device, interval_s: float = 0.5) -> TelemetrySampler | None:
    """A started sampler of this rank's device, or None where nothing can be read (CPU, no pynvml)."""
    read = nvml_reader(device)
    return TelemetrySampler(read, interval_s).start() if read is not None else None


def nvml_reader(device: torch.device) -> Reader | None:
    """Reads the NVML counters of `device` (found by UUID, so CUDA_VISIBLE_DEVICES cannot
    misplace it) and the InfiniBand port counters; None off CUDA or without pynvml."""
    if device.type != "cuda":
        return None
    try:
        import pynvml
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{devices.accelerator_properties(device).uuid}")
    except Exception:  # no pynvml, no driver library, or a device NVML does not know
        return None
    nvlink = Rates()
    nic = Rates()
    fields = (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX)

    def read() -> dict:
        out = {}
        # A counter this device or driver lacks is left out of the sample.
        with contextlib.suppress(Exception):
            util = pynvml.nvmlDeviceGetUtilizationRates(handle)
            out.update(gpu_util_pct=float(util.gpu), mem_bw_util_pct=float(util.memory))
        with contextlib.suppress(Exception):  # KB/s over NVML's 20 ms window
            out["pcie_tx_gbps"] = pynvml.nvmlDeviceGetPcieThroughput(handle, pynvml.NVML_PCIE_UTIL_TX_BYTES) * 1e3 / 1e9
            out["pcie_rx_gbps"] = pynvml.nvmlDeviceGetPcieThroughput(handle, pynvml.NVML_PCIE_UTIL_RX_BYTES) * 1e3 / 1e9
        with contextlib.suppress(Exception):  # running KiB counters over all links
            values = pynvml.nvmlDeviceGetFieldValues(handle, list(fields))
            if all(v.nvmlReturn == pynvml.NVML_SUCCESS for v in values):
                tx, rx = (v.value.ullVal * 1024 for v in values)
                out.update(nvlink.update({"nvlink_tx_gbps": tx, "nvlink_rx_gbps": rx}))
        out.update(nic.update(infiniband_bytes()))
        return out
    return read


class Rates:
    """GB/s from running byte counters: the change since the previous call (nothing the first time)."""

    def __init__(self):
        self.last: tuple[float, dict] | None = None

    def update(self, counters: dict) -> dict:
        now = time.monotonic()
        last, self.last = self.last, (now, counters)
        if last is None or not counters or now <= last[0]:
            return {}
        return {k: (v - last[1][k]) / (now - last[0]) / 1e9 for k, v in counters.items() if k in last[1]}


def infiniband_bytes(root: Path = Path("/sys/class/infiniband")) -> dict:
    """Bytes sent and received so far over every InfiniBand/RoCE port of this host (the counters
    count 4-byte words), keyed by the rate field `Rates` turns them into; empty where there are none."""
    tx = rx = 0
    ports = list(root.glob("*/ports/*/counters"))
    for port in ports:
        with contextlib.suppress(Exception):
            tx += 4 * int((port / "port_xmit_data").read_text())
            rx += 4 * int((port / "port_rcv_data").read_text())
    return {"nic_tx_gbps": tx, "nic_rx_gbps": rx} if ports else {}


def step_profiler(profile: str, first_step: int, trace: Path, device: torch.device):
    """torch.profiler over the steps `train.profile` names (1-based) from `first_step` on, one
    warm-up step before them when there is one; a Chrome trace written to `trace`. None when off."""
    steps = profile_steps(profile)
    steps = range(max(steps.start, first_step + 1), steps.stop)
    if not steps:
        return None
    before = steps.start - 1 - first_step
    warmup = min(1, before)

    def export(prof):
        trace.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace))
    return torch.profiler.profile(
        activities=devices.profiler_activities(device), record_shapes=True, on_trace_ready=export,
        schedule=torch.profiler.schedule(skip_first=before - warmup, wait=0, warmup=warmup, active=len(steps), repeat=1))
