"""`tetrad report`: a finished run becomes an HTML page with its pictures embedded."""

from __future__ import annotations

import json
from pathlib import Path

from tetrad.cli import main
from tetrad.parallel.pipeline.schedules import build_schedule
from tetrad.parallel.pipeline.simulate import StageCosts, simulate

from conftest import tiny_config, train_layout


def test_report_of_a_finished_run():
    cfg = tiny_config(parallel={"dp": 2}, train={"steps": 3, "device": "cpu"})
    train_layout(cfg)
    assert main(["report", cfg.run.dir, "--cluster", "cpu"]) == 0
    out = Path(cfg.run.dir) / "report"
    for name in ("loss.png", "breakdown.png", "comm.png", "predicted.png", "report.html"):
        assert (out / name).stat().st_size > 1000, name
    page = (out / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 4
    assert "pp = 1: no pipeline" in page


def test_report_draws_a_recorded_pipeline_timeline(tmp_path):
    cfg = tiny_config(parallel={"pp": 2}, train={"steps": 2, "device": "cpu"}, run={"dir": str(tmp_path)})
    (tmp_path / "config.toml").write_text(cfg.to_toml())
    record = {"step": 1, "loss": 5.0, "lr": 1e-3, "grad_norm": 1.0, "step_time_s": 0.1, "tokens_per_s": 1e3,
              "mfu": None, "compute_s": 0.07, "exposed_comm_s": 0.01, "bubble_s": 0.02,
              "comm_bytes": {"tp": 0, "cp": 0, "pp": 1000, "dp": 0}}
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps({**record, "step": s}) for s in (1, 2)) + "\n")
    sim = simulate(build_schedule("1f1b", 2, cfg.microbatches, 1), StageCosts(1.0, 1.0, 1.0))
    (tmp_path / "timeline.json").write_text(json.dumps([[r, a.kind, a.mb, a.chunk, s, e]
                                                        for r, a, s, e in sim.timeline]))
    assert main(["report", str(tmp_path), "--cluster", "cpu"]) == 0
    assert (tmp_path / "report" / "timeline_measured.png").exists()
    assert (tmp_path / "report" / "timeline_simulated.png").exists()
