"""The output head and its cross-entropy, fused and chunked (`train.loss_chunk_tokens`,
model/chunked_loss.py) against torch's unfused F.linear + F.cross_entropy (torchtitan's loss, and
tetrad's at loss_chunk_tokens = 0), side by side in one run: forward + backward time, and the peak
of memory allocated during it beyond the inputs, weights and the gradients' own storage.

On CPU the peak comes from torch.profiler's memory events (every allocation and free, summed in
order); on CUDA from torch.cuda.max_memory_allocated. Each figure is the median of `--rounds`
rounds, the variants alternated within a round; the ratio column is against the unfused row of
the same run.

    .venv/bin/python bench/bench_loss.py [--tokens 2048] [--d-model 512] [--vocab 32768] [--chunks 256,1024,4096]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from tetrad.dist.topology import Topology
from tetrad.model.chunked_loss import chunked_head_loss
from tetrad.model.execution import Execution


def unfused(x, weight, labels, vocab):
    return F.cross_entropy(F.linear(x, weight).float(), labels, reduction="sum")


def fused(chunk):
    topo, ex = Topology.single(), Execution(loss_chunk=chunk)
    return lambda x, weight, labels, vocab: chunked_head_loss(x, weight, labels, vocab, topo, ex, chunk)


def step(loss_fn, x, weight, labels, vocab) -> None:
    x.grad = weight.grad = None
    loss_fn(x, weight, labels, vocab).backward()


def cpu_peak_bytes(fn) -> int:
    """The highest sum of live allocations while `fn` runs: the profiler's raw memory records (each
    allocation and free, in time order; its FunctionEvents fold those inside an op into the op)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    records = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in records:
        live += nbytes
        peak = max(peak, live)
    return peak


def peak_bytes(fn, device: torch.device) -> int:
    if device.type != "cuda":
        return cpu_peak_bytes(fn)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def seconds(fn, device: torch.device, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--chunks", default="256,1024,4096")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(args.tokens, args.d_model, generator=gen) * 0.5).to(device, dtype).requires_grad_()
    weight = (torch.randn(args.vocab, args.d_model, generator=gen) * 0.02).to(device, dtype).requires_grad_()
    labels = torch.randint(0, args.vocab, (args.tokens,), generator=gen).to(device)
    variants = {"unfused": unfused, **{f"chunk {c}": fused(c) for c in map(int, args.chunks.split(","))}}
    times = {name: [] for name in variants}
    peaks = {}
    losses = {}
    for name, fn in variants.items():  # warm-up, loss, and memory (deterministic: once)
        step(fn, x, weight, labels, args.vocab)
        losses[name] = fn(x, weight, labels, args.vocab).item()
        peaks[name] = peak_bytes(lambda: step(fn, x, weight, labels, args.vocab), device)
    for _ in range(args.rounds):
        for name, fn in variants.items():
            times[name].append(seconds(lambda: step(fn, x, weight, labels, args.vocab), device, args.repeats))
    base = statistics.median(times["unfused"])
    print(f"{args.device} {args.dtype}: tokens {args.tokens}, d_model {args.d_model}, vocab {args.vocab}; "
          f"{args.rounds} rounds x {args.repeats} repeats; torch {torch.__version__}")
    print(f"{'variant':<12} {'fwd+bwd ms':>11} {'ratio':>6} {'spread ms':>15} {'peak MiB':>9} {'ratio':>6} {'loss':>14}")
    for name in variants:
        t = statistics.median(times[name])
        print(f"{name:<12} {t * 1e3:>11.1f} {t / base:>6.2f} "
              f"{min(times[name]) * 1e3:>7.1f}-{max(times[name]) * 1e3:<7.1f} {peaks[name] / 2**20:>9.1f} "
              f"{peaks[name] / peaks['unfused']:>6.2f} {losses[name]:>14.4f}")


if __name__ == "__main__":
    main()
