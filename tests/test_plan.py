"""The planner: published runs, the ZeRO paper's memory table, Korthikanti's activation formulas,
the FLOP convention, the search's exactness, and the estimate/plan contracts."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from tetrad.cli import main
from tetrad.config import load_config
from tetrad.model import flops
from tetrad.plan.comm_bytes import comm_bytes_per_step
from tetrad.plan.cost import estimate
from tetrad.plan.hardware import HardwareError, load_cluster, load_gpu
from tetrad.plan.memory import ZERO_PAPER_BYTES, activation_bytes_per_layer, model_state_bytes, rank_params
from tetrad.plan.pipeline import _simulate, pipeline
from tetrad.plan.reference import (CALIBRATION_MAPE, agreement, best_estimate, format_agreement, predicted_value,
                                   ranking_group, read_rows)
from tetrad.plan.search import config_of, layouts, plan
from tetrad.plan.stacks import STACKS

ROWS = read_rows(held_out=False)  # the calibration runs shipped with the package (src/tetrad/plan/reference_runs)
# Known gaps, kept visible: torchtitan's Dec 2024 context parallelism at cp = 4 and 8. Every rank
# holds 32768 tokens in all four rows, and torch's ring (torch 1963fc8) then runs cp rounds of the
# same work: one 32768-token causal flash call, or a 32768 x 16384 one, with the same fp32 merges and
# the same K/V bytes per round. Any cost per round makes time per token affine in cp >= 2, with a
# slope no larger than the step from cp = 1 to 2. Published: 257, 394, 934, 1825 us per token; within
# 10% on tokens/s the step from 1 to 2 is at most 204 us and the slope from 2 to 4 at least 205.5,
# so no per-round physics meets all four rows (docs/planner.md, Validation).
KNOWN_GAPS = {"tt-8b-cp4", "tt-8b-cp8"}


# The held-out runs' MAPE as docs/planner.md reports it (bench/bench_plan.py prints the same): a
# change of the model that makes it worse on runs it never saw fails here.
HELD_OUT_MAPE = 0.056


def _cfg(**sections):
    return load_config(overrides=sections, runtime=False)


def test_published_runs_within_10_percent(capsys):
    errors, results = {}, []
    with capsys.disabled():
        print(f"\n{'run':<18}{'metric':<22}{'published':>11}{'predicted':>11}{'error':>9}")
        for row in ROWS:
            pred, pub = predicted_value(row, best_estimate(row)), float(row["value"])
            errors[row["id"]] = (pred - pub) / pub
            results.append((row["source"], ranking_group(row), pub, pred))
            gap = "  (known gap)" if row["id"] in KNOWN_GAPS else ""
            print(f"{row['id']:<18}{row['metric']:<22}{pub:>11.4g}{pred:>11.4g}{100 * errors[row['id']]:>+8.1f}%{gap}")
        summary = agreement(results)
        print(format_agreement(summary))
    # Where a source measured several layouts of one model on one cluster, the order must match.
    assert all(s["tau"] in (None, 1.0) for s in summary.values()), summary
    # `tetrad plan`'s stated spread is the error measured here.
    assert 100 * CALIBRATION_MAPE == pytest.approx(summary["all"]["mape"], abs=0.5), summary["all"]
    bad = {k: f"{100 * v:+.1f}%" for k, v in errors.items() if abs(v) > 0.10 and k not in KNOWN_GAPS}
    assert not bad, f"rows off by more than 10%: {bad}"
    closed = [k for k in KNOWN_GAPS if k in errors and abs(errors[k]) <= 0.10]
    assert not closed, f"known gaps closed, remove them from KNOWN_GAPS: {closed}"


def test_held_out_runs_per_source_and_category(capsys):
    """Published runs no constant was fitted to: MAPE and Kendall's tau per source and per kind
    of run, printed; the order of each source's runs of one model on one cluster must match."""
    results = [(r, float(r["value"]), predicted_value(r, best_estimate(r))) for r in read_rows(held_out=True)]
    with capsys.disabled():
        for key in ("source", "category"):
            summary = agreement([(r[key], ranking_group(r), pub, pred) for r, pub, pred in results])
            print("\n" + format_agreement(summary).replace("source", key, 1))
            assert all(s["tau"] in (None, 1.0) for s in summary.values()), summary
    assert summary["all"]["mape"] <= 100 * HELD_OUT_MAPE + 0.5, summary["all"]


