"""Context-parallel step time at a long sequence, and how much of the ring transfer is hidden.

The same work at every cp: one optimizer-free training micro-step (forward + backward of the
model, gradients reduced over cp) on `--batch` sequences of `--seq` tokens, spread over cp
ranks (cp=1: one process with all the machine's threads). Hidden fraction of the ring: the
time a rank spent blocked in the ring's `wait()` during the step, against the time the same
transfers take with nothing to overlap (measured right after, same sizes and count):
hidden = 1 − exposed / standalone. Blocked time also holds waiting for a slower peer, so a
negative value means the waits cost more than the bare transfers (e.g. no idle core for gloo).

    python bench/bench_cp.py --seq 4096 --cp 1 2 4
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tetrad import launch
from tetrad.config import load_config
from tetrad.model.attention import _pass_on
from tetrad.parallel.data import GradReducer
from tetrad.dist.layout import Layout
from tetrad.dist.sequence import shard_sequence
from tetrad.dist.topology import Topology
from tetrad.train.trainer import build_model


def _rank(cfg, batch: int, steps: int) -> dict:
    p, m = cfg.parallel, cfg.model
    topo = Topology(Layout(cp=p.cp), torch.device("cpu"))
    cp, rank = p.cp, topo.local_rank("cp")
    model = build_model(cfg, topo)
    reducer = GradReducer([q for q in model.parameters()], topo)
    tokens = torch.randint(0, m.vocab_size, (batch, m.seq_len + 1), generator=torch.Generator().manual_seed(0))
    x, labels = (shard_sequence(t, cp, rank) for t in (tokens[:, :-1], tokens[:, 1:]))
    positions = shard_sequence(torch.arange(m.seq_len), cp, rank)
    times, exposed = [], []
    for step in range(steps + 1):  # the first step warms up
        topo.comm.reset()
        start = time.perf_counter()
        model(x, positions, labels).backward()
        reducer.reduce()
        times.append(time.perf_counter() - start)
        ring = topo.comm.stats.get(("send_recv", "cp"))
        exposed.append(topo.comm.seconds_by_group().get("cp", 0.0))
        calls = ring.calls if ring else 0
    out = {"step_s": statistics.median(times[1:]), "exposed_s": statistics.median(exposed[1:])}
    if p.cp_algo == "ring" and cp > 1:
        # The same transfers, alone: every ring pass moves one [2, b, s/cp, kv, d] block.
        block = torch.zeros(2, batch, m.seq_len // cp, m.n_kv_heads, m.head_dim)
        alone = []
        for _ in range(3):
            start = time.perf_counter()
            for _ in range(calls):
                pending, _ = _pass_on(block, topo)
                pending.wait()
            alone.append(time.perf_counter() - start)
        out["standalone_s"] = statistics.median(alone)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--algo", nargs="+", default=["ring", "alltoall"])
    args = ap.parse_args()
    model = {"preset": "tiny", "n_layers": 2, "d_model": 256, "n_heads": 8, "n_kv_heads": 4,
             "ffn_hidden": 512, "seq_len": args.seq}
    print(f"model {model}, batch {args.batch}; step = forward + backward + gradient all-reduce")
    print("| cp | algo | step (s) | vs cp=1 | ring exposed (s) | ring alone (s) | hidden |")
    print("|--:|---|--:|--:|--:|--:|--:|")
    base = None
    for cp in args.cp:
        for algo in (["ring"] if cp == 1 else args.algo):
            cfg = load_config(overrides={"model": model, "parallel": {"cp": cp, "cp_algo": algo}})
            r = launch.run_local(_rank, cp, (cfg, args.batch, args.steps), timeout_s=1200)[0]
            base = r["step_s"] if cp == 1 else base
            ring = (f"{r['exposed_s']:.3f} | {r['standalone_s']:.3f} | {1 - r['exposed_s'] / r['standalone_s']:.0%}"
                    if "standalone_s" in r else "— | — | —")
            label = "local" if cp == 1 else algo
            print(f"| {cp} | {label} | {r['step_s']:.3f} | {base / r['step_s']:.2f}× | {ring} |", flush=True)


if __name__ == "__main__":
    main()
