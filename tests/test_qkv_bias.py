"""Biases on the q, k and v projections (model.qkv_bias: Qwen2 / Qwen2.5). They are split over
tp with their weights' output rows, so every layout must train them as one process does; and the
planner must count them wherever it counts parameters."""

from functools import lru_cache

import pytest

from conftest import assert_parity, tiny_config, train_layout
from tetrad.dist.topology import Topology
from tetrad.model.flops import parameter_count
from tetrad.train.trainer import build_model

LAYOUTS = {  # name -> parallel
    "tp2-sp": {"tp": 2, "sequence_parallel": True},
    "dp2-zero3": {"dp": 2, "zero": 3},
    "pp2-zb": {"pp": 2, "schedule": "zb"},
    "cp2-ring": {"cp": 2, "cp_algo": "ring"},
    "dp2-tp2-zero2": {"dp": 2, "tp": 2, "zero": 2},
}


@lru_cache(maxsize=None)
def _train(name: str | None):
    return train_layout(tiny_config(parallel=LAYOUTS[name] if name else {}, model={"qkv_bias": True}))


def test_the_biases_train():
    """From zero, as Qwen2's start, to values: a layout that dropped their gradients, or reduced
    them over the wrong ranks, shows in the parity below."""
    _, state, _ = _train(None)
    biases = [name for name in state if name.endswith(".bias")]
    assert len(biases) == 3 * 2  # q, k, v in each of the two layers
    assert all(state[name].abs().min() > 0 for name in biases)


@pytest.mark.dist
@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_matches_single_process(name):
    assert_parity(_train(name), _train(None), atol=1e-4)  # tp's bound (tests/test_tp.py)


@pytest.mark.parametrize("tied", [False, True])
def test_the_parameter_count_includes_the_biases(tied):
    cfg = tiny_config(model={"qkv_bias": True, "tie_embeddings": tied}).model
    model = build_model(tiny_config(model={"qkv_bias": True, "tie_embeddings": tied}), Topology.single())
    assert parameter_count(cfg) == sum(p.numel() for p in model.parameters())
    assert parameter_count(cfg) - parameter_count(tiny_config(model={"tie_embeddings": tied}).model) == \
        cfg.n_layers * (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
