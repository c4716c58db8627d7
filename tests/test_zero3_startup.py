"""ZeRO-3 start-up builds each rank's shard straight from the logical init: a rank's peak memory
while the model is built and sharded is its shard plus one layer, never the whole local model
(which is what a model that fits only sharded needs). Parity with the old start-up, bit for
bit, is tests/test_zero.py's ZeRO-3 cases, which train through this start-up."""

import functools

import torch

from conftest import fix_mmap_threshold, run_ranks, tiny_config
from tetrad import device as devices
from tetrad.model.sharding import initial_value
from tetrad.parallel.data import GradReducer
from tetrad.dist.layout import Layout
from tetrad.dist.topology import Topology
from tetrad.train.trainer import build_model

MIB = 2**20


def _startup_peak(cfg):
    """(peak resident growth while building and sharding, this rank's shard bytes, the largest
    layer's bytes, the whole local model's bytes), as the trainer starts ZeRO-3."""
    fix_mmap_threshold()
    topo = Topology(Layout(dp=cfg.parallel.dp), torch.device("cpu"))
    base = devices.start_memory_tracking(topo.device)
    model = build_model(cfg, topo, materialise=False)
    params = list(model.parameters())
    whole = sum(4 * p.numel() for p in params)  # before the reducer: then a freed parameter reads as empty
    reducer = GradReducer(params, topo, cfg.parallel, model, init=functools.partial(initial_value, seed=cfg.train.seed))
    peak = devices.peak_memory_bytes(topo.device, base)
    shard = sum(s.nbytes for s in reducer.weights.shards) + sum(m.nbytes for m in reducer.masters) * reducer.weights.separate
    return peak, shard, max(4 * b.padded for b in reducer.buckets), whole


def test_zero3_startup_peak_is_a_shard_plus_one_layer_at_dp4():
    cfg = tiny_config(model={"d_model": 512, "n_heads": 8, "n_kv_heads": 2, "ffn_hidden": 1536, "n_layers": 8,
                             "vocab_size": 256},
                      parallel={"dp": 4, "zero": 3}, train={"global_batch": 16})
    # Each rank fixes glibc's mmap threshold so that its resident set counts live memory. (The
    # old start-up peaked at 107 MiB here either way: the whole local model, 93 MiB.)
    # Spawned: a forked rank would reuse the pytest process's freed heap and seem to grow less.
    for peak, shard, layer, whole in run_ranks(_startup_peak, 4, cfg, spawn=True):
        print(f"peak {peak / MIB:.1f} MiB: shard {shard / MIB:.1f} + layer {layer / MIB:.1f} MiB "
              f"(whole local model {whole / MIB:.1f} MiB)")
        assert shard + layer < whole / 2  # the bound excludes building the whole model
        assert peak <= shard + layer + 4 * MIB, (peak, shard, layer, whole)


def _both_startups(cfg, scale):
    """Each rank's ZeRO-3 shards and masters from the shard-only start-up and from the old one
    (whole model materialised, then sharded), for the logical init or scaled starting weights."""
    from tetrad.model.sharding import init_parameters, logical_init, spec_of
    topo = Topology(Layout(dp=cfg.parallel.dp), torch.device("cpu"))
    weights = None if scale is None else (lambda name: scale * logical_init(name, spec_of(named[name])[0], 5))
    out = []
    for materialise in (False, True):
        model = build_model(cfg, topo, materialise=materialise)
        named = dict(model.named_parameters())
        if materialise and weights is not None:
            init_parameters(model, cfg.train.seed, weights)
        init = None if materialise else functools.partial(initial_value, seed=cfg.train.seed, weights=weights)
        reducer = GradReducer(list(named.values()), topo, cfg.parallel, model, dtype=torch.bfloat16, init=init)
        out.append((reducer.weights.shards, reducer.masters))
    return out


def test_shard_only_startup_gives_the_same_bits():
    cfg = tiny_config(parallel={"dp": 2, "zero": 3}, train={"dtype": "bf16"})
    for scale in (None, 2.0):
        for new, old in run_ranks(_both_startups, 2, cfg, scale):
            assert len(new[0]) == len(old[0]) > 1 and len(new[1]) == len(old[1])
            for got, want in zip(new[0] + new[1], old[0] + old[1]):
                assert got.dtype == want.dtype and torch.equal(got, want)
