"""The planner's search: its ranking is exactly estimating every layout, every layout it
enumerates is one the runtime accepts, a fixed stage split is kept, and its plot is readable."""

from __future__ import annotations

import json

import pytest

from tetrad.cli import main
from tetrad.config import load_config
from tetrad.plan.cost import estimate
from tetrad.plan.hardware import load_cluster
from tetrad.plan.search import config_of, layouts, plan


def _cfg(**sections):
    return load_config(overrides=sections, runtime=False)


def test_plan_ranking_equals_estimating_every_layout():
    cluster = load_cluster("dgx-a100")
    base = _cfg(model={"preset": "tiny", "n_layers": 8, "d_model": 2048, "n_heads": 16, "n_kv_heads": 4,
                       "ffn_hidden": 5632, "vocab_size": 32000, "seq_len": 2048},
                train={"global_batch": 16, "micro_batch": 1, "dtype": "bf16"})
    result = plan(base, cluster, top=5)
    every = [estimate(config_of(base, x, z), cluster) for x in layouts(base, 8, 8) for z in range(4)
             if z == 0 or x.dp * x.cp > 1]
    best = sorted((e for e in every if e.fits), key=lambda e: e.step_time_s)[:5]
    assert [e.step_time_s for e in result.ranked] == pytest.approx([e.step_time_s for e in best], rel=1e-12)
    assert result.estimated < len(every) / 10


def test_plan_ranks_zero_sharded_within_a_node_as_estimating_every_layout():
    """On two nodes the search also costs hybrid ZeRO 1-3 sharded over one node's dp x cp ranks
    (parallel.zero_shard = gpus_per_node / tp), and ranks them exactly as estimating them all."""
    import dataclasses

    cluster = dataclasses.replace(load_cluster("dgx-a100"), nodes=2)
    base = _cfg(model={"preset": "tiny", "n_layers": 4, "d_model": 1024, "n_heads": 16, "n_kv_heads": 4,
                       "ffn_hidden": 2816, "vocab_size": 32000, "seq_len": 1024},
                train={"global_batch": 32, "micro_batch": 1, "dtype": "bf16"})
    every = [estimate(config_of(base, x, z, s), cluster) for x in layouts(base, 16, 8) for z in range(4)
             for s in (0, 8 // x.tp) if (z == 0 or x.dp * x.cp > 1) and (s == 0 or z and x.dp * x.cp > s)]
    assert any(e.cfg.parallel.zero_shard for e in every if e.fits)
    result = plan(base, cluster, top=8)
    best = sorted((e for e in every if e.fits), key=lambda e: e.step_time_s)[:8]
    assert [e.step_time_s for e in result.ranked] == pytest.approx([e.step_time_s for e in best], rel=1e-12)


def test_every_searched_layout_is_one_the_runtime_accepts():
    """The search enumerates only layouts config validation passes (a long sequence over many
    ranks reaches cp and tp whose sequence-parallel split must divide the tokens)."""
    from tetrad.plan.search import config_of, layouts

    base = load_config(overrides={"model": {"preset": "llama3-405b", "seq_len": 8192},
                                  "train": {"global_batch": 64, "dtype": "bf16"}}, runtime=False)
    found = list(layouts(base, 16384, 8))
    assert found
    for layout in found:
        config_of(base, layout)  # raises ConfigError for a layout validation refuses


def test_estimate_and_plan_honour_stage_layers(capsys):
    """The planner splits layers as the runtime does (parallel/pipeline/split.py), a fixed split included."""
    cluster = load_cluster("dgx-h100")
    model, train = {"preset": "llama3-8b", "n_layers": 8}, {"global_batch": 16, "micro_batch": 1, "dtype": "bf16"}
    even = estimate(_cfg(model=model, parallel={"pp": 2, "dp": 4}, train=train), cluster)
    skewed = estimate(_cfg(model=model, parallel={"pp": 2, "dp": 4, "stage_layers": [6, 2]}, train=train), cluster)
    weights = [[m.weights for m in e.memory_by_rank] for e in (even, skewed)]
    assert weights[1][0] > weights[0][0] and weights[1][1] < weights[0][1]
    assert skewed.step_time_s > even.step_time_s  # the slower first stage sets the pace
    assert main(["estimate", "--cluster", "dgx-h100", "--model.preset=llama3-8b", "--model.n_layers=8",
                 "--parallel.pp=2", "--parallel.dp=4", "--parallel.stage_layers=[6,2]", "--train.global_batch=16",
                 "--train.micro_batch=1", "--train.dtype=bf16", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step_time_s"] == pytest.approx(skewed.step_time_s)

    base = _cfg(model=model, parallel={"pp": 2, "stage_layers": [5, 3]}, train=train)
    result = plan(base, cluster, top=5)
    assert result.ranked
    for e in result.ranked:  # every layout keeps the user's two stages, and costs them as split
        p = e.cfg.parallel
        assert p.pp * p.vpp == 2 and p.stage_layers == [5, 3]
        assert e.step_time_s == pytest.approx(estimate(e.cfg, cluster).step_time_s)


def test_plan_plot_is_readable():
    """Fitting layouts on their own scale (the out-of-memory ones beside them), plain tick labels,
    the best ones named."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from tetrad.plan.plot import plan_figure, short_label

    cluster = load_cluster("dgx-h100")
    base = _cfg(model={"preset": "llama3-8b"}, train={"global_batch": 64, "micro_batch": 1, "dtype": "bf16"})
    result = plan(base, cluster, top=5)
    fig = plan_figure(result, cluster, "test")
    FigureCanvasAgg(fig).draw()
    main_ax, side = fig.axes
    usable = result.ranked[0].usable_gib
    assert max(m for m, _, _ in result.points) > 4 * usable  # candidates far out of memory exist...
    assert main_ax.get_xlim()[1] < 1.1 * usable  # ...and do not squeeze the main panel
    assert side.get_xlim()[0] >= usable and "out of memory" in side.get_title()
    labels = [t.get_text() for ax in (main_ax, side) for t in ax.get_xticklabels() + ax.get_yticklabels()]
    assert labels and not any(c in label for label in labels for c in "^$×e"), labels
    texts = [t.get_text() for t in main_ax.texts]
    assert any(short_label(result.ranked[0].cfg) in t for t in texts)
