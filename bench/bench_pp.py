"""tetrad's pipeline executor against `torch.distributed.pipelining`, side by side in one run, and
the schedule simulator against the measured step.

Same model (tetrad's Llama chunks: torch's schedules drive the very same modules, so only the
executors differ), same initial weights, same micro-batches, same ranks (forked gloo
processes, one thread each). A step is the schedule's forwards and backwards over m
micro-batches, then AdamW on the stage's parameters; tetrad's step also includes its gradient
clipping and metrics. Schedules: 1F1B (torch `Schedule1F1B`) and interleaved 1F1B with two chunks
per rank (torch `ScheduleInterleaved1F1B`).

Step time: the median of the timed steps, max over ranks; the two frameworks alternate for
`--repeats` rounds and each keeps its best round (the machine may be shared). Peak memory: the
rise of the resident set's high-water mark from the built model (reset there through
/proc/self/clear_refs) to the end of the run, max over ranks: torch's CPU allocator keeps no
statistics. It includes the optimizer states, which are the same on both sides.

Measured vs simulated: from tetrad's recorded per-action times of its last step, the mean F and
B duration of each stage go into the simulator (simulate.py); its step time is compared with
the measured span of that step's actions.

    python bench/bench_pp.py                      # pp=2, m=8, d_model 256, 8 layers, seq 128
    python bench/bench_pp.py --pp 4 --microbatches 8
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from tetrad import launch
from tetrad.config import load_config
from tetrad.parallel.pipeline.registry import build_schedule
from tetrad.parallel.pipeline.schedules import Action
from tetrad.parallel.pipeline.simulate import StageCosts, simulate
from tetrad.dist.layout import Layout
from tetrad.dist.topology import Topology
from tetrad.train.batches import split_batches
from tetrad.train.trainer import Trainer, build_model


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident set


def _peak_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _tetrad_rank(cfg, warmup: int, steps: int):
    trainer = Trainer(cfg, torch.device("cpu"))
    _reset_peak()
    base = _rss_bytes()
    for step in range(warmup):
        trainer.train_step(step)
    times = [trainer.train_step(warmup + i)["step_time_s"] for i in range(steps)]
    return statistics.median(times), _peak_bytes() - base, [(t.kind, t.mb, t.chunk, t.start, t.end)
                                                            for t in trainer.pipeline.timeline()]


def _torch_rank(cfg, warmup: int, steps: int):
    """The same model chunks, driven by torch.distributed.pipelining's schedule."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

    p = cfg.parallel
    topo = Topology(Layout(pp=p.pp), torch.device("cpu"))
    model = build_model(cfg, topo)  # tetrad's chunks with the logical init, no tetrad hooks
    batches, _ = split_batches(cfg)
    tokens = cfg.train.global_batch * cfg.model.seq_len
    positions = torch.arange(cfg.model.seq_len)

    class Chunk(torch.nn.Module):
        def __init__(self, chunk):
            super().__init__()
            self.chunk = chunk

        def forward(self, x):
            return self.chunk(x, positions)

    stages = [PipelineStage(Chunk(c), g, p.pp * p.vpp, torch.device("cpu"))
              for c, g in zip(model.chunks, model.stage_ids)]

    def loss_fn(logits, labels):
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / tokens

    m = cfg.microbatches
    schedule = (Schedule1F1B(stages[0], m, loss_fn=loss_fn) if p.vpp == 1
                else ScheduleInterleaved1F1B(stages, m, loss_fn=loss_fn))
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, betas=(0.9, 0.95),
                                  weight_decay=cfg.train.weight_decay)
    first, last = any(c.first for c in model.chunks), any(c.last for c in model.chunks)

    def step(i):
        inputs, labels = batches.global_batch_at(i)
        start = time.perf_counter()
        schedule.step(*([inputs] if first else []), target=labels if last else None)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    _reset_peak()
    base = _rss_bytes()
    for i in range(warmup):
        step(i)
    times = [step(warmup + i) for i in range(steps)]
    return statistics.median(times), _peak_bytes() - base, None


def measure(cfg, fn, warmup: int, steps: int):
    results = launch.run_local(fn, cfg.parallel.world_size, (cfg, warmup, steps), timeout_s=900)
    return max(r[0] for r in results), max(r[1] for r in results), [r[2] for r in results]


def simulated_vs_measured(cfg, timelines) -> tuple[float, float]:
    """(measured span of the step's actions, simulated step time from their mean costs per stage)."""
    p = cfg.parallel
    stages = p.pp * p.vpp
    rows = [(r, Action(k, mb, c), s, e) for r, tl in enumerate(timelines) for k, mb, c, s, e in tl]
    cost = {k: [0.0] * stages for k in ("F", "B")}
    for kind in cost:
        for g in range(stages):
            spans = [e - s for r, a, s, e in rows if a.kind == kind and a.chunk * p.pp + r == g]
            cost[kind][g] = statistics.mean(spans)
    sim = simulate(build_schedule(p.schedule, p.pp, cfg.microbatches, p.vpp),
                   StageCosts(cost["F"], [b / 2 for b in cost["B"]], [b / 2 for b in cost["B"]]))
    measured = max(e for _, _, s, e in rows) - min(s for _, _, s, e in rows)
    return measured, sim.step_time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    print(f"pp={args.pp}, m={args.microbatches}, d_model {args.d_model}, {args.layers} layers, seq {args.seq}, "
          f"micro-batch {args.micro_batch}; fp32 on CPU (gloo), one thread per rank")
    print(f"{'schedule':<14}{'tetrad s':>10}{'torch s':>10}{'time ratio':>12}{'tetrad MiB':>12}{'torch MiB':>11}"
          f"{'mem ratio':>11}{'sim err':>9}")
    for schedule, vpp in (("1f1b", 1), ("interleaved", 2)):
        cfg = load_config(overrides={
            "model": {"d_model": args.d_model, "n_heads": 8, "n_kv_heads": 4, "ffn_hidden": 3 * args.d_model,
                      "n_layers": args.layers, "seq_len": args.seq},
            "parallel": {"pp": args.pp, "vpp": vpp, "schedule": schedule},
            "train": {"micro_batch": args.micro_batch, "global_batch": args.micro_batch * args.microbatches,
                      "device": "cpu", "grad_clip": 0.0},
            "run": {"dir": "runs/bench_pp"}})
        best = {"tetrad": None, "torch": None}
        for _ in range(args.repeats):
            for name, fn in (("tetrad", _tetrad_rank), ("torch", _torch_rank)):
                got = measure(cfg, fn, args.warmup, args.steps)
                if best[name] is None or got[0] < best[name][0]:
                    best[name] = got
        (t_time, t_mem, timelines), (o_time, o_mem, _) = best["tetrad"], best["torch"]
        measured, simulated = simulated_vs_measured(cfg, timelines)
        print(f"{schedule:<14}{t_time:>10.3f}{o_time:>10.3f}{t_time / o_time:>12.2f}{t_mem / 2**20:>12.1f}"
              f"{o_mem / 2**20:>11.1f}{t_mem / max(o_mem, 1):>11.2f}{100 * (simulated / measured - 1):>8.1f}%")
    print("time ratio and mem ratio: tetrad / torch (below 1: tetrad faster or smaller); sim err: simulated "
          "step time from the measured mean action costs vs the measured span of tetrad's last step")


if __name__ == "__main__":
    main()
