"""The host's AdamW under `train.offload_optimizer`: torch's fused CPU AdamW (what
parallel/data/optimizer.py runs on offloaded masters) against the memory bandwidth of a plain
copy, at 1..N threads, so the planner's host AdamW model (bytes per element over the host's
memory bandwidth, docs/planner.md) can be checked against a real CPU.

AdamW reads the fp32 weight, gradient and both moments and writes the weight and moments: 28 bytes
an element. The bandwidth reference is a triad, c = a + s b: 12 bytes an element. The tensors are
made once (`--elements` fp32 values each, default 32M: 128 MiB, far beyond the caches), and the
thread counts are taken in turn `--rounds` times; each figure is the median over rounds of the
median of `--repeats` timed calls after one warm-up.

    .venv/bin/python bench/bench_cpu_adam.py [--elements 33554432] [--threads 1,2] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

ADAM_BYTES = 28  # read weight, gradient, exp_avg, exp_avg_sq; write weight, exp_avg, exp_avg_sq
TRIAD_BYTES = 12  # read a, b; write c


def median_seconds(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--elements", type=int, default=1 << 25)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    n = args.elements
    weight = torch.nn.Parameter(torch.randn(n))
    weight.grad = torch.randn(n)
    adam = torch.optim.AdamW([weight], lr=1e-4, fused=True)
    a, b, c = torch.randn(n), torch.randn(n), torch.empty(n)
    threads = [int(t) for t in args.threads.split(",")]
    adam_s, triad_s = {t: [] for t in threads}, {t: [] for t in threads}
    for _ in range(args.rounds):
        for t in threads:
            torch.set_num_threads(t)
            adam_s[t].append(median_seconds(adam.step, args.repeats))
            triad_s[t].append(median_seconds(lambda: torch.add(a, b, alpha=0.5, out=c), args.repeats))
    print(f"torch {torch.__version__}, {n} fp32 elements, fused AdamW on the CPU; medians of {args.rounds} rounds")
    print("threads  AdamW Gelem/s  AdamW GB/s  triad GB/s  AdamW/triad")
    for t in threads:
        adam_t, triad_t = statistics.median(adam_s[t]), statistics.median(triad_s[t])
        adam_gbps, triad_gbps = n * ADAM_BYTES / adam_t / 1e9, n * TRIAD_BYTES / triad_t / 1e9
        print(f"{t:7d}  {n / adam_t / 1e9:13.3f}  {adam_gbps:10.1f}  {triad_gbps:10.1f}  "
              f"{adam_gbps / triad_gbps:11.2f}")


if __name__ == "__main__":
    main()
