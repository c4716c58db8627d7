"""Device telemetry: the sampler thread's lifecycle and averaging, the counter arithmetic, and no
telemetry at all on a CPU (the fields are absent from metrics.jsonl: tests/test_device.py)."""

import threading

import torch

from tetrad.train import telemetry


class CountingReader:
    """A device whose utilisation reads 10, 20, 30, ...; records which thread asked."""

    def __init__(self):
        self.calls, self.threads = 0, set()

    def __call__(self):
        self.calls += 1
        self.threads.add(threading.current_thread().name)
        return {"gpu_util_pct": 10.0 * self.calls}


def test_sampler_samples_off_the_calling_thread_and_stops():
    read = CountingReader()
    sampler = telemetry.TelemetrySampler(read, interval_s=0.01).start()
    assert sampler.running
    while read.calls < 3:
        threading.Event().wait(0.01)
    sample = sampler.take()
    assert read.threads == {"tetrad-telemetry"}  # never on the training thread
    n = read.calls
    assert 10.0 * 1 <= sample["gpu_util_pct"] <= 10.0 * n  # the mean of the samples so far
    sampler.stop()
    assert not sampler.running
    after = read.calls
    threading.Event().wait(0.05)
    assert read.calls == after  # nothing samples after stop


def test_take_averages_since_the_last_take_and_reads_once_when_empty():
    read = CountingReader()
    sampler = telemetry.TelemetrySampler(read)  # not started: samples only on demand
    sampler._sample()
    sampler._sample()
    assert sampler.take() == {"gpu_util_pct": 15.0}
    assert sampler.take() == {"gpu_util_pct": 30.0}  # nothing new since: one fresh sample


def test_fields_a_sample_lacks_are_averaged_over_the_samples_that_have_them():
    samples = iter([{"gpu_util_pct": 50.0}, {"gpu_util_pct": 70.0, "pcie_tx_gbps": 2.0}])
    sampler = telemetry.TelemetrySampler(lambda: next(samples))
    sampler._sample()
    sampler._sample()
    assert sampler.take() == {"gpu_util_pct": 60.0, "pcie_tx_gbps": 2.0}


def test_rates_from_running_counters():
    rates = telemetry.Rates()
    assert rates.update({"nic_tx_gbps": 0}) == {}  # the first reading has nothing to compare
    rates.last = (rates.last[0] - 2.0, rates.last[1])  # as if two seconds had passed
    assert abs(rates.update({"nic_tx_gbps": 4e9})["nic_tx_gbps"] - 2.0) < 1e-3


def test_infiniband_counters_count_four_byte_words(tmp_path):
    assert telemetry.infiniband_bytes(tmp_path) == {}
    for device, words in (("mlx5_0", 10), ("mlx5_1", 5)):
        port = tmp_path / device / "ports" / "1" / "counters"
        port.mkdir(parents=True)
        (port / "port_xmit_data").write_text(f"{words}\n")
        (port / "port_rcv_data").write_text(f"{2 * words}\n")
    assert telemetry.infiniband_bytes(tmp_path) == {"nic_tx_gbps": 60, "nic_rx_gbps": 120}


def test_no_telemetry_on_cpu():
    assert telemetry.nvml_reader(torch.device("cpu")) is None
    assert telemetry.for_device(torch.device("cpu")) is None


def test_report_shows_the_telemetry_a_run_recorded():
    from tetrad.config import load_config
    from tetrad.viz import report
    record = {"step": 1, "loss": 3.0, "step_time_s": 0.5, "tokens_per_s": 100.0, "mfu": None, "hfu": None,
              "compute_s": 0.4, "gpu_util_pct": 87.0, "nvlink_tx_gbps": 120.5}
    page = report._html(load_config(), [record], [record], [], [], [])
    assert "GPU busy % 87.0" in page and "NVLink tx GB/s 120.5" in page and "PCIe" not in page
    plain = {k: v for k, v in record.items() if k not in telemetry.FIELDS}
    assert "device telemetry" not in report._html(load_config(), [plain], [plain], [], [], [])
