"""torch.compile against eager, per layout: the training step time of `train.compile = true` over
`false`, on two CPU ranks with inductor (C++ kernels), for dp2, tp2, cp2 (ring), pp2 (1F1B) and
an MoE model's dp2 ep2.

Each rank builds two Trainers of the same config, one compiled; each takes WARMUP steps first
(the compiled one compiles then: that time is reported on its own, not in the ratio). Then in
each round both run `--steps` steps (Trainer.train_step: data, forward/backward, reduction,
clipping, AdamW), the order swapped round to round. Prints ms/step per way (median over rounds
[min-max]), the compiled/eager ratio (median of the per-round ratios [range]), the warm-up
seconds of each way, and how many frames dynamo compiled after the warm-up (0: no recompiles).
The inductor cache (/tmp/torchinductor_$USER unless TORCHINDUCTOR_CACHE_DIR says otherwise)
shortens a second run's warm-up, not its steps.

    .venv/bin/python bench/bench_compile.py [--layouts dp2 tp2 cp2 pp2 moe-ep2] [--rounds 5] [--steps 5]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters

from tetrad import launch
from tetrad.config import load_config
from tetrad.train.trainer import Trainer

# Small enough for a 2-core CPU, large enough that a step is mostly kernels, not Python: the
# issue's comparison model (d 256, GQA 8:4, vocab 4096, seq 256) at 4 layers instead of 8.
MODEL = {"n_layers": 4, "d_model": 256, "n_heads": 8, "n_kv_heads": 4, "ffn_hidden": 688, "vocab_size": 4096,
         "seq_len": 256}
# layout -> (parallel, model keys over MODEL): moe-ep2 makes every layer's MLP 4 experts, top-2,
# spread over dp2 (its routing runs eagerly between the compiled regions: model/moe.py).
LAYOUTS = {"dp2": ({"dp": 2}, {}), "tp2": ({"tp": 2}, {}), "cp2": ({"cp": 2, "cp_algo": "ring"}, {}),
           "pp2": ({"pp": 2}, {}),
           "moe-ep2": ({"dp": 2, "ep": 2}, {"n_experts": 4, "experts_per_token": 2, "router_aux_loss": 0.01})}
WAYS = ("eager", "compiled")
WARMUP = 2  # the compiled trainer compiles in its first step (forward and backward graphs)


def _cfg(layout: str, compile: bool, run_dir: str):
    return load_config(overrides={
        "model": {**MODEL, **LAYOUTS[layout][1]}, "parallel": LAYOUTS[layout][0],
        "train": {"global_batch": 4, "micro_batch": 1, "steps": 10_000, "warmup": 2, "compile": compile},
        "run": {"dir": run_dir}})


def _run(trainer: Trainer, first: int, steps: int) -> float:
    """Seconds per step of steps first..first+steps-1."""
    dist.barrier()
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        for step in range(first, first + steps):
            trainer.train_step(step)
    return (time.perf_counter() - start) / steps


def _rank(layout: str, rounds: int, steps: int) -> dict:
    counters.clear()
    with tempfile.TemporaryDirectory(prefix="tetrad-bench-compile-") as tmp:
        trainers = {way: Trainer(_cfg(layout, way == "compiled", tmp), torch.device("cpu")) for way in WAYS}
        warmup = {way: WARMUP * _run(trainers[way], 0, WARMUP) for way in WAYS}
        frames_after_warmup = counters["frames"]["total"]
        times: dict[str, list[float]] = {way: [] for way in WAYS}
        for r in range(rounds):
            for way in (WAYS if r % 2 == 0 else WAYS[::-1]):
                times[way].append(_run(trainers[way], WARMUP + r * steps, steps))
    return {"times": times, "warmup_s": warmup, "frames": frames_after_warmup,
            "recompiled": counters["frames"]["total"] - frames_after_warmup}


def _report(layout: str, result: dict) -> str:
    times = result["times"]

    def ms(xs):
        return f"{1e3 * statistics.median(xs):7.1f} ms/step [{1e3 * min(xs):.1f}-{1e3 * max(xs):.1f}]"
    ratios = [c / e for c, e in zip(times["compiled"], times["eager"])]
    warm = result["warmup_s"]
    extra = LAYOUTS[layout][1]
    return (f"{layout}{f' (model {extra} over the above)' if extra else ''}: eager {ms(times['eager'])}  "
            f"compiled {ms(times['compiled'])}  "
            f"compiled/eager {statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}]\n"
            f"     warm-up ({WARMUP} steps, excluded): eager {warm['eager']:.1f} s, compiled {warm['compiled']:.1f} s; "
            f"dynamo frames compiled {result['frames']}, after warm-up {result['recompiled']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per way per round")
    args = ap.parse_args()
    print(f"model {MODEL}, global batch 4 x seq {MODEL['seq_len']}, 2 ranks, {args.rounds} rounds x {args.steps} steps")
    for layout in args.layouts:
        result = launch.run_local(_rank, 2, (layout, args.rounds, args.steps), timeout_s=900, pg_timeout_s=300)[0]
        print(_report(layout, result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
