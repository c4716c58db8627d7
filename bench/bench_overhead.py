"""tetrad's fixed cost per step: a tiny model (2 layers, d_model 32, vocab 256, seq 16), where a
step is mostly framework overhead, trained by tetrad's Trainer as `tetrad train` runs it against a
minimal hand-written torch loop of the same model and optimizer (the torch-native floor).

Three ways to run a step, alternated within each round (the order rotates round to round):

- torch: a plain torch Llama (bench_tp.py's), a batch of random windows, forward, cross-entropy,
  backward, (dp > 1) one flat all-reduce of the gradients, clip_grad_norm_, the LR schedule,
  fused AdamW, `loss.item()`;
- tetrad model: tetrad's model (build_model) in that same hand-written loop: the model's share;
- tetrad Trainer: `Trainer.fit`, the loop `tetrad train` runs (data, forward/backward through the
  pipeline executor, bucketed reduction, clipping, AdamW, LR schedule, the metrics.jsonl line,
  checkpoint and stop-signal checks). Its per-step time is (fit of SHORT + STEPS steps - fit of
  SHORT steps) / STEPS, so what a run does once (opening metrics.jsonl, the resume check, the
  first step's set-up) cancels out.

Prints ms/step per way (median over rounds and [min-max]) and Trainer/torch, median of the
per-round ratios with their range, for dp=1 (one rank) and dp=2 (two forked gloo ranks).

    .venv/bin/python bench/bench_overhead.py [--rounds 7] [--steps 100]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from bench_tp import TorchLlama
from tetrad import launch
from tetrad.config import load_config
from tetrad.parallel.data.optimizer import build_optimizer
from tetrad.train.optim import lr_at
from tetrad.train.trainer import Trainer, build_model

MODEL = {"n_layers": 2, "d_model": 32, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 96, "vocab_size": 256,
         "seq_len": 16}
MICRO_BATCH = 4
SHORT = 5  # steps of the shorter fit, whose time is subtracted
WAYS = ("torch", "tetrad model", "tetrad Trainer")


def _cfg(dp: int, run_dir: str):
    return load_config(overrides={
        "model": MODEL, "parallel": {"dp": dp},
        "train": {"global_batch": MICRO_BATCH * dp, "micro_batch": MICRO_BATCH, "steps": SHORT},
        "run": {"dir": run_dir}})


def _hand_loop(model, loss_of, cfg):
    """A step function: the minimal torch training step of `model` (loss_of(x, y) -> mean loss)."""
    params = list(model.parameters())
    optimizer = build_optimizer(params, cfg.train)  # fused AdamW, betas (0.9, 0.95), decay on matrices
    tokens = torch.randint(0, cfg.model.vocab_size, (1 << 16,), generator=torch.Generator().manual_seed(0))
    seq, dp = cfg.model.seq_len, cfg.parallel.dp

    def step(i: int) -> float:
        starts = torch.randint(0, len(tokens) - seq - 1, (MICRO_BATCH,))
        rows = torch.stack([tokens[s:s + seq + 1] for s in starts.tolist()])
        for group in optimizer.param_groups:
            group["lr"] = lr_at(i, cfg.train)
        loss = loss_of(rows[:, :-1], rows[:, 1:])
        loss.backward()
        if dp > 1:
            grads = [p.grad for p in params]
            flat = torch.cat([g.flatten() for g in grads]).div_(dp)
            dist.all_reduce(flat)
            for g, reduced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                g.copy_(reduced)
        torch.nn.utils.clip_grad_norm_(params, cfg.train.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()
    return step


def _timed_loop(step, steps: int) -> float:
    start = time.perf_counter()
    for i in range(steps):
        step(i)
    return time.perf_counter() - start


def _rank(dp: int, rounds: int, steps: int) -> dict:
    rank = dist.get_rank()
    with tempfile.TemporaryDirectory(prefix="tetrad-overhead-") as tmp:
        run_dir = Path(tmp) / "run"  # every rank's own folder: only rank 0 writes, all read the same config
        cfg = _cfg(dp, str(run_dir))
        trainer = Trainer(cfg, torch.device("cpu"))
        plain = TorchLlama(cfg.model)
        positions = torch.arange(cfg.model.seq_len)
        ntok = MICRO_BATCH * cfg.model.seq_len
        tetrad_model = build_model(cfg, trainer.topo)
        loops = {"torch": _hand_loop(plain, lambda x, y: F.cross_entropy(plain(x).flatten(0, 1), y.flatten()), cfg),
                 "tetrad model": _hand_loop(tetrad_model, lambda x, y: tetrad_model(x, positions, y) / ntok, cfg)}

        def fit(n: int) -> float:
            trainer.cfg.train.steps = n
            if rank == 0:  # a fresh run each time: the history guard refuses to overwrite metrics.jsonl
                (run_dir / "metrics.jsonl").unlink(missing_ok=True)
            start = time.perf_counter()
            with contextlib.redirect_stdout(io.StringIO()):
                trainer.fit()
            return time.perf_counter() - start

        def measure(way: str) -> float:
            if way == "tetrad Trainer":
                return (fit(SHORT + steps) - fit(SHORT)) / steps
            return _timed_loop(loops[way], steps) / steps

        for way in WAYS:  # warm-up: allocator, Adam states, first-call paths
            measure(way)
        times: dict[str, list[float]] = {way: [] for way in WAYS}
        for r in range(rounds):
            for way in WAYS[r % 3:] + WAYS[:r % 3]:
                dist.barrier()
                times[way].append(measure(way))
    return times


def _report(dp: int, times: dict) -> str:
    def ms(xs):
        return f"{1e3 * statistics.median(xs):6.2f} ms/step [{1e3 * min(xs):.2f}-{1e3 * max(xs):.2f}]"
    ratios = [a / b for a, b in zip(times["tetrad Trainer"], times["torch"])]
    model_ratios = [a / b for a, b in zip(times["tetrad model"], times["torch"])]
    lines = [f"dp={dp}:"] + [f"  {way:<15}{ms(times[way])}" for way in WAYS]
    lines.append(f"  Trainer/torch  {statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}]; "
                 f"model loop/torch {statistics.median(model_ratios):.2f} "
                 f"[{min(model_ratios):.2f}-{max(model_ratios):.2f}] (median of per-round ratios [range])")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=100, help="timed steps per way per round")
    ap.add_argument("--dp", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args()
    for dp in args.dp:
        times = launch.run_local(_rank, dp, (dp, args.rounds, args.steps), timeout_s=600, pg_timeout_s=120)[0]
        print(_report(dp, times), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
