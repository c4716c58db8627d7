"""tetrad's pipeline executor against `torch.distributed.pipelining`, side by side in one run, and
the schedule simulator against the measured step.

Same model (tetrad's Llama chunks: torch's schedules drive the very same modules, so only the
executors differ), same initial weights, same micro-batches, same ranks (forked gloo
processes, one thread each). A step is the schedule's forwards and backwards over m
micro-batches, then AdamW on the stage's parameters. tetrad's step also includes the job-wide
all-reduce of the step's numbers (gradient norm, loss, stop signal), which holds every rank at the
step's end, and its metrics (`--executor-only` leaves both out); with `--grad-clip` both sides
clip to the global norm, torch's as torchtitan does under pipelining (the norm all-reduced over the
stages' ranks), so both hold their ranks there. Rows (tetrad's schedule against torch's): 1F1B (torch `Schedule1F1B`),
interleaved 1F1B with two chunks per rank (torch `ScheduleInterleaved1F1B`), and tetrad's
zero-bubble ZB-H1 against torch's `Schedule1F1B`, the schedule torch has at that memory (its
zero-bubble schedules all run two or more chunks per rank).

Step time: a round runs each framework once (fresh ranks; which goes first alternates) and takes
the median of its timed steps, max over ranks, each step timed the same way from outside
(perf_counter around the call). Over `--rounds` rounds the table gives each framework's median
and half the range, the ratio of the medians, and the lowest and highest ratio of a single
round (the same round's two runs side by side). Peak memory: the
rise of the resident set's high-water mark from the built model (reset there through
/proc/self/clear_refs) to the end of the run, max over ranks: torch's CPU allocator keeps no
statistics. It includes the optimizer states, which are the same on both sides.

Measured vs simulated: from tetrad's recorded per-action times of its last step, the mean F and
B (or BI and BW) duration of each stage go into the simulator (simulate.py); its step time is compared with
the measured span of that step's actions. "floor" is the time ratio tetrad would have if that
span shrank to the simulated one (no transfer latency, no host time between actions, the same
kernels): the lowest ratio an executor can reach with this schedule and these per-action costs.
"compute" is the busiest rank's summed action time in a step (median over the timed steps) over
torch's step time: the ratio with no bubble and no transfer at all, a bound no schedule or
executor on these kernels can go under (the optimizer step comes on top). "torch cmp" is the
same for torch's own actions, timed in as many extra steps after its timed ones
(`_time_torch_actions`: its stage's forward_one_chunk plus the schedule's loss, and
backward_one_chunk, wrapped with a clock; its timed steps run unwrapped). A second table gives
each stage's mean F and B per micro-batch on both sides (zb: tetrad's BI + BW against torch's
whole B): where they differ, the gap is inside the actions, not between them. "bound" runs
tetrad's schedule in the simulator on torch's own mean action costs (zb: torch's whole B halved
into BI and BW, a split that costs nothing) and divides by torch's step time: no executor
driving torch's kernels through that schedule, with no transfer, host time or optimizer at all,
gets a lower time ratio.

    python bench/bench_pp.py                      # pp=2, m=8, d_model 256, 8 layers, seq 128
    python bench/bench_pp.py --pp 4 --microbatches 8
    python bench/bench_pp.py --executor-only      # tetrad's step less its job-wide all-reduce and metrics
    python bench/bench_pp.py --grad-clip 1.0      # both clip (torch's side as torchtitan does under pp)
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


def _tetrad_step(cfg, torch_schedule: str):
    """tetrad's training step (its Trainer), the timeline of the last one, and no instrumentation
    to add (tetrad's executor times its actions in every step)."""
    trainer = Trainer(cfg, torch.device("cpu"))
    return trainer.train_step, _timeline(trainer), None


def _tetrad_executor_step(cfg, torch_schedule: str):
    """tetrad's step without the job-wide all-reduce of the step's numbers (gradient norm, loss,
    stop signal) and its metrics: the executor, the gradient reduction and AdamW, as torch's step.
    That all-reduce holds every rank at the step's end (`Trainer._step_sums`): the row tells the
    executor's share of a gap from the step's."""
    trainer = Trainer(cfg, torch.device("cpu"))

    def step(i):
        dp = trainer.topo.coords["dp"]
        trainer.forward_backward(trainer.batches.microbatches(i, dp, cfg.parallel.dp, cfg.train.micro_batch),
                                 trainer.batches.loss_tokens(i))
        trainer.grads.reduce()
        trainer.optimizer.step()
        trainer.grads.zero_grad()  # fp32 ZeRO-0's p.grad are the buckets' views (Trainer.train_step)
    return step, _timeline(trainer), None


def _timeline(trainer):
    return lambda: [(t.kind, t.mb, t.chunk, t.start, t.end) for t in trainer.pipeline.timeline()]


# tetrad's schedule, its chunks per rank, and the torch.distributed.pipelining schedule it is measured against
ROWS = (("1f1b", 1, "Schedule1F1B"), ("interleaved", 2, "ScheduleInterleaved1F1B"), ("zb", 1, "Schedule1F1B"))


def _torch_step(cfg, torch_schedule: str):
    """The same model chunks, driven by torch.distributed.pipelining's schedule, then AdamW."""
    from torch.distributed import pipelining

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

    stages = [pipelining.PipelineStage(Chunk(c), g, p.pp * p.vpp, torch.device("cpu"))
              for c, g in zip(model.chunks, model.stage_ids)]

    def loss_fn(logits, labels):
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / tokens

    m = cfg.microbatches
    schedule = getattr(pipelining, torch_schedule)(stages[0] if p.vpp == 1 else stages, m, loss_fn=loss_fn)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, betas=(0.9, 0.95),
                                  weight_decay=cfg.train.weight_decay)
    first, last = any(c.first for c in model.chunks), any(c.last for c in model.chunks)

    clip = cfg.train.grad_clip

    def step(i):
        inputs, labels = batches.global_batch_at(i)
        schedule.step(*([inputs] if first else []), target=labels if last else None)
        if clip > 0:  # torchtitan's clipping under pipelining: the norm summed over the stages' ranks
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            norm_sq = torch.nn.utils.get_total_norm(grads) ** 2
            torch.distributed.all_reduce(norm_sq)  # the pipeline ranks are the whole job here
            torch.nn.utils.clip_grads_with_norm_(model.parameters(), clip, norm_sq.sqrt())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    rows: list = []  # torch's timed actions since the last read, once instrumented

    def timeline():
        got = list(rows)
        rows.clear()
        return got
    return step, timeline, lambda: _time_torch_actions(schedule, stages, rows)


