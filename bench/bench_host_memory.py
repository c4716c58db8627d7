"""glibc's heap on CPU ranks: the measured per-rank peak and the step time by ZeRO stage with
glibc's default malloc and with its mmap and trim thresholds fixed at 128 KiB (freed tensors go
back to the system at once), on issue 20's model: Llama, 8 layers, d_model 256, GQA 8:4, vocab
4096, seq 256, micro-batch 4, 2 spawned gloo ranks, one thread each.

By default glibc raises its mmap threshold to the size of each mmapped block freed (up to 32
MiB), so later buffers of that size come from its heap and stay resident once freed: the resident
set then counts memory the runtime no longer holds. A fixed threshold removes that, at the price
of an mmap and fresh (zeroed, faulted) pages for every large tensor. tetrad leaves glibc as it is
(docs/platform.md has the figures); the memory tests fix the threshold themselves.

Each round runs every stage under both settings in fresh ranks, the settings' order alternating
round to round. Peak: the trainer's peak_memory_gib after the last step, max over ranks. Step:
the median step_time_s of steps 2 on, max over ranks. Prints medians over the rounds with
[min-max] and the ratio of the step medians (fixed / default).

--per-tensor: what one tensor costs instead, in one rank of one thread under each setting:
allocating, filling and freeing it over and over, less filling it alone (medians of 7 repeats).

    .venv/bin/python bench/bench_host_memory.py [--rounds 3] [--steps 8] [--per-tensor]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import tempfile
import time

import torch

from tetrad import launch
from tetrad.config import load_config
from tetrad.train.trainer import Trainer

MODEL = {"n_layers": 8, "d_model": 256, "n_heads": 8, "n_kv_heads": 4, "vocab_size": 4096, "seq_len": 256}
MICRO_BATCH = 4
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
FIXED_THRESHOLD = 128 << 10  # glibc's initial mmap threshold
SETTINGS = ("default", "fixed")


def _set_up(setting: str) -> None:
    if setting == "fixed":
        libc = ctypes.CDLL(None)
        libc.mallopt(M_MMAP_THRESHOLD, FIXED_THRESHOLD)
        libc.mallopt(M_TRIM_THRESHOLD, FIXED_THRESHOLD)


def _rank(cfg, setting: str) -> tuple[float, float]:
    _set_up(setting)
    history = Trainer(cfg, torch.device("cpu")).fit()
    return history[-1]["peak_memory_gib"] * 1024, statistics.median(r["step_time_s"] for r in history[1:])


def _median_s(fn, reps: int) -> float:
    times = []
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        times.append((time.perf_counter() - start) / reps)
    return statistics.median(times)


def _per_tensor(setting: str, sizes_kib: tuple[int, ...]) -> list[tuple[float, float]]:
    """(seconds to allocate, fill and free a tensor, seconds to fill it alone) for each size."""
    _set_up(setting)
    torch.set_num_threads(1)
    out = []
    for kib in sizes_kib:
        numel, reps = kib * 256, max(20, 20000 // kib)
        held = torch.empty(numel)
        out.append((_median_s(lambda: torch.empty(numel).fill_(1.0), reps), _median_s(lambda: held.fill_(1.0), reps)))
    return out


def per_tensor_table() -> str:
    sizes = (256, 1024, 4096, 16384)
    rows = ["setting   KiB   alloc+fill+free us   fill us   extra us   extra us/MiB"]
    for setting in SETTINGS:
        for kib, (whole, fill) in zip(sizes, launch.run_local(_per_tensor, 1, (setting, sizes), spawn=True)[0]):
            extra = 1e6 * (whole - fill)
            rows.append(f"{setting:>7} {kib:>5}  {1e6 * whole:>19.1f}  {1e6 * fill:>8.1f}  {extra:>9.1f}  "
                        f"{extra * 1024 / kib:>13.1f}")
    return "\n".join(rows)


def _cfg(zero: int, steps: int):
    return load_config(overrides={
        "model": MODEL, "parallel": {"dp": 2, "zero": zero},
        "train": {"steps": steps, "device": "cpu", "warmup": 1, "micro_batch": MICRO_BATCH,
                  "global_batch": 2 * MICRO_BATCH},
        "run": {"dir": tempfile.mkdtemp(prefix="tetrad-bench-host-memory-")}})


def _spread(xs: list[float], fmt: str = ".0f") -> str:
    return f"{statistics.median(xs):{fmt}} [{min(xs):{fmt}}-{max(xs):{fmt}}]"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--per-tensor", action="store_true", help="time one tensor's allocation instead")
    args = ap.parse_args()
    if args.per_tensor:
        print(per_tensor_table())
        return 0
    peak = {(s, z): [] for s in SETTINGS for z in range(4)}
    step = {(s, z): [] for s in SETTINGS for z in range(4)}
    for r in range(args.rounds):
        for zero in range(4):
            for setting in SETTINGS if r % 2 == 0 else SETTINGS[::-1]:
                ranks = launch.run_local(_rank, 2, (_cfg(zero, args.steps), setting), spawn=True, timeout_s=900)
                peak[setting, zero].append(max(p for p, _ in ranks))
                step[setting, zero].append(1e3 * max(t for _, t in ranks))
    print(f"{args.rounds} rounds of {args.steps} steps; median [min-max] over rounds")
    print("ZeRO  peak MiB default  peak MiB fixed   step ms default   step ms fixed   step fixed/default")
    for zero in range(4):
        ratio = statistics.median(step["fixed", zero]) / statistics.median(step["default", zero])
        print(f"{zero:>4}  {_spread(peak['default', zero]):>16}  {_spread(peak['fixed', zero]):>14}  "
              f"{_spread(step['default', zero]):>16}  {_spread(step['fixed', zero]):>14}  {ratio:>18.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
