"""`tetrad compare`: two layouts of one training agree at the first step to rounding; a
difference beyond it, or a key that changes the training, is reported as a disagreement."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tetrad.cli import main

from conftest import tiny_config, train_layout


def _run(**parallel_and_train):
    train = {"steps": 3, "device": "cpu", **parallel_and_train.pop("train", {})}
    cfg = tiny_config(parallel=parallel_and_train, train=train)
    train_layout(cfg)
    return Path(cfg.run.dir)


def test_two_layouts_agree_and_a_changed_gradient_does_not(tmp_path, capsys):
    one, four = _run(), _run(dp=2, tp=2, zero=1, train={"micro_batch": 4})
    assert main(["compare", str(one), str(four), "--out", str(tmp_path / "c.png")]) == 0
    out = capsys.readouterr().out
    assert "parallel.dp: 1 -> 2" in out and "parallel.tp: 1 -> 2" in out and "train.micro_batch" in out
    assert "training keys that differ" not in out
    assert "within fp32 rounding" in out and "BEYOND" not in out
    assert out.rstrip().endswith("the runs agree")
    assert (tmp_path / "c.png").stat().st_size > 1000

    # The same runs, with layout B's first gradient norm off by 1e-4 relative (a backward off
    # by less than a per-mille, as a wrong reduction of a few parameters' gradients would be).
    changed = tmp_path / "changed"
    shutil.copytree(four, changed)
    records = [json.loads(line) for line in (changed / "metrics.jsonl").read_text().splitlines()]
    records[0]["grad_norm"] *= 1 + 1e-4
    (changed / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["compare", str(one), str(changed)]) == 1
    out = capsys.readouterr().out
    assert "relative difference 1.00e-04 (BEYOND fp32 rounding, 1e-05)" in out
    assert out.rstrip().endswith("the runs DISAGREE")


def test_a_training_key_that_differs_is_named(capsys):
    a, b = _run(dp=2), _run(train={"lr": 1e-3})
    assert main(["compare", str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert "training keys that differ: train.lr: 0.01 -> 0.001" in out
    assert "step 1 loss" in out  # the first step is still the same forward: shown


def test_a_key_an_older_config_lacks_reads_as_its_default(tmp_path, capsys):
    run = _run()
    older = tmp_path / "older"
    shutil.copytree(run, older)
    config = older / "config.toml"
    config.write_text("".join(line for line in config.read_text().splitlines(keepends=True)
                              if not line.startswith(("adam_eps", "rope_scaling"))))
    assert main(["compare", str(run), str(older)]) == 0
    out = capsys.readouterr().out
    assert "training keys that differ" not in out and "adam_eps" not in out


def test_a_folder_that_is_not_a_run_is_refused(tmp_path, capsys):
    assert main(["compare", str(tmp_path), str(tmp_path)]) == 2
    assert "holds no metrics.jsonl and config.toml" in capsys.readouterr().err


def test_an_unset_path_shows_as_empty_quotes(tmp_path):
    """checkpoint.init_from unset in one run: `checkpoint.init_from: '' -> hf`, not a blank."""
    from tetrad.viz.compare import config_differences
    for name, init_from in (("a", ""), ("b", "hf")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.toml").write_text(tiny_config(checkpoint={"init_from": init_from}).to_toml())
    execution, training = config_differences(tmp_path / "a", tmp_path / "b")
    assert "checkpoint.init_from: '' -> hf" in training, (execution, training)


@pytest.mark.parametrize("argv", [["compare", "A", "B", "--drift", "-0.05"], ["check", "--drift", "nan"],
                                  ["schedule", "--p2p", "-1"]])
def test_a_negative_tolerance_or_latency_is_refused_in_one_line(argv, capsys):
    """--drift -0.05 called every pair of runs different (exit 1, 'DISAGREE' at a 0 difference),
    --p2p -1 simulated a pipeline faster than with no latency: now argparse's one line, exit 2."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and f"argument {argv[-2]}: expected a number >= 0, got '{argv[-1]}'" in err, err