def _time_torch_actions(schedule, stages, rows: list) -> None:
    """Time torch's compute entry points on this rank as tetrad's executor times its actions:
    F is `forward_one_chunk` (called once its receive was waited for) plus, on the last stage,
    the loss the schedule computes from its output (`_maybe_compute_loss`; tetrad's last chunk
    computes it inside F); B is `backward_one_chunk` (after its receive; BI when not full) and BW
    `backward_weight_one_chunk`. Instance attributes shadow the methods, which the schedules call
    through the instance: the work is torch's own, plus two clock reads and an append an action.
    Appends (kind, mb, local chunk, start, end)."""
    def timed(fn, chunk: int, kind: str):
        def call(mb, *args, **kwargs):
            start = time.perf_counter()
            out = fn(mb, *args, **kwargs)
            # backward_one_chunk(mb, loss=None, full_backward=True, ...), by keyword or position
            full = kwargs.get("full_backward", args[1] if kind == "B" and len(args) > 1 else True)
            rows.append((kind if full else "BI", mb, chunk, start, time.perf_counter()))
            return out
        return call
    for c, stage in enumerate(stages):
        stage.forward_one_chunk = timed(stage.forward_one_chunk, c, "F")
        stage.backward_one_chunk = timed(stage.backward_one_chunk, c, "B")
        stage.backward_weight_one_chunk = timed(stage.backward_weight_one_chunk, c, "BW")
    compute_loss = schedule._maybe_compute_loss

    def loss(stage, output, targets, mb, *args):
        start = time.perf_counter()
        compute_loss(stage, output, targets, mb, *args)
        if stage.is_last:
            rows.append(("loss", mb, stages.index(stage), start, time.perf_counter()))
    schedule._maybe_compute_loss = loss