# Rajbhandari et al. 2020, Table 1: model-state GB per device, K=12, N_d = 1..1024.
ZERO_TABLE = {7.5e9: {1: [120, 52.5, 35.6, 31.4, 30.4, 30.1], 2: [120, 41.3, 21.6, 16.6, 15.4, 15.1],
                      3: [120, 30, 7.5, 1.88, 0.47, 0.12]},
              128e9: {1: [2048, 896, 608, 536, 518, 513], 2: [2048, 704, 368, 284, 263, 257],
                      3: [2048, 512, 128, 32, 8, 2]}}


@pytest.mark.parametrize("params", ZERO_TABLE)
def test_zero_paper_table_1_within_2_percent(params):
    for stage, row in ZERO_TABLE[params].items():
        for shards, published in zip([1, 4, 16, 64, 256, 1024], row):
            ours = sum(model_state_bytes(params, stage, shards, ZERO_PAPER_BYTES)) / 1e9
            # abs: the paper prints 0.12 for 0.117 (its rounding to two digits).
            assert ours == pytest.approx(published, rel=0.02, abs=0.005), (params, stage, shards)


def test_korthikanti_activation_formulas_are_reproduced_exactly():
    """GPT layer (LayerNorm, GELU, dropout, scores materialised), 16-bit: Korthikanti et al. Table 2."""
    s, b, h, a = 2048, 2, 1024, 16
    m = _cfg(model={"preset": "tiny", "n_layers": 2, "d_model": h, "n_heads": a, "n_kv_heads": a, "ffn_hidden": 4 * h,
                    "seq_len": s, "mlp": "gelu", "norm": "layernorm", "dropout": 0.1}).model
    stack = STACKS["megatron-2021"]
    sbh, score = s * b * h, 5 * a * s / h
    for tp, sp, recompute, expected in [(1, False, "none", 34 + score), (4, False, "none", 10 + 24 / 4 + score / 4),
                                        (4, True, "none", 34 / 4 + score / 4), (4, False, "selective", 10 + 24 / 4),
                                        (4, True, "selective", 34 / 4), (1, False, "full", 2)]:
        got = activation_bytes_per_layer(m, b * s, tp, sp, recompute, 2, stack)
        assert got == pytest.approx(sbh * expected), (tp, sp, recompute)


def test_flop_convention_matches_narayanan_eq3_with_full_recompute():
    m = _cfg(model={"preset": "gpt3-175b"}).model
    batch = 1536
    ours = flops.hardware_flops_per_token(m, "full") * batch * m.seq_len
    eq3 = flops.narayanan_eq3_flops(batch, m.seq_len, m.n_layers, m.d_model, m.vocab_size)
    assert ours == pytest.approx(eq3, rel=1e-9)
    assert flops.model_flops_per_token(m) < ours / batch / m.seq_len  # MFU's numerator has no recompute


# docs/design.md's contract for `estimate --json` and each element of `plan --json`.
CONTRACT = ("step_time_s", "tokens_per_s", "model_tflops_per_gpu", "mfu", "hfu", "bubble_fraction", "peak_memory_gib")
MEMORY_PARTS = {"weights", "grads", "optimizer", "activations", "other"}


def _assert_contract(out: dict) -> None:
    for key in CONTRACT:
        assert isinstance(out[key], float) and out[key] >= 0, key
    assert set(out["memory_gib"]) == MEMORY_PARTS
    assert out["peak_memory_gib"] == pytest.approx(sum(out["memory_gib"].values()))
    assert {"tp", "pp", "cp", "dp", "vpp", "schedule", "zero"} <= set(out["parallel"])


