"""tetrad ZeRO-0 vs torch DDP and tetrad ZeRO-3 vs torch FSDP2 (`fully_shard`), side by side on
the same model, data and 2 gloo ranks (overlap is measurable only at 2 ranks on these CPUs).

Against torch's default AdamW (ddp, fsdp2) and, for DDP, also against the fused AdamW tetrad uses
(ddp_fused: the same optimizer on both sides, so the ratio is the data-parallel machinery's alone).
Prints step time and peak-memory ratios (tetrad / torch; <= 1.0 is as good or better) and the
fraction of DP communication hidden behind backward: (backward alone + reduction alone -
overlapped step) / reduction alone. Each framework runs in fresh ranks once per round, the pair's
order alternating round to round; figures are medians over the rounds with their [min-max], the
ratio the median of the per-round ratios.  Run: .venv/bin/python bench/bench_dp.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time

import torch

from tetrad import device as devices
from tetrad import launch
from tetrad.config import load_config
from tetrad.dist.layout import Layout
from tetrad.dist.topology import Topology
from tetrad.train.trainer import Trainer, build_model

STEPS = 12
# Wide and short: 12.6M parameters (a 50 MB fp32 gradient) against 64 tokens of compute per rank,
# so the reduction costs about as much as the backward and its hidden part stands out of the noise.
MODEL = {"n_layers": 4, "d_model": 512, "n_heads": 8, "n_kv_heads": 4, "ffn_hidden": 1536, "seq_len": 32}
BATCH = 2


def _cfg(zero: int):
    return load_config(overrides={"model": MODEL, "parallel": {"dp": 2, "zero": zero, "grad_bucket_mb": 4.0},
                                  "train": {"global_batch": 2 * BATCH, "micro_batch": BATCH, "steps": STEPS,
                                            "lr": 1e-3}})


def _median_time(fn) -> float:
    times = []
    for _ in range(STEPS):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


def _rank(kind: str) -> dict:
    import torch.distributed as dist
    cpu = torch.device("cpu")
    base = devices.start_memory_tracking(cpu)  # the growth from here: a forked rank starts with its parent's pages
    cfg = _cfg(3 if kind == "zero3" else 0)
    tokens = torch.randint(0, cfg.model.vocab_size, (BATCH, MODEL["seq_len"] + 1),
                           generator=torch.Generator().manual_seed(dist.get_rank()))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(MODEL["seq_len"])
    if kind in ("zero0", "zero3"):
        trainer = Trainer(cfg, torch.device("cpu"))
        model, grads = trainer.model, trainer.grads

        def fwd_bwd(sync: bool):
            loss = model(inputs, positions, labels)
            with grads.last_microbatch() if sync else contextlib.nullcontext():
                loss.backward()
            if sync:
                grads.reduce()

        def zero():
            trainer.optimizer.zero_grad(set_to_none=True)
            grads.zero_grad()  # also drops gradients a no-sync pass left unreduced

        def step():
            fwd_bwd(True)
            trainer.optimizer.step()
            zero()

        def comm_alone():  # the same buckets reduced after backward, blocking
            fwd_bwd(False)
            start = time.perf_counter()
            grads.reduce()
            elapsed = time.perf_counter() - start
            trainer.optimizer.zero_grad(set_to_none=True)
            return elapsed
    else:
        model = build_model(cfg, Topology(Layout(dp=2), torch.device("cpu")))
        if kind.startswith("ddp"):
            wrapped = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=4)
        else:
            from torch.distributed.fsdp import fully_shard
            for block in model.layers.values():
                fully_shard(block)
            wrapped = fully_shard(model)
        # torch's default AdamW (a foreach loop), or, for "ddp_fused", the fused kernel tetrad uses.
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), fused=kind == "ddp_fused")
        flat = torch.zeros(sum(p.numel() for p in model.parameters()))

        def fwd_bwd(sync: bool):
            ctx = contextlib.nullcontext() if sync or kind == "fsdp2" else wrapped.no_sync()
            with ctx:
                wrapped(inputs, positions, labels).backward()

        def zero():
            optimizer.zero_grad(set_to_none=True)

        def step():
            fwd_bwd(True)
            optimizer.step()
            zero()

        def comm_alone():
            start = time.perf_counter()
            dist.all_reduce(flat)
            return time.perf_counter() - start
    step_s = _median_time(step)
    # ZeRO-3 and FSDP2 reduce-scatter inside every backward: there is no backward without it to
    # compare with, so no hidden fraction for them.
    hidden = None
    if kind in ("zero0", "ddp", "ddp_fused"):
        overlapped = _median_time(lambda: (fwd_bwd(True), zero()))
        alone = _median_time(lambda: (fwd_bwd(False), zero()))
        comm = statistics.median(comm_alone() for _ in range(STEPS))
        hidden = (alone + comm - overlapped) / comm
    return {"step_s": step_s, "hidden": hidden,
            "peak_bytes": devices.peak_memory_bytes(cpu, base)}


def _spread(xs: list[float], scale: float = 1.0, fmt: str = ".1f") -> str:
    return f"{statistics.median(xs) * scale:{fmt}} [{min(xs) * scale:{fmt}}-{max(xs) * scale:{fmt}}]"


def _compare(ours: str, theirs: str, rounds: int) -> str:
    runs: dict[str, list[dict]] = {ours: [], theirs: []}
    for r in range(rounds):
        for kind in (ours, theirs) if r % 2 == 0 else (theirs, ours):
            runs[kind].append(launch.run_local(_rank, 2, (kind,), timeout_s=600, pg_timeout_s=120)[0])
    a, b = runs[ours], runs[theirs]
    step = {k: [r["step_s"] for r in v] for k, v in runs.items()}
    ratio = [x / y for x, y in zip(step[ours], step[theirs])]
    peak = [x["peak_bytes"] / max(1, y["peak_bytes"]) for x, y in zip(a, b)]

    def hidden(rs):
        return "n/a" if rs[0]["hidden"] is None else _spread([r["hidden"] for r in rs], 100, ".0f") + " %"
    return (f"tetrad {ours} vs torch {theirs}, {rounds} rounds: step {_spread(step[ours], 1e3)} vs "
            f"{_spread(step[theirs], 1e3)} ms, ratio {_spread(ratio, fmt='.2f')}; peak-RSS growth ratio "
            f"{_spread(peak, fmt='.2f')}; dp comm hidden behind backward {hidden(a)} (tetrad) vs {hidden(b)} (torch)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--pairs", nargs="+", default=["zero0:ddp", "zero0:ddp_fused", "zero3:fsdp2"],
                    help="e.g. zero0:ddp (ddp_fused: DDP with the fused AdamW tetrad uses)")
    args = ap.parse_args()
    for pair in args.pairs:
        print(_compare(*pair.split(":"), args.rounds), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