STEPPERS = {"tetrad": _tetrad_step, "tetrad executor": _tetrad_executor_step, "torch": _torch_step}


def _rank(name: str, cfg, torch_schedule: str, warmup: int, steps: int):
    """One framework's run on this rank: (median step time, peak memory rise, action timelines).
    tetrad's timelines are its timed steps' (read after each step's clock stops); torch's come
    from `steps` further steps after the timed ones and the memory reading, with its compute entry
    points wrapped (`_time_torch_actions`), so its timed steps run torch's code untouched."""
    step, timeline, instrument = STEPPERS[name](cfg, torch_schedule)
    _reset_peak()
    base = _rss_bytes()
    for i in range(warmup):
        step(i)
    times, timelines = [], []
    for i in range(warmup, warmup + steps):
        start = time.perf_counter()
        step(i)
        times.append(time.perf_counter() - start)
        timelines.append(timeline())
    peak = _peak_bytes() - base
    if instrument is not None:
        instrument()
        timelines = []
        for i in range(warmup + steps, warmup + 2 * steps):
            step(i)
            timelines.append(timeline())
    return statistics.median(times), peak, timelines


def measure(cfg, name: str, torch_schedule: str, warmup: int, steps: int):
    """(step time, max over ranks; peak memory rise, max over ranks; timelines[rank][step])."""
    results = launch.run_local(_rank, cfg.parallel.world_size, (name, cfg, torch_schedule, warmup, steps),
                               timeout_s=900)
    return max(r[0] for r in results), max(r[1] for r in results), [r[2] for r in results]


def busiest_compute(timelines) -> float:
    """The most time one rank spent inside its actions in a step (seconds), median over steps."""
    return statistics.median(max(sum(e - s for *_, s, e in rank[i]) for rank in timelines)
                             for i in range(len(timelines[0])))


def action_costs(pp: int, timelines) -> dict[tuple[int, str], float]:
    """Mean duration of each kind of action of each global stage over every step given
    ({(stage, kind): seconds}): torch's last-stage loss is counted in its F, as tetrad's is;
    "B" of a split backward is BI + BW (one micro-batch's whole backward)."""
    spans: dict[tuple[int, str, int], float] = {}  # (stage, kind, mb) -> summed over steps
    steps = 0
    for r, rank in enumerate(timelines):
        steps = len(rank)
        for tl in rank:
            for kind, mb, c, s, e in tl:
                key = (c * pp + r, {"loss": "F", "BI": "B", "BW": "B"}.get(kind, kind), mb)
                spans[key] = spans.get(key, 0.0) + e - s
    costs: dict[tuple[int, str], list[float]] = {}
    for (g, kind, _), total in spans.items():
        costs.setdefault((g, kind), []).append(total / steps)
    return {key: statistics.mean(v) for key, v in costs.items()}


