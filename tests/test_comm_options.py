"""Per-group communicator settings (parallel.comm_options): checked before any process starts,
kept through the resolved config, and reported as ignored by a backend without them (gloo)."""

from __future__ import annotations

import pytest

from tetrad.config import ConfigError, load_config

SETTINGS = {"tp": {"high_priority_stream": True, "cga_cluster_size": 2, "min_ctas": 4, "max_ctas": 16},
            "dp_cp_intra": {"max_ctas": 8}}


def test_comm_options_round_trip_through_the_resolved_config(tmp_path):
    cfg = load_config(overrides={"parallel": {"comm_options": SETTINGS}})
    assert cfg.parallel.comm_options == SETTINGS
    path = tmp_path / "resolved.toml"
    path.write_text(cfg.to_toml())
    assert load_config(path) == cfg


@pytest.mark.parametrize("options,message", [
    ({"tensor": {"max_ctas": 8}}, "has no group 'tensor'; groups are tp, cp, dp, pp"),
    ({"tpp": {"max_ctas": 8}}, "has no group 'tpp' \\(did you mean 'parallel.comm_options.tp'\\?\\)"),
    ({"tp": {"max_cta": 8}}, "unknown setting parallel.comm_options.tp.max_cta "
                             "\\(did you mean 'parallel.comm_options.tp.max_ctas'\\?\\)"),
    ({"tp": {"max_ctas": 65}}, "parallel.comm_options.tp.max_ctas must be an integer in 1..64, got 65"),
    ({"tp": {"cga_cluster_size": True}}, "cga_cluster_size must be an integer in 0..8, got True"),
    ({"dp": {"high_priority_stream": 1}}, "high_priority_stream must be true or false, got 1"),
    ({"pp": {"min_ctas": 16, "max_ctas": 8}}, "min_ctas=16 exceeds max_ctas=8"),
    ({"tp": 4}, "parallel.comm_options.tp must be a table"),
])
def test_bad_comm_options_are_refused_with_the_fix(options, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides={"parallel": {"comm_options": options}})


def test_every_group_the_topology_names_takes_settings():
    """Each process group the topology can build (dist/topology.py; hybrid ZeRO's blocks and expert
    parallelism's groups included) is a name comm_options accepts, and no other name is."""
    from tetrad.config import COMM_GROUPS
    from tetrad.dist.layout import DIMS, EP, EXPERT_GRAD, GRAD
    from tetrad.dist.topology import EXPERT_SHARD, INTER, INTRA, REPLICA, SHARD
    assert set(COMM_GROUPS) == {*DIMS, GRAD, INTRA, INTER, SHARD, REPLICA, EP, EXPERT_GRAD, EXPERT_SHARD, "embed"}
    options = {name: {"max_ctas": 8} for name in COMM_GROUPS}
    assert load_config(overrides={"parallel": {"comm_options": options}}).parallel.comm_options == options


def _topology_with_settings():
    import torch

    from tetrad.dist.layout import Layout
    from tetrad.dist.topology import Topology
    import torch.distributed as dist
    Topology(Layout(dp=2), torch.device("cpu"), comm_options=SETTINGS)
    dist.barrier()  # neither rank leaves while the other is still connecting a group


@pytest.mark.dist
def test_gloo_reports_the_settings_it_ignores_once(capfd):
    from conftest import run_ranks
    run_ranks(_topology_with_settings, 2)
    lines = [line for line in capfd.readouterr().err.splitlines() if "comm_options" in line]
    assert lines == ["tetrad: parallel.comm_options for tp, dp_cp_intra ignored: they are NCCL communicator "
                     "settings and this job runs on gloo"]