def test_estimate_json_contract(capsys):
    assert main(["estimate", "--cluster", "dgx-h100", "--model.preset=llama3-8b", "--parallel.tp=8",
                 "--parallel.sequence_parallel=true", "--train.global_batch=8", "--train.micro_batch=1",
                 "--train.dtype=bf16", "--train.recompute=selective", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    _assert_contract(out)
    for key in ("fits", "time_s", "compute_s", "exposed_comm_s", "bubble_s"):
        assert key in out, key
    assert sum(out["time_s"].values()) == pytest.approx(out["step_time_s"])
    assert 0 < out["mfu"] < out["hfu"] < 1 and out["fits"] and out["parallel"]["tp"] == 8


def test_layout_that_does_not_fit_is_reported_with_its_breakdown(capsys):
    args = ["estimate", "--cluster", "dgx-h100", "--model.preset=llama3-70b", "--train.global_batch=8",
            "--train.micro_batch=1", "--train.dtype=bf16"]
    assert main(args) == 1
    text = capsys.readouterr().out
    assert "DOES NOT FIT" in text
    for part in ("weights", "grads", "optimizer", "activations", "other"):
        assert part in text
    assert main(args + ["--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] is False and out["memory_gib"]["optimizer"] > 80 and out["step_time_s"] > 0


def test_unknown_gpu_and_cluster_list_the_known_ones(tmp_path, capsys):
    with pytest.raises(HardwareError, match="known: A100-80GB-SXM, H100-SXM, H100-96GB-500W, H200, B200, MI300X"):
        load_gpu("H900")
    with pytest.raises(HardwareError, match="dgx-h100"):
        load_cluster("no-such-cluster")
    bad = tmp_path / "bad.toml"
    bad.write_text('[cluster]\ngpu = "H900"\n')
    assert main(["estimate", "--cluster", str(bad)]) == 2
    assert "known: A100-80GB-SXM" in capsys.readouterr().err
    assert main(["plan", "--cluster", str(bad)]) == 2
    assert "known: A100-80GB-SXM" in capsys.readouterr().err
    bad.write_text('[cluster]\ngpu = "H100-SXM"\nnode = 4\n')
    with pytest.raises(HardwareError, match="unknown \\[cluster\\] keys \\['node'\\]"):
        load_cluster(str(bad))


def test_cluster_files_and_measured_profiles(tmp_path):
    root = Path(__file__).resolve().parents[1]
    for path in sorted((root / "configs" / "clusters").glob("*.toml")):
        assert load_cluster(str(path)).world >= 1, path
    (tmp_path / "hw.json").write_text(json.dumps({
        "name": "lab-gpu", "base": "H100-SXM", "peak_tflops": {"bf16": 700.0}, "memory_gbps": 3000,
        "links": {"intra_node": {"alpha_s": 4e-6, "beta_gbps": 380},
                  "inter_node": {"alpha_s": 2e-5, "beta_gbps": 40}}}))
    (tmp_path / "c.toml").write_text('[cluster]\ngpu = "hw.json"\ngpus_per_node = 4\nnodes = 2\ninter_node_gbps = 20\n')
    c = load_cluster(str(tmp_path / "c.toml"))
    g = c.gpu
    assert (c.world, g.name, g.peak_tflops["bf16"], g.gemm_efficiency) == (8, "lab-gpu", 700.0, 1.0)
    assert (g.intra_gbps, g.intra_alpha_s, g.inter_gbps, g.hbm_gib) == (380, 4e-6, 20, load_gpu("H100-SXM").hbm_gib)


def test_fp8_and_recompute_and_zero_move_the_estimate_the_physical_way():
    cluster = load_cluster("dgx-h100")
    base = _cfg(model={"preset": "llama3-8b"}, parallel={"dp": 8, "zero": 1},
                train={"global_batch": 32, "micro_batch": 1, "dtype": "bf16"})
    def with_(section, **kw):
        return dataclasses.replace(base, **{section: dataclasses.replace(getattr(base, section), **kw)})
    bf16 = estimate(base, cluster)
    fp8 = estimate(with_("train", dtype="fp8"), cluster)
    assert 1.0 < bf16.step_time_s / fp8.step_time_s < 2.0  # faster GEMMs, same attention and casts on top
    full = estimate(with_("train", recompute="full"), cluster)
    assert full.step_time_s > bf16.step_time_s and full.memory.activations < bf16.memory.activations / 3
    assert full.hfu > full.mfu and bf16.hfu == pytest.approx(bf16.mfu)
    states = [estimate(with_("parallel", zero=z), cluster).memory for z in range(4)]
    states = [s.weights + s.grads + s.optimizer for s in states]
    assert states == sorted(states, reverse=True) and states[3] < states[0] / 6


def test_per_op_recompute_lies_between_the_other_policies():
    """selective-op keeps the block input, the attention's outputs and every other matmul's: with
    flash attention less than selective (which drops only the core's log-sum-exp) and more than
    full; it repeats the other matmuls and the element-wise work, less than full's whole forward."""
    cluster = load_cluster("dgx-h100")
    base = _cfg(model={"preset": "llama3-8b"}, parallel={"dp": 8}, train={"global_batch": 16, "micro_batch": 2,
                                                                          "dtype": "bf16"})
    est = {r: estimate(dataclasses.replace(base, train=dataclasses.replace(base.train, recompute=r)), cluster)
           for r in ("none", "selective", "selective-op", "full")}
    acts = {r: e.memory.activations for r, e in est.items()}
    assert acts["full"] < acts["selective-op"] < acts["selective"] < acts["none"], acts
    m = base.model
    hw = {r: flops.hardware_flops_per_token(m, r) for r in est}
    assert hw["none"] < hw["selective-op"] < hw["full"], hw
    # Three of a SwiGLU layer's seven matmuls (k, the output projection, up) are recomputed.
    h, kv, f = m.d_model, m.n_kv_heads * m.head_dim, m.ffn_hidden
    assert hw["selective-op"] - hw["none"] == m.n_layers * 2 * h * (kv + m.n_heads * m.head_dim + f)
    times = {r: e.step_time_s for r, e in est.items()}
    assert times["none"] < times["selective-op"] < times["full"], times


def test_long_pipelines_are_extrapolated_exactly_from_the_simulator():
    # Costs on the simulation's grid (hundredths of the slowest forward), so rounding moves nothing.
    f, bi, bw = [0.77, 0.85, 0.69, 1.0], [0.92, 0.77, 0.85, 1.08], [0.62, 0.69, 0.77, 0.85]
    for schedule, vpp in (("1f1b", 1), ("zb", 1), ("interleaved", 2)):
        stages = 4 * vpp
        costs = (f * vpp)[:stages], (bi * vpp)[:stages], (bw * vpp)[:stages]
        for m in (29, 40):
            direct, _ = _simulate(schedule, 4, m, vpp, *(tuple(costs_) for costs_ in costs), 0.01)
            extended, _ = pipeline(schedule, 4, m, vpp, *([1.3 * x for x in c] for c in costs), 0.013)
            assert extended == pytest.approx(direct * 1.3, rel=1e-9), (schedule, m)


def test_balanced_1f1b_bubble_is_the_ideal_at_many_micro_batches():
    """With equal stages and negligible transfers the 1F1B bubble is (p-1)/(m+p-1) (Narayanan et
    al. 2021, sec. 2.2.1), for the simulator and for `estimate` (a small vocabulary, so the head
    barely unbalances the last stage; transfers over NVLink): no per-micro-batch charge."""
    for p in (4, 8):
        for m in (4 * p, 8 * p, 16 * p + 3):
            ideal = (p - 1) / (m + p - 1)
            step, _ = pipeline("1f1b", p, m, 1, [1.0] * p, [1.1] * p, [0.9] * p, 1e-4)
            assert 1 - 3 * m / step == pytest.approx(ideal, rel=0.02), (p, m)
    model = {"preset": "tiny", "n_layers": 32, "d_model": 4096, "n_heads": 32, "n_kv_heads": 32, "ffn_hidden": 16384,
             "seq_len": 2048, "vocab_size": 256}
    for m in (32, 64):
        cfg = _cfg(model=model, parallel={"pp": 8, "schedule": "1f1b"},
                   train={"global_batch": m, "micro_batch": 1, "dtype": "bf16"})
        est = estimate(cfg, load_cluster("dgx-a100"), stack="compiled")
        assert est.bubble_fraction == pytest.approx(7 / (m + 7), rel=0.10), m


def test_no_breakdown_part_is_negative_over_a_sweep_of_layouts():
    """The simulator runs rounded costs; the breakdown (the busiest rank's exact work and the
    idle time the simulation finds) must still have no negative part, and sum to the step."""
    checked = 0
    for preset, cluster, batch, dtype in [("llama3-8b", "dgx-h100", 32, "bf16"), ("llama3-70b", "h100x64", 64, "bf16"),
                                          ("tiny-gpt", "dgx-a100", 16, "fp32")]:
        base = _cfg(model={"preset": preset}, train={"global_batch": batch, "dtype": dtype})
        hardware = load_cluster(cluster)
        found = [x for x in layouts(base, hardware.world, hardware.gpus_per_node) if x.pp > 1]
        for layout in found[::max(1, len(found) // 120)]:
            est = estimate(config_of(base, layout), hardware)
            parts = est.breakdown
            assert min(parts.values()) >= 0, (layout, {k: v for k, v in parts.items() if v < 0})
            assert sum(parts.values()) == pytest.approx(est.step_time_s, rel=1e-9)
            assert 0 <= est.bubble_fraction < 1
            checked += 1
    assert checked > 300


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


def test_plan_writes_a_runnable_config(tmp_path, capsys):
    out = tmp_path / "best.toml"
    assert main(["plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--global-batch", "16", "--dtype", "bf16",
                 "--top", "3", "--json", "--out", str(out)]) == 0
    ranked = json.loads(capsys.readouterr().out)
    assert isinstance(ranked, list)
    for r in ranked:
        _assert_contract(r)
    times = [r["step_time_s"] for r in ranked]
    assert len(ranked) == 3 and times == sorted(times) and all(r["fits"] for r in ranked)
    best = load_config(out)  # validates for the runtime, as `tetrad train` would
    assert best.parallel.world_size == 8 and best.parallel.dp == ranked[0]["parallel"]["dp"]


def test_plan_states_its_spread_and_the_layouts_it_cannot_order(capsys):
    assert main(["plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--global-batch", "16", "--dtype", "bf16",
                 "--top", "4"]) == 0
    text = capsys.readouterr().out
    assert f"+- {100 * CALIBRATION_MAPE:.1f}%" in text
    rows = [line.split() for line in text.splitlines() if line.startswith("  #") and "[" in line]
    assert [r[0] for r in rows] == ["#1", "#2", "#3", "#4"]
    times = [float(r[1]) for r in rows]
    close = [f"#{i + 1}" for i, t in enumerate(times[1:], 1) if t * (1 - CALIBRATION_MAPE) <= times[0] * (1 + CALIBRATION_MAPE)]
    verdict = f"{', '.join(close)} within that spread of #1" if close else "#1 is ahead of the others"
    assert verdict in text


def test_plan_with_nothing_fitting_says_why_and_fails(capsys, tmp_path):
    args = ["plan", "--model", "llama3-405b", "--cluster", "dgx-h100", "--global-batch", "8", "--top", "2"]
    assert main(args + ["--write", str(tmp_path / "x.toml")]) == 1
    text = capsys.readouterr().out
    assert "NO LAYOUT FITS" in text and "why the best wins" not in text
    assert "no layout fits in memory: the closest layout needs" in text
    assert "the model states alone do not fit even sharded over the 8 GPUs" in text
    assert not (tmp_path / "x.toml").exists()
    assert main(args + ["--json"]) == 1
    out = capsys.readouterr()
    assert all(not r["fits"] for r in json.loads(out.out)) and "no layout fits in memory" in out.err


def test_plan_defaults_to_bf16_unless_the_config_says(tmp_path, capsys):
    args = ["plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--global-batch", "16", "--top", "1", "--json"]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)[0]["train"]["dtype"] == "bf16"
    cfg = tmp_path / "fp32.toml"
    cfg.write_text('[model]\npreset = "llama3-8b"\nn_layers = 4\n[train]\ndtype = "fp32"\n')
    assert main(["plan", str(cfg), "--cluster", "dgx-h100", "--global-batch", "16", "--top", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["train"]["dtype"] == "fp32"


def test_plan_write_sizes_the_training_to_the_model(tmp_path, capsys):
    from tetrad.model.flops import parameter_count
    from tetrad.plan.recipe import GPT3_LEARNING_RATES, learning_rate

    assert [learning_rate(n) for n, _ in GPT3_LEARNING_RATES] == pytest.approx([lr for _, lr in GPT3_LEARNING_RATES])
    out = tmp_path / "best.toml"
    args = ["plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--global-batch", "16", "--top", "1",
            "--write", str(out)]
    assert main(args) == 0
    written, printed = out.read_text(), capsys.readouterr().out
    cfg = load_config(out)
    params = parameter_count(cfg.model)
    assert cfg.train.lr == pytest.approx(1.1e-4)  # between GPT-3's 6.7B (1.2e-4) and 13B (1.0e-4)
    assert cfg.train.steps == -(-20 * params // (16 * 8192))  # 20 tokens per parameter
    assert cfg.data.source == "data/tokens" and cfg.train.dtype == "bf16"
    for stated in ("train.lr = 0.00011: GPT-3's learning rate", "train.steps = ", "train.warmup = ", "data.source = "):
        assert f"#   {stated}" in written and stated in printed
    assert main(args + ["--train.lr=2e-4", "--data.source=licenses"]) == 0  # what the user set stays
    cfg = load_config(out)
    assert cfg.train.lr == 2e-4 and cfg.data.source == "licenses" and "train.lr =" not in out.read_text()


def test_plan_table_columns_line_up(capsys):
    assert main(["plan", "--model", "llama3-70b", "--cluster", "h100x1024", "--global-batch", "1024", "--top", "6"]) == 0
    lines = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("layout "))
    rows = lines[start:start + 7]
    assert len({len(r) for r in rows}) == 1  # every row as wide as the header
    # Where each cell ends (a non-space followed by two spaces or the line's end): after the
    # left-aligned layout, the seven right-aligned columns end where their headers do.
    ends = [[m.start() for m in re.finditer(r"(?<=\S)(?:  |$)", r)][1:] for r in rows]
    assert all(len(e) == 7 and e == ends[0] for e in ends), rows
    assert len({len(r.split("  ")[0]) for r in rows}) > 1  # layouts of several widths, so the check bites


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


def test_comm_bytes_follow_tetrad_comm_convention():
    cfg = _cfg(model={"preset": "tiny"}, parallel={"dp": 2, "tp": 2, "pp": 2},
               train={"global_batch": 8, "micro_batch": 2, "dtype": "fp32"})
    m, micro = cfg.model, cfg.microbatches
    hidden = 2 * m.seq_len * m.d_model * 4  # micro-batch x seq x d_model, fp32
    got = comm_bytes_per_step(cfg)
    layers = 2  # of 4, on pipeline rank 0
    sums = 5 * 4  # the step's fp32 sums (norm, loss, stop flags) on every group
    assert got["tp"] == micro * (layers * 4 * hidden + hidden) + sums  # 2 all-reduces fwd + 2 bwd per layer; embedding
    assert got["pp"] == micro * hidden + sums  # activations sent on
    assert got["dp"] == int(rank_params(cfg)[0] * 4) + sums  # one all-reduce of fp32 gradients
    assert got["cp"] == 0
    ring = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, tp=1, pp=1, dp=1, cp=2))
    kv = 2 * m.seq_len // 2 * m.n_kv_heads * m.head_dim * 2  # k and v of this rank's tokens, micro-batch 2
    assert comm_bytes_per_step(ring)["cp"] == ring.microbatches * m.n_layers * (kv * 4 + kv * 4 + 2 * kv * 4)


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
