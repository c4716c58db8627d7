"""Seeded fuzzer of the planner against the runtime: draws a layout and model variant
(tests/layout_draws.py, mixtures of experts and latent attention included, plus residual dropout and uneven stage
splits more often), trains it
two steps on gloo ranks and compares, rank by rank, what the planner predicts with what the
trainer counts:

- params, grads, optimizer (tensor storages, GradReducer.model_state_bytes) against
  `plan.memory.rank_model_states(cfg, shard)[pp rank]`, what `estimate` counts for the rank at
  `shard` of the group ZeRO shards over (its memory_by_rank is shard 0's, which holds the most:
  the last shards of a bucket hold its padding, which AdamW's moments leave out): within
  STATE_RTOL each;
- activations (autograd's saved tensors, train/memory.py) against the same less what the plan
  counts alive but not saved (Memory.transient): within ACT_RTOL (under ep the mean of the rank's
  EP group: one rank keeps the rows its routing sends it, the plan the balanced figure);
- rank 0's comm_bytes per group, every step, against plan.comm_bytes.comm_bytes_per_step: equal
  ("ep", which follows a rank's routing, summed over rank 0's EP group: ep times the plan's).

A draw that validation refuses counts as refused; one whose last step fp16's loss scaler
skipped, as skipped (no optimizer state to compare). Each draw is a pure function of its seed;
one JSON line per draw goes to --log. Run from the repository root:

    PYTHONPATH=$PWD/src:$PWD/tests OMP_NUM_THREADS=1 python tools/fuzz_estimate.py --seed 0 --count 20
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import math
import random
import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import rank_histories, tiny_config  # noqa: E402
from layout_draws import draw, seeds, uneven_split  # noqa: E402
from tetrad.config import ConfigError  # noqa: E402
from tetrad.config.sections import shard_ranks  # noqa: E402
from tetrad.dist.layout import GRAD_DIMS, Layout  # noqa: E402
from tetrad.parallel.pipeline.registry import check_config as check_pipeline  # noqa: E402
from tetrad.plan.comm_bytes import comm_bytes_per_step  # noqa: E402
from tetrad.plan.cost import estimate  # noqa: E402
from tetrad.plan.hardware import load_cluster  # noqa: E402
from tetrad.plan.memory import rank_model_states  # noqa: E402

# Model states are tensor sizes against the runtime's own layout rule (padding included): equal
# where the plan follows it. Activations: tests/test_plan_runtime.py's bound.
STATE_RTOL = 0.02
ACT_RTOL = 0.15
STATES = ("params", "grads", "optimizer")


def draw_variant(seed: int) -> dict:
    """layout_draws.draw(seed) for two steps without validation or "auto" settings, with residual
    dropout a quarter of the time and an uneven stage split a third of the time where the draw
    has none."""
    overrides = draw(seed, extended=True)
    rng = random.Random(f"estimate-{seed}")
    model, par = overrides["model"], overrides["parallel"]
    if rng.random() < 0.25:
        model["dropout"] = 0.1
    stages = par["pp"] * par["vpp"]
    if "stage_layers" not in par and stages > 1 and model["n_layers"] > stages and rng.random() < 0.33:
        par["stage_layers"] = uneven_split(model["n_layers"], stages, rng)
    for key in ("grad_bucket_mb", "hierarchical"):  # "auto" is measured at start: no plan predicts it
        if par.get(key) == "auto":
            del par[key]
    overrides["train"].update(steps=2, device="cpu")
    # CPU training refuses offload: already there. A ramp's steps are smaller than the final batch
    # the plan costs, by design.
    for key in ("eval_every", "offload_optimizer", "batch_rampup"):
        overrides["train"].pop(key, None)
    overrides["run"] = {"log_every": 10}  # quiet: the activation meter counts the first step
    overrides["data"] = {"source": overrides["data"]["source"]} if "source" in overrides["data"] else {}  # a mask's shards
    return overrides


def relative(got: float, want: float) -> float:
    return 0.0 if got == want else abs(got - want) / max(abs(want), abs(got))


def compare(cfg, results) -> tuple[list[str], dict]:
    """(mismatches, per-rank figures) of one trained draw; None for the mismatches when the last
    step was skipped (fp16's loss scale): its model states hold no optimizer state to compare."""
    est, layout = estimate(cfg, load_cluster("cpu")), Layout.of(cfg.parallel)
    misses, ranks = [], {}
    # Under ep a rank keeps the rows its routing sends it; the planner's balanced figure is its EP
    # group's mean (docs/planner.md): each rank's activations are compared as that mean.
    ep = cfg.parallel.ep
    block = lambda c: (c["dp"] // ep, c["tp"], c["pp"], c["cp"])  # noqa: E731
    groups = collections.defaultdict(list)
    for coords, history in results:
        groups[block(coords)].append(history[-1]["memory_bytes"]["activations"])
    for coords, history in results:
        name = "r" + "".join(f"{k}{coords[k]}" for k in ("dp", "tp", "pp", "cp"))
        rank = layout.rank_at(coords)
        shard = layout.group_of(rank, GRAD_DIMS).index(rank) % shard_ranks(cfg.parallel)
        plan = est.memory_by_rank[coords["pp"]]
        got = {**history[-1]["memory_bytes"], "activations": statistics.mean(groups[block(coords)])}
        want = {**dict(zip(STATES, rank_model_states(cfg, shard)[coords["pp"]])),
                "activations": plan.activations - plan.transient}
        figures = {}
        for part, predicted in want.items():
            diff = relative(got[part], predicted)
            figures[part] = [got[part], round(predicted), round(diff, 4)]
            if diff > (ACT_RTOL if part == "activations" else STATE_RTOL):
                misses.append(f"{name} {part}: counted {got[part]} predicted {predicted:.0f} ({diff:+.1%})")
        if ep > 1:  # the rank's own count beside its EP group's mean
            figures["own_activations"] = history[-1]["memory_bytes"]["activations"]
        ranks[name] = figures
    if any(history[-1]["skipped"] for _, history in results):
        return None, ranks
    want = comm_bytes_per_step(cfg)
    # One rank's "ep" follows its routing; the EP group's sum is exact (docs/planner.md): rank 0's group's.
    ep = cfg.parallel.ep
    ep_group = [h for c, h in results if c["dp"] < ep and c["tp"] == c["pp"] == c["cp"] == 0]
    want = {**want, "ep": want.get("ep", 0) * ep}
    for step, record in enumerate(results[0][1]):
        got = {**record["comm_bytes"], "ep": sum(h[step]["comm_bytes"].get("ep", 0) for h in ep_group)}
        for group in sorted(set(got) | set(want)):
            if got.get(group, 0) != want.get(group, 0):
                misses.append(f"step {record['step']} comm {group}: runtime {got.get(group, 0)} "
                              f"planned {want.get(group, 0)} ({got.get(group, 0) - want.get(group, 0):+d})")
    ranks["comm"] = {"runtime": results[0][1][-1]["comm_bytes"], "planned": want}
    return misses, ranks


def run_one(seed: int, timeout_s: float) -> dict:
    overrides = draw_variant(seed)
    record = {"seed": seed, "config": overrides}
    try:
        cfg = tiny_config(**overrides)
        check_pipeline(cfg)  # as `tetrad train` does before it starts
    except ConfigError as e:
        return {**record, "result": "refused", "message": str(e)}
    start = time.perf_counter()
    try:
        misses, ranks = compare(cfg, rank_histories(cfg, timeout_s=timeout_s))
    except Exception as e:
        tail = "".join(traceback.format_exception_only(type(e), e))[-1500:]
        return {**record, "result": "crash", "message": tail, "s": round(time.perf_counter() - start, 1)}
    result = "skipped" if misses is None else "mismatch" if misses else "ok"
    return {**record, "result": result, "misses": misses or [], "ranks": ranks, "s": round(time.perf_counter() - start, 1)}


def describe(overrides: dict) -> str:
    """One short line of a draw's layout and variant."""
    p, m, t = overrides["parallel"], overrides["model"], overrides["train"]
    dims = "".join(f"{k}{p[k]}" for k in ("dp", "tp", "pp", "cp") if p[k] > 1) or "single"
    extra = [f"z{p['zero']}", p["schedule"] if p["pp"] > 1 else "", f"vpp{p['vpp']}" if p["vpp"] > 1 else "",
             "sp" + ("+regather" if p.get("sp_regather") else "") if p.get("sequence_parallel") else "",
             p.get("cp_algo", ""), p.get("grad_codec", ""), t["dtype"], t["recompute"],
             "drop" if m.get("dropout") else "", "tied" if m["tie_embeddings"] else "",
             "gpt" if m.get("mlp") == "gelu" else "", f"stages{p['stage_layers']}" if p.get("stage_layers") else "",
             f"moe{m['n_experts']}k{m['experts_per_token']}" if m.get("n_experts") else "",
             f"mla{m['kv_lora_rank']}q{m['q_lora_rank']}" if m.get("kv_lora_rank") else "",
             f"mb{t['micro_batch']}x{t['global_batch'] // (t['micro_batch'] * p['dp'])}"]
    return " ".join([dims, *(x for x in extra if x)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0, help="first seed")
    ap.add_argument("--count", type=int, default=20)
    ap.add_argument("--timeout", type=float, default=150.0, help="seconds per draw's training (a hang fails)")
    ap.add_argument("--log", default=None, help="append one JSON line per draw to this file")
    ap.add_argument("--budget", type=float, default=math.inf, help="stop starting draws after this many seconds")
    args = ap.parse_args()
    counts: collections.Counter = collections.Counter()
    start = time.perf_counter()
    with open(args.log, "a") if args.log else contextlib.nullcontext() as log:
        for seed in seeds(args.seed, args.count, args.budget):
            record = run_one(seed, args.timeout)
            if log is not None:
                log.write(json.dumps(record) + "\n")
                log.flush()
            counts[record["result"]] += 1
            why = "; ".join(record.get("misses") or [record.get("message", "")])[:400].replace("\n", " | ")
            print(seed, record["result"], record.get("s", ""), describe(record["config"]), "|", why, flush=True)
    print("summary:", dict(counts), f"{time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