def simulated_vs_measured(cfg, timelines) -> tuple[float, float]:
    """(measured span of the step's actions, simulated step time from their mean costs per stage)."""
    p = cfg.parallel
    stages = p.pp * p.vpp
    rows = [(r, Action(k, mb, c), s, e) for r, tl in enumerate(timelines) for k, mb, c, s, e in tl]

    def mean_cost(kind: str, g: int) -> float | None:
        spans = [e - s for r, a, s, e in rows if a.kind == kind and a.chunk * p.pp + r == g]
        return statistics.mean(spans) if spans else None
    f, bi, bw = [], [], []
    for g in range(stages):
        whole = mean_cost("B", g)  # split schedules run BI and BW instead
        f.append(mean_cost("F", g))
        bi.append(whole / 2 if whole is not None else mean_cost("BI", g))
        bw.append(whole / 2 if whole is not None else mean_cost("BW", g))
    measured = max(e for _, _, s, e in rows) - min(s for _, _, s, e in rows)
    return measured, simulated_step(cfg, f, bi, bw)


def simulated_step(cfg, f: list, bi: list, bw: list) -> float:
    """The step time of `cfg`'s (tetrad's) schedule with these per-stage action costs and nothing
    between actions: no transfer latency, no host time, no optimizer."""
    p = cfg.parallel
    return simulate(build_schedule(p.schedule, p.pp, cfg.microbatches, p.vpp), StageCosts(f, bi, bw)).step_time


def torch_bound(cfg, costs: dict[tuple[int, str], float]) -> float:
    """`simulated_step` on torch's own mean F and B per stage (`action_costs`), each B halved into
    BI and BW where tetrad's schedule splits it (a split then costs nothing): how short any
    executor of this schedule on torch's kernels could make the step."""
    stages = range(cfg.parallel.pp * cfg.parallel.vpp)
    half = [costs[(g, "B")] / 2 for g in stages]
    return simulated_step(cfg, [costs[(g, "F")] for g in stages], half, half)


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
    ap.add_argument("--rounds", type=int, default=5, help="alternated rounds of both frameworks")
    ap.add_argument("--grad-clip", type=float, default=0.0,
                    help="clip to this global gradient norm on both sides (0: neither clips)")
    ap.add_argument("--executor-only", action="store_true",
                    help="time tetrad's step without its job-wide all-reduce of the step's numbers and metrics")
    args = ap.parse_args()
    ours = "tetrad executor" if args.executor_only else "tetrad"
    print(f"pp={args.pp}, m={args.microbatches}, d_model {args.d_model}, {args.layers} layers, seq {args.seq}, "
          f"micro-batch {args.micro_batch}; fp32 on CPU (gloo), one thread per rank; {args.rounds} alternated "
          f"rounds of {args.steps} timed steps")
    print(f"{'schedule':<13}{'torch':<25}{'tetrad s':>15}{'torch s':>15}{'time ratio':>11}{'ratio range':>13}"
          f"{'tetrad MiB':>11}{'torch MiB':>10}{'mem ratio':>10}{'sim err':>9}{'floor':>7}{'compute':>9}"
          f"{'torch cmp':>11}{'bound':>7}")
    per_action = []  # (schedule, {framework: action_costs})
    for schedule, vpp, torch_schedule in ROWS:
        cfg = load_config(overrides={
            "model": {"d_model": args.d_model, "n_heads": 8, "n_kv_heads": 4, "ffn_hidden": 3 * args.d_model,
                      "n_layers": args.layers, "seq_len": args.seq},
            "parallel": {"pp": args.pp, "vpp": vpp, "schedule": schedule},
            "train": {"micro_batch": args.micro_batch, "global_batch": args.micro_batch * args.microbatches,
                      "device": "cpu", "grad_clip": args.grad_clip},
            "run": {"dir": "runs/bench_pp"}})
        rounds = []  # per round: {framework: (step time, peak memory rise, timelines[rank][step])}
        for r in range(args.rounds):
            order = (ours, "torch") if r % 2 == 0 else ("torch", ours)
            rounds.append({name: measure(cfg, name, torch_schedule, args.warmup, args.steps) for name in order})
        per_action.append((schedule, _print_row(cfg, schedule, torch_schedule, ours, order, rounds)))
    print(LEGEND)
    _print_actions(ours, per_action)


