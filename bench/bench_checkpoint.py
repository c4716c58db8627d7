"""Synchronous against background checkpoints (`checkpoint.async_save`), side by side in one run.

The same run (dp2 ZeRO-1 on forked gloo ranks, one thread each; a checkpoint every `--every`
steps) once per mode per round, modes alternated. Per mode: what the training loop waits for at a
save step (the whole write and hashing when synchronous; the copy of the state into CPU memory in
the background mode) and at the step after it (the background mode's publish: hashes gathered,
manifest, rename), the median training step, and the whole run, each the median over rounds.
On a CPU the background threads compete with the training thread for the cores; on an
accelerator they use a host that would otherwise wait.

    python bench/bench_checkpoint.py                  # d_model 512, 8 layers, vocab 8192
    python bench/bench_checkpoint.py --d-model 1024 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from tetrad import launch
from tetrad.config import load_config
from tetrad.train.trainer import Trainer


def _rank(cfg):
    """(time in maybe_save per step, median train_step time, the whole fit), seconds."""
    trainer = Trainer(cfg, torch.device("cpu"))
    in_save, steps = [], []

    def timed(fn, into):
        def run(*args, **kwargs):
            start = time.perf_counter()
            result = fn(*args, **kwargs)
            into.append(time.perf_counter() - start)
            return result
        return run
    trainer.checkpointer.maybe_save = timed(trainer.checkpointer.maybe_save, in_save)
    trainer.train_step = timed(trainer.train_step, steps)
    start = time.perf_counter()
    trainer.fit()
    return in_save, statistics.median(steps), time.perf_counter() - start


def measure(args, async_save: bool):
    cfg = load_config(overrides={
        "model": {"d_model": args.d_model, "n_heads": 8, "n_kv_heads": 4, "ffn_hidden": 3 * args.d_model,
                  "n_layers": args.layers, "vocab_size": 8192, "seq_len": 128},
        "parallel": {"dp": 2, "zero": 1},
        "train": {"steps": args.steps, "micro_batch": 2, "global_batch": 4, "device": "cpu"},
        "checkpoint": {"every": args.every, "async_save": async_save, "keep": 1},
        "run": {"dir": tempfile.mkdtemp(prefix="bench-checkpoint-")}})
    results = launch.run_local(_rank, 2, (cfg,), timeout_s=900)
    every = args.every
    at_save = max(statistics.median(r[0][every - 1::every]) for r in results)
    after = max(statistics.median(r[0][every::every]) for r in results)
    return at_save, after, max(r[1] for r in results), max(r[2] for r in results)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--every", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    runs = {False: [], True: []}
    for r in range(args.rounds):
        for mode in ((False, True) if r % 2 == 0 else (True, False)):
            runs[mode].append(measure(args, mode))
    print(f"dp2 ZeRO-1, d_model {args.d_model}, {args.layers} layers, a checkpoint every {args.every} of "
          f"{args.steps} steps; fp32 on CPU (gloo), one thread per rank; {args.rounds} alternated rounds, medians")
    print(f"{'mode':<12}{'save step ms':>14}{'next step ms':>14}{'train step ms':>15}{'run s':>8}")
    for mode, name in ((False, "synchronous"), (True, "background")):
        cols = [statistics.median(x[i] for x in runs[mode]) for i in range(4)]
        print(f"{name:<12}{1e3 * cols[0]:>14.0f}{1e3 * cols[1]:>14.0f}{1e3 * cols[2]:>15.0f}{cols[3]:>8.2f}")
    print("save step / next step: time in Checkpointer.maybe_save at a save step and at the step after it "
          "(max over ranks); train step: Trainer.train_step")


if __name__ == "__main__":
    main()
