"""`tetrad plan`: every legal layout of a model on a cluster, ranked by predicted step time.

Enumerates (tp, pp, cp, dp, vpp, micro_batch, recompute, zero, schedule). For each shape the
cheapest ZeRO stage that fits is kept (higher stages only cost communication), and the pipeline
simulator's results are cached across candidates, which keeps a 16k-GPU search in seconds.
"""

from __future__ import annotations

import dataclasses
import itertools

from tetrad.config import Config, ConfigError, validate
from tetrad.parallel.pipeline.schedules import min_microbatches
from tetrad.plan.cost import Estimate, estimate
from tetrad.plan.hardware import Cluster


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(base: Config, cluster: Cluster, micro_batches=(1, 2, 4, 8)):
    """Every legal config for `base`'s model and global batch on the cluster's world size."""
    m, world = base.model, cluster.world
    tps = [t for t in _divisors(min(world, cluster.gpus_per_node)) if m.n_heads % t == 0 and m.n_kv_heads % t == 0]
    for tp in tps:
        for pp in _divisors(world // tp):
            if pp > m.n_layers:
                continue
            for cp in _divisors(world // (tp * pp)):
                if cp > 1 and (m.seq_len % (2 * cp) or m.seq_len // cp < 1024):
                    continue
                dp = world // (tp * pp * cp)
                for mb, recompute, sp in itertools.product(micro_batches, ("none", "selective", "full"),
                                                           (tp > 1,)):
                    if base.train.global_batch % (mb * dp):
                        continue
                    micro = base.train.global_batch // (mb * dp)
                    for schedule, vpp in _schedules(pp, micro, m.n_layers):
                        par = dataclasses.replace(base.parallel, tp=tp, pp=pp, cp=cp, dp=dp, vpp=vpp,
                                                  schedule=schedule, sequence_parallel=sp, zero=0)
                        cfg = dataclasses.replace(base, parallel=par,
                                                  train=dataclasses.replace(base.train, micro_batch=mb,
                                                                            recompute=recompute))
                        try:
                            validate(cfg, world, runtime=False)
                        except ConfigError:
                            continue
                        yield cfg


def _schedules(pp: int, micro: int, layers: int):
    if pp == 1:
        yield "1f1b", 1
        return
    for name in ("1f1b", "zb"):
        if micro >= min_microbatches(name, pp, 1):
            yield name, 1
    for vpp in (2, 4):
        if layers >= pp * vpp and micro >= min_microbatches("interleaved", pp, vpp) and micro % pp == 0:
            yield "interleaved", vpp


def plan(base: Config, cluster: Cluster, top: int = 10) -> list[Estimate]:
    """The `top` fastest layouts that fit in memory (best first); if none fits, the ones closest
    to fitting, so the user sees why.

    Branch and bound: every candidate is first costed with the pipeline's lower bound (its
    busiest rank's work); candidates are then simulated in that order until the next lower
    bound is slower than the `top`-th simulated time, so the ranking is exact.
    """
    bounded, closest = [], []
    for cfg in candidates(base, cluster):
        for zero in (0, 1, 2, 3):
            layout = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, zero=zero))
            est = estimate(layout, cluster, simulate_pipeline=False)
            if est.fits:
                bounded.append(est)
                break
        else:
            closest.append(est)
    if not bounded:
        return sorted(closest, key=lambda e: e.peak_memory_gib)[:top]
    bounded.sort(key=lambda e: e.step_time_s)
    ranked: list[Estimate] = []
    for lower in bounded:
        if len(ranked) >= top and lower.step_time_s > ranked[top - 1].step_time_s:
            break
        ranked.append(estimate(lower.cfg, cluster))
        ranked.sort(key=lambda e: e.step_time_s)
    return ranked[:top]
