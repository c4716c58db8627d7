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
    ({"tp": {"max_cta": 8}}, "unknown setting parallel.comm_options.tp.max_cta \\(did you mean 'max_ctas'\\?\\)"),
    ({"tp": {"max_ctas": 65}}, "parallel.comm_options.tp.max_ctas must be an integer in 1..64, got 65"),
    ({"tp": {"cga_cluster_size": True}}, "cga_cluster_size must be an integer in 0..8, got True"),
    ({"dp": {"high_priority_stream": 1}}, "high_priority_stream must be true or false, got 1"),
    ({"pp": {"min_ctas": 16, "max_ctas": 8}}, "min_ctas=16 exceeds max_ctas=8"),
    ({"tp": 4}, "parallel.comm_options.tp must be a table"),
])
def test_bad_comm_options_are_refused_with_the_fix(options, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides={"parallel": {"comm_options": options}})
