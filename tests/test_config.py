"""Config loading and validation: every invalid config gets a message naming the fix, before any
process starts."""

import subprocess
import sys
import textwrap

import pytest

from tetrad.config import Config, ConfigError, load_config

ERRORS = [
    ({"parallel": {"dp": 2, "tp": 2}}, 8, "dp*tp*pp*cp = 2*2*1*1 = 4 but the job has 8 ranks; set parallel.dp=4"),
    ({"parallel": {"tp": 3}}, None, "tp=3 does not divide n_heads=4; use tp in [1, 2]"),
    ({"model": {"n_heads": 8, "n_kv_heads": 2}, "parallel": {"tp": 4}}, None,
     "tp=4 does not divide n_kv_heads=2; use tp in [1, 2]"),
    ({"parallel": {"pp": 4, "vpp": 2, "schedule": "interleaved"}}, None,
     "n_layers=4 is fewer than pp*vpp = 4*2 = 8 pipeline stages"),
    ({"parallel": {"cp": 3}}, None, "seq_len=128 is not divisible by 2*cp = 6"),
    ({"train": {"global_batch": 12, "micro_batch": 4}, "parallel": {"dp": 2}}, None,
     "global_batch=12 is not divisible by micro_batch*dp = 4*2 = 8"),
    ({"parallel": {"tpp": 2}}, None, "unknown key parallel.tpp (did you mean 'tp'?)"),
    ({"trian": {"steps": 2}}, None, "unknown section [trian] (did you mean 'train'?)"),
    ({"model": {"preset": "lama3-8b"}}, None, "unknown model.preset 'lama3-8b' (did you mean 'llama3-8b'?)"),
    ({"train": {"lr": "fast"}}, None, "train.lr must be a number, got 'fast' (str)"),
    ({"parallel": {"tp": 2.5}}, None, "parallel.tp must be an integer, got 2.5 (float)"),
    ({"parallel": {"sequence_parallel": 1}}, None, "parallel.sequence_parallel must be true or false"),
    ({"model": {"seq_len": 36, "n_kv_heads": 4}, "parallel": {"tp": 4, "cp": 2, "sequence_parallel": True}}, None,
     "sequence_parallel splits each rank's 18 tokens (seq_len/cp) over tp=4"),
    ({"parallel": {"stage_layers": [2, "x"], "pp": 2}}, None, "parallel.stage_layers[1] must be an integer"),
    ({"parallel": {"tp": 2, "sp_regather": True}}, None, "sp_regather gathers sequence parallelism's input"),
]


@pytest.mark.parametrize("overrides,world,message", ERRORS)
def test_invalid_config_names_the_fix(overrides, world, message):
    with pytest.raises(ConfigError) as err:
        load_config(overrides=overrides, world_size=world)
    assert message in str(err.value)


def test_preset_then_user_keys_then_overrides(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(textwrap.dedent("""
        [model]
        preset = "llama3-8b"
        n_layers = 2
        [parallel]
        tp = 2
    """))
    cfg = load_config(path, ["--parallel.tp=4", "--train.lr=1e-4", "--parallel.schedule=gpipe"])
    assert (cfg.model.d_model, cfg.model.n_layers, cfg.model.vocab_size) == (4096, 2, 128256)
    assert cfg.parallel.tp == 4 and cfg.train.lr == 1e-4 and cfg.parallel.schedule == "gpipe"


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(overrides=["--parallel.dp=2", "--model.preset=tiny-gpt"])
    path = tmp_path / "resolved.toml"
    path.write_text(cfg.to_toml())
    assert load_config(path) == cfg
    assert isinstance(cfg, Config)


def test_bad_override_syntax():
    with pytest.raises(ConfigError, match="--section.key=value"):
        load_config(overrides=["--tp=2"])


def test_cli_rejects_invalid_config_without_starting_a_process(tmp_path):
    # Any rank would write RUN_DIR/config.toml first; its absence shows no rank ran.
    run_dir = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "tetrad", "train", "--parallel.tp=3", f"--run.dir={run_dir}"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "tp=3 does not divide n_heads=4; use tp in [1, 2]" in out.stderr
    assert "training" not in out.stdout and not run_dir.exists()


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_fewer_micro_batches_than_stages_is_legal_and_exact(schedule):
    """Issue 19 flagged pp with fewer micro-batches than stages: legal for gpipe, 1f1b and zb (the
    bubble grows; interleaved is refused, test_pipeline), and it trains the one-process model."""
    from conftest import assert_parity, tiny_config, train_layout

    train = {"global_batch": 1, "micro_batch": 1, "steps": 3}  # m = 1 < pp = 2
    pipelined = train_layout(tiny_config(parallel={"pp": 2, "schedule": schedule}, train=train))
    assert_parity(pipelined, train_layout(tiny_config(train=train)))
