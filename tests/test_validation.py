"""Validation loss (train.eval_every): computed in the training layout, it equals one process's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tetrad.cli import main
from tetrad.plan.comm_bytes import comm_bytes_per_step

from conftest import tiny_config, train_layout

EVAL = {"steps": 3, "eval_every": 2, "eval_steps": 2, "device": "cpu"}


def val_losses(**parallel) -> tuple[list, list, Path, object]:
    cfg = tiny_config(parallel=parallel, train=EVAL, model={"n_layers": 4},  # 4: interleaved pp2 x vpp2
                      data={"val_fraction": 0.1})
    _, _, history = train_layout(cfg)
    logged = [json.loads(line) for line in (Path(cfg.run.dir) / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["val_loss"]) for r in history if "val_loss" in r], logged, Path(cfg.run.dir), cfg


@pytest.fixture(scope="module")
def reference():
    return val_losses()


def test_val_loss_on_evaluation_steps_only(reference):
    got, logged, _, _ = reference
    assert [step for step, _ in got] == [2, 3]  # every 2 steps, and the last
    assert [("val_loss" in r) for r in logged] == [False, True, True]
    assert got[1][1] < got[0][1]  # it learns; the held-out loss follows


@pytest.mark.parametrize("parallel", [{"dp": 2, "zero": 3}, {"tp": 2, "sequence_parallel": True}, {"pp": 2},
                                      {"pp": 2, "vpp": 2, "schedule": "interleaved"}, {"cp": 2}],
                         ids=["dp2-zero3", "tp2-sp", "pp2", "pp2-interleaved", "cp2"])
def test_val_loss_equals_one_process(reference, parallel):
    """The parity tolerance (conftest.assert_parity): fp32 layouts differ from one process only in
    the order of sums over ranks, micro-batches and tp pieces, ~1e-7 relative per step."""
    got, logged, _, cfg = val_losses(**parallel)
    ref, _, _, _ = reference
    assert [s for s, _ in got] == [s for s, _ in ref]
    torch.testing.assert_close(torch.tensor([v for _, v in got]), torch.tensor([v for _, v in ref]),
                               rtol=1e-5, atol=1e-6)
    # an evaluation leaves nothing behind for the next step: it moves the bytes the planner counts
    # (ZeRO-3's evaluation kept the gathered root, and the step after it skipped that gather)
    assert [r["comm_bytes"] for r in logged] == [comm_bytes_per_step(cfg)] * len(logged)


def test_report_shows_the_validation_loss(reference):
    got, _, run_dir, _ = reference
    assert main(["report", str(run_dir), "--cluster", "cpu"]) == 0
    page = (run_dir / "report" / "report.html").read_text()
    assert f"<th>validation loss</th><td>{got[-1][1]:.4f} at step 3</td>" in page


def test_a_blend_reports_each_sources_validation_loss_in_every_layout(tmp_path):
    # Two sources of different text: the licences, and one sentence over and over (easy to learn).
    (tmp_path / "easy.txt").write_text("the quick brown fox jumps over the lazy dog. " * 200)
    source = f"3 licenses 1 {tmp_path / 'easy.txt'}"
    by_layout = []
    for parallel in ({}, {"dp": 2, "pp": 2}):
        cfg = tiny_config(parallel=parallel, train=EVAL, model={"n_layers": 4},
                          data={"source": source, "val_fraction": 0.1})
        _, _, history = train_layout(cfg)
        evaluated = [r for r in history if "val_loss" in r]
        for record in evaluated:
            losses = record["val_loss_by_source"]
            assert list(losses) == ["licenses", str(tmp_path / "easy.txt")]
            licenses, easy = losses.values()
            assert record["val_loss"] == pytest.approx(0.75 * licenses + 0.25 * easy)
        by_layout.append([list(r["val_loss_by_source"].values()) for r in evaluated])
    assert by_layout[0][-1][1] < by_layout[0][-1][0]  # the repeated sentence is the easier text
    torch.testing.assert_close(torch.tensor(by_layout[1]), torch.tensor(by_layout[0]), rtol=1e-5, atol=1e-6)
    assert main(["report", cfg.run.dir, "--cluster", "cpu", "--samples", "0"]) == 0
    page = (Path(cfg.run.dir) / "report" / "report.html").read_text()
    assert f"; licenses {by_layout[1][-1][0]:.4f}; {tmp_path / 'easy.txt'} {by_layout[1][-1][1]:.4f}</td>" in page
