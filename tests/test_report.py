"""`tetrad report`: a finished run becomes an HTML page with its pictures embedded."""

from __future__ import annotations

import html
import json
from pathlib import Path

import numpy as np
import pytest

from tetrad.cli import main
from tetrad.data.sources import CORPORA
from tetrad.data.tokenizer import byte_tokenizer, train_bpe
from tetrad.viz.report import (GROUPS, SAMPLE_PROMPTS, SAMPLE_TOKENS, comm_medians, group_label, layout_fact,
                                layout_segments, load_run, plot_breakdown)

from conftest import tiny_config, train_layout


def test_report_of_a_finished_run():
    cfg = tiny_config(parallel={"dp": 2}, train={"steps": 3, "device": "cpu"})
    train_layout(cfg)
    assert main(["report", cfg.run.dir, "--cluster", "cpu"]) == 0
    out = Path(cfg.run.dir) / "report"
    for name in ("loss.png", "breakdown.png", "comm.png", "predicted.png", "memory.png", "report.html"):
        assert (out / name).stat().st_size > 1000, name
    page = (out / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 5
    assert "pp = 1: no pipeline" in page
    assert "<th>layout</th><td>dp=2 tp=1 pp=1 cp=1, zero=0</td>" in page  # no schedule without a pipeline
    assert "no checkpoint: no samples" in page  # the run saved none


@pytest.mark.parametrize("asked", [None, {"do_sample": False, "repetition_penalty": 1.3}])
def test_report_shows_what_generate_prints_from_the_latest_checkpoint(capsys, asked):
    """The samples are `tetrad generate`'s, in its sampling: a generation_config.json beside the
    run's tokenizer (an imported model's: greedy here, with a penalty) is followed by both (before:
    the report sampled at tetrad's defaults); the command the page quotes names the CPU it samples
    on (before: none, and generate's default is a GPU, in bf16, where there is one)."""
    cfg = tiny_config(train={"steps": 2, "device": "cpu"}, checkpoint={"every": 2})
    train_layout(cfg)
    if asked is not None:
        latest = Path(cfg.run.dir) / "checkpoints" / "step_00000002"
        byte_tokenizer().save(str(latest / "tokenizer.json"))
        (latest / "generation_config.json").write_text(json.dumps(asked))
    capsys.readouterr()
    assert main(["report", cfg.run.dir, "--cluster", "cpu"]) == 0
    printed = capsys.readouterr().out
    page = (Path(cfg.run.dir) / "report" / "report.html").read_text()
    for k, prompt in enumerate(SAMPLE_PROMPTS):
        assert main(["generate", cfg.run.dir, "--prompt", prompt, "--seed", str(k), "--device", "cpu",
                     "--max-new-tokens", str(SAMPLE_TOKENS)]) == 0
        text = capsys.readouterr().out.removesuffix("\n")
        assert len(text) > len(prompt) + 8  # a continuation, not the prompt alone
        assert f"--- sample {k + 1}\n{text}\n" in printed
        assert f"<pre>{html.escape(text)}</pre>" in page
    assert "no checkpoint" not in page
    # the command the page gives for them samples where the report does: generate's default is a GPU, in bf16
    assert f"generate {cfg.run.dir} --device cpu --max-new-tokens {SAMPLE_TOKENS} --seed k" in page
    assert ("(temperature 0.0, top-k 0, top-p 1.0, min-p 0.0, repetition-penalty 1.3)" in page) == (asked is not None)


def test_layout_and_group_labels_name_what_is_in_use():
    """The page names only the options of the dimensions in use, and the comm panel says the
    "dp" bytes are the gradient group's, which a cp-only run has too."""
    def fact(**parallel):
        return layout_fact(tiny_config(parallel=parallel, model={"n_layers": 4}).parallel)
    assert fact(tp=2, sequence_parallel=True) == "dp=1 tp=2 pp=1 cp=1, zero=0, sequence parallel"
    assert fact(pp=2, vpp=2, schedule="interleaved") == "dp=1 tp=1 pp=2 cp=1, zero=0, schedule interleaved (vpp=2)"
    assert fact(cp=2) == "dp=1 tp=1 pp=1 cp=2, zero=0, cp_algo ring"
    assert layout_fact(tiny_config(parallel={"dp": 2, "ep": 2}, model={"n_experts": 4}).parallel) == \
        "dp=2 tp=1 pp=1 cp=1 ep=2, zero=0"
    assert [group_label(g) for g in GROUPS] == ["tp", "cp", "dp (dp×cp grads)", "pp", "ep"]


def test_a_run_of_one_step_draws_its_step(tmp_path):
    """A mid-step area needs two steps; a run stopped after its first must still show its block
    (thousands of pixels of the compute colour; the legend's swatch alone has ~200)."""
    image = pytest.importorskip("matplotlib.image")
    record = {"step": 1, "step_time_s": 0.2, "compute_s": 0.15, "exposed_comm_s": 0.03, "bubble_s": 0.0,
              "optimizer_s": 0.02, "data_s": 0.0, "exposed_comm_s_by_group": {"tp": 0.0, "cp": 0.0, "dp": 0.03, "pp": 0.0}}
    plot_breakdown([record], tmp_path / "breakdown.png")
    rgb = image.imread(tmp_path / "breakdown.png")[..., :3]
    compute = 0.85 * np.array([0x3B, 0x6F, 0xB6]) / 255 + 0.15  # alpha 0.85 over white
    assert (abs(rgb - compute).max(axis=-1) < 0.02).sum() > 2000


def test_sample_prompts_tokenize_as_running_text_does():
    """A prompt's tokens begin those of a corpus line that starts with it, for bytes and for
    byte-level BPE; "The " would end in a lone space token ("Ġ") where text has "Ġword"."""
    text = CORPORA["licenses"].read_text()
    lines = text.splitlines()
    for tokenizer in (byte_tokenizer(), train_bpe(iter([text[:100_000]]), vocab_size=512)):
        for prompt in filter(None, SAMPLE_PROMPTS):
            line = next(line for line in lines if line.startswith(prompt))
            ids = tokenizer.encode(prompt, add_special_tokens=False).ids
            assert tokenizer.encode(line, add_special_tokens=False).ids[:len(ids)] == ids, (prompt, line)


def test_report_draws_the_measured_pipeline_timeline():
    cfg = tiny_config(parallel={"pp": 2}, train={"steps": 2, "device": "cpu"})
    train_layout(cfg)
    run_dir = Path(cfg.run.dir)
    rows = [row for r in (0, 1) for row in json.loads((run_dir / "timeline" / f"pp{r}.json").read_text())]
    # 1F1B on pp=2: each rank runs F and B for each of the 4 micro-batches, in time order.
    assert sorted((r, kind) for r, kind, *_ in rows) == sorted((r, k) for r in (0, 1) for k in ("F", "B") * 4)
    for r in (0, 1):
        ends = [(s, e) for rank, _, _, _, s, e in rows if rank == r]
        assert all(s <= e for s, e in ends) and all(a[1] <= b[0] for a, b in zip(ends, ends[1:]))
    history = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(r["bubble_s"] > 0 for r in history)  # rank 0 waits for the first gradient
    assert main(["report", str(run_dir), "--cluster", "cpu"]) == 0
    for name in ("timeline_measured.png", "timeline_simulated.png"):
        assert (run_dir / "report" / name).stat().st_size > 1000, name
    page = (run_dir / "report" / "report.html").read_text()
    assert "bubble (idle share of rank-time, last step) measured " in page and "%, simulated " in page


def test_tensorboard_gets_the_metrics():
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    cfg = tiny_config(train={"steps": 2, "device": "cpu"}, run={"tensorboard": True})
    _, _, history = train_layout(cfg)
    board = event_accumulator.EventAccumulator(str(Path(cfg.run.dir) / "tensorboard"))
    board.Reload()
    assert {"loss", "mfu", "compute_s", "comm_bytes/dp", "exposed_comm_s_by_group/pp"} <= set(board.Tags()["scalars"])
    assert [(e.step, e.value) for e in board.Scalars("loss")] == [(r["step"], pytest.approx(r["loss"])) for r in history]


def test_report_after_a_layout_change_keeps_the_layouts_apart():
    first = tiny_config(parallel={"dp": 2}, train={"steps": 2, "device": "cpu"}, checkpoint={"every": 2})
    train_layout(first)
    resumed = tiny_config(parallel={"tp": 2}, train={"steps": 4, "device": "cpu"}, run={"dir": first.run.dir})
    train_layout(resumed)
    cfg, records = load_run(Path(first.run.dir))
    segments = layout_segments(records, cfg)
    assert [(label, [r["step"] for r in rs]) for label, rs in segments] == [
        ("dp2 tp1 pp1 cp1 zero0", [1, 2]), ("dp1 tp2 pp1 cp1 zero0", [3, 4])]
    dp_only, tp_only = (dict(zip(GROUPS, comm_medians(rs))) for _, rs in segments)
    assert dp_only["dp"] > 0 and dp_only["tp"] == 0  # not an average of the two layouts
    assert tp_only["tp"] > 0 and tp_only["dp"] == 0
    assert main(["report", first.run.dir, "--cluster", "cpu"]) == 0
    page = (Path(first.run.dir) / "report" / "report.html").read_text()
    assert "dp2 tp1 pp1 cp1 zero0 for steps 1-2; then dp1 tp2 pp1 cp1 zero0 for steps 3-4" in page


def test_report_of_a_missing_folder_is_one_line(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds no metrics.jsonl" in err


def test_an_unknown_cluster_is_refused_before_the_report(capsys):
    """--cluster with a typo was a report whose notes said the prediction was skipped, exit 0."""
    cfg = tiny_config(train={"steps": 1, "device": "cpu"})
    train_layout(cfg)
    capsys.readouterr()
    assert main(["report", cfg.run.dir, "--cluster", "h100x64x", "--samples", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown cluster 'h100x64x'" in err and not (Path(cfg.run.dir) / "report").exists()
