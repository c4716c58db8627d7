"""How the model's layers are cut into the pp·vpp pipeline stages: one rule, read by the runtime
(stages.py builds the chunks from it) and by the planner (plan/ costs and sizes them with it).

`parallel.stage_layers` lists the layers of each global stage when the user fixes them;
otherwise they are balanced by FLOPs: the last stage also runs the final norm, head and loss,
worth head/layer FLOPs of a layer, and the multi-token prediction modules (model.mtp_layers:
each depth's layer, eh_proj and pass through the head, flops.mtp_matmul_flops), so it gets fewer
layers (every stage keeps at least one).
Global stage g = chunk·pp + rank (schedules.stage_of), so a rank holds stages rank, rank + pp, ...
"""

from __future__ import annotations

from functools import lru_cache
from itertools import accumulate

from tetrad.config import Config, ModelConfig
from tetrad.model import flops
from tetrad.parallel.pipeline.schedules import stage_of


def balanced_layers(m: ModelConfig, stages: int) -> list[int]:
    """Layers per global stage, balanced by FLOPs with the head (and the multi-token prediction
    modules) counted on the last stage, in layers' matmul FLOPs."""
    last = flops.head_flops(m) + flops.mtp_matmul_flops(m)
    return list(_balanced(m.n_layers, stages, round(last / flops.layer_matmul_flops(m), 2)))


@lru_cache(maxsize=4096)
def _balanced(n_layers: int, stages: int, head_layers: float) -> tuple[int, ...]:
    counts = [0] * stages
    loads = [0.0] * (stages - 1) + [head_layers]
    for _ in range(n_layers):  # each layer to the least-loaded stage, the earliest on ties
        i = min(range(stages), key=lambda k: (loads[k], k))
        counts[i] += 1
        loads[i] += 1
    for i in range(stages):  # a stage without layers: take one from the largest
        if counts[i] == 0:
            j = max(range(stages), key=lambda k: counts[k])
            counts[j] -= 1
            counts[i] = 1
    return tuple(counts)


def stage_layers(cfg: Config) -> list[int]:
    """Layers of each of `cfg`'s pp·vpp global stages: `parallel.stage_layers` if given, else balanced."""
    p = cfg.parallel
    return list(p.stage_layers) or balanced_layers(cfg.model, p.pp * p.vpp)


def layer_split(cfg: Config) -> list[range]:
    """The global layer indices of each of the pp·vpp stages."""
    bounds = [0, *accumulate(stage_layers(cfg))]
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def rank_stages(pp: int, vpp: int, rank: int) -> range:
    """The global stages pipeline rank `rank` holds, one per local chunk: stage_of(rank, chunk, pp)
    for chunk = 0..vpp-1, every pp-th stage from `rank` on."""
    return range(stage_of(rank, 0, pp), stage_of(rank, vpp, pp), pp)


def chunk_layers(cfg: Config) -> tuple[tuple[int, ...], ...]:
    """Layers of each pipeline rank's chunks, in local chunk order."""
    p, counts = cfg.parallel, stage_layers(cfg)
    return tuple(tuple(map(counts.__getitem__, rank_stages(p.pp, p.vpp, r))) for r in range(p.pp))


def rank_chunk_layers(cfg: Config) -> tuple[tuple[range, ...], ...]:
    """The global layer indices of each pipeline rank's chunks, in local chunk order: what a rank
    holds where layers differ (model.dense_layers)."""
    p = cfg.parallel
    return _rank_chunk_layers(tuple(stage_layers(cfg)), p.pp, p.vpp)


@lru_cache(maxsize=4096)  # the planner asks it several times of each layout it weighs
def _rank_chunk_layers(counts: tuple[int, ...], pp: int, vpp: int) -> tuple[tuple[range, ...], ...]:
    bounds = [0, *accumulate(counts)]
    return tuple(tuple(range(bounds[g], bounds[g + 1]) for g in rank_stages(pp, vpp, r)) for r in range(pp))


def rank_layers(cfg: Config) -> list[int]:
    """Layers each pipeline rank holds (its vpp chunks together)."""
    return [sum(chunks) for chunks in chunk_layers(cfg)]