LEGEND = ("tetrad s, torch s: median over rounds +- half their range; time ratio: of those medians (below 1: "
          "tetrad faster), ratio range: lowest and highest of the rounds' ratios; MiB: median peak rise; "
          "sim err: simulated step time from the measured mean action costs vs the measured span of tetrad's "
          "last step; floor: the time ratio with tetrad's pipeline span at the simulated one; compute: the "
          "busiest rank's time inside tetrad's actions in a step (median over the round's steps) over torch's "
          "step time of the same round, median over rounds (so are bound and the per-action costs); torch cmp: "
          "the same for torch's own actions (timed in extra steps after its timed ones); bound: tetrad's "
          "schedule simulated on torch's mean action costs (zb: torch's B halved, the split free), no "
          "transfer, host time or optimizer, over torch's step time: the lowest time ratio any executor "
          "reaches on torch's kernels")


def _print_row(cfg, schedule: str, torch_schedule: str, ours: str, order, rounds) -> dict:
    """One schedule's line of the table; returns each framework's per-action costs (median over rounds)."""
    time_of = {name: statistics.median(got[name][0] for got in rounds) for name in order}
    mem_of = {name: statistics.median(got[name][1] for got in rounds) for name in order}
    ratios = [got[ours][0] / got["torch"][0] for got in rounds]
    measured, simulated = simulated_vs_measured(cfg, [rank[-1] for rank in rounds[-1][ours][2]])
    compute = {name: statistics.median(busiest_compute(got[name][2]) / got["torch"][0] for got in rounds)
               for name in order}
    costs = [{name: action_costs(cfg.parallel.pp, got[name][2]) for name in order} for got in rounds]
    bound = statistics.median(torch_bound(cfg, c["torch"]) / got["torch"][0] for c, got in zip(costs, rounds))
    print(f"{schedule:<13}{torch_schedule:<25}{_spread([got[ours][0] for got in rounds]):>15}"
          f"{_spread([got['torch'][0] for got in rounds]):>15}{time_of[ours] / time_of['torch']:>11.2f}"
          f"{f'{min(ratios):.2f}-{max(ratios):.2f}':>13}{mem_of[ours] / 2**20:>11.1f}"
          f"{mem_of['torch'] / 2**20:>10.1f}{mem_of[ours] / max(mem_of['torch'], 1):>10.2f}"
          f"{100 * (simulated / measured - 1):>8.1f}%"
          f"{(time_of[ours] - measured + simulated) / time_of['torch']:>7.2f}"
          f"{compute[ours]:>9.2f}{compute['torch']:>11.2f}{bound:>7.2f}")
    return {name: {key: statistics.median(c[name][key] for c in costs) for key in costs[0][name]} for name in order}


def _print_actions(ours: str, per_action) -> None:
    """Each stage's mean F and B (zero bubble: BI + BW) per micro-batch, tetrad against torch."""
    print("\nper action, ms (mean over a round's steps and micro-batches, median over rounds; F includes the "
          "last stage's loss; B of zb is BI+BW)")
    print(f"{'schedule':<13}{'stage':>6}{'tetrad F':>10}{'torch F':>9}{'ratio':>7}"
          f"{'tetrad B':>10}{'torch B':>9}{'ratio':>7}")
    for schedule, costs in per_action:
        for g in sorted({g for g, _ in costs[ours]}):
            cells = "".join(f"{1e3 * costs[ours][(g, k)]:>10.2f}{1e3 * costs['torch'][(g, k)]:>9.2f}"
                            f"{costs[ours][(g, k)] / costs['torch'][(g, k)]:>7.2f}" for k in ("F", "B"))
            print(f"{schedule:<13}{g:>6}{cells}")


def _spread(times: list[float]) -> str:
    return f"{statistics.median(times):.3f}+-{(max(times) - min(times)) / 2:.3f}"


if __name__ == "__main__":
    main()
